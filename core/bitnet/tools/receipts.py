"""Receipts: a JSON record of what one run did, where, and how fast, and the checks made on it.

The kernel list is the provider's `dispatches` Counter, filled by each kernel as it is
dispatched; CPU fallbacks come from `provider.fallbacks` the same way. Nothing here names a
kernel, so a receipt can only list what ran. The JSON Schema (receipt.schema.json, shipped
with the package) fixes the shape; `verify` adds the checks a schema cannot express.

    text = "".join(engine.generate(prompt, max_tokens=32, seed=1))
    receipt = bitnet.tools.receipts.build(engine, text, {"max_tokens": 32, "seed": 1})
    bitnet.tools.receipts.write("receipt.json", receipt)
    assert not bitnet.tools.receipts.verify(receipt, require_real=True)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bitnet import __version__
from bitnet.errors import BitnetError, GateError, UsageError
from bitnet.plugins.types import host_cpu_name

if TYPE_CHECKING:
    from bitnet.plugins.selection import Selection
    from bitnet.runtime.engine import Engine
    from bitnet.runtime.provider import KernelProvider

SCHEMA_VERSION = 1
# engine.generate's defaults: what a run used for any setting the caller does not pass.
SAMPLING_DEFAULTS: dict[str, Any] = dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, max_tokens=128,
                                         stop=[])
_OPENCL_KEYS = ("platform", "platform_version", "driver_version", "opencl_version")
_CUDA_KEYS = ("driver_version", "runtime_version")


# -- building -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """A provider's counters at one moment, so a receipt can cover one run of a long-lived engine."""

    dispatches: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)


def snapshot(provider: KernelProvider) -> Snapshot:
    return Snapshot(Counter(provider.dispatches), Counter(provider.fallbacks))


def build(engine: Engine, text: str, sampling: Mapping[str, Any] | None = None,
          since: Snapshot | None = None) -> dict[str, Any]:
    """The receipt of the engine's last run, which generated `text` with `sampling`.

    Kernels and fallbacks are those dispatched since `since` (a `snapshot` taken before the
    run), else since the provider was opened. Metrics are the engine's `stats` of the last run.
    """
    since = since or Snapshot()
    provider, stats = engine.provider, engine.stats
    latencies = sorted(stats.token_latencies_ms)
    metrics = {
        "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
        "load_ms": stats.load_ms, "ttft_ms": stats.ttft_ms, "prefill_ms": stats.prefill_ms,
        "decode_ms": stats.decode_ms, "prefill_tps": stats.prefill_tps, "decode_tps": stats.decode_tps,
        "token_latency_p50_ms": percentile(latencies, 50), "token_latency_p95_ms": percentile(latencies, 95),
        "peak_rss_bytes": peak_rss_bytes(), "peak_device_memory_bytes": peak_device_memory(provider),
    }
    kernels = provider.dispatches - since.dispatches  # Counter subtraction keeps positive counts only
    fallbacks = provider.fallbacks - since.fallbacks
    receipt = _skeleton(engine.selection, sampling)
    receipt.update(
        model=model_section(engine.model),
        kernels=[{"name": k, "count": n} for k, n in sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))],
        fallbacks=[{"operation": op, "reason": why, "count": n}
                   for (op, why), n in sorted(fallbacks.items(), key=lambda kv: (-kv[1], kv[0]))],
        metrics=metrics,
        settings={"act_quant": engine.transformer.act_quant, "n_ctx": engine.n_ctx},
        output={"text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "text_chars": len(text)},
    )
    return receipt


