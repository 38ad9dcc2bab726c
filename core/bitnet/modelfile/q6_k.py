"""Q6_K, ggml's 6-bit k-quant, written in NumPy.

bitnet.cpp's `--quant-embd` variant of BitNet b1.58 2B-4T stores its token embedding (the tied LM
head) as Q6_K (microsoft/BitNet src/README.md: `llama-quantize --token-embedding-type Q6_K ... I2_S`).
gguf-py can read Q6_K but not write it, so the synthetic writer quantizes with this module; the
loader, the writer's expected values and the tests read the blocks back with gguf-py.

A block (ggml's block_q6_K, ggml/src/ggml-common.h) holds 256 consecutive values of a row in 210
bytes:

    ql[128]     the low 4 bits of the 256 6-bit codes
    qh[64]      their high 2 bits
    scales[16]  int8, one per 16 values (sub-block j holds values 16j .. 16j+15)
    d           float16 super-scale

and value i = d * scales[i // 16] * (code_i - 32). The codes are packed per half of 128 values:
for h in (0, 1) and l < 32, with c(k) the code of value 128h + 32k + l,

    ql[64h + l]      = c(0) & 15 | (c(2) & 15) << 4
    ql[64h + 32 + l] = c(1) & 15 | (c(3) & 15) << 4
    qh[32h + l]      = c(0) >> 4 | (c(1) >> 4) << 2 | (c(2) >> 4) << 4 | (c(3) >> 4) << 6

(ggml's dequantize_row_q6_K reads them so).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # values per block
BLOCK_BYTES = 210  # ql 128 + qh 64 + scales 16 + d 2


def _check_width(cols: int) -> None:
    if cols <= 0 or cols % QK_K:
        raise ValueError(f"Q6_K rows need a multiple of {QK_K} values, got {cols}")


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of float values [rows, cols] (cols a multiple of 256) as Q6_K bytes [rows, cols // 256 * 210].

    Each 16-value sub-block gets the scale that maps its value of largest magnitude to code -32
    (the one level without a positive twin, so all 64 levels are used). The 16 scales of a block
    are stored as int8 multiples of d = max|scale| / 127 (d rounded up to float16), rounded away
    from zero, so that a stored step is never smaller than the scale asked for and no value falls
    outside the codes: every value decodes within one stored step, |scale| + d. Codes are rounded
    with the steps as stored. ggml's own quantizer also searches nearby scales for a lower error;
    these files only need codes that decode close to the input, deterministically.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array of rows, got shape {x.shape}")
    rows, cols = x.shape
    _check_width(cols)
    sub = x.reshape(-1, QK_K // 16, 16)  # [blocks, 16 sub-blocks, 16 values]
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[..., None], axis=2)[..., 0]
    scale = extreme / np.float32(-32)
    want = np.abs(scale).max(axis=1) / np.float32(127)
    d = want.astype(np.float16)
    d = np.where(d.astype(np.float32) < want, np.nextafter(d, np.float16(np.inf)), d)
    if not np.all(np.isfinite(d)):
        raise ValueError("values too large for Q6_K's float16 super-scale")
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.sign(scale) * np.ceil(np.abs(scale) / d32[:, None]), 0)
    sc = np.clip(sc, -127, 127).astype(np.int8)
    step = d32[:, None] * sc.astype(np.float32)  # the sub-block scales the file will hold
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] != 0, np.rint(sub / step[..., None]), 0)
    codes = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, k, l]

    nb = codes.shape[0]
    out = np.empty((nb, BLOCK_BYTES), dtype=np.uint8)
    lo, hi = codes & np.uint8(15), codes >> np.uint8(4)
    out[:, :128] = (lo[:, :, 0:2] | (lo[:, :, 2:4] << np.uint8(4))).reshape(nb, 128)
    out[:, 128:192] = (hi[:, :, 0] | hi[:, :, 1] << np.uint8(2) | hi[:, :, 2] << np.uint8(4)
                       | hi[:, :, 3] << np.uint8(6)).reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(nb, 1).view(np.uint8)
    return out.reshape(rows, cols // QK_K * BLOCK_BYTES)
