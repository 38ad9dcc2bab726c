"""Receipts: built from real runs, validated by the schema, and every verify check seen failing.

The kernel list is evidence: a provider op that stops recording its dispatch must make a test
fail, and the tests below show that it does.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bitnet.errors import BitnetError, GateError, NoBackendError
from bitnet.runtime.engine import Engine
from bitnet.runtime.provider import KernelProvider
from bitnet.tools import receipts
from bitnet_cpu.provider import CpuProvider
from conftest import BITNET_ENV, cli_env, run_cli

# More tokens than the CPU plugin runs through its layers in one region: the prefill runs every operation.
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away"
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "seed": 1}
# The operations core's transformer calls on a provider in a greedy run (memory ops excluded:
# uploads, cache allocation and to_host move data, they are not kernels).
MODEL_OPS = ("embed", "rmsnorm", "bitlinear", "rope", "attention", "act_mul", "add", "rows", "lm_head",
             "argmax")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pytest.MonkeyPatch]:
    """No BITNET_* variable from the caller; the default model cached per module (xdist-safe)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in BITNET_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("BITNET_CACHE_DIR", str(tmp_path_factory.mktemp("bitnet-cache")))
        yield mp


def open_engine(device: str) -> Engine:
    import bitnet

    try:
        return bitnet.load(device=device)
    except (NoBackendError, ImportError) as exc:
        pytest.skip(f"{device} cannot run here: {exc}")


def generate(engine: Engine, sampling: dict[str, Any] = SAMPLING) -> str:
    engine.tokenizer.is_eog = lambda tok: False  # type: ignore[method-assign]  # a fixed token count
    engine.reset()  # a whole prefill each time (rows runs), not the prefix the previous run cached
    return "".join(engine.generate(PROMPT, **sampling))


@pytest.fixture(scope="module")
def cpu_engine(env: pytest.MonkeyPatch) -> Iterator[Engine]:
    with open_engine("cpu") as engine:
        yield engine


@pytest.fixture(scope="module")
def good(cpu_engine: Engine) -> dict[str, Any]:
    """A receipt of a real greedy CPU run; each check test edits a copy of it."""
    before = receipts.snapshot(cpu_engine.provider)
    text = generate(cpu_engine)
    return receipts.build(cpu_engine, text, SAMPLING, since=before)


