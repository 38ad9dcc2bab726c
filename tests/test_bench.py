"""`bitnet-select bench`: measured tables, CSV/JSON, receipts, and each gate seen failing and passing."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from bitnet.tools import bench
from conftest import cli_env, run_cli

# Short runs: one short prompt, few tokens (the gates' logic does not need long ones).
FAST = ("--prompt", "Hello there", "-n", "4", "-r", "2", "--warmup", "0")


@pytest.fixture
def env(bitnet_cache_dir: str) -> dict[str, str]:
    return cli_env(BITNET_CACHE_DIR=bitnet_cache_dir)


def opencl_runs(env: dict[str, str]) -> bool:
    return run_cli("--device", "opencl", env=env).returncode == 0


def test_bench_table_csv_json_and_receipts(tmp_path: Path, env: dict[str, str]) -> None:
    devices = "cpu,opencl" if opencl_runs(env) else "cpu"
    out, rec = tmp_path / "out", tmp_path / "receipts"
    r = run_cli("bench", "--device", devices, *FAST, "--seed", "1", "--determinism", "--out", str(out),
                "--receipts", str(rec), env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bench ") and lines[1].split()[:3] == ["BACKEND", "DEVICE", "RUNS"]
    data = json.loads((out / "bench.json").read_text())
    assert [s["backend"] for s in data["summary"]] == devices.split(",")
    for s in data["summary"]:
        assert s["status"] == "ran" and s["runs"] == 2 and s["deterministic"] is True
        assert s["decode_tps_median"] > 0 and s["wall_ms_p95"] >= s["wall_ms_median"] > 0
        assert any(line.startswith(s["backend"] + " ") for line in lines[2:])
        v = run_cli("receipt", "verify", s["receipt"], "--require-real", "--require-backend", s["backend"])
        assert v.returncode == 0, v.stderr
    assert len(data["runs"]) == 2 * len(data["summary"])
    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["backend"] for row in rows] == devices.split(",")
    assert {"prefill_tps_median", "prefill_tps_p95", "decode_tps_median", "decode_tps_p95",
            "wall_ms_median", "wall_ms_p95"} <= set(rows[0])
    with open(out / "bench_runs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(data["runs"])


def test_determinism_gate_fails_without_seed_and_passes_with_one(env: dict[str, str]) -> None:
    # Three unseeded samples of 32 tokens: all equal by chance is negligible (8 x 2 once was not).
    args = ("bench", "--device", "cpu", "--prompt", "Hello there", "-n", "32", "-r", "3", "--warmup", "0",
            "--temperature", "1.0", "--determinism")
    r = run_cli(*args, env=env)
    assert r.returncode == 5, r.stdout + r.stderr
    assert re.search(r"error: gate determinism failed: cpu prompt 0 gave [23] different texts with seed None",
                     r.stderr), r.stderr
    ok = run_cli(*args, "--seed", "7", env=env)
    assert ok.returncode == 0, ok.stderr


def test_throughput_and_wall_gates_fail_and_pass(env: dict[str, str]) -> None:
    r = run_cli("bench", "--device", "cpu", *FAST, "--min-decode-tps", "1e9", "--max-wall-ms", "0.001",
                env=env)
    assert r.returncode == 5
    errors = r.stderr.strip().splitlines()[-2:]
    assert errors[0].startswith("error: gate min-decode-tps failed: cpu decodes ")
    assert errors[1].startswith("error: gate max-wall-ms failed: cpu wall time p95 ")
    ok = run_cli("bench", "--device", "cpu", *FAST, "--min-decode-tps", "0.001", "--max-wall-ms", "1e9",
                 env=env)
    assert ok.returncode == 0, ok.stderr


def test_unavailable_backend_is_skipped_with_reason_unless_required(env: dict[str, str]) -> None:
    # cuda is disabled so the test means the same on a machine that has a CUDA device.
    env = {**env, "BITNET_DISABLE_PLUGINS": "cuda"}
    r = run_cli("bench", "--device", "cpu,cuda", *FAST, env=env)
    assert r.returncode == 0, r.stderr
    assert "cuda: skipped: no backend satisfies --device cuda" in r.stdout
    assert any(line.startswith("cpu ") for line in r.stdout.splitlines())
    req = run_cli("bench", "--device", "cpu,cuda", *FAST, "--require", "cuda", env=env)
    assert req.returncode == 3
    assert "error: required backend cuda did not run: no backend satisfies --device cuda" in req.stderr


def test_required_backend_not_requested_is_still_tried(env: dict[str, str]) -> None:
    r = run_cli("bench", "--device", "cpu", *FAST, "--require", "cuda",
                env={**env, "BITNET_DISABLE_PLUGINS": "cuda"})
    assert r.returncode == 3 and "required backend cuda did not run" in r.stderr


def test_fake_device_is_skipped_not_measured(env: dict[str, str]) -> None:
    r = run_cli("bench", "--device", "cuda", *FAST, env={**env, "BITNET_GPU_FAKE": "cuda"})
    assert r.returncode == 0 and "cuda: skipped: cuda is a fake device" in r.stdout
    assert "(no backend ran)" in r.stdout


def test_gate_failures_name_gate_backend_and_value() -> None:
    report = bench.BenchReport(bench.BenchConfig(seed=None, temperature=0.8), "now", [
        bench.BackendResult("cpu", "cpu", "x", runs=[
            bench.Run("cpu", "x", 0, rep, 3, 4, 1.0, 100.0, 10.0 + rep, 50.0 + rep, "h") for rep in range(3)],
            texts={0: {"a", "b"}}),
        bench.BackendResult("cuda", skipped="no device"),
    ])
    assert bench.gate_failures(report) == []
    assert bench.gate_failures(report, min_decode_tps=11.0) == []  # the median is 11
    assert bench.gate_failures(report, min_decode_tps=11.5) == [
        "gate min-decode-tps failed: cpu decodes 11.00 tokens/s (median of 3 runs) < 11.5"]
    assert bench.gate_failures(report, max_wall_ms=52.0) == []
    failed = bench.gate_failures(report, max_wall_ms=51.5)
    assert len(failed) == 1 and failed[0].startswith("gate max-wall-ms failed: cpu wall time p95 51.9 ms")
    assert bench.gate_failures(report, determinism=True) == [
        "gate determinism failed: cpu prompt 0 gave 2 different texts with seed None (temperature 0.8)"]
    summary = report.results[0].summary()
    assert summary["decode_tps_p95"] == pytest.approx(10.1) and summary["wall_ms_p95"] == pytest.approx(51.9)
    assert "cuda: skipped: no device" in bench.table(report)
