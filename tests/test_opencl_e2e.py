"""Whole models on the OpenCL backend against the CPU plugin: logits, greedy tokens, repeated runs on one
engine, the program cache and device out-of-memory. Every test runs on each OpenCL platform present
(BITNET_OPENCL_PLATFORM names it): PoCL runs the portable kernel paths, Intel's CPU runtime the subgroup,
dot-product and f16 ones.

Agreement rule (the integer parts of BitLinear are exact on both backends; float summation order is not):
- act_quant "none": at every position, max |opencl - cpu| <= 5e-3 * max |cpu logit| of that position
  (measured worst: 1.8e-6).
- act_quant "row" and "block256" hold the same tolerance until the first int8 rounding flip: a value
  whose x * s lands within float32 rounding of a .5 step, so that the backends round it to
  neighbouring integers (an 11 -> 12 flip was measured at 4.4e-3 of the largest logit, others here up
  to 1.2e-2). About 1 % of positions have one. A flip is not local: the K and V it perturbs are read by
  every later position, whose activations then quantize differently in many places, so after it the
  backends differ by the quantization noise itself, 1-3 % of the largest logit, at every later
  position (measured: all 128 positions of a prompt beyond 5e-3 once a flip fell in its first tokens).
  Hence two rules, both citing docs/design.md section 5b:
  * isolated positions (one-token prompts, where a flip cannot propagate): the rule the brief gives,
    at least 98 % of positions within 5e-3 and all within 0.05 (pooled over every model and mode);
  * whole sequences: section 5b's rule for two correct implementations that round differently,
    every position (not only 98 %) within 0.05 and the arg-max equal wherever the top-two margin
    exceeds 0.05 (measured worst: 2.7e-2).
  The exactness of the integer path itself is tested per kernel in test_opencl_provider.py.
Greedy generation is teacher-forced (the CPU's greedy tokens fed to both), the margin threshold being
each mode's tolerance, as the issue asks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import bitnet
from bitnet.errors import NoBackendError, UsageError
from bitnet.modelfile.ternary import from_values
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.testing import operation_support
from conftest import cli_env, opencl_platforms, run_cli

cl = pytest.importorskip("pyopencl")

from bitnet_opencl.provider import OpenCLProvider  # noqa: E402

PLATFORMS = opencl_platforms()
pytestmark = [pytest.mark.opencl,
              pytest.mark.skipif(not PLATFORMS, reason="pyopencl finds no OpenCL platform with a device")]


@pytest.fixture(autouse=True, params=PLATFORMS)
def platform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`device="opencl"` opens the first device of this platform (fresh processes get it through env=)."""
    monkeypatch.setenv("BITNET_OPENCL_PLATFORM", request.param)
    return request.param

TOL = {"none": 5e-3, "row": 0.05, "block256": 0.05}  # see the module docstring
N_CTX = 192
MODELS = {
    # arch, weight format, attention shape (GQA 2:1, 4:1, MQA, MHA), LM head tied or not, scales.
    "bitnet-tq2_0-gqa-tied": SyntheticSpec(arch="bitnet", weight_type="tq2_0", n_heads=4, n_kv_heads=2,
                                           tied=True, n_ctx=N_CTX),
    "bitnet-tq1_0-mha-untied-f32embd": SyntheticSpec(arch="bitnet", weight_type="tq1_0", n_heads=4, n_kv_heads=4,
                                                     tied=False, embd_type="f32", n_ctx=N_CTX, seed=1),
    "b1.58-i2_s-gqa4-tied": SyntheticSpec(arch="bitnet-b1.58", weight_type="i2_s", dim=512, n_heads=8,
                                          n_kv_heads=2, ffn_dim=768, n_ctx=N_CTX, seed=2),
    "bitnet-f32-scales-untied": SyntheticSpec(arch="bitnet", weight_type="f32", scales=True, tied=False,
                                              n_ctx=N_CTX, seed=3),
    "b1.58-tq2_0-mqa-scales-spm": SyntheticSpec(arch="bitnet-b1.58", weight_type="tq2_0", n_heads=4, n_kv_heads=1,
                                                scales=True, tokenizer="llama", n_ctx=N_CTX, seed=4),
}
MODES = ("none", "row", "block256")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {name: write_model(d / f"{name}.gguf", spec) for name, spec in MODELS.items()}


