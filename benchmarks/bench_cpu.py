"""CPU plugin vs llama.cpp on one GGUF file: decode and prefill tokens/s, load time, peak RSS.

Each measurement is a fresh process; ours and llama.cpp alternate within every run, so both see
the same background load (the machines this runs on are shared), and the table shows medians
of `--runs` with the ratios ours / llama.cpp. A memory-bandwidth probe (numba, the same thread
count, with and without software prefetch, best of all runs) gives the decode ceiling: the
bytes one decode step must read (ternary weights plus the LM head) over the probed GB/s. Each of our processes
also reads 512 MB on its own threads after it decodes: a process's memory stays fast or slow through its life on
the shared hosts, and decode's share of that read is its share of what its own process could read. A multiply
probe (the int8 multiply-add instruction of the kernels' ISA level, registers only, best of all runs)
gives prefill's: the ternary products of one token over the probed products/s. The
first-run JIT cost (empty numba cache) is measured once. "ready" is the time from the same start to the end of the
first forward pass, less what the same pass takes run again: what an engine defers past load counts, wherever it
lands (for ours, the linking of numba's cached kernels; a garbage collection the load put off would land in the
prompt's ids, made in between; llama.cpp has next to none). Load starts before the
engine's package is imported (NumPy, which both use, is already in): `import llama_cpp` loads
llama.cpp's shared libraries (0.11 s on the 2-core EPYC), as our load imports numba.
Below each thread count's table, our layer stack's decode step split by phase (the region's own cycle stamps,
bitnet_cpu.stack_phases): the projections' time and their weight bytes' rate against the probe, attention, the
serial steps between phases and the waiting, per thread.
With an int8 LM head (`--lm-head q8`, or `auto` on a file whose head is stored quantized) it also
prints the head's accuracy against the F16 head, from one more process: top-1 agreement and mean
KL divergence over the cross-validation prompts (bitnet.testing.crossval). Beside the int8 head's decode ratio
to the F16 head (`--with-f16-head`) it prints the bound the bytes of a step set on it; beside two threads' decode
against one, round by round, how the same processes' own reads scaled.
`--busy N` keeps N processes spinning on the CPU through every run, a shared machine made on purpose:
how much of its speed each engine keeps when a co-tenant takes cores from it.
Our KV cache is F16 (`--kv-type`), as llama.cpp's and bitnet.cpp's are by default: attention reads the same bytes
in each engine (a float32 cache had made our 2-thread step 0.5 ms slower at 128-176 positions).

    python benchmarks/bench_cpu.py --model /tmp/m-tq2_0.gguf --threads 1,2 --runs 5
    python benchmarks/bench_cpu.py --model /tmp/m-i2_s.gguf --llama-model /tmp/m-tq2_0.gguf
    python benchmarks/bench_cpu.py --model /tmp/m-tq2_0.gguf --lm-head q8

llama.cpp cannot read I2_S: give its TQ2_0 twin (same shapes) as --llama-model. Microsoft's bitnet.cpp
(`--bitnet-cpp` its llama-bench, built by a tool outside this repository) joins the rotation with its
own file (`--bitnet-cpp-model`: the same I2_S tensors written with `--arch bitnet`, the only
architecture its llama.cpp fork knows): prefill from its llama-bench, decode after the prompt from the llama-cli
beside it; no load time or RSS.
Models: `python -m bitnet.modelfile.writer OUT --preset 2b4t --arch bitnet --weight-type tq2_0` (its vocabulary has
Llama 3's 128256 tokens and 279888 merges, written as 2B-4T's 280147 are: what a load parses and builds).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workers

SEED = 1234


def _ids(n: int, vocab: int) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(SEED).integers(0, vocab // 2, n)]


def _warm_up(step: Callable[[], None], reset: Callable[[], None], start: float) -> tuple[float, float]:
    """The warm-up steps' time, and the time from `start` (the load's) to their end less the same steps run again:
    the load and whatever it left for later, up to the first forward pass (numba's cached-kernel linking, first
    page touches, a deferred collection)."""
    t0 = time.perf_counter()
    step()
    end = time.perf_counter()
    reset()
    t1 = time.perf_counter()
    step()
    again_s = time.perf_counter() - t1
    reset()
    return end - t0, end - start - again_s


def _finish(load_s: float, warm: tuple[float, float], n_prompt: int, prefill_s: float, n_decode: int,
            decode_s: float) -> dict[str, Any]:
    import resource

    return {"load_s": load_s, "warmup_s": warm[0], "ready_s": warm[1],
            "prefill_tps": n_prompt / prefill_s,
            "decode_tps": n_decode / decode_s,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def worker_ours(model: str, n_prompt: int, n_decode: int, act_quant: str, lm_head: str,
                kv_type: str) -> dict[str, Any]:
    import numpy as np

    t0 = time.perf_counter()  # from the import: see the module docstring
    import bitnet

    eng = bitnet.load(model, device="cpu", n_ctx=n_prompt + n_decode + 16, act_quant=act_quant, lm_head=lm_head,
                      kv_type=kv_type)
    load_s = time.perf_counter() - t0
    tr, p = eng.transformer, eng.provider
    ids = _ids(n_prompt, eng.config.vocab_size)

    def step(tokens: list[int], pos: int) -> int:
        return int(p.argmax(tr.forward(np.asarray(tokens, dtype=np.int32), pos, all_logits=False))[0])

    def warm_steps() -> None:
        step(ids[:8], 0)
        step([ids[8]], 8)

    warm = _warm_up(warm_steps, tr.reset, t0)
    from bitnet_cpu import stack_phases

    rate = stack_phases.cycles_per_second()
    t0 = time.perf_counter()
    tok = step(ids, 0)
    prefill_s = time.perf_counter() - t0
    phases = []  # each decode step's layer-stack phases (the stamps are read after the step's timing)
    decode_s = 0.0
    for pos in range(n_prompt, n_prompt + n_decode):
        t0 = time.perf_counter()
        tok = step([tok], pos)
        decode_s += time.perf_counter() - t0
        if p.stack_marks.size:
            phases.append(stack_phases.seconds(p.stack_marks, rate))
    out = _finish(load_s, warm, n_prompt, prefill_s, n_decode, decode_s)
    # The same threads reading 512 MB in this process, after its RSS is taken: on the shared hosts a process's
    # memory stays fast or slow through its life (docs/measurements.md, session 50: 45-50 against 72-86 GB/s on
    # the Zen 5 EPYC), so decode's share of this read is its share of what this process could read.
    room = np.empty(1 << 26, np.uint64)
    out["probe_gbps"] = max(read_gbps(room, ahead, 3) for ahead in (False, True))
    out["stack_phases"] = {k: statistics.median(s[k] for s in phases) for k in phases[0]} if phases else {}
    out["kernels"] = sorted(k for k in p.dispatches if "bitlinear" in k or "lm_head" in k or "layer_stack" in k)
    eng.close()
    return out


def worker_accuracy(model: str, act_quant: str) -> dict[str, Any]:
    """The int8 LM head against the F16 head over the cross-validation prompts: the same hidden states
    (every layer runs the same kernels), two heads."""
    import numpy as np

    import bitnet
    from bitnet.testing.crossval import agreement, crossval_prompts

    f16, q8 = (bitnet.load(model, device="cpu", n_ctx=128, act_quant=act_quant, lm_head=h) for h in ("f16", "q8"))
    same, kl = [], []
    for ids in crossval_prompts(f16.tokenize):  # a prompt at a time: [tokens, vocab] float64 temporaries
        s, k = agreement(f16.logits(ids), q8.logits(ids))
        same.append(s)
        kl.append(k)
    return {"positions": int(sum(len(s) for s in same)), "top1": float(np.mean(np.concatenate(same))),
            "mean_kl": float(np.mean(np.concatenate(kl)))}


def worker_llama(model: str, threads: int, n_prompt: int, n_decode: int) -> dict[str, Any]:
    import numpy as np

    t0 = time.perf_counter()  # from the import: see the module docstring
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_prompt + n_decode + 16, n_batch=max(512, n_prompt),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    ids = _ids(n_prompt, vocab)

    def step(tokens: list[int]) -> int:
        llm.eval(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(np.argmax(logits))

    def warm_steps() -> None:
        step(ids[:8])
        step([ids[8]])

    warm = _warm_up(warm_steps, llm.reset, t0)
    t0 = time.perf_counter()
    tok = step(ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = step([tok])
    decode_s = time.perf_counter() - t0
    llm.close()
    return _finish(load_s, warm, n_prompt, prefill_s, n_decode, decode_s)


def prompt_text(reader: Any, n: int) -> str:
    """Text of about n tokens in the file's own vocabulary (llama-cli takes text, not ids): English repeated, cut at
    n tokens by our tokenizer; llama-cli's own count of it is printed beside its decode rate."""
    from bitnet.modelfile.model import _metadata
    from bitnet.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(_metadata(reader))
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it sleeps. " * (n // 8 + 1))
    return tok.decode(ids[:n])


