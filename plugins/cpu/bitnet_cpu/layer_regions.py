"""One decode token's layer halves, each in one parallel region ("row" quantization, a scale per weight row):
the CPU plugin's `ffn` and `attention_block`.

A decode step made 14 calls from Python a layer (RMSNorm, Q/K/V, two ropes, attention, sub-norm, wo, add; RMSNorm,
gate/up, act, sub-norm, down, add), five of them parallel loops; here each half's threads stay in one region and
hand the work on through atomic counters. On the Zen 5 EPYC, 30 layers' FFN took 6.25 ms against 7.35 as calls on
2 threads, 10.4 against 11.7 on 1; a decode step with both halves 14.6-14.8 ms against 15.9-16.6 on 2 threads.

This file is the second half of the per-level template `int_kernels`: `isa.build` runs it in the same module,
after int_kernels.py, so the names below that it does not define (the drivers `_row_sums`, `quantize_rows`,
`int8_rows`, BLOCK, WIDE, CACHE, numba's `njit`/`prange`) are int_kernels'. It is not imported by name.
"""

# ruff: noqa: F821  (the names int_kernels.py defines in the same module)

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bitnet_cpu import atomics
from bitnet_cpu import attention as attn
from bitnet_cpu import float_kernels as fk

_PART = 8  # int64s apart: each counter of `_claimed_tasks` on its own 64-byte line


@njit(inline="always", cache=CACHE, error_model="numpy")
def _one_task(tasks: np.ndarray, k: int, nb: int, bstride: int, q: np.ndarray, qtot: float, s: np.ndarray,
              row_scale: np.ndarray, out: np.ndarray, isum: np.ndarray, acc: np.ndarray) -> None:
    """One task of one token's BitLinear into out: matmul_rowscale's sums and epilogue for n = 1."""
    w0, wstride, r0, r1, first = tasks[k, 0], tasks[k, 1], tasks[k, 2], tasks[k, 3], tasks[k, 4]
    _row_sums(w0, wstride, r0, r1, nb, bstride, q.ctypes.data, q.strides[0], 1, isum, acc)
    o, scale, st = out[first + r0:first + r1], row_scale[first + r0:first + r1], np.float64(s[0])
    for j in range(r1 - r0):
        o[j] = np.float32((np.float64(acc[0, 0, j]) - qtot) * np.float64(scale[j]) / st)


@njit(inline="always", cache=CACHE, error_model="numpy")
def _claimed_tasks(part: int, n_parts: int, ctrl: np.ndarray, base: int, tasks: np.ndarray, nb: int, bstride: int,
                   q: np.ndarray, qtot: float, s: np.ndarray, row_scale: np.ndarray, out: np.ndarray,
                   isum: np.ndarray, acc: np.ndarray) -> int:
    """Tasks of one BitLinear, claimed one at a time: first from this part's contiguous share (each thread
    streams its own rows; tasks dealt alternately made two threads 1.25x slower than the calls), then from the
    others'. Returns how many this thread ran."""
    ran = 0
    for h in range(n_parts):
        share = (part + h) % n_parts
        lo, hi = share * len(tasks) // n_parts, (share + 1) * len(tasks) // n_parts
        while True:
            k = lo + atomics.fetch_add(ctrl, base + _PART * share, 1)
            if k >= hi:
                break
            _one_task(tasks, k, nb, bstride, q, qtot, s, row_scale, out, isum, acc)
            ran += 1
    return ran


@njit(inline="always", cache=CACHE)
def _counters(n: int) -> np.ndarray:
    """n zeroed int64s. (A plain loop, not np.zeros or an array expression: parallel=True makes each of those a
    parallel loop of its own, a fork and a join more; three of them had cost the FFN region more than it saved.)"""
    ctrl = np.empty(n, np.int64)
    for i in range(n):
        ctrl[i] = 0
    return ctrl


@njit(inline="always", cache=CACHE)
def _most_rows(a: np.ndarray, b: np.ndarray) -> int:
    """The most rows a task of either table has (a plain loop, as _counters)."""
    rows = 0
    for tasks in (a, b):
        for k in range(len(tasks)):
            rows = max(rows, tasks[k, 3] - tasks[k, 2])
    return rows