@pytest.fixture
def receipt(good: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(good)


def make_fake(r: dict[str, Any]) -> dict[str, Any]:
    """A consistent fake receipt derived from a real one: what a fake device's run records."""
    r.update(compute_path="fake", kernels=[], fallbacks=[], metrics=None, model=None, output=None,
             reason="fake device (BITNET_GPU_FAKE)")
    r["selection"]["fake"] = r["selection"]["device"]["fake"] = True
    return r


def checks(problems: list[str]) -> set[str]:
    return {p.split(":", 1)[0] for p in problems}


# -- real runs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_real_run_receipt_validates_and_verifies(backend: str, env: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    with open_engine(backend) as engine:
        before = receipts.snapshot(engine.provider)
        text = generate(engine)
        r = receipts.build(engine, text, SAMPLING, since=before)
        ran = engine.provider.dispatches - before.dispatches
    assert receipts.schema_errors(r) == []
    assert receipts.verify(r, require_backend=backend, require_real=True, max_fallbacks=0) == []
    # The kernel list is exactly what the provider recorded during this run, nothing added.
    assert {k["name"]: k["count"] for k in r["kernels"]} == dict(ran) and ran
    assert r["compute_path"] == "real" and r["selection"]["backend"] == backend
    assert r["output"]["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert r["model"]["sha256"] == hashlib.sha256(Path(engine.model.path).read_bytes()).hexdigest()
    m = r["metrics"]
    assert m["generated_tokens"] == SAMPLING["max_tokens"]
    assert m["prompt_tokens"] == len(engine.tokenize(PROMPT))
    assert m["decode_tps"] > 0 and m["token_latency_p95_ms"] >= m["token_latency_p50_ms"] > 0
    assert m["peak_rss_bytes"] > 0
    assert r["sampling"]["seed"] == 1 and r["sampling"]["max_tokens"] == 6
    if backend == "opencl":
        assert r["environment"]["opencl"]["platform"]
    receipts.write(tmp_path / "r.json", r)
    assert receipts.read(tmp_path / "r.json") == r


def test_cli_run_writes_a_receipt_that_verifies(tmp_path: Path, bitnet_cache_dir: str) -> None:
    path = tmp_path / "run.json"
    env = cli_env(BITNET_CACHE_DIR=bitnet_cache_dir)
    r = run_cli("--device", "cpu", "run", "-p", PROMPT, "-n", "4", "--seed", "3", "--receipt", str(path),
                env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(path.read_text())
    assert data["sampling"]["seed"] == 3 and data["selection"]["requested"] == "cpu"
    v = run_cli("receipt", "verify", str(path), "--require-real", "--require-backend", "cpu",
                "--max-fallbacks", "0")
    assert v.returncode == 0, v.stderr
    assert v.stdout.startswith(f"ok: {path}: cpu compute_path=real")


def test_receipt_covers_one_run_when_given_a_snapshot(cpu_engine: Engine) -> None:
    generate(cpu_engine)
    before = receipts.snapshot(cpu_engine.provider)
    r = receipts.build(cpu_engine, generate(cpu_engine), SAMPLING, since=before)
    whole = receipts.build(cpu_engine, "", SAMPLING)
    one = {k["name"]: k["count"] for k in r["kernels"]}
    assert one == dict(cpu_engine.provider.dispatches - before.dispatches)
    assert sum(one.values()) < sum(k["count"] for k in whole["kernels"])


# -- the kernel list is evidence -----------------------------------------------------------------------

class SilentRopeProvider(CpuProvider):
    """A CPU provider whose rope computes but no longer records its dispatch."""

    def rope(self, *args: Any, **kwargs: Any) -> Any:
        self.record = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            return super().rope(*args, **kwargs)
        finally:
            del self.record


def engine_with(provider: KernelProvider, like: Engine) -> Engine:
    from bitnet.runtime.transformer import Transformer

    transformer = Transformer(like.model, provider, like.n_ctx, "row")
    return Engine(like.selection, provider, like.model, like.tokenizer, transformer, like.load_ms)


def assert_model_ops_recorded(receipt: dict[str, Any], prefix: str) -> None:
    """Every op of the model appears in the receipt as a `<prefix>.<op>[_variant]` kernel."""
    names = [k["name"] for k in receipt["kernels"]]
    missing = [op for op in MODEL_OPS
               if not any(n == f"{prefix}.{op}" or n.startswith(f"{prefix}.{op}_") for n in names)]
    assert not missing, f"ops with no recorded kernel: {missing} (kernels: {names})"


def test_every_model_op_appears_in_the_receipt(good: dict[str, Any]) -> None:
    assert_model_ops_recorded(good, "cpu")


def test_deleting_a_dispatch_record_fails_the_kernel_list_check(cpu_engine: Engine) -> None:
    with engine_with(SilentRopeProvider(cpu_engine.selection.device), cpu_engine) as engine:
        r = receipts.build(engine, generate(engine), SAMPLING)
    assert not any("rope" in k["name"] for k in r["kernels"])
    with pytest.raises(AssertionError, match=r"\['rope'\]"):
        assert_model_ops_recorded(r, "cpu")


def silent_ops(engine: Engine) -> set[str]:
    """Run a greedy generation and return the ops that were called without recording a dispatch.

    Independent of kernel names, so it holds every backend to the same rule."""
    provider, silent = engine.provider, set()
    for op in MODEL_OPS:
        inner = getattr(provider, op)

        def audited(*args: Any, _op: str = op, _inner: Any = inner, **kwargs: Any) -> Any:
            before = sum(provider.dispatches.values())
            out = _inner(*args, **kwargs)
            if sum(provider.dispatches.values()) == before:
                silent.add(_op)
            return out

        setattr(provider, op, audited)
    try:
        generate(engine)
    finally:
        for op in MODEL_OPS:
            delattr(provider, op)
    return silent


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_every_op_call_records_a_dispatch(backend: str, env: pytest.MonkeyPatch) -> None:
    with open_engine(backend) as engine:
        assert silent_ops(engine) == set()


def test_op_audit_catches_a_silent_op(cpu_engine: Engine) -> None:
    with engine_with(SilentRopeProvider(cpu_engine.selection.device), cpu_engine) as engine:
        assert silent_ops(engine) == {"rope"}


class FallbackProvider(CpuProvider):
    """Pretends its act_mul is missing on the device and runs on the host CPU instead."""

    def act_mul(self, gate: Any, up: Any, act: str) -> Any:
        self.record_fallback("act_mul", f"no {act} kernel on this device")
        return super().act_mul(gate, up, act)


def test_fallbacks_reach_the_receipt_with_reason_and_count(cpu_engine: Engine) -> None:
    with engine_with(FallbackProvider(cpu_engine.selection.device), cpu_engine) as engine:
        r = receipts.build(engine, generate(engine), SAMPLING)
    n_calls = cpu_engine.config.n_layers * SAMPLING["max_tokens"]  # one per layer per forward pass
    assert r["fallbacks"] == [{"operation": "act_mul", "reason": "no relu2 kernel on this device",
                               "count": n_calls}]
    assert receipts.verify(r, max_fallbacks=n_calls) == []
    assert checks(receipts.verify(r, max_fallbacks=0)) == {"max-fallbacks"}


class CpuWithoutRope(CpuProvider):
    """A CPU provider that leaves rope to core, as a backend without that kernel does."""

    rope = KernelProvider.rope


def test_an_operation_the_backend_lacks_reaches_the_receipt_as_a_fallback(cpu_engine: Engine) -> None:
    with engine_with(CpuWithoutRope(cpu_engine.selection.device), cpu_engine) as engine:
        r = receipts.build(engine, generate(engine), SAMPLING)
    n_calls = 2 * cpu_engine.config.n_layers * SAMPLING["max_tokens"]  # q and k, per layer, per forward pass
    assert r["fallbacks"] == [{"operation": "rope", "reason": "not implemented by backend 'cpu'", "count": n_calls}]
    assert not any("rope" in k["name"] for k in r["kernels"])
    assert checks(receipts.verify(r, max_fallbacks=0)) == {"max-fallbacks"}


# -- fake devices ------------------------------------------------------------------------------------------

def test_fake_device_receipt_is_fake_and_fails_require_real(env: pytest.MonkeyPatch) -> None:
    env.setenv("BITNET_GPU_FAKE", "cuda")
    try:
        r = receipts.fake_run_receipt("cuda", "cuda is a fake device", SAMPLING)
    finally:
        env.delenv("BITNET_GPU_FAKE")
    assert r is not None and r["compute_path"] == "fake" and r["selection"]["fake"]
    assert r["kernels"] == [] and r["metrics"] is None and r["model"] is None
    assert receipts.verify(r) == []  # consistent: a fake device that claims no compute
    problems = receipts.verify(r, require_real=True)
    assert checks(problems) == {"require-real"} and "compute_path is 'fake'" in problems[0]


def test_real_device_gives_no_fake_receipt(env: pytest.MonkeyPatch) -> None:
    assert receipts.fake_run_receipt("cpu", "not fake") is None


def test_cli_run_on_fake_device_writes_fake_receipt_that_fails_require_real(tmp_path: Path) -> None:
    path = tmp_path / "fake.json"
    env = cli_env(BITNET_GPU_FAKE="cuda")
    r = run_cli("--device", "cuda", "run", "-p", "hi", "--receipt", str(path), env=env)
    assert r.returncode == 3 and "fake device" in r.stderr
    assert json.loads(path.read_text())["compute_path"] == "fake"
    assert run_cli("receipt", "verify", str(path)).returncode == 0
    v = run_cli("receipt", "verify", str(path), "--require-real")
    assert v.returncode == 5
    assert "require-real: compute_path is 'fake'" in v.stderr


# -- each check rejects the receipt that breaks it --------------------------------------------------------

def test_good_receipt_passes_every_check_a_cpu_run_can_pass(receipt: dict[str, Any]) -> None:
    assert receipts.verify(receipt, require_backend="cpu", require_real=True, max_fallbacks=0) == []


def test_schema_rejects_a_missing_required_field(receipt: dict[str, Any]) -> None:
    del receipt["kernels"]
    problems = receipts.verify(receipt)
    assert problems == ["schema: (top level): 'kernels' is a required property"]


def test_schema_rejects_a_malformed_kernel_entry(receipt: dict[str, Any]) -> None:
    receipt["kernels"].append({"name": "made_up", "count": 0})
    assert checks(receipts.verify(receipt)) == {"schema"}


def test_schema_requires_model_and_metrics_of_a_real_run(receipt: dict[str, Any]) -> None:
    receipt["metrics"] = None
    assert checks(receipts.verify(receipt)) == {"schema"}


def test_consistency_rejects_real_compute_path_on_a_fake_device(receipt: dict[str, Any]) -> None:
    receipt["selection"]["fake"] = receipt["selection"]["device"]["fake"] = True
    assert checks(receipts.verify(receipt)) == {"consistency"}


def test_consistency_rejects_a_fake_receipt_that_lists_kernels(receipt: dict[str, Any]) -> None:
    kernels = receipt["kernels"]
    fake = make_fake(receipt)
    fake["kernels"] = kernels
    assert checks(receipts.verify(fake)) == {"consistency"}


def test_consistency_rejects_generated_tokens_without_kernels(receipt: dict[str, Any]) -> None:
    receipt["kernels"] = []
    problems = receipts.verify(receipt)
    assert checks(problems) == {"consistency"} and "no kernel dispatch was recorded" in problems[0]


def test_require_backend(receipt: dict[str, Any]) -> None:
    assert receipts.verify(receipt, require_backend="cpu") == []
    assert receipts.verify(receipt, require_backend="host") == []  # an alias names the same backend
    assert receipts.verify(receipt, require_backend="cpu:0") == []
    for other in ("opencl", "cuda", "cpu:1"):
        assert checks(receipts.verify(receipt, require_backend=other)) == {"require-backend"}


def test_require_real_rejects_a_fake_receipt(receipt: dict[str, Any]) -> None:
    fake = make_fake(receipt)
    assert receipts.verify(fake) == []
    assert checks(receipts.verify(fake, require_real=True)) == {"require-real"}


def test_require_real_rejects_a_run_that_dispatched_nothing(receipt: dict[str, Any]) -> None:
    receipt["kernels"] = []
    receipt["metrics"]["generated_tokens"] = 0
    assert receipts.verify(receipt) == []
    problems = receipts.verify(receipt, require_real=True)
    assert problems == ["require-real: no kernel was dispatched, so nothing was computed"]


def test_require_gpu_kernels_rejects_a_cpu_kind_device(receipt: dict[str, Any]) -> None:
    problems = receipts.verify(receipt, require_gpu_kernels=True)
    assert checks(problems) == {"require-gpu-kernels"} and "cpu-kind device" in problems[0]
    receipt["selection"]["kind"] = "gpu"
    assert receipts.verify(receipt, require_gpu_kernels=True) == []


def test_require_gpu_kernels_rejects_a_fallback(receipt: dict[str, Any]) -> None:
    receipt["selection"]["kind"] = "gpu"
    receipt["fallbacks"] = [{"operation": "attention", "reason": "no kernel", "count": 1}]
    problems = receipts.verify(receipt, require_gpu_kernels=True)
    assert problems == ["require-gpu-kernels: 1 CPU fallback(s) (attention)"]


def test_require_gpu_kernels_rejects_no_kernels(receipt: dict[str, Any]) -> None:
    receipt["selection"]["kind"] = "gpu"
    receipt["kernels"] = []
    receipt["metrics"]["generated_tokens"] = 0
    problems = receipts.verify(receipt, require_gpu_kernels=True)
    assert problems == ["require-gpu-kernels: no kernel was dispatched"]


def test_require_gpu_kernels_rejects_a_fake_gpu(receipt: dict[str, Any]) -> None:
    fake = make_fake(receipt)
    fake["selection"]["kind"] = "gpu"
    assert checks(receipts.verify(fake, require_gpu_kernels=True)) == {"require-gpu-kernels"}


def test_max_fallbacks(receipt: dict[str, Any]) -> None:
    receipt["fallbacks"] = [{"operation": "rope", "reason": "no kernel", "count": 2}]
    assert receipts.verify(receipt, max_fallbacks=2) == []
    problems = receipts.verify(receipt, max_fallbacks=1)
    assert problems == ["max-fallbacks: 2 CPU fallback(s) > 1 (rope x2: no kernel)"]


def test_write_refuses_an_invalid_receipt(receipt: dict[str, Any], tmp_path: Path) -> None:
    receipt["compute_path"] = "simulated"
    with pytest.raises(BitnetError, match="compute_path"):
        receipts.write(tmp_path / "r.json", receipt)
    assert not (tmp_path / "r.json").exists()


# -- the CLI -------------------------------------------------------------------------------------------------

def write_json(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_cli_verify_lists_every_failed_check_and_exits_5(receipt: dict[str, Any], tmp_path: Path) -> None:
    receipt["fallbacks"] = [{"operation": "rope", "reason": "no kernel", "count": 3}]
    path = write_json(tmp_path / "r.json", receipt)
    ok = run_cli("receipt", "verify", path, "--require-real", "--require-backend", "cpu")
    assert ok.returncode == 0, ok.stderr
    r = run_cli("receipt", "verify", path, "--require-backend", "opencl", "--require-gpu-kernels",
                "--max-fallbacks", "0")
    assert r.returncode == 5
    lines = r.stderr.strip().splitlines()
    assert [line.split(": ")[2] for line in lines] == ["require-backend", "require-gpu-kernels",
                                                       "require-gpu-kernels", "max-fallbacks"]
    assert all(line.startswith(f"error: {path}: ") for line in lines)


def test_cli_verify_schema_violation_exits_5_with_the_jsonschema_message(receipt: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    del receipt["selection"]
    r = run_cli("receipt", "verify", write_json(tmp_path / "r.json", receipt))
    assert r.returncode == 5
    assert "schema: (top level): 'selection' is a required property" in r.stderr


def test_cli_verify_invalid_json_exits_5(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("{not json")
    r = run_cli("receipt", "verify", str(path))
    assert r.returncode == 5 and "invalid JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_verify_missing_file_exits_2(tmp_path: Path) -> None:
    assert run_cli("receipt", "verify", str(tmp_path / "absent.json")).returncode == 2


def test_read_raises_gate_error_on_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("[1,")
    with pytest.raises(GateError):
        receipts.read(path)


# -- measurements the engine does not keep -----------------------------------------------------------------

def test_peak_device_memory_comes_from_the_providers_memory_stats() -> None:
    class WithStats:
        def memory_stats(self) -> dict[str, int]:
            return {"peak_bytes": 1234, "current_bytes": 10}

    assert receipts.peak_device_memory(WithStats()) == 1234
    assert receipts.peak_device_memory(object()) is None


def test_git_commit_is_recorded_and_absent_without_git(good: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    commit = good["bitnet"]["commit"]
    assert commit is None or len(commit) == 40
    monkeypatch.setenv("PATH", "")  # no git executable: no commit, and no error
    assert receipts._git_state.__wrapped__() == (None, None)


def test_percentile_matches_numpy() -> None:
    import numpy as np

    values = [5.0, 1.0, 4.0, 2.5, 9.0, 7.0]
    for q in (5, 50, 95):
        assert receipts.percentile(sorted(values), q) == pytest.approx(np.percentile(values, q))
    assert receipts.percentile([], 50) is None
