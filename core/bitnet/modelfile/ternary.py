"""The one in-memory layout of ternary weights that every kernel provider receives.

Rows of 256-value blocks. Each block is 64 bytes laid out as TQ2_0's `qs`: value e of a
block sits in byte 32*(e//128) + e%32 at bit shift 2*((e%128)//32); code c in {0,1,2}
means c-1. A TQ2_0 tensor therefore is this layout once its per-block `d` is dropped (kept
in `scales`), and I2_S is this layout with the four codes of each byte in reverse order
(`fields_reversed`): both are used in place, and `packed()` gives canonical bytes.

Any width: a matrix whose files rows are not a multiple of 256 (1bitLLM 3B: 3200, 8640) is held
zero-extended to whole blocks, and bitlinear zero-extends its input rows to `cols` the same way
(`zero_extend`). Zero columns add nothing to a row's sum or to its largest magnitude, so every
activation mode gives the unpadded result exactly, and the kernels keep whole 256-blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 256
BYTES_PER_BLOCK = BLOCK // 4


@dataclass(frozen=True)
class TernaryMatrix:
    """A [rows, cols] ternary matrix: value = (code - 1) * scales[row, col // 256].

    `codes` holds the code bytes either as uint8 [rows, cols // 4] or as blocks, uint8
    [rows, cols // 256, 64]: the blocks form lets a TQ2_0 tensor stay in the memory-mapped
    file as a strided view (its blocks are 66 bytes apart), with no copy. `blocks()` is a view
    of either form, in the weight's own field order; `packed()` is contiguous canonical bytes
    [rows, cols // 4] (a copy unless the codes already are exactly that).
    """

    codes: np.ndarray
    scales: np.ndarray  # float32 [rows, cols // 256]; a read-only broadcast when one scale serves the tensor
    fields_reversed: bool = False  # I2_S order: each byte's four codes at shifts 6, 4, 2, 0

    def __post_init__(self) -> None:
        c = self.codes
        width = c.shape[1] * (4 if c.ndim == 2 else BLOCK) if c.ndim in (2, 3) else -1
        if c.dtype != np.uint8 or width < 0 or (c.ndim == 3 and c.shape[2] != BYTES_PER_BLOCK) \
                or self.scales.shape != (c.shape[0], width // BLOCK):
            raise ValueError(f"TernaryMatrix needs uint8 codes [rows, cols/4] or [rows, cols/256, 64] and "
                             f"scales [rows, cols/256]; got {c.dtype} {c.shape} and {self.scales.shape}")

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.scales.shape[1]) * BLOCK

    def blocks(self) -> np.ndarray:
        """uint8 [rows, cols // 256, 64], a view (strided when the codes stay in the file)."""
        return self.codes if self.codes.ndim == 3 else self.codes.reshape(self.rows, -1, BYTES_PER_BLOCK)

    def packed(self) -> np.ndarray:
        """Contiguous canonical uint8 [rows, cols // 4]."""
        codes = np.ascontiguousarray(self.blocks()).reshape(self.rows, self.cols // 4)
        return reverse_fields(codes) if self.fields_reversed else codes

    @property
    def row_scales(self) -> np.ndarray | None:
        """One scale per row when every block of the row shares it, else None."""
        if self.scales.strides[1] == 0:  # a broadcast: a row's blocks share its scale by construction
            return np.ascontiguousarray(self.scales[:, 0])
        first = self.scales[:, :1]
        return first[:, 0].copy() if bool((self.scales == first).all()) else None

    def values(self) -> np.ndarray:
        """The ternary values t in {-1, 0, 1} as int8 [rows, cols] (tests and reference only)."""
        return unpack_codes(self.packed())

    def dequantize(self) -> np.ndarray:
        """Float32 [rows, cols]: t times its block scale (tests and reference only)."""
        t = self.values().astype(np.float32).reshape(self.rows, -1, BLOCK)
        return (t * self.scales[:, :, None]).reshape(self.rows, self.cols)


def pack_values(t: np.ndarray) -> np.ndarray:
    """int8 [rows, cols] in {-1,0,1} -> uint8 codes [rows, cols // 4] in the canonical layout."""
    rows, cols = t.shape
    if cols % BLOCK:
        raise ValueError(f"ternary rows need a multiple of {BLOCK} columns, got {cols}")
    c = (t.astype(np.int16) + 1).astype(np.uint8).reshape(rows, cols // 128, 4, 32)
    packed = c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)
    return packed.reshape(rows, cols // 4)


_LOW2 = np.uint64(0x0303030303030303)
_HIGH2 = np.uint64(0x0C0C0C0C0C0C0C0C)


def reverse_fields(codes: np.ndarray) -> np.ndarray:
    """A copy of uint8 `codes` (a multiple of 8 bytes) with the four 2-bit fields of every byte
    in reverse order, eight bytes per operation (2.5x faster than a 256-entry table)."""
    x = np.ascontiguousarray(codes).view(np.uint64)
    two, six = np.uint64(2), np.uint64(6)
    out = ((x & _LOW2) << six) | ((x & _HIGH2) << two) | ((x >> two) & _HIGH2) | ((x >> six) & _LOW2)
    return out.view(np.uint8).reshape(codes.shape)


def unpack_codes(codes: np.ndarray) -> np.ndarray:
    """Inverse of pack_values."""
    rows, nbytes = codes.shape
    q = codes.reshape(rows, nbytes // 32, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    c = (q >> shifts) & 3
    return (c.astype(np.int8) - 1).reshape(rows, nbytes * 4)


def zero_extend(x: np.ndarray, cols: int) -> np.ndarray:
    """Rows of x [n, width <= cols] with zero columns appended up to cols (x itself when already that wide)."""
    if x.shape[1] == cols:
        return x
    if x.shape[1] > cols:
        raise ValueError(f"input width {x.shape[1]} exceeds the weight's {cols} columns")
    out = np.zeros((x.shape[0], cols), dtype=x.dtype)
    out[:, :x.shape[1]] = x
    return out


def from_values(t: np.ndarray, scale: float | np.ndarray) -> TernaryMatrix:
    """A TernaryMatrix from int8 values and a per-tensor, per-row or per-block scale; any number of
    columns (zero-extended to whole 256-blocks)."""
    t = zero_extend(t, -(-t.shape[1] // BLOCK) * BLOCK)
    rows, cols = t.shape
    scales = np.broadcast_to(np.asarray(scale, dtype=np.float32).reshape(-1, 1) if np.ndim(scale) == 1
                             else np.asarray(scale, dtype=np.float32), (rows, cols // BLOCK))
    return TernaryMatrix(pack_values(t), np.ascontiguousarray(scales))