@njit(inline="always", cache=CACHE)
def _activations(cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Room for one row's quantized activations: codes, scale, block sums, their total (float64, exact)."""
    return int8_rows(1, cols), np.empty(1, np.float32), np.empty((1, cols // BLOCK), np.int32), np.empty(1, np.float64)


@njit(inline="always", cache=CACHE)
def _quantize(x: np.ndarray, rev: bool, q: np.ndarray, s: np.ndarray, qsum: np.ndarray, qtot: np.ndarray) -> None:
    """quantize_rows of one row into room from _activations, and the total of its block sums."""
    quantize_rows(x, q, s, qsum, rev)
    total = 0
    for b in range(x.shape[1] // BLOCK):
        total += qsum[0, b]
    qtot[0] = total


@njit(inline="always", cache=CACHE)
def _plus(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x [1, n] + y [n], float32: the residual's add (a plain loop, as _counters)."""
    out = np.empty_like(x)
    for i in range(x.shape[1]):
        out[0, i] = x[0, i] + y[i]
    return out


@njit(parallel=True, cache=CACHE, error_model="numpy")
def ffn_row_rowscale(x: np.ndarray, norm: np.ndarray, sub_norm: np.ndarray, has_sub: bool, eps: float, relu2: bool,
                     gu_tasks: np.ndarray, gu_bstride: int, gu_scale: np.ndarray, gu_rev: bool, hidden: int,
                     d_tasks: np.ndarray, d_bstride: int, d_scale: np.ndarray, d_rev: bool,
                     n_parts: int) -> np.ndarray:
    """x [1, dim] + down(sub_norm(act(gate) * up)), gate and up of rmsnorm(x, norm): the provider's calls'
    operations in their order, to the bit. gate/up is one stack (gate's `hidden` rows, then up's).

    n_parts threads enter one region. Each claims gate/up tasks (`_claimed_tasks`); whoever finishes the last
    one computes the activation, the sub-norm and the down projection's quantized input, then raises a
    flag the others wait on, and all claim the down tasks. A thread that arrives late finds less (or
    nothing) to claim, and one that never arrives is not waited for, so a busy co-tenant costs what it
    costs TBB's calls: a thread only waits for work another has claimed.
    """
    dim = x.shape[1]
    m = np.empty_like(x)
    fk.rmsnorm(x, norm, eps, m)
    q1, s1, qsum1, qtot1 = _activations(dim)
    _quantize(m, gu_rev, q1, s1, qsum1, qtot1)
    gu, f = np.empty(2 * hidden, np.float32), np.empty((1, hidden), np.float32)
    normed = np.empty((1, hidden), np.float32) if has_sub else f
    q2, s2, qsum2, qtot2 = _activations(hidden)
    down = np.empty(dim, np.float32)
    # [0]: gate/up tasks done; [_PART]: the down projection's input is ready; then each share's next task.
    ctrl = _counters(_PART * (2 + 2 * n_parts))
    gu_base, d_base = 2 * _PART, (2 + n_parts) * _PART
    rows = _most_rows(gu_tasks, d_tasks)
    for part in prange(n_parts):
        isum, acc = np.empty(2 * WIDE, np.int32), np.empty((WIDE, 1, rows), np.int32)
        ran = _claimed_tasks(part, n_parts, ctrl, gu_base, gu_tasks, dim // BLOCK, gu_bstride, q1, qtot1[0],
                         s1, gu_scale, gu, isum, acc)
        if ran and atomics.fetch_add(ctrl, 0, ran) + ran == len(gu_tasks):
            fk.act_mul(gu[:hidden].reshape((1, hidden)), gu[hidden:].reshape((1, hidden)), relu2, f)
            if has_sub:
                fk.rmsnorm(f, sub_norm, eps, normed)
            _quantize(normed, d_rev, q2, s2, qsum2, qtot2)
            atomics.store(ctrl, _PART, 1)
        while atomics.load(ctrl, _PART) == 0:
            atomics.pause()
        _claimed_tasks(part, n_parts, ctrl, d_base, d_tasks, hidden // BLOCK, d_bstride, q2, qtot2[0], s2, d_scale,
                   down, isum, acc)
    return _plus(x, down)


@njit(parallel=True, cache=CACHE, error_model="numpy")
def attention_row_rowscale(x: np.ndarray, norm: np.ndarray, sub_norm: np.ndarray, has_sub: bool, eps: float,
                           qkv_tasks: np.ndarray, qkv_bstride: int, qkv_scale: np.ndarray, qkv_rev: bool, q_rows: int,
                           kv_rows: int, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray, values: np.ndarray,
                           slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int,
                           wo_tasks: np.ndarray, wo_bstride: int, wo_scale: np.ndarray, wo_rev: bool,
                           n_parts: int) -> np.ndarray:
    """x [1, dim] + wo(sub_norm(attention(rope(q), rope(k), v))), q, k, v of rmsnorm(x, norm) (one stack, in that
    order), k and v stored in the cache at the token's position first: the provider's calls' operations in their
    order, to the bit, in one parallel region as ffn_row_rowscale's (three phases: Q/K/V's tasks, the KV heads'
    attention tasks, wo's; between them whoever finishes a phase's last task does the rope and the cache's
    stores, then the sub-norm and wo's quantized input)."""
    dim = x.shape[1]
    h = np.empty_like(x)
    fk.rmsnorm(x, norm, eps, h)
    q1, s1, qsum1, qtot1 = _activations(dim)
    _quantize(h, qkv_rev, q1, s1, qsum1, qtot1)
    qkv = np.empty(q_rows + 2 * kv_rows, np.float32)
    q_roped, k_roped = np.empty((1, q_rows), np.float32), np.empty((1, kv_rows), np.float32)
    a = np.empty((1, q_rows), np.float32)
    normed = np.empty((1, q_rows), np.float32) if has_sub else a
    q2, s2, qsum2, qtot2 = _activations(q_rows)
    attended = np.empty(dim, np.float32)
    # [0] Q/K/V tasks done, [_PART] K, V stored; [2 _PART] heads done, [3 _PART] wo's input ready; [4 _PART] the
    # next head; then each share's next Q/K/V task, then wo's.
    ctrl = _counters(_PART * (5 + 2 * n_parts))
    qkv_base, wo_base = 5 * _PART, (5 + n_parts) * _PART
    rows = _most_rows(qkv_tasks, wo_tasks)
    for part in prange(n_parts):
        isum, acc = np.empty(2 * WIDE, np.int32), np.empty((WIDE, 1, rows), np.int32)
        ran = _claimed_tasks(part, n_parts, ctrl, qkv_base, qkv_tasks, dim // BLOCK, qkv_bstride, q1, qtot1[0], s1,
                         qkv_scale, qkv, isum, acc)
        if ran and atomics.fetch_add(ctrl, 0, ran) + ran == len(qkv_tasks):
            fk.rope(qkv[:q_rows].reshape((1, q_rows)), n_heads, head_dim, cos, sin, q_roped)
            fk.rope(qkv[q_rows:q_rows + kv_rows].reshape((1, kv_rows)), n_kv_heads, head_dim, cos, sin, k_roped)
            attn.store_kv(k_roped, qkv[q_rows + kv_rows:].reshape((1, kv_rows)), keys, values, slots, positions)
            atomics.store(ctrl, _PART, 1)
        while atomics.load(ctrl, _PART) == 0:
            atomics.pause()
        ran = 0
        while True:
            head = atomics.fetch_add(ctrl, 4 * _PART, 1)
            if head >= n_kv_heads:
                break
            attn.attend(head, q_roped, keys, values, slots, positions, n_heads, a)
            ran += 1
        if ran and atomics.fetch_add(ctrl, 2 * _PART, ran) + ran == n_kv_heads:
            if has_sub:
                fk.rmsnorm(a, sub_norm, eps, normed)
            _quantize(normed, wo_rev, q2, s2, qsum2, qtot2)
            atomics.store(ctrl, 3 * _PART, 1)
        while atomics.load(ctrl, 3 * _PART) == 0:
            atomics.pause()
        _claimed_tasks(part, n_parts, ctrl, wo_base, wo_tasks, q_rows // BLOCK, wo_bstride, q2, qtot2[0], s2, wo_scale,
                   attended, isum, acc)
    return _plus(x, attended)
