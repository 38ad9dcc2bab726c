"""A decode step's tokens (one sequence's, or several sequences' together) through every layer in one parallel
region ("row" quantization, a scale per weight row): the CPU plugin's `layer_stack`.

A decode step had made 14 calls from Python a layer (RMSNorm, Q/K/V, two ropes, attention, sub-norm, wo, add;
RMSNorm, gate/up, act, sub-norm, down, add), five of them parallel loops. Here the threads enter one region for the
whole stack and hand the work on through atomic counters: no fork, join or Python between two projections.
- One region per layer half (session 38) had already made a 2-thread step on the Zen 5 EPYC 14.6-14.8 ms against
  15.9-16.6 as calls. Timestamps in that attention region showed where the rest of a half's 100 us went beside its
  two projections: 6-13 us before both threads were in (TBB's fork), 4 us in the join, 4-5 in Python around it.

This file is the second half of the per-level template `int_kernels`: `isa.build` runs it in the same module,
after int_kernels.py, so the names below that it does not define (the drivers `_row_sums`, `quantize_rowscale`,
`int8_rows`, `row_blocks`, RB, WIDE, CACHE, numba's `njit`/`prange`) are int_kernels'. It is not imported by name.
"""

# ruff: noqa: F821  (the names int_kernels.py defines in the same module)

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bitnet_cpu import atomics
from bitnet_cpu import attention as attn
from bitnet_cpu import float_kernels as fk
from bitnet_cpu import stack_phases as ph

_PART = 8  # int64s apart: each counter of `_claimed_tasks` on its own 64-byte line
# Bytes of its share of the next projection a waiting thread requests into L2 (`_wait_fetching`): half the smallest
# L2 measured (512 KB, Zen 1-3), beside what a step keeps there. On the Emerald Rapids Xeon (2 MB L2) 256 KB to
# 2 MB did the same, 64 KB half as much.
FETCH_BYTES = 256 * 1024
# Parts of its share a thread claims at a time for one token, so that a thread done early can take what another has
# not started (a thread alone claims all). A Zen 5's 2-thread decode step, projections: 5.37-5.42 ms claiming whole
# shares, 5.44-5.50 in 4 parts, 5.51-5.54 in 16, 6.31-6.34 task by task (64 rows each).
TOKEN_CLAIMS = 4


@njit(inline="always", cache=CACHE)
def _share(n_tasks: int, part: int, n_parts: int) -> tuple[int, int]:
    """The first and end task of part `part`'s contiguous share."""
    return part * n_tasks // n_parts, (part + 1) * n_tasks // n_parts


@njit(inline="always", cache=CACHE)
def token_tasks(tasks: np.ndarray, k0: int, k1: int, nb: int, bstride: int, q: np.ndarray, qtot: np.ndarray,
                s: np.ndarray, row_scale: np.ndarray, out: np.ndarray, isum: np.ndarray, sums: np.ndarray) -> None:
    """Tasks k0..k1 - 1 of matmul_rowscale for one token (q [1, cols]): each run of them whose rows follow each other
    in memory and in out goes through one loop of its rows' dots, then through rowscale_task's epilogue. sums [1, 1,
    the stack's height] holds row j's int32 sum at j. Task by task, each with its own epilogue, a Zen 5's one-thread
    decode step had taken 11.3-11.5 ms in its projections against 10.4-10.5 so."""
    st, qt = np.float64(s[0]), qtot[0]
    k = k0
    while k < k1:
        wstride = tasks[k, 1]
        at, o0, rows = tasks[k, 0] + tasks[k, 2] * wstride, tasks[k, 4] + tasks[k, 2], tasks[k, 3] - tasks[k, 2]
        k += 1
        while (k < k1 and tasks[k, 1] == wstride and tasks[k, 0] + tasks[k, 2] * wstride == at + rows * wstride
               and tasks[k, 4] + tasks[k, 2] == o0 + rows):
            rows += tasks[k, 3] - tasks[k, 2]
            k += 1
        _row_sums(at, wstride, 0, rows, nb, bstride, q.ctypes.data, q.strides[0], 1, isum, sums[:, :, o0:])
        # Indexed from 0, not from o0: an index LLVM cannot prove non-negative (numba wraps negative ones) had made
        # this loop gathers and scatters, 0.8 ms of a one-thread decode step on a Zen 5.
        o, total, scale = out[o0:o0 + rows], sums[0, 0, o0:o0 + rows], row_scale[o0:o0 + rows]
        for j in range(rows):
            o[j] = np.float32((np.float64(total[j]) - qt) * np.float64(scale[j]) / st)


