"""`bitnet-select`: say what was requested, found and chosen, then run there."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

import click

from bitnet import __version__

from .errors import BitnetError, UsageError, is_ctrl_c

EXIT_CODES = """Exit codes: 0 success, 1 internal error, 2 usage error, 3 no backend satisfies the
request, 4 invalid or unsupported model file, 5 a gate or threshold failed."""


def _fail(ctx: click.Context, exc: BaseException) -> NoReturn:
    if ctx.obj and ctx.obj.get("debug"):
        raise exc
    if isinstance(exc, BitnetError):
        click.echo(f"error: {exc}", err=True)
        ctx.exit(exc.exit_code)
    click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", err=True)
    ctx.exit(1)


class Group(click.Group):
    """Turns every error into one line on stderr with its documented exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as exc:
            if is_ctrl_c(exc):  # Ctrl-C inside a kernel call: click's own "Aborted!", not an internal error
                raise KeyboardInterrupt from exc
            _fail(ctx, exc)


def _registry(ctx: click.Context):
    from bitnet.plugins.registry import Registry

    if "registry" not in ctx.obj:
        ctx.obj["registry"] = Registry()
    return ctx.obj["registry"]


def _set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:
        # The environment is the one channel every backend (and its thread pools) reads.
        os.environ["BITNET_NUM_THREADS"] = str(value)


# Before the command (`bitnet-select -t 2 run`) or after it, where llama.cpp's tools take it (`run -t 2`).
_threads_option = click.option(
    "--threads", "-t", type=click.IntRange(min=1), default=None, expose_value=False, callback=_set_threads,
    help="CPU threads for backends that use them (sets BITNET_NUM_THREADS). Default: all cores.")


@click.group(cls=Group, invoke_without_command=True, epilog=EXIT_CODES)
@click.option("--device", "-d", metavar="REQUEST", default=None,
              help="auto, gpu, a backend name or alias (cuda, opencl, ocl, cpu, ...), NAME:INDEX, "
                   "or an ordered list a,b,c. Default: $BITNET_DEVICE, else auto.")
