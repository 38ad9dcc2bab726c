"""`bitnet-select`: say what was requested, found and chosen, then run there."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from . import __version__
from .errors import BitnetError, UsageError

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
            _fail(ctx, exc)


def _registry(ctx: click.Context):
    from .registry import Registry

    if "registry" not in ctx.obj:
        ctx.obj["registry"] = Registry()
    return ctx.obj["registry"]


@click.group(cls=Group, invoke_without_command=True, epilog=EXIT_CODES)
@click.option("--device", "-d", metavar="REQUEST", default=None,
              help="auto, gpu, a backend name or alias (cuda, opencl, ocl, cpu, ...), NAME:INDEX, "
                   "or an ordered list a,b,c. Default: $BITNET_DEVICE, else auto.")
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
        from .selection import select

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
    """List every backend and device, available or with the reason not."""
    registry = _registry(ctx)
    rows: list[dict[str, Any]] = []
    for b in registry.backends():
        probe = registry.probe(b.name)
        base = {"backend": b.name, "aliases": list(b.aliases), "kind": b.kind, "priority": b.priority}
        if not probe.devices:
            rows.append({**base, "index": None, "available": False, "reason": probe.reason, "device": None})
        for d in probe.devices:
            rows.append({**base, "index": d.index, "available": True, "reason": None, "device": d.to_json()})
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    header = ("BACKEND", "IDX", "DEVICE", "VENDOR", "MEMORY", "CU/CC", "FP16", "BF16", "PRIO", "STATUS")
    table = [header]
    for r in rows:
        d = r["device"] or {}
        units = d.get("compute_capability") or d.get("compute_units")
        status = ("fake" if d.get("fake") else "available") if r["available"] else f"unavailable: {r['reason']}"
        table.append((r["backend"], "-" if r["index"] is None else str(r["index"]), d.get("name", "-"),
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
        click.echo(line + (f" error: {p.error}" if p.error else ""))


@main.command()
@click.option("--model", "-m", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file. Default: a small built-in synthetic model (random weights, gibberish text).")
@click.option("--prompt", "-p", required=True, help="Prompt text.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed: the same seed gives the same text.")
@click.option("--n-ctx", type=click.IntRange(min=1), default=None,
              help="Context length (default: the model's, at most 4096).")
@click.option("--act-quant", type=click.Choice(["row", "block256", "none"]), default="row", show_default=True,
              help="Activation quantization: BitNet per-row int8, llama.cpp's per-256 Q8_K, or float.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.pass_context
def run(ctx: click.Context, model: str | None, prompt: str, max_tokens: int, temperature: float, top_k: int,
        top_p: float, seed: int | None, n_ctx: int | None, act_quant: str, stop: tuple[str, ...]) -> None:
    """Generate text: it streams to stdout; selection and timings go to stderr."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the prompt is not valid UTF-8") from None
    from .engine import load

    with _load_progress() as progress:
        engine = load(model, device=ctx.obj["device"], n_ctx=n_ctx, act_quant=act_quant, progress=progress)
    with engine:
        click.echo(engine.summary, err=True)
        for piece in engine.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, stop=stop):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        s = engine.stats
        click.echo(f"load time = {s.load_ms:.1f} ms", err=True)
        click.echo(f"prompt eval time = {s.prefill_ms:.1f} ms / {s.prompt_tokens} tokens "
                   f"({s.prefill_tps:.2f} tokens per second)", err=True)
        click.echo(f"eval time = {s.decode_ms:.1f} ms / {s.generated_tokens} tokens "
                   f"({s.decode_tps:.2f} tokens per second)", err=True)


class _load_progress:
    """A progress bar on stderr while layers load (click draws it only on a terminal)."""

    def __enter__(self):
        self.bar = None
        return self.update

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=total, label="loading", file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