@njit(cache=CACHE, error_model="numpy")
def _claimed_tasks(part: int, n_parts: int, ctrl: np.ndarray, base: int, tasks: np.ndarray, nb: int, bstride: int,
                   q: np.ndarray, qtot: np.ndarray, s: np.ndarray, row_scale: np.ndarray, out: np.ndarray, kb: int,
                   isum: np.ndarray, acc: np.ndarray, sums: np.ndarray) -> int:
    """Tasks of one BitLinear, claimed from this part's contiguous share first (each thread streams its own rows;
    tasks dealt alternately made two threads 1.25x slower than the calls), then from the others'. One token claims
    a share in TOKEN_CLAIMS parts (a thread alone all of it), each through `token_tasks`; more tokens one task at
    a time. Returns how many tasks this thread ran."""
    ran = 0
    one = q.shape[0] == 1
    for h in range(n_parts):
        share = (part + h) % n_parts
        lo, hi = _share(len(tasks), share, n_parts)
        step = max(1, -(-(hi - lo) // (1 if n_parts == 1 else TOKEN_CLAIMS))) if one else 1
        while True:
            k = lo + atomics.fetch_add(ctrl, base + _PART * share, step)
            if k >= hi:
                break
            end = min(hi, k + step)
            if one:
                token_tasks(tasks, k, end, nb, bstride, q, qtot, s, row_scale, out, isum, sums)
            else:
                rowscale_task(tasks, k, nb, bstride, q, qtot, s, row_scale, out, kb, isum, acc)
            ran += end - k
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
def _height(tasks: np.ndarray) -> int:
    """The rows of the stack a table's tasks cover, top row + 1 (a plain loop, as _counters)."""
    top = 0
    for k in range(len(tasks)):
        top = max(top, tasks[k, 4] + tasks[k, 3])
    return top


@njit(inline="always", cache=CACHE)
def _activations(n: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Room for n rows' quantized activations: codes, scales, block sums, their totals (float64, exact)."""
    nb = row_blocks(cols)
    return int8_rows(n, nb * RB), np.empty(n, np.float32), np.empty((n, nb), np.int32), np.empty(n, np.float64)


@njit(inline="always", cache=CACHE)
def _quantize(x: np.ndarray, rev: bool, q: np.ndarray, s: np.ndarray, qsum: np.ndarray, qtot: np.ndarray) -> None:
    """quantize_rowscale into room from _activations, and each row's total of its block sums."""
    quantize_rowscale(x, q, s, qsum, rev)
    row_totals(qsum, qtot)


@njit(inline="always", cache=CACHE)
def _wait(ctrl: np.ndarray, i: int) -> None:
    while atomics.load(ctrl, i) == 0:
        atomics.pause()


@njit(inline="always", cache=CACHE)
def _next_line(tasks: np.ndarray, hi: int, k: int, at: int, end: int) -> tuple[int, int, int, int]:
    """A step of a walk over the rows of tasks k..hi - 1, a 64-byte line at a time, from `at` (before `end`, the end
    of task k - 1's rows): the line's address, or -1 past the last task; then the walk's next k, at and end."""
    if at >= end:
        if k >= hi:
            return -1, k, at, end
        at, end = tasks[k, 0] + tasks[k, 2] * tasks[k, 1], tasks[k, 0] + tasks[k, 3] * tasks[k, 1]
        k += 1
    return at, k, at + 64, end


@njit(inline="always", cache=CACHE)
def _fetch_ahead(ctrl: np.ndarray, i: int, tasks: np.ndarray, part: int, n_parts: int, seen: np.ndarray) -> int:
    """Until ctrl[i] is raised, the first FETCH_BYTES of the rows this part starts the next projection on (`tasks`,
    its share) requested into L2, each line's address also kept in `seen` while it has room (the tests' record; the
    region keeps none). Returns how many lines it requested."""
    k, hi = _share(len(tasks), part, n_parts)
    at = end = 0
    for n in range(FETCH_BYTES // 64):
        line, k, at, end = _next_line(tasks, hi, k, at, end)
        if line < 0 or atomics.load(ctrl, i) != 0:
            return n
        fk.prefetch_keep(line)
        if n < len(seen):
            seen[n] = line
    return FETCH_BYTES // 64


@njit(inline="always", cache=CACHE)
def _wait_fetching(ctrl: np.ndarray, i: int, tasks: np.ndarray, part: int, n_parts: int, seen: np.ndarray) -> None:
    """_wait, meanwhile `_fetch_ahead`: a thread waiting on another's serial step leaves the memory bus idle. On the
    Emerald Rapids Xeon, 2 threads, steps with and without alternating in one process: the stack 21.71 -> 21.27
    ms at 128-160 positions (192 steps each), 22.45 -> 22.15 at 128-368 (144 steps)."""
    _fetch_ahead(ctrl, i, tasks, part, n_parts, seen)
    _wait(ctrl, i)


@njit(cache=CACHE)
def fetch_lines(tasks: np.ndarray, part: int, n_parts: int, raised: bool) -> np.ndarray:
    """The lines `_fetch_ahead` requests, in its order, when the flag stays down (a long wait) or is `raised` already
    (for the tests)."""
    seen = np.empty(2 * FETCH_BYTES // 64, np.int64)  # (room past the budget: a walk that overran it would show)
    return seen[:_fetch_ahead(np.full(1, int(raised), np.int64), 0, tasks, part, n_parts, seen)]


@njit(inline="always", cache=CACHE)
def _last(ctrl: np.ndarray, i: int, ran: int, total: int) -> bool:
    """Whether this thread, having run `ran` of a phase's `total` tasks, ran its last one (counted at ctrl[i])."""
    return ran > 0 and atomics.fetch_add(ctrl, i, ran) + ran == total


@njit(inline="always", cache=CACHE)
def _add(x: np.ndarray, y: np.ndarray) -> None:
    """x [n, width] += y (flat, [n, width]'s values), float32: the residual's add, in place (a plain loop, as
    _counters)."""
    n, width = x.shape
    for t in range(n):
        for i in range(width):
            x[t, i] += y[t * width + i]


# Each layer's counters, _PART int64s apart: phases done, flags ("the next phase's input is ready"), the next
# attention head; then the share counters of its four projections (Q/K/V, wo, gate/up, down), n_parts each.
_QKV_DONE, _KV_STORED, _HEADS_DONE, _WO_IN, _NEXT_HEAD, _WO_DONE, _GU_IN, _GU_DONE, _DOWN_IN, _DOWN_DONE = range(10)
_LAYER_OUT = 10  # the layer's output is in x and the next layer's Q/K/V input is ready
_SHARES = 11


@njit(cache=CACHE, error_model="numpy")
def _stack_part(part: int, n_parts: int, state: tuple) -> None:
    """One thread's way through layers_row_rowscale's layers: its arguments and buffers, grouped. A function of its
    own, called from the parallel loop: numba's parallel-loop passes over a body this size had compiled for 21 s
    (of a first run's 49 s on an empty kernel cache, 30 s now)."""
    ctrl, marks, (rows, height), weights, norms, dims, rope_cache, buffers, acts = state
    (qkv_tasks, qkv_bstride, qkv_scale, qkv_rev, wo_tasks, wo_bstride, wo_scale, wo_rev,
     gu_tasks, gu_bstride, gu_scale, gu_rev, d_tasks, d_bstride, d_scale, d_rev) = weights
    attn_norm, attn_sub, ffn_norm, ffn_sub, has_attn_sub, has_ffn_sub, eps, relu2 = norms
    q_rows, kv_rows, hidden, n_heads, n_kv_heads, head_dim, kb_dim, kb_q, kb_hidden = dims
    cos, sin, keys, values, width, slots, positions, att_tasks, part_o, part_top, part_den = rope_cache
    xs, h, qkv, q_roped, k_roped, a, a_normed, attended, gu, f, f_normed, down = buffers
    qd, sd, qsumd, qtotd, qo, so, qsumo, qtoto, qf, sf, qsumf, qtotf = acts
    (n, dim), n_layers = xs.shape, qkv_tasks.shape[0]
    per_layer = _PART * (_SHARES + 4 * n_parts)
    isum, acc = np.empty(2 * WIDE, np.int32), np.empty((WIDE, 1, rows), np.int32)
    sums = np.empty((1, 1, height), np.int32)  # (one token's, see token_tasks)
    no_record = np.empty(0, np.int64)  # (_fetch_ahead's record: none here)
    for layer in range(n_layers):
        m = marks[layer, part]
        m[0] = atomics.cycles()
        c = layer * per_layer
        share = c + _PART * _SHARES
        if layer > 0:
            _wait_fetching(ctrl, c - per_layer + _PART * _LAYER_OUT, qkv_tasks[layer], part, n_parts, no_record)
        m[ph.QKV] = atomics.cycles()
        ran = _claimed_tasks(part, n_parts, ctrl, share, qkv_tasks[layer], row_blocks(dim), qkv_bstride, qd,
                             qtotd, sd, qkv_scale[layer], qkv, kb_dim, isum, acc, sums)
        m[ph.QKV_DONE] = atomics.cycles()
        if _last(ctrl, c + _PART * _QKV_DONE, ran, len(qkv_tasks[layer])):
            k0, v0 = n * q_rows, n * (q_rows + kv_rows)
            fk.rope(qkv[:k0].reshape((n, q_rows)), n_heads, head_dim, cos, sin, q_roped)
            fk.rope(qkv[k0:v0].reshape((n, kv_rows)), n_kv_heads, head_dim, cos, sin, k_roped)
            attn.store_kv(k_roped, qkv[v0:].reshape((n, kv_rows)), keys[layer], values[layer], width, slots,
                          positions)
            atomics.store(ctrl, c + _PART * _KV_STORED, 1)
        m[ph.QKV_SERIAL] = atomics.cycles()
        _wait_fetching(ctrl, c + _PART * _KV_STORED, wo_tasks[layer], part, n_parts, no_record)
        m[ph.ATTEND] = atomics.cycles()
        ran = 0
        while True:
            task = atomics.fetch_add(ctrl, c + _PART * _NEXT_HEAD, 1)
            if task >= len(att_tasks):
                break
            attn.attend(task, att_tasks, q_roped, keys[layer], values[layer], width, slots, positions, n_heads, a,
                        part_o, part_top, part_den, n_parts)
            ran += 1
        m[ph.ATTEND_DONE] = atomics.cycles()
        if _last(ctrl, c + _PART * _HEADS_DONE, ran, len(att_tasks)):
            attn.combine(att_tasks, part_o, part_top, part_den, a)
            if has_attn_sub:
                fk.rmsnorm(a, attn_sub[layer], eps, a_normed)
            _quantize(a_normed, wo_rev, qo, so, qsumo, qtoto)
            atomics.store(ctrl, c + _PART * _WO_IN, 1)
        m[ph.ATTEND_SERIAL] = atomics.cycles()
        _wait_fetching(ctrl, c + _PART * _WO_IN, wo_tasks[layer], part, n_parts, no_record)
        m[ph.WO] = atomics.cycles()
        ran = _claimed_tasks(part, n_parts, ctrl, share + _PART * n_parts, wo_tasks[layer], row_blocks(q_rows),
                             wo_bstride, qo, qtoto, so, wo_scale[layer], attended, kb_q, isum, acc, sums)
        m[ph.WO_DONE] = atomics.cycles()
        if _last(ctrl, c + _PART * _WO_DONE, ran, len(wo_tasks[layer])):
            _add(xs, attended)
            fk.rmsnorm(xs, ffn_norm[layer], eps, h)
            _quantize(h, gu_rev, qd, sd, qsumd, qtotd)
            atomics.store(ctrl, c + _PART * _GU_IN, 1)
        m[ph.WO_SERIAL] = atomics.cycles()
        _wait_fetching(ctrl, c + _PART * _GU_IN, gu_tasks[layer], part, n_parts, no_record)
        m[ph.GATE_UP] = atomics.cycles()
        ran = _claimed_tasks(part, n_parts, ctrl, share + 2 * _PART * n_parts, gu_tasks[layer], row_blocks(dim),
                             gu_bstride, qd, qtotd, sd, gu_scale[layer], gu, kb_dim, isum, acc, sums)
        m[ph.GATE_UP_DONE] = atomics.cycles()
        if _last(ctrl, c + _PART * _GU_DONE, ran, len(gu_tasks[layer])):
            fk.act_mul(gu[:n * hidden].reshape((n, hidden)), gu[n * hidden:].reshape((n, hidden)), relu2, f)
            if has_ffn_sub:
                fk.rmsnorm(f, ffn_sub[layer], eps, f_normed)
            _quantize(f_normed, d_rev, qf, sf, qsumf, qtotf)
            atomics.store(ctrl, c + _PART * _DOWN_IN, 1)
        m[ph.GATE_UP_SERIAL] = atomics.cycles()
        _wait_fetching(ctrl, c + _PART * _DOWN_IN, d_tasks[layer], part, n_parts, no_record)
        m[ph.DOWN] = atomics.cycles()
        ran = _claimed_tasks(part, n_parts, ctrl, share + 3 * _PART * n_parts, d_tasks[layer], row_blocks(hidden),
                             d_bstride, qf, qtotf, sf, d_scale[layer], down, kb_hidden, isum, acc, sums)
        m[ph.DOWN_DONE] = atomics.cycles()
        if _last(ctrl, c + _PART * _DOWN_DONE, ran, len(d_tasks[layer])):
            _add(xs, down)
            if layer + 1 < n_layers:
                fk.rmsnorm(xs, attn_norm[layer + 1], eps, h)
                _quantize(h, qkv_rev, qd, sd, qsumd, qtotd)
            atomics.store(ctrl, c + _PART * _LAYER_OUT, 1)
        m[ph.DOWN_SERIAL] = atomics.cycles()


@njit(parallel=True, cache=CACHE, error_model="numpy")
def layers_row_rowscale(x: np.ndarray, attn_norm: np.ndarray, attn_sub: np.ndarray, ffn_norm: np.ndarray,
                        ffn_sub: np.ndarray, has_attn_sub: bool, has_ffn_sub: bool, eps: float, relu2: bool,
                        qkv_tasks: np.ndarray, qkv_bstride: int, qkv_scale: np.ndarray, qkv_rev: bool,
                        wo_tasks: np.ndarray, wo_bstride: int, wo_scale: np.ndarray, wo_rev: bool,
                        gu_tasks: np.ndarray, gu_bstride: int, gu_scale: np.ndarray, gu_rev: bool,
                        d_tasks: np.ndarray, d_bstride: int, d_scale: np.ndarray, d_rev: bool,
                        q_rows: int, kv_rows: int, hidden: int, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                        values: np.ndarray, width: int, slots: np.ndarray, positions: np.ndarray, n_heads: int,
                        n_kv_heads: int, head_dim: int, wide_bytes: int, n_parts: int, marks: np.ndarray) -> np.ndarray:
    """x [n, dim] (a few tokens, each of its slot and position) through every layer l: x += wo(sub_norm(attention(
    rope(q), rope(k), v))), q, k, v of rmsnorm(x, attn_norm[l]) (one stack, in that order), k and v stored in the
    cache's layer l first; then x += down(sub_norm(act(gate) * up)), gate and up of rmsnorm(x, ffn_norm[l]). The
    provider's operations in their order, to the bit. Per layer, a projection's arrays are [l] of these ([layers,
    tasks, 6] tasks, [layers, rows] scales); keys and values are the cache's bytes [layers, n_seqs, n_kv_heads,
    n_ctx, row bytes], its elements of `width` bytes (attention.cache_bytes). A task runs every token through its
    rows, as matmul_rowscale's (rowscale_task).

    n_parts threads enter one region. In each of a layer's five phases (Q/K/V's tasks, the attention tasks (a
    token and a KV head each, over up to attention.CHUNK positions), wo's tasks, gate/up's, down's) they claim
    tasks through counters (`_claimed_tasks`); whoever finishes a phase's last task does the serial step that
    follows (rope and the cache's stores; the parts of attention joined, sub-norm and wo's input; the residual
    add, RMSNorm and gate/up's input; act, sub-norm and down's input; the add and the next layer's input), then
    raises a flag the others wait on. A thread that arrives late finds less (or nothing) to claim, and one that
    never arrives is not waited for, so a busy co-tenant costs what it costs TBB's calls: a thread only waits
    for work another has claimed. Each buffer is rewritten only by a serial step after every task that read it
    is done. Each thread stamps its phase boundaries into marks [layers, n_parts, stack_phases.MARKS].
    """
    (n, dim), n_layers = x.shape, qkv_tasks.shape[0]
    xs, h = np.empty_like(x), np.empty_like(x)
    for t in range(n):  # (plain loops, as _counters)
        for i in range(dim):
            xs[t, i] = x[t, i]
    qd, sd, qsumd, qtotd = _activations(n, dim)  # Q/K/V's input, then gate/up's
    fk.rmsnorm(xs, attn_norm[0], eps, h)
    _quantize(h, qkv_rev, qd, sd, qsumd, qtotd)
    qkv = np.empty(n * (q_rows + 2 * kv_rows), np.float32)  # Q [n, q_rows], then K, then V (see int_kernels)
    q_roped, k_roped = np.empty((n, q_rows), np.float32), np.empty((n, kv_rows), np.float32)
    a = np.empty((n, q_rows), np.float32)
    a_normed = np.empty((n, q_rows), np.float32) if has_attn_sub else a
    qo, so, qsumo, qtoto = _activations(n, q_rows)
    attended = np.empty(n * dim, np.float32)
    gu = np.empty(n * 2 * hidden, np.float32)  # gate [n, hidden], then up
    f = np.empty((n, hidden), np.float32)
    f_normed = np.empty((n, hidden), np.float32) if has_ffn_sub else f
    qf, sf, qsumf, qtotf = _activations(n, hidden)
    down = np.empty(n * dim, np.float32)
    kb_dim, kb_q = column_blocks(row_blocks(dim), wide_bytes), column_blocks(row_blocks(q_rows), wide_bytes)
    kb_hidden = column_blocks(row_blocks(hidden), wide_bytes)
    per_layer = _PART * (_SHARES + 4 * n_parts)
    ctrl = _counters(per_layer * n_layers)
    rows = max(_most_rows(qkv_tasks[0], wo_tasks[0]), _most_rows(gu_tasks[0], d_tasks[0]))
    height = max(_height(qkv_tasks[0]), _height(wo_tasks[0]), _height(gu_tasks[0]), _height(d_tasks[0]))
    att_tasks = attn.attention_tasks(positions, n_kv_heads)
    part_o, part_top, part_den = attn.part_buffers(att_tasks, n_heads // n_kv_heads, head_dim)
    # (A tuple holding arrays cannot enter numba's parallel loop: rebuilt inside. The index as int64: numba types a
    # parallel loop's index signed before it makes the loop and unsigned in the loop's body, and had compiled
    # _stack_part for both, 14 of the region's 55 s on a Zen 5.)
    for part in prange(n_parts):
        _stack_part(np.int64(part), n_parts, (
            ctrl, marks, (rows, height),
            (qkv_tasks, qkv_bstride, qkv_scale, qkv_rev, wo_tasks, wo_bstride, wo_scale, wo_rev,
             gu_tasks, gu_bstride, gu_scale, gu_rev, d_tasks, d_bstride, d_scale, d_rev),
            (attn_norm, attn_sub, ffn_norm, ffn_sub, has_attn_sub, has_ffn_sub, eps, relu2),
            (q_rows, kv_rows, hidden, n_heads, n_kv_heads, head_dim, kb_dim, kb_q, kb_hidden),
            (cos, sin, keys, values, width, slots, positions, att_tasks, part_o, part_top, part_den),
            (xs, h, qkv, q_roped, k_roped, a, a_normed, attended, gu, f, f_normed, down),
            (qd, sd, qsumd, qtotd, qo, so, qsumo, qtoto, qf, sf, qsumf, qtotf)))
    return xs