def relative_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per position: the largest logit difference over that position's largest |logit|."""
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


def top_two_margin(logits: np.ndarray) -> np.ndarray:
    """Per position: (largest - second largest logit) over the largest |logit|."""
    top = np.sort(logits, axis=1)[:, -2:]
    return (top[:, 1] - top[:, 0]) / np.abs(logits).max(axis=1)


def check_agreement(got: np.ndarray, want: np.ndarray, mode: str) -> None:
    rel, margin = relative_errors(got, want), top_two_margin(want)
    tol = TOL[mode]
    worst = int(np.argmax(rel))
    assert rel.max() <= tol, f"position {worst}: {rel[worst]:.2e} of the largest logit (tolerance {tol})"
    decided = margin > tol
    differ = np.flatnonzero(decided & (got.argmax(axis=1) != want.argmax(axis=1)))
    assert differ.size == 0, f"arg-max differs at positions {differ.tolist()} despite margins above {tol}"


# -- logits ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_position_logits_match_the_cpu_plugin(models, name, mode, platform):
    vocab = MODELS[name].vocab_size
    # 160 tokens: two chunks of the transformer's (PREFILL_CHUNK), their logits joined through the device's from_host
    ids = np.random.default_rng(len(name)).integers(0, vocab, 160).astype(np.int32)
    with bitnet.load(models[name], device="cpu", act_quant=mode) as cpu, \
            bitnet.load(models[name], device="opencl", act_quant=mode) as ocl:
        assert ocl.provider.backend == "opencl" and cpu.provider.backend == "cpu"
        assert ocl.provider.cl_device.platform.name.strip() == platform
        want, got = cpu.logits(ids), ocl.logits(ids)
        # The mode reached the device: only the int8 modes quantize, and nothing fell back to the CPU
        # (an operation the provider stopped implementing would run on the host and be counted).
        assert (ocl.provider.dispatches["quantize_i8"] > 0) == (mode != "none")
        support = operation_support(ocl.provider)
        assert support.pop("lm_head_q8") == "fallback"  # GPUs run the int8 head on the host (design.md 4)
        assert set(support.values()) == {"native"} and not ocl.provider.fallbacks
    assert got.shape == want.shape == (len(ids), vocab) and got.dtype == np.float32
    check_agreement(got, want, mode)


