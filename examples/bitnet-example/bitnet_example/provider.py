"""The example backend's one kernel: the ternary matrix product, in NumPy.

Handles are NumPy arrays, so KernelProvider's default memory methods (host arrays) already
fit; only `upload_ternary` is overridden, to unpack the weights once. Every operation other
than `bitlinear` runs on the host through core's reference and is counted as a fallback.
The arithmetic follows the contract in KernelProvider.bitlinear's docstring: quantize in
float32, sum the integer products exactly per 256-value block, apply the scales in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import bitnet

BLOCK = 256


class ExampleProvider(bitnet.KernelProvider):
    def upload_ternary(self, w: Any) -> tuple[np.ndarray, np.ndarray]:
        # Value e of a 256-block sits in byte 32*(e//128) + e%32 at bit shift 2*((e%128)//32);
        # code c means c - 1. Unpacked once to float32 [blocks, 256, rows] for BLAS (16 times the
        # packed size: fine for an example, not for a large model).
        codes = w.packed().reshape(w.rows, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        t = (codes & 3).astype(np.float32).reshape(w.rows, w.cols // BLOCK, BLOCK) - 1
        return np.ascontiguousarray(t.transpose(1, 2, 0)), w.scales.astype(np.float64)

    def bitlinear(self, x: Any, w: tuple[np.ndarray, np.ndarray], act_quant: str) -> np.ndarray:
        self.record("example.bitlinear")
        t, scales = w
        x = np.asarray(x, dtype=np.float32)
        xb = x.reshape(x.shape[0], t.shape[0], BLOCK)
        if act_quant == "none":
            sums = np.matmul(xb.astype(np.float64).transpose(1, 0, 2), t)  # [blocks, n, rows]
            return np.einsum("bnr,rb->nr", sums, scales).astype(np.float32)
        if act_quant == "row":  # one scale s per row: q = rint(x * s), y = sum(q * t) * scale / s
            amax = np.abs(x).max(axis=1)
            s = np.float32(127) / np.where(amax > 0, amax, np.float32(127))
            q = np.clip(np.rint(xb * s[:, None, None]), -128, 127)
            sums = np.matmul(q.transpose(1, 0, 2), t)  # integers below 2**24: exact in float32
            return (np.einsum("bnr,rb->nr", sums.astype(np.float64), scales) / s[:, None]).astype(np.float32)
        if act_quant == "block256":  # llama.cpp's Q8_K: iscale = -127 / (the first value of largest magnitude)
            v = np.take_along_axis(xb, np.abs(xb).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
            iscale = np.float32(-127) / np.where(v != 0, v, np.float32(1))
            q = np.clip(np.rint(xb * iscale[:, :, None]), -128, 127) * (v != 0)[:, :, None]
            d = np.where(v != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float64)
            sums = np.matmul(q.transpose(1, 0, 2), t).astype(np.float64)
            return np.einsum("bnr,rb,nb->nr", sums, scales, d).astype(np.float32)
        raise ValueError(f"unknown activation quantization {act_quant!r}")
