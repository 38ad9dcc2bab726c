"""Inference benchmark (issue 3): our engine next to llama.cpp on the same model file and thread count.

Writes (or reuses) a synthetic model of the BitNet b1.58 2B-4T shape with our writer, then for our
engine on each `--device` and for llama.cpp (llama-cpp-python) measures, each engine in its own
fresh process: load time, peak RSS (getrusage ru_maxrss), prefill tokens/s on a prompt of
`--prompt-tokens` tokens, and decode tokens/s over `--decode-tokens` greedy steps, then prints the
medians over `--runs` processes and the ratios ours / llama.cpp.

    python benchmarks/bench_inference.py --preset 2b4t --weight-type tq2_0,i2_s --threads 1,2 --runs 3
    python benchmarks/bench_inference.py --layers 2 --prompt-tokens 32 --decode-tokens 8   # a quick run

The models are written with architecture `bitnet`, the name llama.cpp knows (the real 2B-4T file
says `bitnet-b1.58` and uses squared ReLU instead of SiLU: same shapes, same cost). llama.cpp
cannot read I2_S (Microsoft's bitnet.cpp format): for an I2_S model ours runs on it and llama.cpp
runs on its TQ2_0 twin (the same weights, written with the same seed), and the output says so.

Both engines run exactly the requested number of decode steps (greedy arg-max, never stopping at
an end-of-generation token a synthetic model may well emit), so ours is driven through the
transformer and provider rather than `Engine.generate`. llama.cpp runs with its defaults (F16 KV
cache) and `n_threads = n_threads_batch = --threads`; ours gets the thread count through the BLAS
and numba thread variables (and PoCL's compute-unit limit for OpenCL), set before NumPy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import workers

BENCH_SEED = 1234  # the prompt's token ids
# Every thread pool our providers may use: BLAS, numba's prange, PoCL's compute units.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
               "POCL_CPU_MAX_CU_NUM")


# -- worker: one engine, one process ----------------------------------------------------------------

def _prompt_ids(n: int, vocab: int) -> list[int]:
    import numpy as np

    # Random ids from the lower half of the vocabulary: the synthetic vocabularies put control
    # and reserved tokens at the top, and compute does not depend on which ids they are.
    return [int(i) for i in np.random.default_rng(BENCH_SEED).integers(0, vocab // 2, n)]


def _result(load_s: float, prompt_tokens: int, prefill_s: float, decode_tokens: int, decode_s: float,
            note: str) -> dict[str, Any]:
    import resource

    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"load_s": load_s, "prefill_tps": prompt_tokens / prefill_s,
            "decode_tps": decode_tokens / decode_s, "rss_mb": rss_mb, "note": note}


def run_ours(model: str, device: str, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    import numpy as np

    import bitnet

    n_ctx = prompt_tokens + decode_tokens + 16
    t0 = time.perf_counter()
    eng = bitnet.load(model, device=device, n_ctx=n_ctx)
    load_s = time.perf_counter() - t0
    tr, prov = eng.transformer, eng.provider
    ids = _prompt_ids(prompt_tokens, eng.config.vocab_size)

    def step(tokens: list[int], pos: int) -> int:
        return int(prov.argmax(tr.forward(np.asarray(tokens, dtype=np.int32), pos, all_logits=False))[0])

    tr.reset()  # warm-up: first-call costs (allocation, kernel compilation) are not throughput
    step(ids[:8], 0)
    step([ids[8]], 8)
    tr.reset()
    t0 = time.perf_counter()
    tok = step(ids, 0)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for pos in range(prompt_tokens, prompt_tokens + decode_tokens):
        tok = step([tok], pos)
    decode_s = time.perf_counter() - t0
    summary = eng.summary
    eng.close()
    return _result(load_s, prompt_tokens, prefill_s, decode_tokens, decode_s, summary)


def run_llama(model: str, threads: int, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    n_ctx = prompt_tokens + decode_tokens + 16
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=max(512, prompt_tokens),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    ids = _prompt_ids(prompt_tokens, vocab)

    def step(tokens: list[int]) -> int:
        llm.eval(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(np.argmax(logits))

    llm.reset()
    step(ids[:8])
    step([ids[8]])
    llm.reset()
    t0 = time.perf_counter()
    tok = step(ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        tok = step([tok])
    decode_s = time.perf_counter() - t0
    llm.close()
    return _result(load_s, prompt_tokens, prefill_s, decode_tokens, decode_s,
                   f"llama-cpp-python {llama_cpp.__version__}")


def worker(args: argparse.Namespace) -> int:
    if args.worker == "llama":
        out = run_llama(str(args.model), args.worker_threads, args.prompt_tokens, args.decode_tokens)
    else:
        out = run_ours(str(args.model), args.worker.split(":", 1)[1], args.prompt_tokens, args.decode_tokens)
    workers.result(out)
    return 0


# -- driver -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    model: str  # weight type of the file ours ran on
    engine: str  # "ours:<device>" or "llama.cpp"
    threads: int
    file: Path
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str = ""

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs) if self.runs else float("nan")


def model_path(args: argparse.Namespace, weight_type: str) -> Path:
    """Write the benchmark model of this weight type into the cache unless it is there already."""
    from bitnet.modelfile.writer import PRESETS, write_model

    spec = dataclasses.replace(PRESETS[args.preset], arch="bitnet", weight_type=weight_type, embd_type="f16",
                               tokenizer="gpt2", seed=args.seed)
    if args.layers:
        spec = dataclasses.replace(spec, n_layers=args.layers)
    path = args.cache_dir / f"{args.preset}-L{spec.n_layers}-{weight_type}-s{spec.seed}.gguf"
    if not path.exists():
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        t0 = time.perf_counter()
        print(f"writing {path.name} ...", file=sys.stderr, flush=True)
        write_model(tmp, spec)
        tmp.replace(path)  # a killed run leaves no half-written model behind to be reused
        print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return path


def measure_once(row: Row, args: argparse.Namespace, run: int) -> None:
    if row.error:
        return
    worker_name = "llama" if row.engine == "llama.cpp" else row.engine
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update({k: str(row.threads) for k in THREAD_VARS})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker_name, "--model", str(row.file),
           "--worker-threads", str(row.threads), "--prompt-tokens", str(args.prompt_tokens),
           "--decode-tokens", str(args.decode_tokens)]
    try:
        r = workers.run(cmd, env, args.timeout, worker_name)
    except workers.WorkerError as exc:  # one line already
        row.error = str(exc)
        return
    row.runs.append(r)
    print(f"  {row.model:<6} {row.engine:<12} t={row.threads} run {run + 1}/{args.runs}: "
          f"load {r['load_s']:.2f} s, prefill {r['prefill_tps']:.2f} tok/s, "
          f"decode {r['decode_tps']:.2f} tok/s, RSS {r['rss_mb']:.0f} MB", file=sys.stderr, flush=True)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b and b == b and a == a else "-"


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    head = (f"{'model':<7}{'engine':<13}{'thr':>4}{'load s':>9}{'RSS MB':>9}{'prefill t/s':>13}"
            f"{'decode t/s':>12}   {'ours/llama: load':>16}{'RSS':>7}{'prefill':>9}{'decode':>8}")
    print(head)
    print("-" * len(head))
    ref = {(r.model, r.threads): r for r in rows if r.engine == "llama.cpp"}
    for r in rows:
        if r.error:
            print(f"{r.model:<7}{r.engine:<13}{r.threads:>4}  FAILED {r.error}")
            continue
        line = (f"{r.model:<7}{r.engine:<13}{r.threads:>4}{r.median('load_s'):>9.2f}"
                f"{r.median('rss_mb'):>9.0f}{r.median('prefill_tps'):>13.2f}{r.median('decode_tps'):>12.2f}")
        base = ref.get(("tq2_0" if r.model == "i2_s" else r.model, r.threads))
        if r.engine != "llama.cpp" and base is not None and base.runs:
            line += (f"   {_ratio(r.median('load_s'), base.median('load_s')):>16}"
                     f"{_ratio(r.median('rss_mb'), base.median('rss_mb')):>7}"
                     f"{_ratio(r.median('prefill_tps'), base.median('prefill_tps')):>9}"
                     f"{_ratio(r.median('decode_tps'), base.median('decode_tps')):>8}")
        print(line)
    for r in rows:
        if r.engine != "llama.cpp" and r.runs and r.threads == rows[0].threads and r.model == rows[0].model:
            print(f"{r.engine}: {r.runs[0]['note']}")
    if any(r.model == "i2_s" for r in rows):
        print("i2_s: llama.cpp cannot read I2_S; its ratios are against llama.cpp on the TQ2_0 twin "
              "(same shape and weights).")


def main(argv: list[str] | None = None) -> int:
    from bitnet.modelfile.writer import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="2b4t")
    ap.add_argument("--weight-type", default="tq2_0,i2_s", help="comma-separated: tq2_0, tq1_0, i2_s")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (quick runs)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the written models")
    ap.add_argument("--model", type=Path, help="benchmark this GGUF file instead of writing one")
    ap.add_argument("--llama-model", type=Path, help="with an I2_S --model: llama.cpp's TQ2_0 twin of it")
    cache = Path(os.environ.get("BITNET_CACHE_DIR", Path.home() / ".cache" / "bitnet")) / "bench"
    ap.add_argument("--cache-dir", type=Path, default=cache, help=f"where written models are kept ({cache})")
    ap.add_argument("--device", default="cpu", help="our devices, comma-separated (cpu, opencl, ...)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="processes per measurement; the table shows medians")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--no-llama", action="store_true", help="measure ours only")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per measured process")
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.prompt_tokens < 9 or args.decode_tokens < 1 or args.runs < 1:
        ap.error("--prompt-tokens must be at least 9 (the warm-up uses 9), --decode-tokens and --runs 1")
    threads = [int(t) for t in args.threads.split(",")]
    devices = [d.strip() for d in args.device.split(",") if d.strip()]

    types = [wt.strip() for wt in args.weight_type.split(",") if wt.strip()]
    if args.model and len(types) != 1:
        ap.error("with --model, --weight-type names the file's one weight type")
    ours = {wt: args.model or model_path(args, wt) for wt in types}
    # llama.cpp runs on the same file, except I2_S, which it cannot read: then on the TQ2_0 twin.
    theirs = {wt: f for wt, f in ours.items() if wt != "i2_s"}
    if "i2_s" in ours and not args.no_llama:
        twin = args.llama_model or (None if args.model else model_path(args, "tq2_0"))
        if twin is not None:
            theirs["tq2_0"] = twin

    rows: list[Row] = []
    for t in threads:
        rows.extend(Row(wt, f"ours:{d}", t, f) for wt, f in ours.items() for d in devices)
        if not args.no_llama:
            rows.extend(Row(wt, "llama.cpp", t, f) for wt, f in theirs.items())
    files = {**{f"ours {k}": v for k, v in ours.items()}, **{f"llama.cpp {k}": v for k, v in theirs.items()}}
    print(f"bench_inference: prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, "
          f"{args.runs} run(s) each, medians", file=sys.stderr)
    from bitnet.modelfile import huge_pages

    for path in sorted({r.file for r in rows}):
        huge_pages.reread(str(path))  # as after a reboot, and neither engine pays the first cold read
    load_before = os.getloadavg()[0]
    # Runs interleave the engines, so a neighbour's load on a shared machine hits them alike.
    for run in range(args.runs):
        for row in rows:
            measure_once(row, args, run)
    load_after = os.getloadavg()[0]

    print("\n" + "\n".join(f"{k}: {v}" for k, v in files.items()))
    print(f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, medians of {args.runs} "
          f"process(es); python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{load_before:.1f} before, {load_after:.1f} after (above the thread count the figures are noise)")
    print_table(rows, args)
    if args.json:
        runs = [dataclasses.asdict(r) | {"file": str(r.file)} for r in rows]
        args.json.write_text(json.dumps(runs, indent=1))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