def bitnet_cpp(bench: str, model: str, threads: int, n_prompt: int, n_decode: int, prompt: Path,
               timeout: float) -> dict[str, Any]:
    """One run of bitnet.cpp: prefill from `llama-bench -p`, decode after the prompt from `llama-cli` beside it (their
    perf line for the tokens after the first). No load time or RSS.

    llama-bench's own decode test starts from an empty cache (7 % faster at 1 thread than after 128 tokens, on the AMD
    EPYC), and its prompt-then-decode test minus its prompt test is noise once the prompt takes much longer than the
    decode: after 2048 tokens on the Zen 5 EPYC that difference gave 8.7, 44.6 and -570 tokens/s."""
    import re
    import subprocess

    out = subprocess.run([bench, "-m", model, "-p", str(n_prompt), "-n", "0", "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, timeout=timeout, check=True)
    prefill = float(json.loads(out.stdout)[0]["avg_ts"])
    cli = subprocess.run([str(Path(bench).with_name("llama-cli")), "-m", model, "-f", str(prompt), "-n",
                          str(n_decode + 1), "--ignore-eos", "--temp", "0", "-t", str(threads)],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", timeout=timeout,
                         check=True)  # (random weights write any bytes, half a character too)
    read = re.search(r"prompt eval time =.*/\s*(\d+) tokens", cli.stderr)
    runs = re.search(r"context_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", cli.stderr)
    if read is None or runs is None:
        raise RuntimeError(f"llama-cli printed no timings: {cli.stderr[-300:]}")
    return {"prefill_tps": prefill, "decode_tps": int(runs[2]) / float(runs[1]) * 1e3, "cli_prompt": int(read[1]),
            "load_s": float("nan"), "ready_s": float("nan"), "rss_mb": float("nan")}


_PAGE = 512  # uint64 per 4 KB: each page of the probe prefetches the next while it xors this one


@functools.cache
def _reader() -> Callable[..., int]:
    import numba
    import numpy as np

    from bitnet_cpu.float_kernels import prefetch

    @numba.njit(parallel=True)
    def read(pages: np.ndarray, ahead: bool) -> int:
        n = pages.shape[0]
        parts = numba.get_num_threads()
        acc = np.zeros(parts, np.uint64)
        step = (n + parts - 1) // parts
        for t in numba.prange(parts):
            s = np.uint64(0)
            for p in range(t * step, min(n, (t + 1) * step)):
                if ahead:
                    for c in range(0, _PAGE * 8, 64):
                        prefetch(pages.ctypes.data + (p + 1) * _PAGE * 8 + c)
                row = pages[p]
                for i in range(_PAGE):
                    s ^= row[i]
            acc[t] = s
        return int(acc.sum())

    return read


def read_gbps(a: Any, ahead: bool, rounds: int) -> float:
    """GB/s of numba's threads reading uint64 array `a` (its pages touched first), best of `rounds`."""
    a[:] = 1
    pages = a.reshape(-1, _PAGE)
    read = _reader()
    read(pages, ahead)
    return a.nbytes / min(_timed(read, pages, ahead) for _ in range(rounds)) / 1e9


def worker_bandwidth(threads: int) -> dict[str, Any]:
    """Read GB/s of `threads` numba threads streaming a 1 GB array, best of 5, with and without
    software prefetch with the kernels' hint (they prefetch, and on AMD beat a plain loop's figure by up to 40 %;
    on an Emerald Rapids Xeon the plain loop reads as much as any hint), in 4 KB and in 2 MB pages; the best of
    the four.

    Each 4 KB page is one loop of fixed length, which LLVM vectorizes: the earlier probe's loop ran up to
    min(page end, part end) and stayed scalar, so it measured instructions, not memory (on a Zen 5 EPYC
    8.4 GB/s on one thread where this loop reads 32-39)."""
    import mmap

    import numba
    import numpy as np

    numba.set_num_threads(threads)
    # In 4 KB and in 2 MB pages (the model file's, where its page cache holds 2 MB folios: see huge_pages).
    huge = mmap.mmap(-1, (1 << 30) + (2 << 20))
    huge.madvise(mmap.MADV_HUGEPAGE)
    spare = np.frombuffer(huge, np.uint8)
    spare = spare[-spare.ctypes.data % (2 << 20):][:1 << 30].view(np.uint64)
    best = {}
    for pages, a in (("4k", np.empty(1 << 27, dtype=np.uint64)), ("2m", spare)):
        for ahead in (False, True):
            best[pages, ahead] = read_gbps(a, ahead, 5)
    return {"gbps": max(best.values()), "plain_gbps": best["4k", False], "prefetch_gbps": best["4k", True],
            "huge_pages_gbps": max(best["2m", False], best["2m", True])}


def worker_compute(threads: int) -> dict[str, Any]:
    """int8 products/s of `threads` threads running the kernels' multiply-add instruction on registers, best of
    5 (bitnet_cpu.dot_ir.emit_peak): what prefill, which reads each weight once for many tokens, cannot pass."""
    import numba

    from bitnet_cpu import dot_ir, isa

    level = isa.choose()
    if level == "generic":
        return {"level": level, "gops": float("nan")}
    probe = isa.kernels(level).multiply_peak
    numba.set_num_threads(threads)
    rounds = 5_000_000
    probe(1000, threads)
    seconds = min(_timed(probe, rounds, threads) for _ in range(5))
    return {"level": level, "gops": threads * rounds * dot_ir.peak_products(level) / seconds / 1e9}


def _timed(f: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    f(*args)
    return time.perf_counter() - t0


def _tensor_types(path: str) -> set[str]:
    from bitnet.modelfile.model import _open, type_name

    return {type_name(int(t.tensor_type)) for t in _open(path).tensors}


def decode_bytes(reader: Any, lm_head: str) -> tuple[int, int, str]:
    """Bytes one decode step reads from a model file's `reader`: every projection tensor's (the layer stack), the LM
    head's; the head's format."""
    from bitnet.modelfile.model import type_name
    from bitnet.runtime.engine import choose_lm_head

    names = {t.name for t in reader.tensors}
    name = "output.weight" if "output.weight" in names else "token_embd.weight"
    head = next(t for t in reader.tensors if t.name == name)
    fmt = choose_lm_head(lm_head, type_name(int(head.tensor_type)))
    head_bytes = int(head.n_elements) + 4 * int(head.shape[1]) if fmt == "q8" else int(head.n_bytes)  # int8, scales
    return sum(int(t.n_bytes) for t in _projections(reader)), head_bytes, fmt


def base3_stack_bytes(reader: Any) -> int:
    """Bytes of the layer stack's codes packed in base 3 (the avx512vbmi level: 64 bytes a 320 weights of a row,
    rows padded), what our kernels read there in place of the file's codes."""
    from bitnet_cpu.dot_ir import BASE3_BLOCK, BLOCK_BYTES

    return sum(int(t.shape[1]) * -(-int(t.shape[0]) // BASE3_BLOCK) * BLOCK_BYTES for t in _projections(reader))


def token_products(reader: Any) -> int:
    """The ternary products one token costs (every projection's rows x columns; the LM head, which prefill
    runs for one token only, not counted)."""
    return sum(int(t.n_elements) for t in _projections(reader))


def _projections(reader: Any) -> list[Any]:
    return [t for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith(".weight")
            and "norm" not in t.name]


def spawn(kind: str, args: argparse.Namespace, model: str, threads: int,
          env_extra: dict[str, str] | None = None, lm_head: str | None = None) -> dict[str, Any]:
    options = ["--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
               "--act-quant", args.act_quant, "--lm-head", lm_head or args.lm_head, "--kv-type", args.kv_type]
    return workers.spawn(str(Path(__file__).resolve()), kind, model, threads, options, args.timeout, env_extra)


def _current_bytecode() -> None:
    """Our packages' bytecode, current before any load is timed: pip compiled llama_cpp's at install, but an
    editable checkout whose sources changed since, under PYTHONDONTWRITEBYTECODE, would compile them again
    in every load (0.02 s for the CPU plugin's kernel modules on the AMD EPYC)."""
    import compileall

    import bitnet
    import bitnet_cpu

    for package in (bitnet, bitnet_cpu):
        compileall.compile_dir(os.path.dirname(package.__file__), quiet=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-model", help="the file llama.cpp runs (default: --model)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--act-quant", default="row")
    ap.add_argument("--lm-head", choices=("f16", "q8", "auto"), default="auto",
                    help="our LM head (llama.cpp runs the file's); q8 also prints its accuracy against f16")
    ap.add_argument("--with-f16-head", action="store_true",
                    help="with --lm-head q8: our F16 head runs in each round too, so the int8 head's decode ratio "
                         "to it is measured in one run")
    ap.add_argument("--kv-type", choices=("f16", "f32", "q8"), default="f16",
                    help="our KV cache; llama.cpp's and bitnet.cpp's default, F16, reads the same bytes as theirs")
    ap.add_argument("--bitnet-cpp", metavar="LLAMA_BENCH", help="bitnet.cpp's llama-bench binary")
    ap.add_argument("--bitnet-cpp-model", help="the file bitnet.cpp runs (I2_S, --arch bitnet)")
    ap.add_argument("--no-jit-probe", action="store_true", help="skip the empty-cache first-run measurement")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="N processes spin on the CPU beside every run (a shared machine's co-tenants)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = [int(t) for t in str(args.threads).split(",")]
    if args.worker:
        if args.worker == "ours":
            out = worker_ours(args.model, args.prompt_tokens, args.decode_tokens, args.act_quant, args.lm_head,
                              args.kv_type)
        elif args.worker == "accuracy":
            out = worker_accuracy(args.model, args.act_quant)
        elif args.worker == "llama":
            out = worker_llama(args.model, threads[0], args.prompt_tokens, args.decode_tokens)
        elif args.worker == "compute":
            out = worker_compute(threads[0])
        else:
            out = worker_bandwidth(threads[0])
        workers.result(out)
        return 0

    if args.busy < 0:
        ap.error(f"--busy must be 0 or more, not {args.busy}")
    llama_model = args.llama_model or args.model
    for path in (args.model, llama_model, args.bitnet_cpp_model):
        if path is not None and not os.path.isfile(path):
            ap.error(f"no such file: {path}")
    if "I2_S" in _tensor_types(llama_model):
        ap.error(f"llama.cpp cannot read I2_S ({llama_model}): give its TQ2_0 twin as --llama-model")
    _current_bytecode()
    from bitnet.modelfile import huge_pages

    for path in {args.model, llama_model, args.bitnet_cpp_model} - {None}:
        huge_pages.reread(path)  # every engine's file cached as after a reboot, and none pays the first cold read
    size_mb = os.path.getsize(args.model) / 2**20
    from bitnet.modelfile.model import _open  # gguf's own reader rejects I2_S (ggml type 36)

    reader = _open(args.model)  # (a 2B-4T file's header: 0.13-0.17 s a parse)
    stack_bytes, head_bytes, head_format = decode_bytes(reader, args.lm_head)
    file_step_gb = (stack_bytes + head_bytes) / 1e9  # what llama.cpp and bitnet.cpp read
    from bitnet_cpu import dot_ir, isa

    level = isa.choose()  # ours (its rows with one scale, as I2_S's and those the writer makes, in base 3 or not)
    if dot_ir.row_block(level) == dot_ir.BASE3_BLOCK:
        stack_bytes = base3_stack_bytes(reader)
    step_gb = (stack_bytes + head_bytes) / 1e9
    if args.with_f16_head and head_format != "q8":
        ap.error(f"--with-f16-head compares the int8 head with the F16 one; our head here is {head_format}")
    f16_step_gb = (stack_bytes + decode_bytes(reader, "f16")[1]) / 1e9 if args.with_f16_head else step_gb
    products = token_products(reader)
    log = sys.stderr
    print(f"model {args.model} ({size_mb:.0f} MiB), llama.cpp on {llama_model}; prompt {args.prompt_tokens}, "
          f"decode {args.decode_tokens} tokens, {args.runs} runs, act_quant {args.act_quant}, "
          f"our LM head {head_format}, KV cache {args.kv_type}; a decode step reads {file_step_gb:.2f} GB of the "
          f"file, {step_gb:.2f} GB at our level {level}",
          file=log, flush=True)
    jit = {}
    if not args.no_jit_probe:
        with tempfile.TemporaryDirectory() as cache:
            jit = spawn("ours", args, args.model, threads[0], {"NUMBA_CACHE_DIR": cache})
        print(f"first run, empty numba cache: warm-up {jit['warmup_s']:.1f} s (cached runs below)", file=log)
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    bandwidth = dict.fromkeys(threads, 0.0)  # the best probe of all runs: background load only lowers it
    compute, level = dict.fromkeys(threads, 0.0), "generic"
    engines = ["ours"] + (["ours_f16"] if args.with_f16_head else []) + ["llama"] + (
        ["bitnet.cpp"] if args.bitnet_cpp else [])
    names = {"ours": "ours", "ours_f16": "ours f16", "llama": "llama.cpp", "bitnet.cpp": "bitnet.cpp"}
    others = [k for k in engines if k not in ("ours", "ours_f16")]
    if args.busy:
        print(f"{args.busy} busy co-tenant process(es) spin beside every run", file=log, flush=True)
    with workers.busy(args.busy), tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        if args.bitnet_cpp:
            prompt.write_text(prompt_text(reader, args.prompt_tokens))
        for run in range(args.runs):
            for t in threads:
                bandwidth[t] = max(bandwidth[t], spawn("bandwidth", args, args.model, t)["gbps"])
                probe = spawn("compute", args, args.model, t)
                compute[t], level = max(compute[t], probe["gops"]), probe["level"]
                for kind in engines[run % len(engines):] + engines[:run % len(engines)]:  # each goes first in turn
                    if kind == "bitnet.cpp":
                        r = bitnet_cpp(args.bitnet_cpp, args.bitnet_cpp_model or args.model, t, args.prompt_tokens,
                                       args.decode_tokens, prompt, args.timeout)
                    elif kind == "ours_f16":
                        r = spawn("ours", args, args.model, t, lm_head="f16")
                    else:
                        r = spawn(kind, args, args.model if kind == "ours" else llama_model, t)
                    results.setdefault((kind, t), []).append(r)
                    print(f"  run {run + 1} {names[kind]:<10} t={t}: load {r['load_s']:.2f} s "
                          f"(ready {r['ready_s']:.2f} s), "
                          f"prefill {r['prefill_tps']:.2f} tok/s, decode {r['decode_tps']:.2f} tok/s, "
                          f"RSS {r['rss_mb']:.0f} MB" + (f"; llama-cli read {r['cli_prompt']} prompt tokens"
                                                          if "cli_prompt" in r else ""), file=log, flush=True)

    def med(kind: str, t: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(kind, t)])

    head = (f"{'thr':>3} {'engine':<12}{'decode t/s':>11}{'prefill t/s':>12}{'load s':>8}{'ready s':>8}{'RSS MiB':>9}"
            f"{'RSS/file':>9}{'bw-limit t/s':>13}{'of limit':>9}{'spread':>8}")
    print(head)
    print("-" * len(head))
    for t in threads:
        for kind in engines:
            limit = bandwidth[t] / (f16_step_gb if kind == "ours_f16" else step_gb if kind == "ours" else file_step_gb)
            dec = med(kind, t, "decode_tps")
            runs = [r["decode_tps"] for r in results[(kind, t)]]
            print(f"{t:>3} {names[kind]:<12}{dec:>11.2f}"
                  f"{med(kind, t, 'prefill_tps'):>12.2f}{med(kind, t, 'load_s'):>8.2f}{med(kind, t, 'ready_s'):>8.2f}"
                  f"{med(kind, t, 'rss_mb'):>9.0f}"
                  f"{med(kind, t, 'rss_mb') / size_mb:>9.2f}{limit:>13.2f}{dec / limit:>9.0%}"
                  f"{max(runs) / min(runs):>8.2f}")
        for other in others:
            ratios = {k: med("ours", t, k) / med(other, t, k)
                      for k in ("decode_tps", "prefill_tps", "load_s", "ready_s", "rss_mb")}
            print(f"{t:>3} {'ours/' + names[other]:<12}{ratios['decode_tps']:>11.2f}{ratios['prefill_tps']:>12.2f}"
                  f"{ratios['load_s']:>8.2f}{ratios['ready_s']:>8.2f}{ratios['rss_mb']:>9.2f}")
        if args.with_f16_head:  # round by round: the two heads ran minutes apart at most
            pairs = zip(results[("ours", t)], results[("ours_f16", t)], strict=True)
            rounds = [q["decode_tps"] / f["decode_tps"] for q, f in pairs]
            print(f"{t:>3} our int8 head decodes {statistics.median(rounds):.2f}x our F16 head (median of the rounds' "
                  f"ratios, {min(rounds):.2f}-{max(rounds):.2f}); the bytes a step reads bound it at "
                  f"{f16_step_gb / step_gb:.2f}x")
        print(f"{t:>3} bandwidth probe {bandwidth[t]:.1f} GB/s; spread = max/min decode over the runs; "
              "ready = from the load's start to the first forward pass's end, less a second pass")
        reads = [r["probe_gbps"] for r in results[("ours", t)]]
        of_read = [step_gb * r["decode_tps"] / r["probe_gbps"] for r in results[("ours", t)]]
        print(f"{t:>3} our decode reads at {statistics.median(of_read):.0%} ({min(of_read):.0%}-{max(of_read):.0%}) "
              f"of a read in its own process ({min(reads):.1f}-{max(reads):.1f} GB/s, spread "
              f"{max(reads) / min(reads):.2f})")
        phases = [r["stack_phases"] for r in results[("ours", t)] if r.get("stack_phases")]
        if phases:
            ms = {k: 1e3 * statistics.median(ph[k] for ph in phases) for k in phases[0]}
            gbs = stack_bytes / ms["projection"] / 1e6
            print(f"{t:>3} our layer stack, a decode step: {ms['total']:.2f} ms; its projections "
                  f"{ms['projection']:.2f} ms at {gbs:.1f} GB/s ({gbs / bandwidth[t]:.0%} of the probe), attention "
                  f"{ms['attention']:.2f}, serial steps {ms['serial']:.2f}, waiting {ms['wait']:.2f} (per thread, "
                  "from the region's stamps)")
        if level != "generic":
            limit = compute[t] * 1e9 / products
            shares = ", ".join(f"{names[k]} {med(k, t, 'prefill_tps') / limit:.0%}" for k in engines)
            print(f"{t:>3} multiply probe ({level}) {compute[t]:.1f} G int8 products/s: prefill limit {limit:.2f} t/s "
                  f"at {products / 1e9:.2f} G ternary products per token; prefill at {shares} of it")
    for t in threads[1:]:  # round by round: run k's processes at each thread count ran minutes apart at most
        pairs = list(zip(results[("ours", threads[0])], results[("ours", t)], strict=True))
        decode = [b["decode_tps"] / a["decode_tps"] for a, b in pairs]
        read = [b["probe_gbps"] / a["probe_gbps"] for a, b in pairs]
        print(f"{t:>3} threads decode {statistics.median(decode):.2f}x {threads[0]} ({min(decode):.2f}-"
              f"{max(decode):.2f}); the same processes' own reads scaled {statistics.median(read):.2f}x "
              f"({min(read):.2f}-{max(read):.2f}; each read runs after its process's decode, and the host's memory "
              "can change speed between the two)")
    accuracy = spawn("accuracy", args, args.model, threads[-1]) if head_format == "q8" else {}
    if accuracy:
        print(f"LM head q8 vs f16 over {accuracy['positions']} positions of the cross-validation prompts: "
              f"top-1 agreement {accuracy['top1']:.2%}, mean KL divergence {accuracy['mean_kl']:.2e} nats")
    if jit:
        print(f"first-run JIT (empty cache) warm-up: {jit['warmup_s']:.1f} s; "
              f"kernels: {', '.join(jit['kernels'])}")
    if args.json:
        runs = {f"{k}:{t}": v for (k, t), v in results.items()}
        args.json.write_text(json.dumps({"runs": runs, "bandwidth_gbps": bandwidth, "multiply_gops": compute,
                                         "multiply_level": level, "products_per_token": products, "jit": jit,
                                         "decode_gb": step_gb, "lm_head": head_format, "kv_type": args.kv_type,
                                         "lm_head_accuracy": accuracy},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(workers.main_exit(main))