def test_isolated_positions_in_the_int8_modes_flip_rarely(models):
    """The brief's rule for the int8 modes where a flip cannot propagate: one-token prompts, whose logits
    depend on their own quantization only. Pooled over every model, both modes and 128 tokens each:
    at least 98 % of positions within 5e-3 of the largest logit, all within 0.05 (measured: 4 of 1280
    beyond 5e-3, the worst at 1.2e-2). A wrong quantizer or mode fails nearly every position; pooling
    keeps the count meaningful however a machine's float rounding places its few flips."""
    rel = []
    for name, spec in MODELS.items():
        for mode in ("row", "block256"):
            with bitnet.load(models[name], device="cpu", act_quant=mode) as cpu, \
                    bitnet.load(models[name], device="opencl", act_quant=mode) as ocl:
                for tok in range(0, spec.vocab_size, spec.vocab_size // 128):
                    rel.append(relative_errors(ocl.logits([tok]), cpu.logits([tok]))[0])
    rel = np.array(rel)
    assert rel.size == 1280
    assert np.mean(rel <= 5e-3) >= 0.98, f"{np.sum(rel > 5e-3)} of {rel.size} positions beyond 5e-3"
    assert rel.max() <= 0.05


# -- greedy generation, teacher-forced -------------------------------------------------------------------
def greedy_decode(engine: bitnet.Engine, prompt: list[int], forced: list[int] | None, steps: int
                  ) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's logits, through the decode path generate() uses (prefill, then one
    token per forward pass, arg-max on the device). With `forced`, those tokens are fed instead."""
    tr, p = engine.transformer, engine.provider
    tr.reset()
    handle = tr.forward(np.asarray(prompt, np.int32), 0, all_logits=False)
    tokens, logits = [], []
    for step in range(steps):
        logits.append(p.to_host(handle)[-1])
        tokens.append(int(p.argmax(handle)[-1]))
        fed = forced[step] if forced is not None else tokens[-1]
        if step + 1 < steps:
            handle = tr.forward(np.array([fed], np.int32), len(prompt) + step, all_logits=False)
    return tokens, np.array(logits)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_64_tokens_teacher_forced(models, name, mode):
    with bitnet.load(models[name], device="cpu", act_quant=mode) as cpu, \
            bitnet.load(models[name], device="opencl", act_quant=mode) as ocl:
        prompt = cpu.tokenize("The quick brown fox jumps over the lazy dog")
        want_tokens, want = greedy_decode(cpu, prompt, None, 64)
        got_tokens, got = greedy_decode(ocl, prompt, want_tokens, 64)
    tol = TOL[mode]
    decided = top_two_margin(want) > tol
    # Not vacuous: most steps are decided (measured 39..62 of 64 over these models and modes).
    assert decided.sum() >= 32, f"only {decided.sum()} of 64 steps have a top-two margin above {tol}"
    differ = [i for i in np.flatnonzero(decided) if got_tokens[i] != want_tokens[i]]
    assert not differ, f"steps {differ}: opencl chose {[got_tokens[i] for i in differ]}, " \
                       f"cpu {[want_tokens[i] for i in differ]}"
    assert relative_errors(got, want).max() <= tol


def test_free_running_generate_gives_the_cpu_text(models):
    """generate() itself, free-running, in "none" mode: for as many leading steps as the two backends'
    logits differ by less than half the top-two margin (so the arg-max cannot differ), the texts are
    equal."""
    path = models["bitnet-tq2_0-gqa-tied"]
    with bitnet.load(path, device="cpu", act_quant="none") as cpu, \
            bitnet.load(path, device="opencl", act_quant="none") as ocl:
        prompt = cpu.tokenize("Once upon a time")
        tokens, want = greedy_decode(cpu, prompt, None, 64)
        _, got = greedy_decode(ocl, prompt, tokens, 64)
        safe = relative_errors(got, want) < top_two_margin(want) / 2
        steps = int(np.argmin(safe)) if not safe.all() else len(safe)
        assert steps >= 16, f"only {steps} leading steps are decided beyond doubt"
        text = "".join(ocl.generate(prompt, max_tokens=steps))
        assert text == "".join(cpu.generate(prompt, max_tokens=steps)) == cpu.detokenize(tokens[:steps])


# -- repeated runs on one engine -------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_twenty_generations_on_one_engine_are_identical_and_leak_nothing(models, temperature):
    """Every host read waits for the work it reads (one in-order queue): twenty runs on one engine,
    reusing its pooled buffers and KV cache, give the same text, and the pool reaches a steady state."""
    engine = bitnet.load(models["b1.58-i2_s-gqa4-tied"], device="opencl")
    prompt = engine.tokenize("In a hole in the ground there lived a hobbit. " * 3)
    texts, stats = [], []
    for _ in range(20):
        texts.append("".join(engine.generate(prompt, max_tokens=48, temperature=temperature, seed=11)))
        assert engine.provider.leaks() == []
        s = engine.provider.pool.stats
        stats.append((s.current, s.in_use, s.allocations))
    assert texts[0] and all(t == texts[0] for t in texts), [t for t in texts if t != texts[0]][:1]
    assert len(set(stats[1:])) == 1, "the pool kept growing after the first run"
    pool = engine.provider.pool
    engine.close()
    assert engine.provider.leaks() == [] and (pool.stats.current, pool.stats.in_use) == (0, 0)


# -- many sequences at once: batch invariance ----------------------------------------------------------------
# One sequence per slot, each a token list; the batched steps below cut them into prefill chunks and
# decodes. Sequence A is 21 tokens, B 13, C 2, D 17 (so rows fall at every offset of a matmul tile).
SEQUENCES = {2: list(range(3, 24)), 0: list(range(40, 53)), 3: [7, 7], 1: list(range(90, 107))}
# Steps: (slot, first position, tokens) per sequence, in batch order, and the rows that get logits (None:
# every row). A prefill chunk of one sequence runs beside decodes of others; slot order is arbitrary.
BATCH_STEPS = [
    ([(2, 0, 20), (0, 0, 5)], None),  # two prefills, 25 rows: more than three tiles of 8
    ([(2, 20, 1), (0, 5, 7), (3, 0, 1), (1, 0, 16)], None),  # A decodes beside three prefill chunks
    ([(3, 1, 1), (0, 12, 1), (1, 16, 1)], [0, 2]),  # three decodes, logits of two (rows() gathers)
]


def sequences_alone(path: Path, mode: str) -> dict[int, np.ndarray]:
    """Every position's logits of each sequence run alone: a one-slot engine, one forward per sequence."""
    with bitnet.load(path, device="opencl", act_quant=mode) as alone:
        out = {}
        for slot, ids in SEQUENCES.items():
            alone.transformer.reset()
            out[slot] = alone.provider.to_host(alone.transformer.forward(np.array(ids, np.int32), 0, all_logits=True))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["b1.58-i2_s-gqa4-tied", "b1.58-tq2_0-mqa-scales-spm"])
