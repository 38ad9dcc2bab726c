"""The BitNet b1.58 transformer, written once against KernelProvider (docs/design.md section 4)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np

from bitnet.errors import ModelError, UsageError
from bitnet.modelfile.ternary import TernaryMatrix
from bitnet.runtime.fallback import kv_cache_for, place_weight, refuse_partial_in_strict_mode
from bitnet.runtime.provider import (
    ACT_QUANT_MODES,
    ACTIVATIONS,
    OPERATIONS,
    KernelProvider,
    LayerWeights,
    check_kv_type,
    native_operations,
)

if TYPE_CHECKING:
    from bitnet.modelfile.model import Model


# Tokens a prompt runs through the layers at a time: its activations stay in a core's L2. Prefill of 2B-4T
# (I2_S, 2 threads, Emerald Rapids), tokens/s by chunk: 512 tokens 148 whole / 155 at 256 / 157 at 128 / 146 at
# 64; 1024 tokens 110 whole / 140 at 128; 2048 tokens 83 whole / 117 at 128; 4000 tokens 62 whole / 88 at 128, and
# peak RSS 1836 -> 1418 MiB.
PREFILL_CHUNK = 128


class Transformer:
    """Weights resident on one provider, a KV cache of n_seqs sequence slots of n_ctx positions each,
    and the forward pass over a batch of tokens from any of the slots.

    The forward pass calls the provider for every operation; one it does not implement runs
    on the host (bitnet.runtime.fallback), so weights read only by such operations stay on the
    host and are not uploaded.
    """

    def __init__(self, model: Model, provider: KernelProvider, n_ctx: int, act_quant: str, n_seqs: int = 1,
                 lm_head: str = "f16", kv_type: str = "f32") -> None:
        """lm_head "f16" runs the model's float LM-head table as it is, "q8" an int8 copy built here.
        kv_type "f32", "f16" or "q8": what the KV cache stores."""
        if lm_head not in ("f16", "q8"):
            raise UsageError(f"unknown LM head {lm_head!r}; expected f16 or q8")
        check_kv_type(kv_type)
        if act_quant not in ACT_QUANT_MODES:
            raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                             f"{', '.join(ACT_QUANT_MODES)}")
        if n_ctx < 1:
            raise UsageError(f"the context must hold at least one token, got n_ctx={n_ctx}")
        if n_seqs < 1:
            raise UsageError(f"at least one sequence slot is needed, got n_seqs={n_seqs}")
        cfg = model.config
        if cfg.activation not in ACTIVATIONS:
            raise ModelError(f"unsupported FFN activation {cfg.activation!r}")
        self.config, self.provider, self.n_ctx, self.act_quant = cfg, provider, n_ctx, act_quant
        self.lm_head_format = lm_head
        unused = "lm_head" if lm_head == "q8" else "lm_head_q8"
        # Before anything is uploaded or computed.
        refuse_partial_in_strict_mode(provider, [op for op in OPERATIONS if op != unused])
        p, native = provider, native_operations(provider)
        self.token_embd = place_weight(p, "embed", model.token_embd)
        head = model.token_embd if model.output is None else model.output
        if lm_head == "q8":
            self.lm_head: Any = place_weight(p, "lm_head_q8", head)
        elif model.output is None and ("embed" in native) == ("lm_head" in native):
            self.lm_head = self.token_embd  # tied, and both read from the same side: one copy
        else:
            self.lm_head = place_weight(p, "lm_head", head)
        self.output_norm = place_weight(p, "rmsnorm", model.output_norm)

        def upload(a: TernaryMatrix | np.ndarray | None) -> Any:
            if a is None:
                return None
            return p.upload_ternary(a) if isinstance(a, TernaryMatrix) else place_weight(p, "rmsnorm", a)

        groups = {"qkv": ("wq", "wk", "wv"), "gate_up": ("w_gate", "w_up")}

        def layer(lw: Any) -> LayerWeights:
            return LayerWeights(**{f.name: p.upload_ternary_group([getattr(lw, k) for k in groups[f.name]])
                                   if f.name in groups else upload(getattr(lw, f.name)) for f in fields(LayerWeights)})

        self.layers = [layer(lw) for lw in model.layers]
        p.uploaded()
        self.cache = kv_cache_for(p, cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim, n_seqs, kv_type)
        self.n_seqs = n_seqs
        self.filled = [0] * n_seqs  # positions 0..filled[s]-1 of slot s hold valid K and V

    @property
    def n_past(self) -> int:
        """Valid cached positions of slot 0 (the engine's single-sequence runs)."""
        return self.filled[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.filled[0] = int(value)

    def reset(self) -> None:
        """Forget every slot's cached positions."""
        self.filled = [0] * self.n_seqs

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool, slot: int = 0) -> Any:
        """Run tokens `ids` of one sequence at positions pos0..; logits handle of all rows or the last.

        A prompt longer than PREFILL_CHUNK runs a chunk at a time: the same bits, since rows are computed on
        their own, and its activations' peak stays that of one chunk."""
        ids, slots, positions = self._rows(ids, pos0, slot)
        n = len(ids)
        if all_logits and n > PREFILL_CHUNK:
            return self.provider.from_host(self._chunked_logits(ids, slots, positions))
        if n > PREFILL_CHUNK:  # the whole prompt checked before its first chunk writes the cache
            self._sequence_ends(ids, slots, positions, np.empty(0, np.int32))
        for c in range(0, n, PREFILL_CHUNK):
            m = min(PREFILL_CHUNK, n - c)
            rows = np.arange(m, dtype=np.int32) if all_logits else np.array([m - 1] if c + m == n else [], np.int32)
            out = self.forward_batch(ids[c:c + m], slots[c:c + m], positions[c:c + m], rows)
        return out

    def host_logits(self, ids: np.ndarray, pos0: int = 0, slot: int = 0) -> np.ndarray:
        """float32 [n, vocab] on the host: the logits of every row of `ids` run at positions pos0.. (as forward
        with all_logits, without a handle of them all to copy back)."""
        ids, slots, positions = self._rows(ids, pos0, slot)
        if len(ids) > PREFILL_CHUNK:
            return self._chunked_logits(ids, slots, positions)
        return self.provider.to_host(self.forward_batch(ids, slots, positions, np.arange(len(ids), dtype=np.int32)))

    def _rows(self, ids: np.ndarray, pos0: int, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids, slots and positions of one sequence's tokens at pos0.., checked against the context."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if n == 0:
            raise UsageError("nothing to run: no tokens")
        if pos0 + n > self.n_ctx:
            what = f"prompt of {n} tokens exceeds" if pos0 == 0 else f"{n} token(s) at position {pos0} exceed"
            raise UsageError(f"{what} the context of {self.n_ctx}")
        return ids, np.full(n, slot, np.int32), np.arange(pos0, pos0 + n, dtype=np.int32)

    def _chunked_logits(self, ids: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Every row's logits, a chunk at a time, each chunk's copied into one host array as it ends: a
        2048-position window of 2B-4T holds 1 GB of logits once, not as chunks, their join and a copy."""
        self._sequence_ends(ids, slots, positions, np.empty(0, np.int32))  # all checked before a chunk writes
        out = None
        for c in range(0, len(ids), PREFILL_CHUNK):
            m = min(PREFILL_CHUNK, len(ids) - c)
            part = self.provider.to_host(self.forward_batch(ids[c:c + m], slots[c:c + m], positions[c:c + m],
                                                            np.arange(m, dtype=np.int32)))
            if out is None:
                out = np.empty((len(ids), part.shape[1]), np.float32)
            out[c:c + m] = part
        assert out is not None
        return out

    def forward_batch(self, ids: np.ndarray, slots: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> Any:
        """One pass over a batch: token ids[i] of sequence slot slots[i] at position positions[i];
        logits handle [len(rows), vocab] of the batch rows `rows` (ascending), or None for no rows (a
        step that only prefills).

        A sequence's tokens are consecutive and in position order, and each sequence continues
        where its slot's cache ends (or earlier, overwriting). Each row is computed on its own:
        its logits do not depend on the other rows.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        slots = np.ascontiguousarray(slots, dtype=np.int32).reshape(-1)
        positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        rows = np.ascontiguousarray(rows, dtype=np.int32).reshape(-1)
        n, cfg, p = len(ids), self.config, self.provider
        ends = self._sequence_ends(ids, slots, positions, rows)
        eps, hd, aq = cfg.rms_eps, cfg.head_dim, self.act_quant
        x = p.embed(self.token_embd, ids)
        x = p.layer_stack(x, self.layers, self.cache, slots, positions, cfg.n_heads, cfg.n_kv_heads, hd,
                          cfg.rope_theta, eps, cfg.activation, aq)
        for slot, last in ends:
            self.filled[slot] = last + 1  # a sequence that rewound no longer owns what follows
        if len(rows) == 0:
            return None
        if len(rows) != n:  # (n ascending rows in 0..n-1 are all of them)
            x = p.rows(x, rows)
        head = p.lm_head_q8 if self.lm_head_format == "q8" else p.lm_head
        return head(p.rmsnorm(x, self.output_norm, eps), self.lm_head)

    def _sequence_ends(self, ids: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                       rows: np.ndarray) -> list[tuple[int, int]]:
        """Each sequence's slot and last position, once the batch is checked (see forward_batch).

        On Python lists: a decode step's few rows after the layers had left NumPy's code out of the CPU
        caches, and its ~25 calls here took 0.3 ms of a 33 ms step (2B-4T, 2 threads, Emerald Rapids)."""
        n, vocab = len(ids), self.config.vocab_size
        if n == 0:
            raise UsageError("nothing to run: no tokens")
        if len(slots) != n or len(positions) != n:
            raise UsageError(f"{n} tokens need {n} slots and positions, got {len(slots)} and {len(positions)}")
        ids, slots, positions, rows = ids.tolist(), slots.tolist(), positions.tolist(), rows.tolist()
        if min(ids) < 0 or max(ids) >= vocab:
            raise UsageError(f"token id out of range 0..{vocab - 1}")
        if min(slots) < 0 or max(slots) >= self.n_seqs:
            raise UsageError(f"sequence slot out of range 0..{self.n_seqs - 1}")
        if min(positions) < 0 or max(positions) >= self.n_ctx:
            raise UsageError(f"position {max(positions)} is beyond the context of {self.n_ctx}")
        if rows and (rows[0] < 0 or rows[-1] >= n or any(rows[i] >= rows[i + 1] for i in range(len(rows) - 1))):
            raise UsageError(f"logit rows must be ascending indices in 0..{n - 1}")
        # Each sequence: one run of consecutive rows, positions consecutive, starting within what its slot holds.
        ends: list[tuple[int, int]] = []
        seen: set[int] = set()
        for i, (slot, pos) in enumerate(zip(slots, positions, strict=True)):
            if i and slot == slots[i - 1]:
                if pos != positions[i - 1] + 1:
                    raise UsageError("a sequence's positions must follow each other")
                ends[-1] = (slot, pos)
                continue
            if slot in seen:
                raise UsageError("a sequence's tokens must be consecutive in the batch")
            if pos > self.filled[slot]:
                raise UsageError(f"position {pos} follows only {self.filled[slot]} cached positions of slot {slot}")
            seen.add(slot)
            ends.append((slot, pos))
        return ends