def build_unrun(selection: Selection, reason: str, sampling: Mapping[str, Any] | None = None,
                settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The receipt of a run that could not compute: a fake device (BITNET_GPU_FAKE) is selected
    but cannot load a model, so it has no model, kernels, metrics or output, and its
    compute_path says so (`verify(..., require_real=True)` rejects it)."""
    receipt = _skeleton(selection, sampling)
    receipt.update(reason=reason, settings={"act_quant": None, "n_ctx": None, **(settings or {})})
    return receipt


def fake_run_receipt(request: str | None, reason: str, sampling: Mapping[str, Any] | None = None,
                     settings: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The receipt of a run refused because `request` selects a fake device, else None.

    Called after a load failed with NoBackendError, so the cost of selecting again is paid
    only on that path."""
    from bitnet.plugins.selection import select

    sel = select(request)
    if sel.device is None or not sel.device.fake:
        return None
    return build_unrun(sel, reason, sampling, settings)


def _skeleton(selection: Selection, sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    device = selection.device
    fake = bool(device is not None and device.fake)
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "bitnet": {"version": __version__, "commit": _git_state()[0], "dirty": _git_state()[1],
                   "plugins": plugins_section(selection)},
        "model": None,
        "selection": selection_section(selection),
        "compute_path": "fake" if fake else "real",
        "kernels": [],
        "fallbacks": [],
        "metrics": None,
        "sampling": sampling_section(sampling),
        "settings": {"act_quant": None, "n_ctx": None},
        "output": None,
        "environment": environment(device.to_json() if device is not None else {}),
        "reason": None,
    }


def selection_section(selection: Selection) -> dict[str, Any]:
    backend, device = selection.backend, selection.device
    if backend is None or device is None:
        raise UsageError(f"no receipt without a selected device: {selection.error or selection.summary}")
    return {
        "requested": selection.requested,
        "detected": [b.name for b in selection.detected],
        "selected": selection.selected,
        "backend": backend.name,
        "aliases": list(backend.aliases),
        "kind": device.kind or backend.kind,
        "fake": device.fake,
        "device": _jsonable(device.to_json()),
    }


def plugins_section(selection: Selection) -> list[dict[str, Any]]:
    registry = selection.registry
    if registry is None:
        return []
    return [{"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status,
             "backends": list(p.backends), "error": p.error} for p in registry.plugins]


def model_section(model: Any) -> dict[str, Any]:
    return {
        "path": str(Path(model.path).resolve()),
        "sha256": file_sha256(model.path),
        "size_bytes": int(model.file_size),
        "architecture": model.config.arch,
        "weight_types": dict(model.weight_types),
        "n_params": int(model.n_params),
        "config": _jsonable(asdict(model.config)),
    }


def sampling_section(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    given = dict(sampling or {})
    unknown = sorted(set(given) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise UsageError(f"unknown sampling settings {', '.join(unknown)}; "
                         f"known: {', '.join(SAMPLING_DEFAULTS)}")
    out = {**SAMPLING_DEFAULTS, **given}
    stop = out["stop"]
    out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return out


# -- measurements that the engine does not keep ---------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (NumPy's default); None for no values."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def peak_rss_bytes() -> int | None:
    """Peak resident set of this process so far (the whole process: the run and what came before)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def peak_device_memory(provider: Any) -> int | None:
    """`provider.memory_stats()` peak, if the provider has that method: a mapping with
    `peak_bytes` (or `peak`), or an object with such an attribute."""
    stats_fn = getattr(provider, "memory_stats", None)
    if not callable(stats_fn):
        return None
    stats = stats_fn()
    if isinstance(stats, Mapping):
        peak = stats.get("peak_bytes", stats.get("peak"))
    else:
        peak = getattr(stats, "peak_bytes", getattr(stats, "peak", None))
    return None if peak is None else int(peak)


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):  # streamed: a 2B model is over a gigabyte
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, hashed once per process while its size and mtime stay the same."""
    st = os.stat(path)
    return _sha256_cached(os.fspath(path), st.st_size, st.st_mtime_ns)


def git_commit() -> str | None:
    return _git_state()[0]


@functools.cache
def _git_state() -> tuple[str | None, bool | None]:
    """(HEAD, whether the checkout has changes) of the git checkout bitnet is imported from, or
    (None, None) for an installed wheel or no git.

    Only when this package's own files are tracked there: a wheel installed into a virtualenv
    that sits inside some other repository must not report that repository's commit."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None, None
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None, None
    commit = head.stdout.strip()
    if head.returncode != 0 or len(commit) != 40:
        return None, None
    return commit, (bool(status.stdout.strip()) if status.returncode == 0 else None)




def environment(device: Mapping[str, Any]) -> dict[str, Any]:
    """Host and runtime versions; GPU runtime details come from the selected device's probe."""
    try:
        import numpy

        numpy_version: str | None = numpy.__version__
    except ImportError:
        numpy_version = None
    props = device.get("properties") or {}
    backend = device.get("backend")
    opencl = {k: props[k] for k in _OPENCL_KEYS if k in props} if backend == "opencl" else {}
    cuda = {k: props[k] for k in _CUDA_KEYS if k in props} if backend == "cuda" else {}
    if backend == "cuda" and device.get("compute_capability"):
        cuda["compute_capability"] = device["compute_capability"]
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": numpy_version,
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpu": host_cpu_name(),
        "cpu_count": os.cpu_count(),
        "opencl": _jsonable(opencl) or None,
        "cuda": _jsonable(cuda) or None,
    }


def _jsonable(value: Any) -> Any:
    # Probe properties are plugin-defined: whatever JSON cannot hold becomes its str().
    return json.loads(json.dumps(value, default=str))


# -- files ------------------------------------------------------------------------------------------

def write(path: str | os.PathLike[str], receipt: Mapping[str, Any]) -> None:
    """Write a receipt as JSON, atomically; a receipt that violates the schema is a bug, not written."""
    problems = schema_errors(receipt)
    if problems:
        raise BitnetError("refusing to write an invalid receipt: " + "; ".join(problems))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(receipt, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a receipt file; a file that is not JSON is a failed check (GateError)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GateError(f"{path}: not a receipt: invalid JSON ({exc})") from None


# -- checking ---------------------------------------------------------------------------------------

@functools.cache
def schema() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("receipt.schema.json").read_text("utf-8"))


def schema_errors(receipt: Any) -> list[str]:
    """Every violation of receipt.schema.json, as `schema: <where>: <jsonschema's message>`."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(receipt),
                    key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"schema: {'/'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}" for e in errors]


def verify(receipt: Any, require_backend: str | None = None, require_gpu_kernels: bool = False,
           require_real: bool = False, max_fallbacks: int | None = None) -> list[str]:
    """Every failed check, one line each; empty means the receipt passes.

    Always: the schema, then consistency (a fake device computes nothing; a run that produced
    tokens dispatched kernels). A receipt that fails the schema is reported by the schema
    alone: the other checks need its shape.
    """
    problems = schema_errors(receipt)
    if problems:
        return problems
    sel, path = receipt["selection"], receipt["compute_path"]
    kernel_calls = sum(k["count"] for k in receipt["kernels"])
    fallback_calls = sum(f["count"] for f in receipt["fallbacks"])
    where = f"{sel['selected']} ({sel['device'].get('name', '?')})"

    if (path == "fake") != sel["fake"] or sel["fake"] != sel["device"]["fake"]:
        problems.append(f"consistency: compute_path is {path!r} but the selected device's fake flag is "
                        f"{sel['fake']} (device: {sel['device']['fake']})")
    if path == "fake" and (kernel_calls or fallback_calls):
        problems.append(f"consistency: compute_path is 'fake' yet {kernel_calls} kernel call(s) and "
                        f"{fallback_calls} fallback(s) are recorded")
    metrics = receipt["metrics"] or {}
    if path == "real" and metrics.get("generated_tokens", 0) > 0 and kernel_calls == 0:
        problems.append(f"consistency: {metrics['generated_tokens']} token(s) generated but no kernel "
                        "dispatch was recorded: the kernel list is not evidence of this run")

    if require_backend is not None:
        name, _, index = require_backend.strip().lower().partition(":")
        names = {sel["backend"].lower(), *(a.lower() for a in sel.get("aliases", []))}
        if name not in names or (index and index != str(sel["device"]["index"])):
            problems.append(f"require-backend: the run was on {where}, not {require_backend}")
    if require_real:
        if path != "real":
            problems.append(f"require-real: compute_path is {path!r}"
                            + (f" ({receipt['reason']})" if receipt["reason"] else ""))
        elif sel["fake"]:
            problems.append(f"require-real: the selected device {where} is fake")
        if kernel_calls == 0:
            problems.append("require-real: no kernel was dispatched, so nothing was computed")
    if require_gpu_kernels:
        if sel["kind"] != "gpu" or path != "real":
            problems.append(f"require-gpu-kernels: the run was on {where}, a {path} "
                            f"{sel['kind']}-kind device, not a real GPU")
        if kernel_calls == 0:
            problems.append("require-gpu-kernels: no kernel was dispatched")
        if fallback_calls:
            ops = ", ".join(sorted({f["operation"] for f in receipt["fallbacks"]}))
            problems.append(f"require-gpu-kernels: {fallback_calls} CPU fallback(s) ({ops})")
    if max_fallbacks is not None and fallback_calls > max_fallbacks:
        detail = ", ".join(f"{f['operation']} x{f['count']}: {f['reason']}" for f in receipt["fallbacks"])
        problems.append(f"max-fallbacks: {fallback_calls} CPU fallback(s) > {max_fallbacks} ({detail})")
    return problems