def test_a_batch_of_sequences_gives_each_its_logits_alone_bit_for_bit(models, name, mode):
    """Batch invariance: a row's logits never depend on the rows beside it, whatever their slots,
    positions or number, and whatever the chunking of its own prompt. Bit for bit, every mode."""
    want = sequences_alone(models[name], mode)
    with bitnet.load(models[name], device="opencl", act_quant=mode, n_seqs=4) as engine:
        tr, p = engine.transformer, engine.provider
        for step, rows in BATCH_STEPS:
            ids = np.concatenate([SEQUENCES[slot][p0:p0 + n] for slot, p0, n in step]).astype(np.int32)
            slots = np.concatenate([np.full(n, slot) for slot, _, n in step]).astype(np.int32)
            positions = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in step]).astype(np.int32)
            index = np.arange(len(ids)) if rows is None else np.array(rows)
            got = p.to_host(tr.forward_batch(ids, slots, positions, index.astype(np.int32)))
            expected = np.stack([want[slots[i]][positions[i]] for i in index])
            for row, (g, w) in enumerate(zip(got, expected, strict=True)):
                np.testing.assert_array_equal(g, w, err_msg=f"row {index[row]}: slot {slots[index[row]]} "
                                                            f"position {positions[index[row]]}")
        assert p.dispatches["copy_rows"] == 1 and not p.fallbacks and p.leaks() == []


PROMPTS = ["Hello", "Once upon a time, in a land far away,", "The quick brown fox", "1, 2, 3,", "Numbers: 42"]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}], ids=["greedy", "seeded"])
def test_generate_batch_gives_every_prompt_its_text_alone(models, sampling):
    """engine.generate_batch on 4 slots (5 prompts: one waits for a slot) equals each prompt's generate.
    End-of-generation tokens are biased away so that every sequence runs its 16 tokens."""
    with bitnet.load(models["bitnet-tq2_0-gqa-tied"], device="opencl", n_seqs=4) as engine:
        kwargs = {"max_tokens": 16, "logit_bias": {t: -100.0 for t in engine.tokenizer.eog_ids}, **sampling}
        alone = []
        for prompt in PROMPTS:
            engine.reset()
            alone.append("".join(engine.generate(prompt, **kwargs)))
        batched = engine.generate_batch(PROMPTS, **kwargs)
        assert engine.provider.leaks() == []
    assert all(alone) and len(set(alone)) > 1  # real, different texts
    assert batched == alone


