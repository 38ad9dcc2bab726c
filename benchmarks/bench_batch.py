"""Continuous batching vs llama.cpp's batched decoding: aggregate decode tokens/s for B sequences at once.

For each thread count, one process per engine loads the file once and, for every B, starts B
sequences of `--prompt-tokens` random tokens (all prefilled in one step), then greedy-decodes
`--decode-tokens` tokens each; the aggregate rate is the tokens decoded after the last sequence's
first token over that time. Ours goes through the Scheduler (the path generate_batch and the
server use); llama.cpp (llama-cpp-python) decodes the same shapes with one llama_decode per step
over B sequence ids, as llama-server's -np does. The engines alternate across `--runs`; the table
shows medians and our B vs our B=1 and vs llama.cpp's same B. Then a chat's second-turn time to
first token with the KV cache reused vs recomputed from scratch.

    python benchmarks/bench_batch.py --model /tmp/2b4t-i2_s.gguf --llama-model /tmp/2b4t-tq2_0.gguf

Models: `python -m bitnet.modelfile.writer OUT --preset 2b4t --weight-type i2_s` and its TQ2_0 twin
(`--weight-type tq2_0 --arch bitnet`) for llama.cpp, which cannot read I2_S.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import workers

SEED = 99


def _prompts(b: int, n: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(SEED)
    return [[int(t) for t in rng.integers(0, vocab // 2, n)] for _ in range(b)]


def worker_ours(model: str, batches: list[int], n_prompt: int, n_decode: int, lm_head: str,
                kv_type: str) -> dict[str, Any]:
    import bitnet
    from bitnet.runtime.scheduler import Scheduler

    top = max(batches)
    eng = bitnet.load(model, device="cpu", n_ctx=n_prompt + n_decode + 8, n_seqs=top, lm_head=lm_head,
                      kv_type=kv_type)
    no_eog = {t: -100.0 for t in eng.tokenizer.eog_ids}
    out = {}
    for b in [1, *batches]:  # the first B=1 warms the kernels up and is not kept
        prompts = _prompts(b, n_prompt, eng.config.vocab_size)
        with Scheduler(eng, n_slots=b, step_tokens=b * n_prompt + b, prefill_chunk=n_prompt) as s:
            reqs = [s.submit(p, max_tokens=n_decode, logit_bias=no_eog) for p in prompts]
            for r in reqs:
                r.text()
            end = time.perf_counter()
        start = max(r.first_token for r in reqs)
        out[b] = b * (n_decode - 1) / (end - start)
    eng.close()
    return {"decode_tps": out}


def worker_llama(model: str, threads: int, batches: list[int], n_prompt: int, n_decode: int) -> dict[str, Any]:
    import llama_cpp as L
    import numpy as np

    top = max(batches)
    per_seq = n_prompt + n_decode + 8
    mp = L.llama_model_default_params()
    llm = L.llama_model_load_from_file(model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = top * per_seq, top * n_prompt, top * n_prompt
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = top, threads, threads
    ctx = L.llama_init_from_model(llm, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(llm))
    batch = L.llama_batch_init(top * n_prompt, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    out = {}
    for b in [1, *batches]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        prompts = _prompts(b, n_prompt, vocab)
        decode([(t, p, s, p == n_prompt - 1) for s in range(b) for p, t in enumerate(prompts[s])])
        toks = [greedy(s * n_prompt + n_prompt - 1) for s in range(b)]
        start = time.perf_counter()
        for step in range(1, n_decode):
            decode([(toks[s], n_prompt + step - 1, s, True) for s in range(b)])
            toks = [greedy(s) for s in range(b)]
        out[b] = b * (n_decode - 1) / (time.perf_counter() - start)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(llm)
    return {"decode_tps": out}


def worker_chat(model: str, n_decode: int) -> dict[str, Any]:
    import bitnet
    from bitnet.runtime.conversation import Conversation

    eng = bitnet.load(model, device="cpu", n_ctx=1024)
    no_eog = {t: -100.0 for t in eng.tokenizer.eog_ids}
    system = " ".join(["You answer questions about the history of computing, briefly and precisely."] * 12)
    out: dict[str, list[float]] = {"reuse": [], "fresh": []}
    for _ in range(3):
        for mode in ("reuse", "fresh"):
            conv = Conversation(eng, system, max_tokens=n_decode, logit_bias=no_eog)
            eng.reset()
            "".join(conv.reply("Who built the first stored-program computer?"))
            if mode == "fresh":
                eng.reset()
            "".join(conv.reply("And when did it first run a program?"))
            out[mode].append(eng.stats.ttft_ms)
            out.setdefault(f"{mode}_prefilled", []).append(eng.stats.prompt_tokens - eng.stats.cached_tokens)
    eng.close()
    return out


def spawn(kind: str, args: argparse.Namespace, model: str, threads: int) -> dict[str, Any]:
    options = ["--batches", args.batches, "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens), "--lm-head", args.lm_head, "--kv-type", args.kv_type]
    return workers.spawn(str(Path(__file__).resolve()), kind, model, threads, options, args.timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-model", help="the file llama.cpp runs (default: --model)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--lm-head", choices=("f16", "q8", "auto"), default="auto", help="our LM head")
    # llama.cpp's cache is F16 unless asked otherwise, and this runs it with its defaults. At B=8 the cache
    # outgrows the L3 (f32: 59 MB a step at 48 positions on 2B-4T), and attention reads it from memory.
    ap.add_argument("--kv-type", choices=("f32", "f16", "q8"), default="f16", help="our KV cache (llama.cpp's: F16)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        if args.worker == "ours":
            out = worker_ours(args.model, batches, args.prompt_tokens, args.decode_tokens, args.lm_head,
                              args.kv_type)
        elif args.worker == "llama":
            out = worker_llama(args.model, threads[0], batches, args.prompt_tokens, args.decode_tokens)
        else:
            out = worker_chat(args.model, args.decode_tokens)
        workers.result(out)
        return 0

    llama_model = args.llama_model or args.model
    from bitnet.modelfile import huge_pages

    for path in {args.model, llama_model}:
        huge_pages.reread(path)  # both engines' files cached as after a reboot (see bench_cpu)
    log = sys.stderr
    print(f"model {args.model}, llama.cpp on {llama_model}; prompts of {args.prompt_tokens} tokens, "
          f"{args.decode_tokens} decoded each, B in {batches}, {args.runs} runs, our LM head {args.lm_head}, "
          f"our KV cache {args.kv_type} (llama.cpp's f16)",
          file=log, flush=True)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for run in range(args.runs):
        for t in threads:
            for kind in (("ours", "llama") if run % 2 == 0 else ("llama", "ours")):
                r = spawn(kind, args, args.model if kind == "ours" else llama_model, t)["decode_tps"]
                results.setdefault((kind, t), []).append({int(b): v for b, v in r.items()})
                print(f"  run {run + 1} {kind:<5} t={t}: " + ", ".join(f"B={b} {v:.1f}" for b, v in r.items()),
                      file=log, flush=True)

    def med(kind: str, t: int, b: int) -> float:
        return statistics.median(r[b] for r in results[(kind, t)])

    head = f"{'thr':>3} {'B':>3}{'ours t/s':>10}{'llama.cpp t/s':>15}{'ours/llama':>11}{'ours B/B=1':>11}"
    print("aggregate decode tokens/s (medians)")
    print(head)
    print("-" * len(head))
    for t in threads:
        for b in batches:
            ours, llama = med("ours", t, b), med("llama", t, b)
            print(f"{t:>3} {b:>3}{ours:>10.2f}{llama:>15.2f}{ours / llama:>11.2f}{ours / med('ours', t, 1):>11.2f}")
    chat = spawn("chat", args, args.model, threads[-1])
    print(f"chat turn 2, time to first token (t={threads[-1]}, medians of 3): cache reused "
          f"{statistics.median(chat['reuse']):.0f} ms ({statistics.median(chat['reuse_prefilled']):.0f} tokens "
          f"prefilled) vs recomputed {statistics.median(chat['fresh']):.0f} ms "
          f"({statistics.median(chat['fresh_prefilled']):.0f} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(workers.main_exit(main))