@_threads_option
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(__version__, prog_name="bitnet-select")
@click.pass_context
def main(ctx: click.Context, device: str | None, debug: bool) -> None:
    """Select a compute backend for BitNet b1.58 inference and run models on it.

    With no command, print `requested=... detected=[...] selected=...` and exit 0 if a
    backend was selected, 3 if not.
    """
    ctx.ensure_object(dict)
    ctx.obj.update(device=device, debug=debug)
    if ctx.invoked_subcommand is None:
        from bitnet.plugins.selection import select

        sel = select(device, _registry(ctx))
        click.echo(sel.summary)
        if sel.backend is None:
            click.echo(f"error: {sel.error}", err=True)
            ctx.exit(3)


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _flag(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def devices(ctx: click.Context, as_json: bool) -> None:
    """List every device in the order `auto` ranks them, then each backend without one and why."""
    from bitnet.plugins.selection import ranked

    registry = _registry(ctx)

    def row(b: Any, rank: int | None, d: Any, reason: str | None) -> dict[str, Any]:
        return {"rank": rank, "backend": b.name, "aliases": list(b.aliases), "kind": b.kind, "priority": b.priority,
                "index": None if d is None else d.index, "available": d is not None, "reason": reason,
                "device": None if d is None else d.to_json()}

    rows = [row(b, rank, d, None) for rank, (b, d) in enumerate(ranked(registry), start=1)]
    rows += [row(b, None, None, registry.probe(b.name).reason) for b in registry.backends()
             if not registry.probe(b.name).devices]
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    header = ("RANK", "BACKEND", "IDX", "DEVICE", "KIND", "VENDOR", "MEMORY", "CU/CC", "FP16", "BF16", "PRIO",
              "STATUS")
    table = [header]
    for r in rows:
        d = r["device"] or {}
        units = d.get("compute_capability") or d.get("compute_units")
        status = ("fake" if d.get("fake") else "available") if r["available"] else f"unavailable: {r['reason']}"
        table.append(("-" if r["rank"] is None else str(r["rank"]), r["backend"],
                      "-" if r["index"] is None else str(r["index"]), d.get("name", "-"), d.get("kind") or r["kind"],
                      d.get("vendor") or "-", _fmt_bytes(d.get("memory_bytes")), "-" if units is None else str(units),
                      _flag(d.get("fp16")), _flag(d.get("bf16")), str(r["priority"]), status))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def plugins(ctx: click.Context, as_json: bool) -> None:
    """List each discovered plugin: distribution, version, backends, load status and error."""
    infos = _registry(ctx).plugins
    if as_json:
        click.echo(json.dumps([p.to_json() for p in infos], indent=2))
        return
    for p in infos:
        line = f"{p.name}: {p.distribution} {p.version} [{p.status}] backends={','.join(p.backends) or '-'}"
        if p.clashes:
            line += f" disabled (name claimed by another plugin too): {','.join(p.clashes)}"
        click.echo(line + (f" error: {p.error}" if p.error else ""))


def _options(*options: Any) -> Any:
    """One decorator applying click options in the order written (commands share these sets)."""
    def apply(f: Any) -> Any:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


_model_option = click.option(
    "--model", "-m", default=None, metavar="PATH|hf://REPO[/FILE]",
    help="GGUF model file or Hugging Face repo. Default: the built-in model (a small BitNet b1.58 trained on "
         "Shakespeare).")
_act_quant_option = click.option(
    "--act-quant", type=click.Choice(["row", "block256", "none"]), default="row", show_default=True,
    help="Activation quantization: BitNet per-row int8, llama.cpp's per-256 Q8_K, or float.")
_engine_options = _options(  # every command that loads a model
    _threads_option,
    _act_quant_option,
    click.option("--lm-head", type=click.Choice(["f16", "q8", "auto"]), default="auto", show_default=True,
                 help="LM head: the file's float table (f16), an int8 copy built at load (q8: half the bytes "
                      "per token, slightly less accurate), or auto (q8 if the file stores it quantized, else f16)."),
    click.option("--kv-type", type=click.Choice(["f32", "f16", "q8"]), default="f32", show_default=True,
                 help="What the KV cache stores: float32, f16 (llama.cpp's default: half the memory, faster "
                      "attention over long contexts; K and V rounded to F16) or q8 (a quarter of the memory: "
                      "each row of K and V as int8 with a scale; CPU only)."))
_context_options = _options(
    click.option("--n-ctx", "--ctx-size", "-c", "n_ctx", type=click.IntRange(min=1), default=None,
                 help="Context length (default: the model's, at most 4096)."),
    _engine_options)
# bitnet.runtime.sampling has their semantics.
_sampling_options = _options(
    click.option("--temperature", "--temp", "temperature", type=float, default=0.0, show_default=True,
                 help="0 is greedy."),
    click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables."),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--min-p", type=float, default=0.0, show_default=True,
                 help="Drop tokens less likely than min-p times the most likely (0 disables)."),
    click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                 help="llama.cpp's repetition penalty over the last 64 tokens (1 disables)."),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
    click.option("--ignore-eos", is_flag=True, help="Never stop at an end-of-generation token."),
    click.option("--seed", "-s", type=int, default=None, help="Sampling seed: the same seed gives the same text."))


def _prompt_text(prompt: str | None, prompt_file: Any) -> str:
    """The prompt of --prompt or of --file (exactly one of them), checked to be UTF-8."""
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt with --prompt/-p or --file/-f, one of them")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the prompt is not valid UTF-8") from None
        return prompt
    try:
        text = prompt_file.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{prompt_file.name}: not UTF-8 text (byte {exc.start})") from None
    return text[:-1] if text.endswith("\n") else text


