"""An independent float64 forward pass written straight from docs/design.md section 4, plus random models.

It shares no code with bitnet.runtime.transformer or the providers: weights come from
TernaryMatrix.dequantize(), attention is recomputed over the whole sequence (no cache), and
activation quantization is simulated as q / s. Tests compare the engine against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from bitnet.modelfile.ternary import TernaryMatrix, from_values


@dataclass
class Config:
    """The ModelConfig fields the transformer reads."""

    arch: str = "bitnet"
    n_layers: int = 2
    dim: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 512
    vocab_size: int = 300
    n_ctx_train: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    activation: str = "silu"


def random_ternary(rng: np.random.Generator, rows: int, cols: int, block_scales: bool) -> TernaryMatrix:
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    if block_scales:
        return from_values(t, rng.uniform(0.02, 0.1, size=(rows, cols // 256)).astype(np.float32))
    return from_values(t, np.float32(rng.uniform(0.02, 0.1)))


def random_model(seed: int = 0, block_scales: bool = False, tied: bool = True,
                 **config: object) -> SimpleNamespace:
    """A Model-shaped object (config, token_embd F16, output_norm, output, layers) with random weights."""
    cfg = Config(**config)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    d, f = cfg.dim, cfg.ffn_dim

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, size=n).astype(np.float32)

    layers = [
        SimpleNamespace(
            attn_norm=norm(d),
            wq=random_ternary(rng, cfg.n_heads * cfg.head_dim, d, block_scales),
            wk=random_ternary(rng, cfg.n_kv_heads * cfg.head_dim, d, block_scales),
            wv=random_ternary(rng, cfg.n_kv_heads * cfg.head_dim, d, block_scales),
            wo=random_ternary(rng, d, cfg.n_heads * cfg.head_dim, block_scales),
            attn_sub_norm=norm(cfg.n_heads * cfg.head_dim),
            ffn_norm=norm(d),
            w_gate=random_ternary(rng, f, d, block_scales),
            w_up=random_ternary(rng, f, d, block_scales),
            w_down=random_ternary(rng, d, f, block_scales),
            ffn_sub_norm=norm(f),
        )
        for _ in range(cfg.n_layers)
    ]
    embd = rng.standard_normal((cfg.vocab_size, d)).astype(np.float16)
    output = None if tied else (rng.standard_normal((cfg.vocab_size, d)) * 0.5).astype(np.float16)
    return SimpleNamespace(config=cfg, token_embd=embd, output_norm=norm(d), output=output, layers=layers)


def fake_quant(x: np.ndarray, act_quant: str) -> np.ndarray:
    """What the ternary matmul sees of x: the float value its int8 code stands for."""
    if act_quant == "none":
        return x
    if act_quant == "row":
        amax = np.abs(x).max(axis=1, keepdims=True)
        s = np.where(amax > 0, 127.0 / np.where(amax > 0, amax, 1.0), 1.0)
        return np.clip(np.rint(x * s), -128, 127) / s
    n, cols = x.shape
    xb = x.reshape(n, cols // 256, 256)
    v = np.take_along_axis(xb, np.abs(xb).argmax(axis=2)[:, :, None], axis=2)
    iscale = np.where(v != 0, -127.0 / np.where(v != 0, v, 1.0), 0.0)
    d = np.where(iscale != 0, 1.0 / np.where(iscale != 0, iscale, 1.0), 0.0)
    return (np.clip(np.rint(xb * iscale), -128, 127) * d).reshape(n, cols)


def forward(model: SimpleNamespace, ids: list[int] | np.ndarray, act_quant: str = "none") -> np.ndarray:
    """float64 logits [len(ids), vocab] of the whole sequence from position 0."""
    cfg = model.config
    hd, nh, nkv, eps = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.rms_eps
    ids = np.asarray(ids)
    n = len(ids)

    def rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x ** 2, axis=1, keepdims=True) + eps) * w.astype(np.float64)

    def linear(x: np.ndarray, w: TernaryMatrix) -> np.ndarray:
        return fake_quant(x, act_quant) @ w.dequantize().astype(np.float64).T

    def rope(x: np.ndarray, heads: int) -> np.ndarray:
        out = x.reshape(n, heads, hd).copy()
        for pos in range(n):
            for j in range(hd // 2):
                angle = pos * cfg.rope_theta ** (-2.0 * j / hd)
                a, b = out[pos, :, j].copy(), out[pos, :, j + hd // 2].copy()
                out[pos, :, j] = a * np.cos(angle) - b * np.sin(angle)
                out[pos, :, j + hd // 2] = a * np.sin(angle) + b * np.cos(angle)
        return out

    def act(g: np.ndarray) -> np.ndarray:
        return g / (1.0 + np.exp(-g)) if cfg.activation == "silu" else np.maximum(g, 0.0) ** 2

    x = model.token_embd[ids].astype(np.float64)
    causal = np.tril(np.ones((n, n), dtype=bool))
    for L in model.layers:
        h = rmsnorm(x, L.attn_norm)
        q, k, v = rope(linear(h, L.wq), nh), rope(linear(h, L.wk), nkv), linear(h, L.wv).reshape(n, nkv, hd)
        a = np.empty((n, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            a[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + linear(rmsnorm(a.reshape(n, nh * hd), L.attn_sub_norm), L.wo)
        m = rmsnorm(x, L.ffn_norm)
        x = x + linear(rmsnorm(act(linear(m, L.w_gate)) * linear(m, L.w_up), L.ffn_sub_norm), L.w_down)
    head_w = model.token_embd if model.output is None else model.output
    return rmsnorm(x, model.output_norm) @ head_w.astype(np.float64).T
