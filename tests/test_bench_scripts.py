"""The benchmark scripts' errors: a bad file or a failed worker is one line and an exit code, not a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bitnet.modelfile import default_model
from bitnet_cpu import isa

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import workers  # noqa: E402


def bench_cpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu.py"), *args, "--runs", "1"],
                          capture_output=True, text=True, timeout=120)


def test_a_failed_worker_is_its_error_line() -> None:
    cmd = [sys.executable, "-c", "def f():\n    raise ValueError('Failed to load model from file: x.gguf')\nf()"]
    with pytest.raises(workers.WorkerError) as e:
        workers.run(cmd, {}, 60, "llama")
    assert str(e.value) == "llama worker failed (exit 1): ValueError: Failed to load model from file: x.gguf"


def test_a_worker_without_a_result_or_in_time_fails() -> None:
    with pytest.raises(workers.WorkerError, match="no error output"):
        workers.run([sys.executable, "-c", "print('hello')"], {}, 60, "ours")
    with pytest.raises(workers.WorkerError, match="timed out after 0.5 s"):
        workers.run([sys.executable, "-c", "import time; time.sleep(30)"], {}, 0.5, "ours")


def test_ready_counts_what_the_load_left_before_the_first_pass() -> None:
    import bench_cpu

    runs: list[float] = []

    def step() -> None:  # a first pass 90 ms longer than the second
        time.sleep(0.1 if not runs else 0.01)
        runs.append(0)

    start = time.perf_counter()
    time.sleep(0.2)  # what a load left for whatever runs next (a deferred collection lands in the prompt's ids)
    warm_s, ready_s = bench_cpu._warm_up(step, lambda: None, start)
    # 0.2 + 0.1 - 0.01, less any stall of the second pass up to 0.09 s; without the 0.2 s, at most 0.1
    assert warm_s >= 0.1 and ready_s >= 0.2


def test_bench_cpu_refuses_an_i2_s_file_for_llama_cpp() -> None:
    r = bench_cpu("--model", default_model.path())  # llama.cpp would run the I2_S file itself
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("give its TQ2_0 twin as --llama-model")


def test_bench_cpu_bad_files_are_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk")
    r = bench_cpu("--model", str(junk))
    assert (r.returncode, r.stderr.strip()) == (4, f"bench_cpu.py: {junk}: not a GGUF file (no GGUF magic)")
    missing = tmp_path / "missing.gguf"
    r = bench_cpu("--model", str(missing))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(f"no such file: {missing}")


def test_bench_cpu_compares_heads_only_for_the_int8_head(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "bitnet.modelfile.writer", str(tiny), "--preset", "tiny", "--weight-type",
                    "tq2_0"], check=True, capture_output=True, timeout=120)
    r = bench_cpu("--model", str(tiny), "--with-f16-head", "--lm-head", "f16")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--with-f16-head compares the int8 head with the F16 one; our head here is f16")


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_busy_co_tenants_spin_while_the_block_runs_and_are_gone_after() -> None:
    with workers.busy(2) as procs:
        assert len(procs) == 2
        time.sleep(1.0)
        # Spinning, each has had >= 0.1 s of CPU (a share of 2 cores with the suite's other tests);
        # a process that slept would show only its start-up, 2-3 ticks of 10 ms.
        assert all(_cpu_ticks(p.pid) >= 10 for p in procs), [_cpu_ticks(p.pid) for p in procs]
    assert all(p.returncode is not None for p in procs)  # killed and reaped
    assert not any(Path(f"/proc/{p.pid}").exists() for p in procs)


def test_bench_cpu_refuses_a_negative_busy_count() -> None:
    r = bench_cpu("--model", default_model.path(), "--busy", "-1")
    assert r.returncode == 2 and r.stderr.strip().endswith("--busy must be 0 or more, not -1")


def avx2_styles(tmp_path: Path, tokens: int, *defines: str) -> subprocess.CompletedProcess[str]:
    exe = tmp_path / f"styles{tokens}{''.join(defines)}"
    build = subprocess.run(["gcc", "-O2", "-mavx2", f"-DT={tokens}", *defines, "-o", str(exe),
                            str(BENCHMARKS / "avx2_kernel_styles.c")], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(exe), "check"], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("gcc") is None or "avx2" not in isa.host_levels(), reason="needs gcc and an AVX2 CPU")
def test_the_avx2_kernel_styles_compute_the_reference_sums(tmp_path: Path) -> None:
    for tokens in (2, 8):
        r = avx2_styles(tmp_path, tokens)
        assert r.returncode == 0 and "give the reference's sums" in r.stdout, r.stdout + r.stderr
    broken = avx2_styles(tmp_path, 2, "-DBREAK_TABLE")
    assert broken.returncode == 1 and broken.stdout.startswith("lut: row "), broken.stdout


def packing_probe(tmp_path: Path, broken: bool) -> subprocess.CompletedProcess[str]:
    """The probe's exactness check alone (no rounds); `broken` runs a copy whose reference reads the trits reversed."""
    script = BENCHMARKS / "packing_probe.py"
    if broken:
        text = script.read_text()
        assert "codes = TRITS[:, w" in text
        script = tmp_path / "packing_probe.py"
        script.write_text(text.replace("codes = TRITS[:, w", "codes = TRITS[::-1][:, w"))
    return subprocess.run([sys.executable, str(script), "--rounds", "0"], capture_output=True, text=True, timeout=120)


def test_the_packing_probe_checks_the_base3_dot(tmp_path: Path) -> None:
    if "avx512vbmi" not in isa.host_levels():
        r = packing_probe(tmp_path, False)
        assert (r.returncode, r.stdout) == (1, "") and "lacks AVX-512 VBMI or VNNI" in r.stderr, r.stderr
        return
    r = packing_probe(tmp_path, False)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = packing_probe(tmp_path, True)
    assert r.returncode == 1 and "the base-3 dot's sum" in r.stderr and "is wrong" in r.stderr, r.stderr
