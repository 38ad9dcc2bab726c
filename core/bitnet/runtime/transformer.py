"""The BitNet b1.58 transformer, written once against KernelProvider (docs/design.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from bitnet.errors import ModelError, UsageError
from bitnet.modelfile.ternary import TernaryMatrix
from bitnet.runtime.fallback import kv_cache_for, place_weight, refuse_partial_in_strict_mode
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, KernelProvider, native_operations

if TYPE_CHECKING:
    from bitnet.modelfile.model import Model


@dataclass
class _Layer:
    """One layer's weights as provider handles (sub-norms are None when a model lacks them)."""

    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    attn_sub_norm: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    ffn_sub_norm: Any


class Transformer:
    """Weights resident on one provider, a KV cache of n_ctx positions, and the forward pass.

    The forward pass calls the provider for every operation; one it does not implement runs
    on the host (bitnet.runtime.fallback), so weights read only by such operations stay on the
    host and are not uploaded.
    """

    def __init__(self, model: Model, provider: KernelProvider, n_ctx: int, act_quant: str) -> None:
        if act_quant not in ACT_QUANT_MODES:
            raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                             f"{', '.join(ACT_QUANT_MODES)}")
        if n_ctx < 1:
            raise UsageError(f"the context must hold at least one token, got n_ctx={n_ctx}")
        cfg = model.config
        if cfg.activation not in ACTIVATIONS:
            raise ModelError(f"unsupported FFN activation {cfg.activation!r}")
        self.config, self.provider, self.n_ctx, self.act_quant = cfg, provider, n_ctx, act_quant
        refuse_partial_in_strict_mode(provider)  # before anything is uploaded or computed
        p, native = provider, native_operations(provider)
        self.token_embd = place_weight(p, "embed", model.token_embd)
        if model.output is None and ("embed" in native) == ("lm_head" in native):
            self.lm_head = self.token_embd  # tied, and both read from the same side: one copy
        else:
            head = model.token_embd if model.output is None else model.output
            self.lm_head = place_weight(p, "lm_head", head)
        self.output_norm = place_weight(p, "rmsnorm", model.output_norm)

        def upload(a: TernaryMatrix | np.ndarray | None) -> Any:
            if a is None:
                return None
            return p.upload_ternary(a) if isinstance(a, TernaryMatrix) else place_weight(p, "rmsnorm", a)

        names = [f.name for f in fields(_Layer)]
        self.layers = [_Layer(**{k: upload(getattr(lw, k)) for k in names}) for lw in model.layers]
        self.cache = kv_cache_for(p, cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim)
        self.n_past = 0  # positions 0..n_past-1 of the cache hold valid K and V

    def reset(self) -> None:
        """Forget the cached positions: the next forward must start at position 0."""
        self.n_past = 0

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool) -> Any:
        """Run tokens `ids` at positions pos0.. as one batch; logits handle of all rows or the last.

        Positions before pos0 must have been filled by earlier calls since the last reset().
        """
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        n, cfg, p = len(ids), self.config, self.provider
        if n == 0:
            raise UsageError("nothing to run: no tokens")
        if pos0 + n > self.n_ctx:
            what = f"prompt of {n} tokens exceeds" if pos0 == 0 else f"{n} token(s) at position {pos0} exceed"
            raise UsageError(f"{what} the context of {self.n_ctx}")
        if pos0 > self.n_past:
            raise UsageError(f"position {pos0} follows only {self.n_past} cached positions")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise UsageError(f"token id out of range 0..{cfg.vocab_size - 1}")
        eps, hd, aq = cfg.rms_eps, cfg.head_dim, self.act_quant
        x = p.embed(self.token_embd, ids)
        for i, L in enumerate(self.layers):
            h = p.rmsnorm(x, L.attn_norm, eps)
            q = p.rope(p.bitlinear(h, L.wq, aq), cfg.n_heads, hd, pos0, cfg.rope_theta)
            k = p.rope(p.bitlinear(h, L.wk, aq), cfg.n_kv_heads, hd, pos0, cfg.rope_theta)
            v = p.bitlinear(h, L.wv, aq)
            a = p.attention(q, k, v, self.cache, i, pos0, cfg.n_heads, cfg.n_kv_heads, hd)
            if L.attn_sub_norm is not None:
                a = p.rmsnorm(a, L.attn_sub_norm, eps)
            x = p.add(x, p.bitlinear(a, L.wo, aq))
            m = p.rmsnorm(x, L.ffn_norm, eps)
            f = p.act_mul(p.bitlinear(m, L.w_gate, aq), p.bitlinear(m, L.w_up, aq), cfg.activation)
            if L.ffn_sub_norm is not None:
                f = p.rmsnorm(f, L.ffn_sub_norm, eps)
            x = p.add(x, p.bitlinear(f, L.w_down, aq))
        self.n_past = pos0 + n
        if not all_logits and n > 1:
            x = p.last_row(x)
        return p.lm_head(p.rmsnorm(x, self.output_norm, eps), self.lm_head)
