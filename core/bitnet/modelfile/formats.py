"""Ternary weight formats of GGUF files to and from the canonical TernaryMatrix (docs/design.md section 5).

TQ1_0 and TQ2_0 are decoded and encoded through `gguf.quants`, the reference NumPy
implementation, except where TQ2_0's bytes already are the canonical layout. I2_S is not
known to the gguf package, so it is written here straight from the layout in docs/design.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np

from bitnet.errors import ModelError
from bitnet.modelfile.ternary import BLOCK, BYTES_PER_BLOCK, TernaryMatrix, from_values

# ggml type ids (gguf's GGMLQuantizationType) and names of the types a loadable model holds: written out
# so that loading a file the load cache knows never imports gguf (~0.05 s). test_load_cache checks them.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_TQ1_0 = 34
GGML_TQ2_0 = 35
GGML_I2_S = 36  # Microsoft bitnet.cpp; absent from gguf's enum
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
                   11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 36: "I2_S"}

TQ2_0_BLOCK_BYTES = 66  # qs[64], f16 d
TQ1_0_BLOCK_BYTES = 54  # qs[48], qh[4], f16 d
I2S_BLOCK = 128  # values per I2_S block (32 bytes)

# Bounds the temporaries of TQ1_0's chunked decoding (values per chunk).
_CHUNK_VALUES = 1 << 22
# Bytes of codes checked at a time: the chunk, its buffer and its mask stay in L2.
_CHECK_BYTES = 1 << 19


def i2s_nbytes(n: int) -> int:
    """Bytes an I2_S tensor of n values occupies: the codes, then a 32-byte slot holding the f32 scale."""
    return n // 4 + 32


# I2_S byte g of a 128-block holds values g, g+32, g+64, g+96 at shifts 6,4,2,0; the canonical
# layout puts the same four values in the same byte at shifts 0,2,4,6, and both map code c to c-1.
# So I2_S is the canonical layout with the fields of every byte reversed: TernaryMatrix says so
# (fields_reversed) and the codes stay in the file.


@functools.cache
def _field_mask(period: int, nbytes: int) -> np.ndarray:
    """0x55 over the first 64 bytes (codes) of each `period`-byte block, 0 over the rest (a scale)."""
    pattern = np.zeros(period, np.uint8)
    pattern[:64] = 0x55
    return np.tile(pattern, nbytes // period)


def _code3_chunks(flat: np.ndarray, period: int) -> Iterator[tuple[int, np.ndarray, bool]]:
    """(offset, piece, whether a 2-bit code in it is 0b11) over flat uint8 bytes: whole blocks of
    64 code bytes every `period` bytes (the rest of a block is its scale). Pieces are whole
    64-bit words that stay in L2, checked in three passes into one reused buffer: 0.54 GB of
    2B-4T codes in ~0.25 s on one core, where a copy plus a check took 0.4 s."""
    unit = period * 8 // math.gcd(period, 8)
    step = max(unit, _CHECK_BYTES // unit * unit)
    buf = np.empty(step // 8, np.uint64)
    for lo in range(0, flat.size, step):
        chunk = flat[lo:lo + step]
        mask = _field_mask(period, chunk.size)
        if chunk.size % 8:
            yield lo, chunk, bool(np.any(chunk & (chunk >> np.uint8(1)) & mask))
            continue
        x, hits = chunk.view(np.uint64), buf[:chunk.size // 8]
        np.right_shift(x, np.uint64(1), out=hits)
        hits &= x
        hits &= mask.view(np.uint64)
        yield lo, chunk, bool(hits.max())  # max: twice as fast as any() here


def _check_shape(kind: str, raw: np.ndarray, rows: int, cols: int, nbytes: int, unit: int = BLOCK) -> None:
    if rows <= 0 or cols <= 0 or (rows * cols if unit == I2S_BLOCK else cols) % unit:
        what = "values" if unit == I2S_BLOCK else "columns per row"
        raise ModelError(f"{kind} tensor of {rows}x{cols}: needs a positive multiple of {unit} {what}")
    if raw.size != nbytes:
        raise ModelError(f"{kind} tensor of {rows}x{cols} needs {nbytes} bytes, got {raw.size}")


def _check_scales(kind: str, scales: np.ndarray) -> None:
    if not np.all(np.isfinite(scales)):
        raise ModelError(f"{kind} tensor has a NaN or infinite scale")


def tq2_0_to_ternary(raw: np.ndarray, rows: int, cols: int, check: bool = True,
                     block_scale: float | None = None) -> TernaryMatrix:
    """TQ2_0 bytes ([rows, cols/256*66] or flat) -> TernaryMatrix whose codes are a view of the
    blocks' `qs` (already the canonical layout) in place: nothing is copied but the scales.
    Without `check` (data known good) the codes are not scanned for 0b11, and `block_scale`, the
    scale every block is known to hold, spares reading the blocks at all."""
    nb = cols // BLOCK
    _check_shape("TQ2_0", raw, rows, cols, rows * nb * TQ2_0_BLOCK_BYTES)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, nb, TQ2_0_BLOCK_BYTES)
    if not check:
        if block_scale is not None:
            return TernaryMatrix(blocks[:, :, :64], np.broadcast_to(np.float32(block_scale), (rows, nb)))
        scales = blocks.reshape(-1).view(np.float16)[32::TQ2_0_BLOCK_BYTES // 2].astype(np.float32)
        return TernaryMatrix(blocks[:, :, :64], scales.reshape(rows, nb))
    scales = np.empty(rows * nb, np.float32)
    for lo, chunk, bad in _code3_chunks(blocks.reshape(-1), TQ2_0_BLOCK_BYTES):
        if bad:
            raise ModelError("TQ2_0 tensor holds the invalid code 0b11")
        b = lo // TQ2_0_BLOCK_BYTES  # each block's f16 d, while the chunk is in cache
        scales[b:b + chunk.size // TQ2_0_BLOCK_BYTES] = chunk.view(np.float16)[32::TQ2_0_BLOCK_BYTES // 2]
    scales = scales.reshape(rows, nb)
    _check_scales("TQ2_0", scales)
    return TernaryMatrix(blocks[:, :, :64], scales)


# TQ1_0 stores five base-3 digits per byte, read as ggml does: digit n of byte b is
# ((b * 3**n mod 256) * 3) >> 8, in {0, 1, 2}, which is the canonical code itself.
_T = ((((np.arange(256)[:, None] * 3 ** np.arange(5)[None, :]) & 0xFF) * 3) >> 8).astype(np.uint8)
# ggml's element order: qs[m] digit n is value 32n + m (m < 32) or 160 + 16n + (m - 32) (m < 48);
# qh[j] digit n is value 240 + 4n + j. So canonical byte j (j < 32) of a block's first half is
# digits 0-3 of qs[j], and of its second half digit 4 of qs[j] with digits of qs[32 + j % 16]
# and, for j >= 16, of qh: per-byte tables give each half byte in a few lookups.
_FIRST_HALF = _T[:, 0] | _T[:, 1] << 2 | _T[:, 2] << 4 | _T[:, 3] << 6
_DIGIT4 = _T[:, 4]
_SECOND_LOW = _T[:, 0] << 2 | _T[:, 2] << 4 | _T[:, 4] << 6  # qs[32 + j], j < 16
_SECOND_HIGH = _T[:, 1] << 2 | _T[:, 3] << 4  # qs[32 + j - 16], j >= 16


def tq1_0_to_ternary(raw: np.ndarray, rows: int, cols: int) -> TernaryMatrix:
    """TQ1_0 bytes -> TernaryMatrix, each canonical byte assembled from table lookups."""
    nb = cols // BLOCK
    _check_shape("TQ1_0", raw, rows, cols, rows * nb * TQ1_0_BLOCK_BYTES)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * nb, TQ1_0_BLOCK_BYTES)
    scales = blocks.reshape(-1).view(np.float16)[26::TQ1_0_BLOCK_BYTES // 2].astype(np.float32).reshape(rows, nb)
    _check_scales("TQ1_0", scales)
    codes = np.empty((rows * nb, 2, 32), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // BLOCK)
    for b in range(0, rows * nb, step):
        qs, out = blocks[b:b + step], codes[b:b + step]
        mid, qh = qs[:, 32:48], _T[qs[:, 48:52], :4].transpose(0, 2, 1).reshape(-1, 16)  # qh digit n of j -> 4n + j
        out[:, 0] = _FIRST_HALF[qs[:, :32]]
        out[:, 1] = _DIGIT4[qs[:, :32]]
        out[:, 1, :16] |= _SECOND_LOW[mid]
        out[:, 1, 16:] |= _SECOND_HIGH[mid] | qh << 6
    return TernaryMatrix(codes.reshape(rows, cols // 4), scales)


def i2s_to_ternary(raw: np.ndarray, rows: int, cols: int, check: bool = True) -> TernaryMatrix:
    """I2_S bytes (n/4 codes, f32 scale at n/4, padding to n/4+32) -> TernaryMatrix whose codes
    are the I2_S bytes in place (fields_reversed). I2_S blocks run over the flat tensor, so rows
    that are not whole 256-blocks (1bitLLM 3B) are decoded and repacked, zero-extended, instead.
    Without `check` (data known good) the codes are not scanned for 0b11."""
    n = rows * cols
    _check_shape("I2_S", raw, rows, cols, i2s_nbytes(n), I2S_BLOCK)
    flat = np.asarray(raw, dtype=np.uint8).reshape(-1)
    scale = np.frombuffer(flat[n // 4:n // 4 + 4].tobytes(), dtype="<f4")[0]
    if not np.isfinite(scale):
        raise ModelError("I2_S tensor has a NaN or infinite scale")
    packed = flat[:n // 4]
    if cols % BLOCK:
        if np.any(packed & (packed >> 1) & 0x55):
            raise ModelError("I2_S tensor holds the invalid code 0b11")
        return from_values(i2s_values(packed).reshape(rows, cols), scale)
    if check and any(bad for _, _, bad in _code3_chunks(packed, BYTES_PER_BLOCK)):
        raise ModelError("I2_S tensor holds the invalid code 0b11")
    scales = np.broadcast_to(np.float32(scale), (rows, cols // BLOCK))
    return TernaryMatrix(packed.reshape(rows, cols // 4), scales, fields_reversed=True)


def i2s_values(packed: np.ndarray) -> np.ndarray:
    """I2_S code bytes (n/4) -> the n ternary values as flat int8, in file order."""
    g = packed.reshape(-1, 1, 32)
    c = (g >> np.array([6, 4, 2, 0], np.uint8).reshape(1, 4, 1)) & 3  # value 32k + j of a block
    return (c.astype(np.int8) - 1).reshape(-1)


def bf16_to_float32(a: np.ndarray) -> np.ndarray:
    """BF16 stored as uint16 (or its uint8 bytes, last axis doubled) -> float32, exactly."""
    u16 = np.ascontiguousarray(a).view(np.uint16) if a.dtype != np.uint16 else a
    return (u16.astype(np.uint32) << 16).view(np.float32)


def absmean_ternary(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """BitNet b1.58's absmean rule: scale = mean|w| (at least 1e-5, the mean taken in float64), and the
    int8 ternary values clip(rint(w / scale), -1, 1)."""
    w32 = np.asarray(w, dtype=np.float32)
    scale = np.float32(max(np.mean(np.abs(w32), dtype=np.float64), 1e-5))
    return np.clip(np.rint(w32 / scale), -1, 1).astype(np.int8), scale


def float_to_ternary(w: np.ndarray, master_ok: bool = True) -> TernaryMatrix:
    """F32/F16 projection weights [rows, cols] -> TernaryMatrix.

    Weights that already are ternary times one scale (what llama.cpp's converter writes) keep
    that scale exactly; only true master weights get the BitNet absmean rule, since absmean of
    already-ternary weights would shrink their scale to 2/3 of it. With master_ok False, weights
    that are not ternary are refused instead (ModelError).
    """
    if w.ndim != 2:
        raise ModelError(f"projection weights must be 2-D, got shape {w.shape}")
    w32 = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w32)):
        raise ModelError("projection weights hold NaN or infinite values")
    a = np.abs(w32)
    s = a.max() if a.size else np.float32(0)
    if s == 0:
        return from_values(np.zeros(w32.shape, dtype=np.int8), 0.0)
    if np.all((a == 0) | (a == s)):
        return from_values(np.sign(w32).astype(np.int8), s)
    if not master_ok:
        raise ModelError("weights are not ternary (not every value is 0 or +-one scale): a full-precision "
                         "model, not BitNet b1.58; it is refused rather than silently ternarized")
    return from_values(*absmean_ternary(w32))


# -- encoders (the writer and tests) ---------------------------------------------------------------

def ternary_to_i2s(t: np.ndarray, scale: float) -> np.ndarray:
    """Ternary int8 values (any shape, n a multiple of 128) -> I2_S bytes, n/4 + 32 of them."""
    n = t.size
    if n % I2S_BLOCK:
        raise ValueError(f"I2_S needs a multiple of {I2S_BLOCK} values, got {n}")
    c = (t.reshape(-1).astype(np.int16) + 1).astype(np.uint8).reshape(n // I2S_BLOCK, 4, 32)
    out = np.zeros(i2s_nbytes(n), dtype=np.uint8)
    out[:n // 4] = ((c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]).reshape(-1)
    out[n // 4:n // 4 + 4] = np.frombuffer(np.float32(scale).astype("<f4").tobytes(), dtype=np.uint8)
    return out


def ternary_to_tq2_0(t: np.ndarray, scale: float) -> np.ndarray:
    """Ternary int8 [rows, cols] -> TQ2_0 bytes [rows, cols/256*66] via gguf's reference quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(t.astype(np.float32) * np.float32(scale), GGMLQuantizationType.TQ2_0)


def ternary_to_tq1_0(t: np.ndarray, scale: float) -> np.ndarray:
    """Ternary int8 [rows, cols] -> TQ1_0 bytes [rows, cols/256*54] via gguf's reference quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(t.astype(np.float32) * np.float32(scale), GGMLQuantizationType.TQ1_0)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bytes (uint8, last axis doubled), rounding to nearest even as ggml does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(np.asarray(x, dtype=np.float32), GGMLQuantizationType.BF16)