# -- start-up: first-token latency and the program cache ----------------------------------------------------
START = textwrap.dedent("""
    import json, sys, bitnet
    with bitnet.load(sys.argv[1], device="opencl") as e:
        text = "".join(e.generate("Hello there", max_tokens=4))
        print(json.dumps({"ttft_ms": e.stats.ttft_ms, "load_ms": e.stats.load_ms,
                          "build_ms": e.provider.build_ms, "cache": str(e.provider.program_cache)}))
""")


def compiled_files(cache: Path) -> dict[str, tuple[int, int]]:
    """Compiled code in a program cache (PoCL: program.bc and per-kernel .so; PyOpenCL: `binary`), by
    path, with size and modification time: bookkeeping files a cache hit touches are left out."""
    return {str(f.relative_to(cache)): (f.stat().st_size, f.stat().st_mtime_ns) for f in cache.rglob("*")
            if f.is_file() and (f.suffix in (".bc", ".so") or f.name == "binary")}


def test_second_start_uses_the_program_cache(models, tmp_path, platform):
    """Two fresh processes with an empty cache directory: the first compiles and stores, the second
    compiles nothing (its compiled files are the first's, untouched). Both report first-token latency."""
    env = cli_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), BITNET_CACHE_DIR=str(tmp_path / "bitnet"),
                  BITNET_OPENCL_PLATFORM=platform)
    env.pop("POCL_CACHE_DIR", None)
    (tmp_path / "xdg").mkdir()
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", START, str(models["bitnet-tq2_0-gqa-tied"])], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if len(runs) == 1:
            if runs[0]["cache"] == "None":
                pytest.skip("this driver keeps its build cache where we cannot look")
            cache = Path(runs[0]["cache"])
            assert cache.is_relative_to(tmp_path), cache  # the cache follows XDG_CACHE_HOME / BITNET_CACHE_DIR
            first = compiled_files(cache)
            assert first, f"nothing compiled was stored under {cache}"
    assert compiled_files(cache) == first
    for run in runs:
        assert run["ttft_ms"] > 0 and run["build_ms"] > 0 and run["load_ms"] > 0