def _extra_sampling(engine: Any, min_p: float, repeat_penalty: float, presence_penalty: float,
                    frequency_penalty: float, ignore_eos: bool) -> dict[str, Any]:
    bias = {t: -100.0 for t in engine.tokenizer.eog_ids} if ignore_eos else None
    return dict(min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, logit_bias=bias)


@main.command()
@_model_option
@click.option("--system", "-p", "system", default=None,
              help="System prompt (-p as in `llama-cli -cnv -p` and bitnet.cpp's `run_inference.py -cnv -p`).")
@click.option("--chat-template", default=None, metavar="NAME|FILE",
              help="bitnet, llama3, chatml, falcon3, zephyr, or a Jinja file. Default: the model's own, else one "
                   "chosen by its architecture and vocabulary.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=512, show_default=True,
              help="Longest reply, in tokens.")
@_sampling_options
@_context_options
@click.option("--verbose", "-v", is_flag=True, help="After each reply: tokens reused from the cache, prefill, speed.")
@click.pass_context
def chat(ctx: click.Context, model: str | None, system: str | None, chat_template: str | None, max_tokens: int,
         temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, presence_penalty: float,
         frequency_penalty: float, ignore_eos: bool, seed: int | None, n_ctx: int | None, act_quant: str,
         lm_head: str, kv_type: str, verbose: bool) -> None:
    """Chat with a model: replies stream; the KV cache carries over between turns.

    On a terminal: /clear, /system TEXT, /exit (or Ctrl-D); Ctrl-C stops the reply being written.
    With stdin not a terminal, each line is one user message and each reply one line of output.
    """
    from bitnet import repl
    from bitnet.runtime.conversation import Conversation
    from bitnet.runtime.engine import load

    with _load_progress() as progress:
        engine = load(model, device=ctx.obj["device"], n_ctx=n_ctx, act_quant=act_quant, progress=progress,
                      chat_template=chat_template, lm_head=lm_head, kv_type=kv_type)
    with engine:
        click.echo(engine.summary, err=True)
        if engine.chat_template.note or verbose:
            click.echo(f"chat template: {engine.chat_template.name}"
                       + (f" ({engine.chat_template.note})" if engine.chat_template.note else ""), err=True)
        sampling = _extra_sampling(engine, min_p, repeat_penalty, presence_penalty, frequency_penalty, ignore_eos)
        conversation = Conversation(engine, system, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed, **sampling)
        repl.run(conversation, interactive=sys.stdin.isatty(), verbose=verbose)


@main.command()
@_model_option
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--file", "-f", "prompt_file", type=click.File("rb"), default=None,
              help="Read the prompt from a UTF-8 text file ('-': stdin), one final newline dropped, as llama-cli -f.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=0), default=64, show_default=True)
@_sampling_options
@_context_options
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--receipt", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON receipt of the run: the kernels dispatched, the device, timings, versions. "
                   "A fake device (BITNET_GPU_FAKE) gets a compute_path fake receipt, then exit 3.")
@click.pass_context
def run(ctx: click.Context, model: str | None, prompt: str | None, prompt_file: Any, max_tokens: int,
        temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, presence_penalty: float,
        frequency_penalty: float, ignore_eos: bool, seed: int | None, n_ctx: int | None, act_quant: str,
        lm_head: str, kv_type: str, stop: tuple[str, ...], receipt: str | None) -> None:
    """Generate text: it streams to stdout; selection and timings go to stderr."""
    prompt = _prompt_text(prompt, prompt_file)
    from bitnet.runtime.engine import load

    from .errors import NoBackendError

    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop=list(stop))
    try:
        with _load_progress() as progress:
            engine = load(model, device=ctx.obj["device"], n_ctx=n_ctx, act_quant=act_quant,
                          progress=progress, lm_head=lm_head, kv_type=kv_type)
    except NoBackendError as exc:
        if receipt:  # a fake device is selected but cannot run: its receipt says compute_path fake
            _write_fake_receipt(receipt, ctx.obj["device"], str(exc), sampling, act_quant, n_ctx)
        raise
    with engine:
        click.echo(engine.summary, err=True)
        pieces = []
        extra = _extra_sampling(engine, min_p, repeat_penalty, presence_penalty, frequency_penalty, ignore_eos)
        for piece in engine.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, stop=stop, **extra):
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if receipt:
            from bitnet.tools import receipts

            receipts.write(receipt, receipts.build(engine, "".join(pieces), sampling))
        s = engine.stats
        click.echo(f"load time = {s.load_ms:.1f} ms", err=True)
        click.echo(f"prompt eval time = {s.prefill_ms:.1f} ms / {s.prompt_tokens} tokens "
                   f"({s.prefill_tps:.2f} tokens per second)", err=True)
        click.echo(f"eval time = {s.decode_ms:.1f} ms / {s.generated_tokens} tokens "
                   f"({s.decode_tps:.2f} tokens per second)", err=True)
        if receipt:
            click.echo(f"receipt written to {receipt}", err=True)


