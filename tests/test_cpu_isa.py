"""The CPU plugin's instruction-set levels: which one runs, compile checks of those the host lacks, and a
disk cache per level. (The kernels themselves are tested at every level the host runs in test_cpu_kernels.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from bitnet.errors import UsageError
from bitnet_cpu import dot_ir, float_kernels, ir_checks, isa
from conftest import cli_env, run_cli

LEVELS = isa.host_levels()
MISSING = [level for level in dot_ir.LEVELS if level not in LEVELS]


def test_host_levels_are_ordered_and_end_with_generic() -> None:
    assert LEVELS[-1] == "generic"
    assert list(LEVELS) == [level for level in dot_ir.LEVELS if level in LEVELS]


def test_choose_defaults_to_the_best_and_honours_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BITNET_CPU_ISA", raising=False)
    assert isa.choose() == isa.default_level() == (LEVELS[1] if LEVELS[0] == "avx512vbmi" and not isa.base3_by_default()
                                                   else LEVELS[0])
    monkeypatch.setenv("BITNET_CPU_ISA", " Generic ")
    assert isa.choose() == "generic"
    assert isa.choose(LEVELS[0]) == LEVELS[0]  # an explicit level wins over the variable


def test_base3_codes_are_the_default_on_zen_5_and_later_only(tmp_path: Path) -> None:
    # Measured faster on a Zen 5; Zen 4 (family 25) and Intel (family 6) decode 512-bit vectors with less, unmeasured.
    for vendor, family, expected in (("AuthenticAMD", 26, True), ("AuthenticAMD", 27, True),
                                     ("AuthenticAMD", 25, False), ("GenuineIntel", 6, False),
                                     ("GenuineIntel", 26, False)):
        info = tmp_path / f"{vendor}-{family}"
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 2\n\n"
                        f"processor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
        assert isa.base3_by_default(str(info)) is expected, (vendor, family)
    assert isa.base3_by_default(str(tmp_path / "absent")) is False


def test_choose_rejects_unknown_and_unavailable_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITNET_CPU_ISA", "sse9")
    with pytest.raises(UsageError, match="BITNET_CPU_ISA=sse9 is not a level; choose one of generic, avx2"):
        isa.choose()
    if not MISSING:
        pytest.skip("this CPU runs every level")
    monkeypatch.setenv("BITNET_CPU_ISA", "avx512" if MISSING[0] == "avx512vnni" else MISSING[0])
    with pytest.raises(UsageError, match=f"lacks {MISSING[0]}; it runs {', '.join(LEVELS)}$"):
        isa.choose()
    with pytest.raises(UsageError, match=f"lacks {MISSING[0]}"):
        isa.build(MISSING[0])  # never compiled: LLVM would abort the process


def test_the_cli_exits_2_naming_what_the_cpu_runs(tmp_path: Path) -> None:
    wanted = MISSING[0] if MISSING else "sse9"
    env = cli_env(BITNET_CPU_ISA=wanted, BITNET_CACHE_DIR=str(tmp_path))
    r = run_cli("--device", "cpu", "run", "-p", "hi", "--max-tokens", "1", env=env)
    errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("requested=")]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: BITNET_CPU_ISA="), r.stderr
    assert (f"it runs {', '.join(LEVELS)}" if MISSING else "choose one of") in errors[0]


# -- every level compiled to its instructions, whatever the host (nothing runs) ---------------------------

def _instructions(asm: str) -> set[str]:
    """'mnemonic widest-register' pairs of the dot-product instructions in `asm`."""
    found = set()
    for line in asm.splitlines():
        m = re.match(r"\s+(\{vex\}\s+)?(v?p(?:dpbusd|maddubsw|maddwd))\s+(.*)", line)
        if m:
            width = "zmm" if "zmm" in m[3] else "ymm" if "ymm" in m[3] else "xmm"
            found.add(f"{'{vex} ' if m[1] else ''}{m[2]} {width}")
    return found


@pytest.mark.parametrize("level, cpu, expected", [
    ("avx512vnni", None, {"vpdpbusd zmm"}),
    ("avxvnni", None, {"{vex} vpdpbusd ymm"}),  # alderlake: AVX-VNNI, no AVX-512
    ("avxvnni", "icelake-server", {"vpdpbusd ymm"}),  # the same IR as EVEX on AVX-512 VNNI with VL
    ("avx2", None, {"vpmaddubsw ymm", "vpmaddwd ymm"}),
    ("generic", None, {"pmaddwd xmm"}),  # baseline x86-64 (SSE2): LLVM finds pmaddwd on its own
])
@pytest.mark.parametrize("tile, per_block, q8", [(1, False, False), (dot_ir.TILE, True, False),
                                                (dot_ir.WIDE, False, False), (1, False, True),
                                                (dot_ir.TILE, False, True)],
                         ids=["ternary1", "ternary4", "ternary8", "q8_1", "q8_4"])
def test_every_level_compiles_to_its_instructions(level: str, cpu: str | None, expected: set[str], tile: int,
                                                  per_block: bool, q8: bool) -> None:
    # q8: the int8 LM head's dot, the same instructions (|w| unsigned, q with w's sign).
    asm = ir_checks.assembly(level, cpu, tile, per_block, q8)
    assert _instructions(asm) == expected
    # The weight stream is prefetched with the vendor's hint for bytes read once (never into L1 for keeps:
    # prefetcht0 would evict everything else a decode step uses).
    assert _HINTS[dot_ir.STREAM_LOCALITY] in asm and "prefetcht0" not in asm


_HINTS = {0: "prefetchnta", 1: "prefetcht2"}


@pytest.mark.parametrize("tile, rows", [(1, 1), (2, 1), (dot_ir.TILE, 2), (dot_ir.WIDE, 2)])
def test_the_base3_level_decodes_with_vbmi_lookups(tile: int, rows: int) -> None:
    # Two 128-byte table lookups a table (trits 0-3, trit 4), then 512-bit vpdpbusd, as avx512vnni.
    asm = ir_checks.assembly("avx512vbmi", None, tile, rows=rows)
    assert _instructions(asm) == {"vpdpbusd zmm"}
    assert re.search(r"\svperm[it]2b\s+.*zmm", asm)
    assert not re.search(r"\svperm[it]2b\s", ir_checks.assembly("avx512vnni", None, tile, rows=rows))
    # Per-block scales (TQ2_0's) sum 256-blocks, which 320-weight base-3 blocks do not fall on: that level's kernels
    # take 2-bit codes there (int_kernels._PER_BLOCK_ISA), and the base-3 IR refuses.
    with pytest.raises(ValueError, match="base-3 blocks"):
        ir_checks.dot_module("avx512vbmi", dot_ir.TILE, per_block=True)


def test_the_stream_hint_is_the_vendors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Intel fills L1 alone with prefetchnta, through a few fill buffers (a stream capped near 10 GB/s on an
    # Emerald Rapids core): there the hint fills L2. AMD keeps the non-temporal hint; so does an unknown vendor.
    for vendor, locality in (("GenuineIntel", 1), ("AuthenticAMD", 0), ("HygonGenuine", 0)):
        (tmp_path / vendor).write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 6\n")
        assert dot_ir.stream_locality(str(tmp_path / vendor)) == locality
    assert dot_ir.stream_locality(str(tmp_path / "absent")) == 0
    for locality, hint in _HINTS.items():
        monkeypatch.setattr(dot_ir, "STREAM_LOCALITY", locality)
        for q8 in (False, True):
            asm = ir_checks.assembly("avx2", q8=q8)
            assert hint in asm and _HINTS[1 - locality] not in asm


def test_the_stream_prefetch_is_the_hosts_hint() -> None:
    # float_kernels.prefetch (the bandwidth probe's) takes the host's hint: on Intel, prefetcht2 and not nta.
    @numba.njit
    def touch(a: np.ndarray) -> None:
        float_kernels.prefetch(a.ctypes.data)

    touch(np.zeros(8))
    asm = "".join(touch.inspect_asm().values())
    assert _HINTS[dot_ir.STREAM_LOCALITY] in asm and _HINTS[1 - dot_ir.STREAM_LOCALITY] not in asm


@pytest.mark.parametrize("locality", sorted(_HINTS))
def test_the_f16_head_streams_its_rows_with_the_same_hint(locality: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dot_ir, "STREAM_LOCALITY", locality)
    head = float_kernels._make_head(True)  # new intrinsics: compiled now, with the patched hint

    @numba.njit
    def run(x: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
        head(x, table, 16, out)

    out = np.zeros((1, 64), np.float32)
    run(np.ones((1, 256), np.float32), np.full((64, 256), 0x3C00, np.uint16), out)  # F16 ones
    np.testing.assert_array_equal(out, 256.0)
    asm = "".join(run.inspect_asm().values())
    assert _HINTS[locality] in asm and _HINTS[1 - locality] not in asm


def test_the_compile_check_sees_a_missing_instruction() -> None:
    # The check above is not vacuous: the avx2 level has no vpdpbusd, the avx512vnni level no vpmaddubsw.
    assert not any("vpdpbusd" in i for i in _instructions(ir_checks.assembly("avx2")))
    assert not any("maddubsw" in i for i in _instructions(ir_checks.assembly("avx512vnni")))
    assert not any("vpdpbusd" in i for i in _instructions(ir_checks.assembly("avx2", q8=True)))


def _spills(asm: str) -> list[str]:
    return [ln.strip() for ln in asm.splitlines() if re.search(r"\bvmov\w*\s+%[xyz]mm\d+, -?\d*\(%rsp\)", ln)]


@pytest.mark.parametrize("tile, rows", [(1, 1), (dot_ir.TILE, 1), (dot_ir.WIDE, 1), (dot_ir.TILE, 2), (dot_ir.WIDE, 2),
                                        (1, 4)])
def test_vnni_accumulators_stay_in_registers(tile: int, rows: int) -> None:
    # Four accumulators per token (one per 2-bit field) for 8 tokens were 32 zmm registers, all there are:
    # the 8-token pass stored and reloaded three of them in every block. From TILE tokens on the fields share one,
    # and two rows per pass (16 accumulators, 8 code fields) still fit; so do one token's four rows (16 and 16).
    asm = ir_checks.assembly("avx512vnni", "icelake-server", tile, rows=rows)
    assert _spills(asm) == [] and _instructions(asm) == {"vpdpbusd zmm"}


@pytest.mark.parametrize("level", ["avx512vnni", "avxvnni"])
def test_one_tokens_pass_keeps_its_rows_accumulators_in_registers(level: str) -> None:
    # Four rows a pass are 16 accumulators (one per row and 2-bit field): 32 zmm hold them, while Alder Lake's 16
    # ymm spilled them 44 times a pass, so AVX-VNNI keeps one row.
    assert _spills(ir_checks.assembly(level, None, 1, rows=dot_ir.ONE_TOKEN_ROWS.get(level, 1))) == []


def test_a_pass_sums_its_accumulators_by_folding_them_together() -> None:
    # 16 zmm reduced one by one took 64 adds; folded in pairs, 15, and 8 more add a column part's sums to the
    # last part's. A wrong fold fails the exactness tests.
    asm = ir_checks.assembly("avx512vnni", "icelake-server", dot_ir.WIDE, rows=2)
    assert len(re.findall(r"\bvpaddd\b", asm)) <= 16 + dot_ir.WIDE
    with pytest.raises(ValueError, match="3 sums of 16 lanes"):
        ir_checks.dot_module("avx512vnni", 3)


@pytest.mark.parametrize("tile", [dot_ir.TILE, dot_ir.WIDE])
def test_the_int8_heads_two_row_pass_stays_in_registers(tile: int) -> None:
    asm = ir_checks.assembly("avx512vnni", "icelake-server", tile, q8=True, rows=2)
    assert _spills(asm) == [] and _instructions(asm) == {"vpdpbusd zmm"}
    with pytest.raises(ValueError, match="several rows per pass are a VNNI pass"):
        ir_checks.dot_module("avx2", tile, q8=True, rows=2)


def test_two_rows_per_pass_are_vnni_only() -> None:
    with pytest.raises(ValueError, match="VNNI pass without per-block sums"):
        ir_checks.dot_module("avx2", dot_ir.WIDE, rows=2)
    with pytest.raises(ValueError, match="VNNI pass without per-block sums"):
        ir_checks.dot_module("avx512vnni", dot_ir.TILE, per_block=True, rows=2)


def test_the_spill_check_sees_a_spill() -> None:
    spilled = "\tvpdpbusd\t-192(%r14,%rcx), %zmm1, %zmm8\n\tvmovdqu64\t%zmm8, 64(%rsp)\n"
    assert _spills(spilled) == ["vmovdqu64\t%zmm8, 64(%rsp)"]
    assert _spills("\tvmovdqu\t%ymm3, -96(%rsp)\n\tvmovdqu\t(%rsi), %ymm3\n") == ["vmovdqu\t%ymm3, -96(%rsp)"]


def test_unknown_level_is_refused_by_the_emitter() -> None:
    with pytest.raises(ValueError, match="unknown ISA level"):
        ir_checks.dot_module("sse9")


# -- the multiply-add probe the benchmarks time (dot_ir.emit_peak) --------------------------------------------

@pytest.mark.parametrize("level, expected", [("avx512vnni", {"vpdpbusd zmm"}), ("avxvnni", {"{vex} vpdpbusd ymm"}),
                                             ("avx2", {"vpmaddubsw ymm"})])
def test_the_probe_compiles_to_the_level_instruction(level: str, expected: set[str]) -> None:
    # The instruction the level's dot products multiply with, and nothing else of the kind.
    assert _instructions(ir_checks.peak_assembly(level)) == expected
    with pytest.raises(ValueError, match="no multiply-add instruction"):
        ir_checks.peak_module("generic")


def _maddubs_probe(n_iter: int) -> int:
    """emit_peak's avx2 checksum in NumPy: s += pmaddubsw(s's bytes unsigned, q), int16 lanes that wrap."""
    total = 0
    for k in range(dot_ir.PEAK_CHAINS):
        q = np.array([(7 * (k % 2) + j) % 251 - 125 for j in range(32)], np.int32)
        s = np.full(16, k + 1, np.int16)
        for _ in range(n_iter):
            products = s.view(np.uint8).astype(np.int32) * q
            pairs = np.clip(products[0::2] + products[1::2], -32768, 32767)  # pmaddubsw saturates
            s = (s.astype(np.int32) + pairs).astype(np.int16)
        total += int(s.astype(np.int64).sum())
    return total


@pytest.mark.skipif("avx2" not in LEVELS, reason="this CPU lacks AVX2")
def test_the_probe_computes_what_its_instructions_do() -> None:
    # Each thread's chains run every round (an update hoisted out of the loop or a dead chain would change
    # the sum), and two threads add their checksums.
    kernels = isa.kernels("avx2")
    assert kernels.multiply_peak(5, 2) == 2 * _maddubs_probe(5)
    assert _maddubs_probe(5) != _maddubs_probe(4) != _maddubs_probe(1)  # the check tells round counts apart

# -- one disk cache per level, and the first-run announcement -----------------------------------------------

_QUANTIZE_ONCE = """
import numpy as np
from bitnet_cpu.provider import CpuProvider
p = CpuProvider(n_threads=1)
x = np.ones((1, 256), np.float32)
p._tk.quantize_rows(x, np.empty((1, 256), np.int8), np.empty(1, np.float32), np.empty((1, 1), np.int32), False)
print(p.isa)
"""
ANNOUNCEMENT = ("bitnet-cpu: compiling CPU kernels for this machine, once (up to a minute or two; "
                "`bitnet-select --device cpu warmup` compiles them all ahead)")


def _run(level: str | None, cache: Path) -> tuple[str, list[str]]:
    env = cli_env(NUMBA_CACHE_DIR=str(cache))
    env.pop("BITNET_CPU_ISA", None)
    if level:
        env["BITNET_CPU_ISA"] = level
    r = subprocess.run([sys.executable, "-c", _QUANTIZE_ONCE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip(), r.stderr.strip().splitlines()


def _cached_levels(cache: Path) -> set[str]:
    return {d.name.split("-")[1] for d in cache.glob("int-*") if any(d.rglob("*.nbi"))}


def test_each_level_caches_under_its_own_key_and_a_cold_cache_is_announced(tmp_path: Path) -> None:
    assert _run("generic", tmp_path) == ("generic", [ANNOUNCEMENT])
    assert _cached_levels(tmp_path) == {"generic"}  # a forced level caches too
    assert _run("generic", tmp_path) == ("generic", [])  # warm: silent
    if LEVELS[0] == "generic":
        pytest.skip("this host runs only the generic level")
    # The best level finds generic's kernels on disk, yet compiles its own: one level's code never
    # serves another.
    assert _run(None, tmp_path) == (isa.default_level(), [ANNOUNCEMENT])
    assert _cached_levels(tmp_path) == {"generic", isa.default_level()}


def test_wide_bytes_is_two_thirds_of_the_l1_data_cache(tmp_path: Path) -> None:
    caches = [(1, "Instruction", "32K"), (1, "Data", "48K"), (2, "Unified", "1024K")]
    for index, (level, kind, size) in enumerate(caches):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert isa.l1_data_bytes.__wrapped__(str(tmp_path)) == 48 << 10  # the data cache, not the instruction one
    assert isa.l1_data_bytes.__wrapped__(str(tmp_path / "none")) == 32 << 10
    assert isa.wide_bytes() == isa.l1_data_bytes() * 2 // 3


_COMPILED_IN = ("dot_ir.py", "attention.py", "float_kernels.py", "atomics.py", "stack_phases.py")


@pytest.mark.parametrize("edited", _COMPILED_IN)
def test_an_edit_to_a_file_compiled_into_the_int_kernels_misses_their_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edited: str) -> None:
    # numba keys each cached function to its own file; the layer region inlines attention's and the float
    # kernels' functions and reads stack_phases' stamp indices, so their edits must change the cache directory.
    assert set(isa.COMPILED_IN) >= set(_COMPILED_IN)
    for name in isa.COMPILED_IN:
        (tmp_path / name).write_bytes((isa._HERE / name).read_bytes())
    monkeypatch.setattr(isa, "_HERE", tmp_path)
    before = Path(str(isa.cache_dir("generic"))).name
    with open(tmp_path / edited, "a") as f:
        f.write("\n# edited\n")
    assert Path(str(isa.cache_dir("generic"))).name != before


@pytest.mark.parametrize("level, tile, per_block, rows", [
    (level, *variant) for level in dot_ir.LEVELS
    for variant in [(1, False, 1), (dot_ir.WIDE, False, 1)]
    + ([(dot_ir.TILE, True, 1)] if level != "avx512vbmi" else [])  # (per-block sums: 2-bit codes, see below)
    + ([(1, False, 4)] if level in dot_ir.VNNI else [])])  # (several rows a pass: VNNI's)
def test_each_block_requests_the_lines_of_both_ends_of_its_codes(level: str, tile: int, per_block: bool,
                                                                  rows: int) -> None:
    # GGUF aligns a tensor to 32 bytes and TQ2_0's blocks are 66 apart: a block's 64 code bytes often span two lines,
    # and one request a block (its first byte ahead) left a line of each row to the hardware prefetcher.
    text = ir_checks.dot_module(level, tile, per_block, rows=rows)
    ends = {end: re.findall(rf'= add i64 (\S+), {end}\n', text) for end in (0, dot_ir.BLOCK_BYTES - 1)}
    assert ends[0] and sorted(ends[0]) == sorted(ends[dot_ir.BLOCK_BYTES - 1])
    assert text.count('call void @"llvm.prefetch.p0"') == 2 * len(ends[0])