# -- device out of memory ---------------------------------------------------------------------------------
@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[OpenCLProvider]:
    """Every OpenCLProvider opened during the test, so a failed load's provider can be inspected."""
    made: list[OpenCLProvider] = []
    init = OpenCLProvider.__init__

    def recording_init(self: OpenCLProvider, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(OpenCLProvider, "__init__", recording_init)
    return made


def test_absurd_context_is_a_usage_error_before_anything_is_allocated(models, spy):
    """The engine checks the KV cache against the device's memory before the provider allocates."""
    spec = MODELS["bitnet-tq2_0-gqa-tied"]
    n_ctx = 100_000_000
    kv_gib = 2 * spec.n_layers * spec.n_kv_heads * n_ctx * (spec.dim // spec.n_heads) * 4 / (1 << 30)
    with pytest.raises(UsageError) as err:
        bitnet.load(models["bitnet-tq2_0-gqa-tied"], device="opencl", n_ctx=n_ctx)
    msg = str(err.value)
    (provider,) = spy
    assert "\n" not in msg and f"{kv_gib:.1f} GiB KV cache" in msg, msg
    assert f"{provider.device.memory_bytes / (1 << 30):.1f} GiB of opencl:" in msg, msg
    assert provider.closed and provider.pool.stats.allocations == 0 and provider.leaks() == []


def test_absurd_context_through_the_cli_exits_2_on_one_line(models, platform):
    r = run_cli("--device", "opencl", "run", "--model", str(models["bitnet-tq2_0-gqa-tied"]), "--prompt", "x",
                "--n-ctx", "100000000", env=cli_env(BITNET_OPENCL_PLATFORM=platform))
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("requested=")]
    assert len(errors) == 1 and errors[0].startswith("error: n_ctx=100000000 needs a ") and "KV cache" in errors[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.fixture
def engine(models):
    eng = bitnet.load(models["bitnet-tq2_0-gqa-tied"], device="opencl", n_ctx=64)
    yield eng
    eng.close()
    assert eng.provider.pool.stats.current == 0


def test_a_buffer_beyond_the_device_limit_is_refused_before_the_driver_is_asked(engine):
    """The pool's own check, below the engine's: one buffer larger than the device allows."""
    p = engine.provider
    pool = p.pool
    held, allocations = pool.stats.current, pool.stats.allocations
    n_ctx = pool.max_alloc // (8 * 64 * 4) + 1  # one position more than a buffer may hold
    with pytest.raises(NoBackendError, match=rf"KV cache K of {n_ctx} positions needs .*; the device allows at "
                                             rf"most {pool.max_alloc / (1 << 30):.1f} GiB in one buffer"):
        p.kv_cache(1, n_ctx, 8, 64)
    assert (pool.stats.current, pool.stats.allocations) == (held, allocations) and p.leaks() == []


def test_a_failure_midway_releases_what_the_call_allocated(engine):
    """K fits, V does not; the codes fit, the scales do not: the call fails whole, and the model that was
    loaded before it still runs."""
    eng, p = engine, engine.provider
    before = eng.logits([1, 2, 3])
    pool = p.pool
    pool.trim()
    held = pool.stats.current
    cache_bytes = 2 * 8 * 1000 * 64 * 4
    pool.capacity = held + cache_bytes + cache_bytes // 2
    with pytest.raises(NoBackendError, match=r"KV cache V of 1000 positions needs 3\.9 MiB; the device has"):
        p.kv_cache(2, 1000, 8, 64)
    assert pool.stats.current == held
    w = from_values(np.ones((512, 1024), np.int8), 1.0)
    pool.capacity = held + 512 * 1024 // 4 + 4  # the codes, and not the scales
    with pytest.raises(NoBackendError, match="ternary scales 512x1024 needs 8.0 KiB"):
        p.upload_ternary(w)
    assert pool.stats.current == held and p.leaks() == []
    pool.capacity = 1 << 40
    np.testing.assert_array_equal(eng.logits([1, 2, 3]), before)


def test_cached_activations_make_way_for_a_resident_buffer(engine):
    eng, p = engine, engine.provider
    eng.logits(list(range(40)))
    pool = p.pool
    idle = pool.stats.current - pool.stats.in_use
    assert idle > 0  # the forward pass left activation buffers cached for the next one
    pool.capacity = pool.stats.in_use + 1024
    p.upload_float(np.ones(256, np.float32))  # fits only once the idle buffers are given back
    assert pool.stats.current == pool.stats.in_use


def test_the_drivers_own_refusal_is_the_same_clear_error(engine):
    """Past our limits the driver decides: with the per-buffer check lifted, the driver itself refuses
    the buffer (PoCL: INVALID_BUFFER_SIZE), and that, too, is a NoBackendError naming the size."""
    p = engine.provider
    p.pool.max_alloc = p.pool.capacity = 1 << 50
    huge = p.cl_device.max_mem_alloc_size + (1 << 30)
    with pytest.raises(NoBackendError, match=rf"float \({huge // 4},\) needs .*the driver refused"):
        p.upload_float(np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (huge // 4,), (0,)))
    assert p.leaks() == []
