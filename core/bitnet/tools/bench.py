"""The benchmark harness: fixed prompts x backends x repetitions, measured, tabled and gated.

Every figure comes from the engine's own timers during this run. Each backend is loaded
once, warmed up (the first dispatch of a kernel may compile it: PoCL does), then every
prompt runs `repetitions` times with the same sampling settings and seed.

Percentiles: `*_tps_p95` is the throughput 95 % of runs reached or beat (the slow tail, the
5th percentile of the values), `wall_ms_p95` the wall time 95 % of runs stayed within: both
are the pessimistic end, which is what a gate should hold.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bitnet.errors import NoBackendError
from bitnet.tools.receipts import percentile

# Short, long and code-like: prefill at a few lengths, decode after each.
PROMPTS = (
    "The capital of France is",
    "In a distant future, humanity has spread across the stars. The first colony ships left Earth "
    "carrying ten thousand settlers each, and the voyage took three generations. Tell the story of "
    "the day the second generation first saw their destination:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


@dataclass
class Run:
    """One generation: what the engine measured, and the hash of the text for determinism."""

    backend: str
    device: str
    prompt: int
    repetition: int
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tps: float
    decode_tps: float
    wall_ms: float
    text_sha256: str


@dataclass
class BackendResult:
    request: str
    backend: str = ""
    device: str = ""
    skipped: str | None = None  # the reason, when the backend could not run
    load_ms: float = 0.0
    runs: list[Run] = field(default_factory=list)
    # prompt index -> distinct text hashes seen with the same settings and seed
    texts: dict[int, set[str]] = field(default_factory=dict)
    receipt: str | None = None

    def summary(self) -> dict[str, Any]:
        def col(name: str) -> list[float]:
            return sorted(getattr(r, name) for r in self.runs)

        out: dict[str, Any] = {"backend": self.backend or self.request, "device": self.device,
                               "status": "skipped" if self.skipped else "ran", "reason": self.skipped,
                               "runs": len(self.runs), "load_ms": self.load_ms}
        for name in ("prefill_tps", "decode_tps"):
            out[f"{name}_median"] = percentile(col(name), 50)
            out[f"{name}_p95"] = percentile(col(name), 5)  # slow tail: 95 % of runs were at least this fast
        out["wall_ms_median"] = percentile(col("wall_ms"), 50)
        out["wall_ms_p95"] = percentile(col("wall_ms"), 95)
        out["wall_ms_total"] = sum(r.wall_ms for r in self.runs)
        out["deterministic"] = None if not self.texts else all(len(v) == 1 for v in self.texts.values())
        out["receipt"] = self.receipt
        return out


@dataclass
class BenchConfig:
    requests: Sequence[str] | None = None  # None: every detected backend
    model: str | None = None
    max_tokens: int = 16
    repetitions: int = 3
    warmup: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    act_quant: str = "row"
    lm_head: str = "auto"
    kv_type: str = "f32"
    determinism: bool = False
    receipts_dir: str | None = None
    required: Sequence[str] = ()  # backends that must run; benchmarked even when not requested
    prompts: Sequence[str] = PROMPTS


@dataclass
class BenchReport:
    config: BenchConfig
    started: str
    results: list[BackendResult]

    def to_json(self) -> dict[str, Any]:
        cfg = {k: v for k, v in asdict(self.config).items() if k != "prompts"}
        return {"started": self.started, "config": cfg, "prompts": list(self.config.prompts),
                "summary": [r.summary() for r in self.results],
                "runs": [asdict(run) for r in self.results for run in r.runs]}


def available_backends() -> list[str]:
    """Names of the backends whose probe found a device, in priority order (fakes included:
    they are then reported as skipped, with the reason)."""
    from bitnet.plugins.registry import Registry

    return [b.name for b in Registry().detected()]


def run(config: BenchConfig, log: Callable[[str], None] = lambda _: None) -> BenchReport:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    requests = list(config.requests) if config.requests else available_backends()
    requests += [name for name in config.required if name not in requests]
    results: list[BackendResult] = []
    seen: set[str] = set()
    for request in requests:
        result = _bench_backend(request, config, seen, log)
        if result is not None:
            results.append(result)
    return BenchReport(config, started, results)


def _bench_backend(request: str, config: BenchConfig, seen: set[str],
                   log: Callable[[str], None]) -> BackendResult | None:
    from bitnet.runtime.engine import load
    from bitnet.tools import receipts

    result = BackendResult(request)
    try:
        engine = load(config.model, device=request, act_quant=config.act_quant, lm_head=config.lm_head,
                      kv_type=config.kv_type)
    except NoBackendError as exc:
        result.skipped = str(exc)
        log(f"{request}: skipped: {exc}")
        return result
    with engine:
        result.backend, result.device = engine.selection.selected, engine.selection.device.name
        if result.backend in seen:  # `opencl,ocl` names one backend twice: measure it once
            return None
        seen.add(result.backend)
        result.load_ms = engine.load_ms
        sampling = dict(max_tokens=config.max_tokens, temperature=config.temperature, top_k=config.top_k,
                        top_p=config.top_p, seed=config.seed)
        for _ in range(config.warmup):
            "".join(engine.generate(config.prompts[0], **sampling))
        log(f"{result.backend}: {len(config.prompts)} prompts x {config.repetitions} repetitions")
        last_text, before = "", receipts.snapshot(engine.provider)
        for rep in range(config.repetitions):
            for i, prompt in enumerate(config.prompts):
                before = receipts.snapshot(engine.provider)
                last_text, wall_ms = _generate(engine, prompt, sampling)
                result.runs.append(_measure(result, engine, i, rep, last_text, wall_ms))
                result.texts.setdefault(i, set()).add(result.runs[-1].text_sha256)
        if config.receipts_dir and result.runs:
            # The receipt of the last measured run: kernels counted from the snapshot taken before it.
            path = Path(config.receipts_dir) / f"receipt-{result.backend.replace(':', '-')}.json"
            receipts.write(path, receipts.build(engine, last_text, sampling, since=before))
            result.receipt = str(path)
        if config.determinism and config.repetitions < 2:
            for i, prompt in enumerate(config.prompts):  # a second, unmeasured run to compare with
                result.texts[i].add(_sha(_generate(engine, prompt, sampling)[0]))
    return result


def _generate(engine: Any, prompt: str, sampling: dict[str, Any]) -> tuple[str, float]:
    engine.reset()  # every measured run prefills its whole prompt, not what the previous run left cached
    t0 = time.perf_counter()
    text = "".join(engine.generate(prompt, **sampling))
    return text, (time.perf_counter() - t0) * 1e3


def _measure(result: BackendResult, engine: Any, prompt: int, rep: int, text: str, wall_ms: float) -> Run:
    s = engine.stats
    return Run(result.backend, result.device, prompt, rep, s.prompt_tokens, s.generated_tokens, s.ttft_ms,
               s.prefill_tps, s.decode_tps, wall_ms, _sha(text))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- gates -------------------------------------------------------------------------------------------

def gate_failures(report: BenchReport, min_decode_tps: float | None = None, max_wall_ms: float | None = None,
                  determinism: bool = False) -> list[str]:
    """One line per breach, naming the gate, the backend and the measured value."""
    failures: list[str] = []
    for r in report.results:
        if r.skipped:
            continue
        s = r.summary()
        if min_decode_tps is not None and (s["decode_tps_median"] or 0.0) < min_decode_tps:
            failures.append(f"gate min-decode-tps failed: {r.backend} decodes "
                            f"{s['decode_tps_median'] or 0:.2f} tokens/s (median of {s['runs']} runs) "
                            f"< {min_decode_tps:g}")
        if max_wall_ms is not None and (s["wall_ms_p95"] or 0.0) > max_wall_ms:
            failures.append(f"gate max-wall-ms failed: {r.backend} wall time p95 {s['wall_ms_p95']:.1f} ms "
                            f"> {max_wall_ms:g} ms")
        if determinism:
            for i, hashes in sorted(r.texts.items()):
                if len(hashes) > 1:
                    failures.append(f"gate determinism failed: {r.backend} prompt {i} gave {len(hashes)} "
                                    f"different texts with seed {report.config.seed} (temperature "
                                    f"{report.config.temperature:g})")
    return failures


def missing_required(report: BenchReport) -> list[str]:
    """Required backends that did not run, each with the reason."""
    lines = []
    for name in report.config.required:
        matches = [r for r in report.results if name in (r.request, r.backend.split(":")[0])]
        if any(not r.skipped for r in matches):
            continue
        reason = next((r.skipped for r in matches if r.skipped), "it was not benchmarked")
        lines.append(f"required backend {name} did not run: {reason}")
    return lines


# -- output ------------------------------------------------------------------------------------------

def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(report: BenchReport) -> str:
    cfg = report.config
    head = (f"bench {report.started}  {len(cfg.prompts)} prompts x {cfg.repetitions} repetitions, "
            f"max {cfg.max_tokens} tokens, temperature {cfg.temperature:g}, seed {cfg.seed}")
    cols = ("BACKEND", "DEVICE", "RUNS", "PREFILL tok/s med", "p95", "DECODE tok/s med", "p95",
            "WALL ms med", "p95")
    rows: list[tuple[str, ...]] = [cols]
    notes = []
    for r in report.results:
        s = r.summary()
        if r.skipped:
            notes.append(f"{r.request}: skipped: {r.skipped}")
            continue
        rows.append((s["backend"], s["device"], str(s["runs"]), _num(s["prefill_tps_median"]),
                     _num(s["prefill_tps_p95"]), _num(s["decode_tps_median"]), _num(s["decode_tps_p95"]),
                     _num(s["wall_ms_median"]), _num(s["wall_ms_p95"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head]
    for row in rows:
        cells = [c.ljust(w) if i < 2 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    if len(rows) == 1:
        lines.append("(no backend ran)")
    return "\n".join(lines + notes)


def write_outputs(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """bench.json (everything), bench.csv (one row per backend), bench_runs.csv (one row per run)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    paths = [out / "bench.json", out / "bench.csv", out / "bench_runs.csv"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    for path, rows in ((paths[1], data["summary"]), (paths[2], data["runs"])):
        with open(path, "w", newline="", encoding="utf-8") as f:
            names = list(rows[0]) if rows else ["backend"]
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(rows)
    return paths
