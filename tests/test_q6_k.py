"""Our Q6_K writer (bitnet.modelfile.q6_k) read back by gguf-py, the reader the loader uses.

gguf-py's dequantize (written from ggml's block_q6_K) and llama.cpp
(test_model_families.test_2b4t_quant_embd_q6_k) cannot share a layout mistake with our writer.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bitnet.modelfile.q6_k import BLOCK_BYTES, QK_K, quantize_q6_k


def _rows() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 4 * QK_K)).astype(np.float32) * np.float32(0.125)
    x[1] *= 1000  # large values
    x[2] *= 1e-3  # d near the bottom of float16's normal range
    x[3, :16] = 0  # a zero sub-block beside non-zero ones
    x[4, QK_K:2 * QK_K] = 0  # a whole zero block
    x[5] = 0  # a zero row
    x[6, 37] = 40.0  # one outlier: its sub-block's scale dwarfs the others
    x[7, 300] = -40.0
    x[8] = np.abs(x[8])  # one sign only: the extreme maps to code 0 (-32)
    x[9] = -np.abs(x[9])
    return x


def test_round_trip_agrees_with_gguf_exactly() -> None:
    x = _rows()
    q = quantize_q6_k(x)
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], x.shape[1] // QK_K * BLOCK_BYTES)
    ours = dequantize(q, GGMLQuantizationType.Q6_K)
    assert ours.dtype == np.float32
    # Within one stored step of each 16-value sub-block: its largest magnitude / 32, plus the
    # block's int8 scale resolution d (at least float16's smallest step); a layout mistake would
    # misplace whole values.
    err = np.abs(ours - x).reshape(-1, QK_K // 16, 16).max(axis=2)
    amax = np.abs(x).reshape(-1, QK_K // 16, 16).max(axis=2)
    d = amax.max(axis=1, keepdims=True) / 32 / 127 * 1.001 + 2.0**-24
    assert np.all(err <= amax / 32 * 1.0001 + d)
    assert np.array_equal(ours[5], x[5]) and np.array_equal(ours[4, QK_K:2 * QK_K], x[4, QK_K:2 * QK_K])
    rms = np.sqrt(np.mean((ours[10:] - x[10:]) ** 2) / np.mean(x[10:] ** 2))
    assert rms < 0.025  # measured 0.019: a uniform error over a step of max/32 of 16 Gaussian values


def test_representable_values_come_back_exactly() -> None:
    # Values d * m_j * (c - 32) with an exact float16 d, sub-block multipliers m_j <= 127 (one of them
    # 127) and every code c in 0..63 (0 in each sub-block, so -32 is the extreme): each is stored as is.
    rng = np.random.default_rng(3)
    d = np.float32(np.float16(0.0078125))
    m = rng.integers(1, 128, size=(8, 16)).astype(np.float32)
    m[:, 5] = 127
    codes = rng.integers(0, 64, size=(8, 16, 16)).astype(np.float32)
    codes[:, :, 0] = 0
    x = (d * m[..., None] * (codes - 32)).reshape(8, QK_K)
    q = quantize_q6_k(x)
    assert np.array_equal(dequantize(q, GGMLQuantizationType.Q6_K), x)


def test_rows_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q6_k(np.zeros((2, 300), np.float32))
