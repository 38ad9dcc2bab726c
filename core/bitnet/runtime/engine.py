"""The user-facing engine: `bitnet.load(...)` selects a device, loads a model onto it and generates."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.runtime.provider import ACT_QUANT_MODES
from bitnet.runtime.sampling import Sampler

if TYPE_CHECKING:
    from bitnet.modelfile.model import Model, ModelConfig
    from bitnet.plugins.selection import Selection
    from bitnet.plugins.types import Device
    from bitnet.runtime.provider import KernelProvider
    from bitnet.runtime.transformer import Transformer
    from bitnet.text.tokenizer import Tokenizer

DEFAULT_MAX_CTX = 4096


@dataclass
class Stats:
    """Measurements of the last run (load_ms is the engine's load time)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0  # sampled tokens, including an end-of-generation token
    load_ms: float = 0.0
    prefill_ms: float = 0.0  # the prompt's forward pass and the first sampled token
    decode_ms: float = 0.0  # every later token: forward pass of the previous one, then sampling
    ttft_ms: float = 0.0  # tokenization + prefill + first sample (not the caller's wait before iterating)
    token_latencies_ms: list[float] = field(default_factory=list)  # one per decode step

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_ms * 1e3 if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = len(self.token_latencies_ms)
        return n / self.decode_ms * 1e3 if self.decode_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The fields and the derived rates (dataclasses.asdict would miss the properties)."""
        return {**asdict(self), "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps}


def load(path: str | os.PathLike[str] | None = None, device: str | None = None, n_ctx: int | None = None,
         act_quant: str = "row", progress: Callable[[int, int], None] | None = None) -> Engine:
    """Select a device (docs/design.md section 3), load the GGUF model onto it, return an Engine.

    path None is the embedded default model: a small *synthetic* model (random ternary
    weights, it writes gibberish) that exercises every code path. n_ctx defaults to the
    model's training context, at most 4096; a larger n_ctx is allowed (RoPE extends to any
    position, quality beyond the training context is the caller's business). act_quant is
    "row" (BitNet b1.58), "block256" (llama.cpp's Q8_K) or "none" (float).
    """
    from bitnet.modelfile.model import load_model
    from bitnet.plugins.selection import select
    from bitnet.runtime.transformer import Transformer
    from bitnet.text.tokenizer import Tokenizer

    t0 = time.perf_counter()
    if act_quant not in ACT_QUANT_MODES:
        raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                         f"{', '.join(ACT_QUANT_MODES)}")
    if n_ctx is not None and n_ctx < 1:
        raise UsageError(f"n_ctx must be at least 1, got {n_ctx}")
    selection = select(device)
    provider = selection.open()
    try:
        if path is None:
            from bitnet.modelfile import default_model

            path = default_model.path()
        model = load_model(path, progress=progress)
        tokenizer = Tokenizer.from_metadata(model.metadata)
        if n_ctx is None:
            n_ctx = min(model.config.n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
        check_kv_fits(model.config, n_ctx, selection.device)
        transformer = Transformer(model, provider, n_ctx, act_quant)
    except BaseException:
        provider.close()
        raise
    load_ms = (time.perf_counter() - t0) * 1e3
    return Engine(selection, provider, model, tokenizer, transformer, load_ms=load_ms)


def kv_cache_bytes(config: ModelConfig, n_ctx: int, n_seqs: int = 1) -> int:
    """Bytes of the K and V cache (float32) for n_seqs sequences of n_ctx positions."""
    return 2 * 4 * config.n_layers * n_ctx * config.n_kv_heads * config.head_dim * n_seqs


def check_kv_fits(config: ModelConfig, n_ctx: int, device: Device | None, n_seqs: int = 1) -> None:
    """A usage error, before anything is allocated, when the KV cache alone exceeds the device's memory."""
    need = kv_cache_bytes(config, n_ctx, n_seqs)
    have = device.memory_bytes if device is not None else None
    if have and need > have:
        seqs = f" x {n_seqs} sequences" if n_seqs > 1 else ""
        raise UsageError(f"n_ctx={n_ctx}{seqs} needs a {need / 2**30:.1f} GiB KV cache ({config.n_layers} layers x "
                         f"{config.n_kv_heads} KV heads x {config.head_dim} x K,V float32), more than the "
                         f"{have / 2**30:.1f} GiB of {device.backend}:{device.index} ({device.name})")


class Engine:
    """A model resident on one device, with its tokenizer. Not thread-safe: one run at a time."""

    def __init__(self, selection: Selection, provider: KernelProvider, model: Model, tokenizer: Tokenizer,
                 transformer: Transformer, load_ms: float = 0.0) -> None:
        self.selection, self.provider, self.model = selection, provider, model
        self.tokenizer, self.transformer = tokenizer, transformer
        self.load_ms = load_ms
        self.stats = Stats(load_ms=load_ms)
        self._epoch = 0  # bumped by every run: a generator whose cache was reused by a later run stops

    @property
    def summary(self) -> str:
        """`requested=... detected=[...] selected=...` (docs/design.md section 3)."""
        return self.selection.summary

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def n_ctx(self) -> int:
        return self.transformer.n_ctx

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [len(ids), vocab]: one forward pass over ids from position 0 (the cache is reset)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        self._check_fits(len(ids), 0)
        self.stats = Stats(load_ms=self.load_ms, prompt_tokens=len(ids))
        t0 = time.perf_counter()
        self._epoch += 1
        self.transformer.reset()
        out = self.provider.to_host(self.transformer.forward(ids, 0, all_logits=True))
        self.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        return out

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] = ()) -> Iterator[str]:
        """Stream the text generated after `prompt` (text, or token ids used as they are).

        Stops at an end-of-generation token, after max_tokens tokens, or at a stop string
        (which is not emitted). Parameters and the context limit are checked here, before
        any compute; the returned iterator does the work as it is consumed. One run at a time:
        starting another run on this engine ends an unfinished one (UsageError on its next step).
        """
        t0 = time.perf_counter()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
            raise UsageError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        sampler = Sampler(temperature, top_k, top_p, seed)
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise UsageError("stop strings must be non-empty strings")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise UsageError("the prompt is empty and the model has no BOS token to start from")
        self._check_fits(len(ids), max_tokens)
        return self._run(ids, max_tokens, sampler, stops, (time.perf_counter() - t0) * 1e3)

    def _check_fits(self, n_prompt: int, n_generate: int) -> None:
        if n_prompt + n_generate > self.n_ctx:
            raise UsageError(f"prompt of {n_prompt} tokens plus {n_generate} to generate exceeds the context "
                             f"of {self.n_ctx}")

    def _run(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: tuple[str, ...],
             tokenize_ms: float) -> Iterator[str]:
        stats = self.stats = Stats(load_ms=self.load_ms, prompt_tokens=len(ids))
        self._epoch += 1
        epoch = self._epoch
        if max_tokens == 0:
            return
        tr, decode = self.transformer, self.tokenizer.stream_decoder()
        held = StopFilter(stops)
        tr.reset()
        t = time.perf_counter()
        token = sampler.sample(self.provider, tr.forward(np.asarray(ids, np.int32), 0, all_logits=False))
        now = time.perf_counter()
        stats.prefill_ms = (now - t) * 1e3
        stats.ttft_ms = tokenize_ms + stats.prefill_ms
        pos = len(ids)
        while True:
            stats.generated_tokens += 1
            if self.tokenizer.is_eog(token):
                break
            text, stopped = held.push(decode(token))
            if text:
                yield text
            if stopped or stats.generated_tokens >= max_tokens:
                break
            if self._epoch != epoch:
                raise UsageError("generation interrupted: another run on this engine reused its KV cache")
            t = time.perf_counter()
            logits = tr.forward(np.array([token], np.int32), pos, all_logits=False)
            token = sampler.sample(self.provider, logits)
            dt = (time.perf_counter() - t) * 1e3
            stats.decode_ms += dt
            stats.token_latencies_ms.append(dt)
            pos += 1
        if not held.stopped and held.pending:
            yield held.pending

    def close(self) -> None:
        self.provider.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StopFilter:
    """Passes text through, withholding what could be the start of a stop string; cuts at a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.pending, self.stopped = tuple(stops), "", False

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return what is safe to emit now and whether a stop string was reached."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out, True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1))
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False