@main.command()
@_model_option
@click.argument("text_file", type=click.File("r", encoding="utf-8"), metavar="FILE")
@click.option("--window", type=click.IntRange(min=1), default=None,
              help="Positions per window (default: the context). Each window starts after a BOS.")
@_context_options
@click.pass_context
def perplexity(ctx: click.Context, model: str | None, text_file: Any, window: int | None, n_ctx: int | None,
               act_quant: str, lm_head: str, kv_type: str) -> None:
    """Perplexity of a UTF-8 text file ('-': stdin) under the model, as llama-perplexity measures it."""
    from bitnet.runtime.engine import load
    from bitnet.tools.perplexity import text_perplexity

    try:
        text = text_file.read()
    except UnicodeDecodeError:
        raise UsageError(f"{text_file.name} is not UTF-8 text") from None
    with _load_progress() as progress:
        engine = load(model, device=ctx.obj["device"], n_ctx=n_ctx, act_quant=act_quant, lm_head=lm_head,
                      kv_type=kv_type, progress=progress)
    with engine:
        click.echo(engine.summary, err=True)
        click.echo(text_perplexity(engine, text, window))


def _write_fake_receipt(path: str, request: str | None, reason: str, sampling: dict[str, Any], act_quant: str,
                        n_ctx: int | None) -> None:
    from bitnet.tools import receipts

    fake = receipts.fake_run_receipt(request, reason, sampling, {"act_quant": act_quant, "n_ctx": n_ctx})
    if fake is not None:
        receipts.write(path, fake)


class _load_progress:
    """A progress bar on stderr while layers load (click draws it only on a terminal)."""

    def __enter__(self):
        self.bar = None
        return self.update

    def update(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label="loading", file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


# -- receipts and benchmarks (the logic lives in receipts.py and bench.py) -------------------------------

@main.group()
def receipt() -> None:
    """Check run receipts (written by `run --receipt` and `bench --receipts`)."""


@receipt.command("verify")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--require-backend", metavar="NAME[:INDEX]", default=None,
              help="The run must have been on this backend (a name or alias), and device index if given.")
@click.option("--require-gpu-kernels", is_flag=True,
              help="At least one kernel dispatched on a real GPU-kind device, and no CPU fallback.")
@click.option("--require-real", is_flag=True,
              help="compute_path real: a real (not fake) device that dispatched kernels.")
@click.option("--max-fallbacks", type=click.IntRange(min=0), default=None, help="At most N CPU fallbacks.")
@click.pass_context
def receipt_verify(ctx: click.Context, path: str, require_backend: str | None, require_gpu_kernels: bool,
                   require_real: bool, max_fallbacks: int | None) -> None:
    """Check a receipt against the schema and the requirements: exit 5 listing every failed check."""
    from bitnet.tools import receipts

    data = receipts.read(path)
    problems = receipts.verify(data, require_backend=require_backend, require_gpu_kernels=require_gpu_kernels,
                               require_real=require_real, max_fallbacks=max_fallbacks)
    for line in problems:
        click.echo(f"error: {path}: {line}", err=True)
    if problems:
        ctx.exit(5)
    calls = sum(k["count"] for k in data["kernels"])
    click.echo(f"ok: {path}: {data['selection']['selected']} compute_path={data['compute_path']} "
               f"kernels={len(data['kernels'])} calls={calls} fallbacks={len(data['fallbacks'])}")


