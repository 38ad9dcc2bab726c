"""The user-facing engine: `bitnet.load(...)` selects a device, loads a model onto it and generates."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.runtime.provider import ACT_QUANT_MODES, LM_HEADS, check_kv_type, kv_row_bytes
from bitnet.runtime.sampling import Sampler, check_logit_bias

SAMPLING_OPTIONS = frozenset({"min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n",
                              "logit_bias"})

if TYPE_CHECKING:
    from bitnet.modelfile.model import Model, ModelConfig
    from bitnet.plugins.selection import Selection
    from bitnet.plugins.types import Device
    from bitnet.runtime.provider import KernelProvider
    from bitnet.runtime.scheduler import Scheduler
    from bitnet.runtime.transformer import Transformer
    from bitnet.text.chat_template import ChatTemplate
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
    cached_tokens: int = 0  # prompt tokens whose K/V the previous run left in the cache (not recomputed)
    finish_reason: str | None = None  # "stop" (end of generation or a stop string), "length" (max_tokens)
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
         act_quant: str = "row", progress: Callable[[int, int], None] | None = None,
         chat_template: str | None = None, n_seqs: int = 1, lm_head: str = "auto", kv_type: str = "f32") -> Engine:
    """Select a device (docs/design.md section 3), load the GGUF model onto it, return an Engine.

    path None is the embedded default model: a small BitNet b1.58 trained on Shakespeare's plays
    (bitnet.modelfile.default_model), which writes Shakespeare-like text. n_ctx defaults to the
    model's training context, at most 4096; a larger n_ctx is allowed (RoPE extends to any
    position, quality beyond the training context is the caller's business). act_quant is
    "row" (BitNet b1.58), "block256" (llama.cpp's Q8_K) or "none" (float). chat_template names a
    built-in (bitnet, llama3, chatml, falcon3, zephyr) or a Jinja file, in place of the model's own.
    n_seqs is how many sequences can run at once (generate_batch, Scheduler), each with n_ctx positions.
    lm_head is "f16" (the file's float LM-head table as it is), "q8" (an int8 copy built at load: half
    the bytes per token, a little accuracy) or "auto": q8 when the file stores the head quantized, else f16.
    kv_type is what the KV cache stores: "f32", "f16" (llama.cpp's default: half the memory, and faster
    attention over long contexts, for a rounding of K and V to F16) or "q8" (a quarter of the memory, each
    row of K and V as int8 with a scale; the CPU backends only).
    """
    from bitnet.modelfile.model import load_model, map_pages
    from bitnet.plugins.selection import select
    from bitnet.runtime.transformer import Transformer
    from bitnet.text import chat_template as templates
    from bitnet.text.tokenizer import Tokenizer

    if isinstance(path, str) and path.startswith("hf://"):  # (the hub module imports click: only when needed)
        from bitnet.modelfile.hub import resolve_model_path

        path = resolve_model_path(path)  # hf://OWNER/NAME[/FILE]: download (or find in the HF cache) first
    t0 = time.perf_counter()
    if act_quant not in ACT_QUANT_MODES:
        raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                         f"{', '.join(ACT_QUANT_MODES)}")
    if lm_head not in LM_HEADS:
        raise UsageError(f"unknown LM head {lm_head!r}; expected one of {', '.join(LM_HEADS)}")
    check_kv_type(kv_type)
    if n_ctx is not None and n_ctx < 1:
        raise UsageError(f"n_ctx must be at least 1, got {n_ctx}")
    if isinstance(n_seqs, bool) or not isinstance(n_seqs, int) or n_seqs < 1:
        raise UsageError(f"n_seqs must be an integer >= 1, got {n_seqs!r}")
    selection = select(device)
    provider = selection.open()
    try:
        if path is None:
            from bitnet.modelfile import default_model

            path = default_model.path()
        model = load_model(path, progress=progress)
        head = choose_lm_head(lm_head, model.head_type)
        if n_ctx is None:
            n_ctx = min(model.config.n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
        check_kv_fits(model.config, n_ctx, *kv_home(provider, selection.device), n_seqs=n_seqs, kv_type=kv_type)
        # The weights are placed first: an int8 head mapped from its cache then faults in beside the tokenizer's
        # build with the file's pages (in the first token, it had cost 16-23 ms on a Zen 5), and an int8 head
        # built here has released the float table's pages, which the thread leaves alone, before it starts.
        transformer = Transformer(model, provider, n_ctx, act_quant, n_seqs, head, kv_type)
        int8_head = getattr(transformer.lm_head, "q", None)
        own = [getattr(getattr(layer, name), "own_codes", None) for layer in transformer.layers
               for name in ("qkv", "wo", "gate_up", "w_down")]
        codes = not own or any(o is None for o in own)  # (see KernelProvider.upload_ternary)
        also = [a for o in own if o is not None for a in o] if not codes else []
        also += [int8_head] if isinstance(int8_head, np.ndarray) else []
        pages = map_pages(model, head == "f16", also, codes)
        tokenizer = Tokenizer.from_metadata(model.metadata)
        template = templates.choose(model.metadata, tokenizer.has_token, chat_template)
        pages.join()
    except BaseException:
        provider.close()
        raise
    load_ms = (time.perf_counter() - t0) * 1e3
    return Engine(selection, provider, model, tokenizer, transformer, load_ms=load_ms, chat_template=template,
                  name=Path(path).name)


def choose_lm_head(lm_head: str, head_type: str) -> str:
    """The LM head to run for a file whose head tensor has ggml type `head_type`. For "auto": q8 when it
    is stored quantized (Q8_0, Q6_K, ...: it already gave up F16 precision, and int8 reads half the
    bytes of F16), else f16 (the head as trained: no accuracy is given away unasked)."""
    if lm_head != "auto":
        return lm_head
    return "f16" if head_type in ("F16", "F32", "BF16") else "q8"


def kv_cache_bytes(config: ModelConfig, n_ctx: int, n_seqs: int = 1, kv_type: str = "f32") -> int:
    """Bytes of the K and V cache for n_seqs sequences of n_ctx positions."""
    return 2 * kv_row_bytes(kv_type, config.head_dim) * config.n_layers * n_ctx * config.n_kv_heads * n_seqs


def check_kv_fits(config: ModelConfig, n_ctx: int, memory_bytes: int | None, where: str, n_seqs: int = 1,
                  kv_type: str = "f32") -> None:
    """A usage error, before anything is allocated, when the KV cache alone exceeds the memory it goes to."""
    need = kv_cache_bytes(config, n_ctx, n_seqs, kv_type)
    if memory_bytes and need > memory_bytes:
        seqs = f" x {n_seqs} sequences" if n_seqs > 1 else ""
        raise UsageError(f"n_ctx={n_ctx}{seqs} needs a {need / 2**30:.1f} GiB KV cache ({config.n_layers} layers x "
                         f"{config.n_kv_heads} KV heads x {config.head_dim} x K,V {kv_type}), more than the "
                         f"{memory_bytes / 2**30:.1f} GiB of {where}")


def kv_home(provider: KernelProvider, device: Device | None) -> tuple[int | None, str]:
    """The memory the KV cache goes to: the device's, or the host's when attention falls back to the host."""
    from bitnet.plugins.types import host_memory_bytes
    from bitnet.runtime.provider import native_operations

    if device is not None and "attention" in native_operations(provider):
        return device.memory_bytes, f"{device.backend}:{device.index} ({device.name})"
    return host_memory_bytes(), "host memory (attention runs on the host)"


class Engine:
    """A model resident on one device, with its tokenizer. Not thread-safe: one run at a time."""

    def __init__(self, selection: Selection, provider: KernelProvider, model: Model, tokenizer: Tokenizer,
                 transformer: Transformer, load_ms: float = 0.0, chat_template: ChatTemplate | None = None,
                 name: str = "bitnet") -> None:
        from bitnet.text import chat_template as templates

        self.selection, self.provider, self.model = selection, provider, model
        self.tokenizer, self.transformer = tokenizer, transformer
        self.load_ms, self.name = load_ms, name
        self.chat_template = chat_template or templates.choose(model.metadata, tokenizer.has_token)
        self.stats = Stats(load_ms=load_ms)
        self._epoch = 0  # bumped by every run: a generator whose cache was reused by a later run stops
        self._cached: list[int] = []  # the tokens whose K/V sit in the cache at positions 0..len-1
        self._scheduler: Scheduler | None = None  # while one runs, it owns the cache

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

    @property
    def n_seqs(self) -> int:
        return self.transformer.n_seqs

    def reset(self) -> None:
        """Forget the cached tokens: the next run computes its whole prompt (benchmarks want that)."""
        self._epoch += 1
        self._cached = []
        self.transformer.reset()

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [len(ids), vocab]: one forward pass over ids from position 0 (the cache is reset)."""
        self._check_free()
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        self._check_fits(len(ids), 0)
        self.stats = Stats(load_ms=self.load_ms, prompt_tokens=len(ids))
        t0 = time.perf_counter()
        self.reset()
        out = self.transformer.host_logits(ids)
        self._cached = [int(i) for i in ids]
        self.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        return out

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] = (), **sampling: Any) -> Iterator[str]:
        """Stream the text generated after `prompt` (text, or token ids used as they are).

        Stops at an end-of-generation token, after max_tokens tokens, or at a stop string
        (which is not emitted). `sampling` takes min_p, repeat_penalty, presence_penalty,
        frequency_penalty, penalty_last_n and logit_bias (bitnet.runtime.sampling). Parameters and
        the context limit are checked here, before any compute; the returned iterator does the work
        as it is consumed. One run at a time: starting another run on this engine ends an unfinished
        one (UsageError on its next step). The cache is reused: only the part of the prompt that
        differs from the previous run's tokens is computed (a chat's next turn prefills only itself).
        """
        steps = self.stream(prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=stop, **sampling)
        return (s.text for s in steps if s.text)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, **options: Any) -> Iterator[Step]:
        """As generate, one Step per sampled token (its text, and its log-probabilities if asked for);
        options as prepare's."""
        t0 = time.perf_counter()
        self._check_free()
        ids, sampler, stops = self.prepare(prompt, max_tokens, **options)
        return self._run(ids, max_tokens, sampler, stops, (time.perf_counter() - t0) * 1e3)

    def prepare(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] = (),
                logprobs: int | None = None, **sampling: Any) -> tuple[list[int], Sampler, tuple[str, ...]]:
        """Check a run's parameters (UsageError before any compute): its prompt ids, sampler and stops."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
            raise UsageError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        unknown = set(sampling) - SAMPLING_OPTIONS
        if unknown:
            raise UsageError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        sampler = Sampler(temperature, top_k, top_p, seed, logprobs=logprobs, **sampling)
        check_logit_bias(sampler.logit_bias, self.config.vocab_size)
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise UsageError("stop strings must be non-empty strings")
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(i) for i in prompt]
            if ids and not 0 <= min(ids) <= max(ids) < self.config.vocab_size:
                raise UsageError(f"token id out of range 0..{self.config.vocab_size - 1}")
        if not ids:
            raise UsageError("the prompt is empty and the model has no BOS token to start from")
        self._check_fits(len(ids), max_tokens)
        return ids, sampler, stops

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[str]:
        """The texts generated after each prompt, run together with continuous batching on the engine's
        n_seqs slots (a sequence's text is the same as it would be alone; generate's options apply)."""
        from bitnet.runtime.scheduler import Scheduler

        with Scheduler(self, max_queue=len(prompts)) as scheduler:
            requests = [scheduler.submit(p, **kwargs) for p in prompts]
            return [r.text() for r in requests]

    def scheduler(self, n_slots: int | None = None, max_queue: int = 64) -> Scheduler:
        """A running Scheduler over this engine's slots (submit, iterate or `async for`, cancel, close)."""
        from bitnet.runtime.scheduler import Scheduler

        return Scheduler(self, n_slots, max_queue)

    def _check_free(self) -> None:
        if self._scheduler is not None:
            raise UsageError("a Scheduler runs this engine's sequences: submit to it, or close it first")

    def _check_fits(self, n_prompt: int, n_generate: int) -> None:
        if n_prompt + n_generate > self.n_ctx:
            raise UsageError(f"prompt of {n_prompt} tokens plus {n_generate} to generate exceeds the context "
                             f"of {self.n_ctx}")

    def _forward(self, ids: list[int], pos: int) -> Any:
        """Logits of the last of `ids` run at positions pos..; the cache then holds _cached[:pos] + ids. A run
        stopped part way (Ctrl-C in a long prompt) keeps the chunks it finished: the next run reuses them."""
        del self._cached[pos:]
        try:
            logits = self.transformer.forward(np.asarray(ids, np.int32), pos, all_logits=False)
        except BaseException:
            self._cached.extend(ids[:max(self.transformer.n_past - pos, 0)])
            raise
        self._cached.extend(ids)
        return logits

    def _run(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: tuple[str, ...],
             tokenize_ms: float) -> Iterator[Step]:
        stats = self.stats = Stats(load_ms=self.load_ms, prompt_tokens=len(ids))
        self._epoch += 1
        epoch = self._epoch
        if max_tokens == 0:
            stats.finish_reason = "length"
            return
        tr, decode, tok = self.transformer, self.tokenizer.stream_decoder(), self.tokenizer
        held = StopFilter(stops)
        # Reuse the cached prefix; at least the last prompt token runs, for its logits.
        reuse = min(common_prefix(self._cached, ids), len(ids) - 1)
        tr.n_past = reuse
        stats.cached_tokens = reuse
        t = time.perf_counter()
        choice = sampler.pick(self.provider, self._forward(ids[reuse:], reuse), ids)
        now = time.perf_counter()
        stats.prefill_ms = (now - t) * 1e3
        stats.ttft_ms = tokenize_ms + stats.prefill_ms
        history = list(ids)
        while True:
            token = choice.token
            stats.generated_tokens += 1
            if tok.is_eog(token):
                stats.finish_reason = "stop"
                break
            history.append(token)
            text, stopped = held.push(decode(token))
            yield Step(token, text, choice.logprob, choice.top)
            if stopped:
                stats.finish_reason = "stop"
                break
            if stats.generated_tokens >= max_tokens:
                stats.finish_reason = "length"
                break
            if self._epoch != epoch:
                raise UsageError("generation interrupted: another run on this engine reused its KV cache")
            t = time.perf_counter()
            choice = sampler.pick(self.provider, self._forward([token], len(history) - 1), history)
            dt = (time.perf_counter() - t) * 1e3
            stats.decode_ms += dt
            stats.token_latencies_ms.append(dt)
        if not held.stopped and held.pending:
            yield Step(-1, held.pending)

    # -- chat and OpenAI-shaped results (bitnet.runtime.completions) -----------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """The prompt for a conversation, as transformers' method of the same name: token ids, or the text.

        Ids follow llama.cpp's server: the rendered text with its special tokens parsed, and one BOS
        when the vocabulary adds one (never two, whether or not the template writes it).
        """
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        text = self.chat_template.render(messages, add_generation_prompt, bos_token=bos, eos_token=eos)
        if not tokenize:
            return text
        if bos and tok.add_bos and text.startswith(bos):
            text = text[len(bos):]
        return tok.encode(text, add_bos=True, special=True)

    def chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Iterator[str]:
        """Stream the assistant's reply to a conversation (generate's options apply)."""
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def create_completion(self, prompt: str | Sequence[int], stream: bool = False, **kwargs: Any) -> Any:
        """An OpenAI `text_completion` dict, or with stream=True an iterator of its chunks."""
        from bitnet.runtime import completions

        return completions.completion(self, prompt, stream, **kwargs)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], stream: bool = False,
                               **kwargs: Any) -> Any:
        """An OpenAI `chat.completion` dict, or with stream=True an iterator of `chat.completion.chunk`s."""
        from bitnet.runtime import completions

        return completions.chat_completion(self, messages, stream, **kwargs)

    def close(self) -> None:
        self.provider.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class Step:
    """One sampled token of a run and the text it releases (token -1: text held back until the end)."""

    token: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


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