def _names(values: tuple[str, ...] | str | None) -> list[str]:
    given = (values,) if isinstance(values, str) else values or ()
    parts = [p.strip().lower() for v in given for p in v.split(",")]
    if any(not p for p in parts):
        raise UsageError(f"empty backend name in {','.join(parts)!r}")
    return parts


@main.command()
@click.option("--device", "devices", metavar="A,B,...", default=None,
              help="Backends to measure, each of them (not the first available). "
                   "Default: the global --device, else every available backend.")
@_model_option
@click.option("--prompt", "prompts", multiple=True,
              help="Replace the fixed prompt set (repeatable); keep the default to compare runs over time.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--repetitions", "-r", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Unmeasured runs per backend first (kernels may compile on first use).")
@click.option("--temperature", "--temp", "temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed, the same for every run.")
@_engine_options
@click.option("--determinism", is_flag=True, help="Gate: every run of a prompt gives the same text.")
@click.option("--min-decode-tps", type=float, default=None, help="Gate: median decode tokens/s per backend.")
@click.option("--max-wall-ms", type=float, default=None, help="Gate: p95 wall time of one run, per backend.")
@click.option("--require", multiple=True, metavar="A,B",
              help="These backends must run: unavailable exits 3 (otherwise it is reported as skipped).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write bench.json, bench.csv and bench_runs.csv here.")
@click.option("--receipts", "receipts_dir", type=click.Path(file_okay=False), default=None,
              help="Write one receipt per backend here (its last measured run).")
@click.pass_context
def bench(ctx: click.Context, devices: str | None, model: str | None, prompts: tuple[str, ...],
          max_tokens: int, repetitions: int, warmup: int, temperature: float, top_k: int, top_p: float,
          seed: int | None, act_quant: str, lm_head: str, kv_type: str, determinism: bool,
          min_decode_tps: float | None, max_wall_ms: float | None, require: tuple[str, ...], out: str | None,
          receipts_dir: str | None) -> None:
    """Measure fixed prompts on each backend: a table on stdout; gates exit 5, a missing --require 3."""
    from bitnet.runtime.sampling import check_params
    from bitnet.tools import bench as harness

    check_params(temperature, top_k, top_p)
    config = harness.BenchConfig(
        requests=_names(devices or ctx.obj["device"]) or None, model=model, max_tokens=max_tokens,
        repetitions=repetitions, warmup=warmup, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        act_quant=act_quant, lm_head=lm_head, kv_type=kv_type, determinism=determinism,
        receipts_dir=receipts_dir, required=_names(require), prompts=prompts or harness.PROMPTS)
    report = harness.run(config, log=lambda line: click.echo(line, err=True))
    click.echo(harness.table(report))
    if out:
        for path in harness.write_outputs(report, out):
            click.echo(f"wrote {path}", err=True)
    missing = harness.missing_required(report)
    failures = harness.gate_failures(report, min_decode_tps, max_wall_ms, determinism)
    for line in missing + failures:
        click.echo(f"error: {line}", err=True)
    if missing:
        ctx.exit(3)
    if failures:
        ctx.exit(5)


# -- serve (bitnet.server; the [server] extra) ---------------------------------------------------------

@main.command()
@_model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback unless you say otherwise (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free port.")
@click.option("--parallel", "-np", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences generated at once (continuous batching slots; each has its own KV cache of n-ctx).")
@click.option("--n-ctx", "--ctx-size", "-c", "n_ctx", type=click.IntRange(min=1), default=None,
              help="Context length of each sequence (default: the model's, at most 4096).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; past it, 429 with Retry-After.")
@click.option("--api-key", envvar="BITNET_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1/* and /metrics (env: BITNET_API_KEY).")
@click.option("--model-alias", default=None, help="The model name clients use. Default: the file's name.")
@click.option("--chat-template", default=None, metavar="NAME|FILE",
              help="bitnet, llama3, chatml, falcon3, zephyr, or a Jinja file. Default: the model's own.")
@_engine_options
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="On SIGTERM, seconds in-flight requests may take to finish before they are cancelled.")
@click.pass_context
def serve(ctx: click.Context, model: str | None, host: str, port: int, parallel: int, n_ctx: int | None,
          max_queue: int, api_key: str | None, model_alias: str | None, chat_template: str | None,
          act_quant: str, lm_head: str, kv_type: str, shutdown_timeout: float) -> None:
    """Serve the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    from bitnet.server import missing_server_modules

    missing = missing_server_modules()
    if missing:
        raise UsageError(f"serve needs the server extra ({', '.join(missing)} not installed): "
                         "pip install 'bitnet-core[server]'")
    from bitnet.server import app as server_app

    settings = server_app.Settings(
        model=model, device=ctx.obj["device"], n_ctx=n_ctx, parallel=parallel, max_queue=max_queue,
        api_key=api_key or None, model_alias=model_alias, chat_template=chat_template, act_quant=act_quant,
        lm_head=lm_head, kv_type=kv_type, shutdown_timeout=shutdown_timeout, debug=ctx.obj["debug"])
    server_app.run(settings, host, port)


# -- models from the Hugging Face Hub (the logic lives in bitnet.modelfile.hub) -------------------------

@main.command()
@click.argument("repo")
@click.option("--file", "filename", default=None, metavar="NAME",
              help="The GGUF to fetch. Default: the repository's only .gguf file (with several: asks, or exit 2).")
@click.option("--revision", default=None, help="Branch, tag or commit. Default: main.")
def pull(repo: str, filename: str | None, revision: str | None) -> None:
    """Download a GGUF from the Hugging Face Hub into its cache and print the local path.

    Uses huggingface_hub: HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE=1 apply. `-m hf://REPO[/FILE]`
    does the same wherever a model path is taken.
    """
    from bitnet.modelfile import hub

    click.echo(hub.pull(repo.removeprefix(hub.SCHEME), filename, revision))


@main.command("models")
def list_models() -> None:
    """List the GGUF files in the Hugging Face cache: repo, file, revision, size."""
    from bitnet.modelfile import hub

    for m in hub.cached():
        refs = f" ({','.join(m.refs)})" if m.refs else ""
        click.echo(f"{m.repo}  {m.file}  {m.revision[:12]}{refs}  {m.size / 2**20:.1f} MiB")


@main.command("rm")
@click.argument("target", metavar="REPO[/FILE]")
def remove_model(target: str) -> None:
    """Remove a repository (every cached revision) or one of its files from the Hugging Face cache."""
    from bitnet.modelfile import hub

    n, freed = hub.remove(target)
    click.echo(f"removed {n} file{'s' if n != 1 else ''} of {target}, freed {freed}")


@main.command()
@click.pass_context
def warmup(ctx: click.Context) -> None:
    """Compile the device's kernels for this machine now (they are cached on disk), not in the first run.

    Runs small models of every weight layout, activation quantization and LM head once."""
    from bitnet.tools.warmup import CASES
    from bitnet.tools.warmup import warmup as run_warmup

    done = [0]

    def report(model: str, act_quant: str, lm_head: str, kv_type: str, seconds: float) -> None:
        done[0] += 1
        click.echo(f"[{done[0]}/{len(CASES)}] {model}, act-quant {act_quant}, lm-head {lm_head}, kv-type {kv_type}: "
                   f"{seconds:.1f} s", err=True)

    total = run_warmup(ctx.obj["device"], report)
    click.echo(f"warmup done in {total:.1f} s")
