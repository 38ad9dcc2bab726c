"""The CPU plugin's float kernels against the NumPy reference: the F16/F32 LM head, the int8 table's build,
attention over float32 and F16 caches, the softmax's exp, RMSNorm, rope and the FFN activation; each row's
result independent of its batch. Float sums taken in another order carry a stated tolerance; what the
reference stores (the int8 table, the KV cache's bits) is compared bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_support import REF, one_by_one, rel_err, rows_at

from bitnet.runtime.provider import KV_DTYPES
from bitnet.runtime.reference import Q8Table, q8_table
from bitnet_cpu import attention as attn
from bitnet_cpu import float_kernels as fk
from bitnet_cpu.provider import CpuProvider


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
# 116 columns: 3 whole steps of the row dot, 2 lane steps after them and 4 columns one by one
@pytest.mark.parametrize("vocab, dim, n", [(1, 320, 1), (1000, 320, 1), (1537, 320, 3), (700, 100, 6), (3, 7, 2),
                                           (513, 116, 1), (513, 116, 2), (513, 116, 5)])
def test_lm_head(cpu_float: CpuProvider, dtype: type, vocab: int, dim: int, n: int) -> None:
    rng = np.random.default_rng(vocab + n)
    table = rng.standard_normal((vocab, dim)).astype(dtype)
    table[0, :5] = [np.finfo(np.float16).tiny / 4, -0.0, 65504.0 / 512, 1e-7, -6e-8]  # F16 subnormals too
    x = rng.standard_normal((n, dim)).astype(np.float32)
    got = cpu_float.lm_head(x, cpu_float.upload_float(table))
    want = REF.lm_head(x, REF.upload_float(table))
    assert got.shape == (n, vocab) and rel_err(got, want) < 1e-5
    assert np.array_equal(cpu_float.argmax(got), REF.argmax(want))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_lm_head_at_either_width(dtype: type, lanes: int) -> None:
    # The head's row dots are a ymm wide on AVX2 hosts and a zmm on AVX-512 ones (isa.float_lanes): both widths
    # built here, whatever the host, against the reference and alone against in a batch. 116 columns: 3 whole
    # steps, 2 lane steps of 8 or 1 of 16, then 4 columns one by one; 7 tokens: passes of 4 and 3.
    import numba

    head = fk._make_head(dtype == np.float16, lanes)

    @numba.njit(parallel=True)
    def run(x: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
        head(x, table, 64, out)

    rng = np.random.default_rng(lanes)
    for vocab, dim in [(301, 116), (129, 512)]:
        table = rng.standard_normal((vocab, dim)).astype(dtype)
        bits = table.view(np.uint16) if dtype == np.float16 else table

        def logits(x: np.ndarray, bits: np.ndarray = bits) -> np.ndarray:
            out = np.empty((x.shape[0], bits.shape[0]), np.float32)
            run(x, bits, out)
            return out

        x = rng.standard_normal((7, dim)).astype(np.float32)
        got = logits(x)
        assert rel_err(got, REF.lm_head(x, REF.upload_float(table))) < 1e-5, (vocab, dim)
        np.testing.assert_array_equal(got, one_by_one(logits, x))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_q8_table_is_the_references(cpu_float: CpuProvider, dtype: type) -> None:
    # The numba build of the int8 table (F16 converted in registers) gives the reference's codes and scales.
    rng = np.random.default_rng(18)
    table = (rng.standard_normal((700, 320)) * 0.05).astype(dtype)
    table[3] = 0
    table[4, :4] = [6e-8, -6e-8, 1e-7, 0.0]  # F16 subnormals
    table[5, :2] = [1e-6, -2e-6]
    table[5, 2:] = 0
    table[6] = np.float16(0.0503)  # a row of one value: every code 127
    got, want = cpu_float.upload_q8(table), q8_table(table)
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_array_equal(got.scale, want.scale)
    assert got.q.ctypes.data % 64 == 0  # on cache lines: a table off them cost the int8 dot 8-10 %


def test_a_corrupt_q8_table_fails_the_check(cpu_float: CpuProvider) -> None:
    rng = np.random.default_rng(17)
    table = rng.standard_normal((300, 256)).astype(np.float16)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    t = q8_table(table)
    want = REF.lm_head_q8(x, t)
    scale, q = t.scale.copy(), t.q.copy()
    scale[123] *= np.float32(1 + 2 ** -20)  # a few ulps on one row's scale
    q[45, 67] += 1  # one code of one row
    for broken in (Q8Table(t.q, scale), Q8Table(q, t.scale)):
        with pytest.raises(AssertionError):
            np.testing.assert_array_equal(cpu_float.lm_head_q8(x, broken), want)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
def test_attention_prefill_then_decode(cpu_float: CpuProvider, kv_type: str) -> None:
    # Two sequences: slot 0 prefills and decodes alone, then slot 1 prefills in one batch beside
    # slot 0's next token; each reads only its own slot. Both caches hold the same bits (F16: rounded to
    # nearest even alike; q8: quantized alike), so the results differ only by the float sums' order.
    rng = np.random.default_rng(4)
    heads, kv_heads, hd = 8, 2, 64
    caches = (cpu_float.kv_cache(2, 40, kv_heads, hd, n_seqs=2, kv_type=kv_type),
              REF.kv_cache(2, 40, kv_heads, hd, n_seqs=2, kv_type=kv_type))
    assert caches[0].k.dtype == caches[1].k.dtype == KV_DTYPES.get(kv_type, np.int8)
    batches = [rows_at(0, 0, 7), rows_at(0, 7, 1), rows_at(0, 8, 1),
               tuple(np.concatenate(p) for p in zip(rows_at(0, 9, 1), rows_at(1, 0, 29), strict=True))]
    for slots, positions in batches:
        n = len(slots)
        q = rng.standard_normal((n, heads * hd)).astype(np.float32) * 3
        k = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
        v = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
        got = cpu_float.attention(q, k, v, caches[0], 1, slots, positions, heads, kv_heads, hd)
        want = REF.attention(q, k, v, caches[1], 1, slots, positions, heads, kv_heads, hd)
        assert rel_err(got, want) < 1e-5, (slots, positions)
        for mine, theirs in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            np.testing.assert_array_equal(mine.view(np.uint8), theirs.view(np.uint8))


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
def test_attention_over_a_long_row_with_head_and_column_tails(cpu_float: CpuProvider, kv_type: str) -> None:
    # 7 query heads per KV head (chunks of 4, 2 and 1), 124 columns (each chunk's widest value pass, then
    # narrower ones, then 4 single columns; 7 score steps of 16, then 12 single columns) and 2 * CHUNK + 150
    # positions (rows of one, two and three parts, each of blocks of the values pass, the last part-filled):
    # the reference's result, and a prefill's last rows are what decoding them gives.
    heads, kv_heads, hd, n = 14, 2, 124, 2 * attn.CHUNK + 150
    assert attn.CHUNK > 2 * attn._SUM_BLOCK
    rng = np.random.default_rng(9)
    q = rng.standard_normal((n, heads * hd)).astype(np.float32) * 3
    k = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
    v = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
    caches = [cpu_float.kv_cache(1, n, kv_heads, hd, kv_type=kv_type) for _ in range(2)]
    ref_cache = REF.kv_cache(1, n, kv_heads, hd, kv_type=kv_type)
    prefill = cpu_float.attention(q, k, v, caches[0], 0, *rows_at(0, 0, n), heads, kv_heads, hd)
    want = REF.attention(q, k, v, ref_cache, 0, *rows_at(0, 0, n), heads, kv_heads, hd)
    assert rel_err(prefill, want) < 1e-5
    cpu_float.attention(q[:n - 3], k[:n - 3], v[:n - 3], caches[1], 0, *rows_at(0, 0, n - 3), heads, kv_heads, hd)
    steps = [cpu_float.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], caches[1], 0, *rows_at(0, i, 1), heads,
                                 kv_heads, hd) for i in range(n - 3, n)]
    np.testing.assert_array_equal(np.concatenate(steps), prefill[n - 3:])


def test_softmax_exp_is_within_two_ulp() -> None:
    # Every float32 exponent the softmax meets (0 down to the clamp), and a shift by the row's maximum.
    x = np.concatenate([np.linspace(-87.0, 0.0, 400_001), -np.logspace(-8, 0, 1000)]).astype(np.float32) + 3
    got = x.copy()
    fk.exp_shifted(got, np.float32(3.0), np.empty(len(x), np.int32))
    want = np.exp((x - np.float32(3)).astype(np.float64))  # the float32 shift rounds first
    assert np.max(np.abs(got - want) / want) < 2 * 2.0**-24
    got = np.array([-1000.0, -np.inf], np.float32)  # far below the clamp: negligible, never NaN
    fk.exp_shifted(got, np.float32(0.0), np.empty(2, np.int32))
    assert np.all((got >= 0) & (got < 1e-37))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 256, 259])
def test_softmax_maximum_is_the_rows_maximum(n: int) -> None:
    # The softmax's shift: a wrong maximum would still give nearly the same weights (they shift out), so its own
    # check. Negative rows (the lanes must start below any score), the maximum in every lane and in the tail.
    rng = np.random.default_rng(n)
    lanes = np.empty(16, np.float32)
    for at in range(n):
        x = -np.abs(rng.standard_normal(n)).astype(np.float32) - 1
        x[at] = -0.5
        assert attn._largest(x, lanes) == np.float32(-0.5)


def test_silu_holds_at_any_magnitude(cpu_float: CpuProvider) -> None:
    # silu's exp(-g) is exp_shifted's: past its upper clamp (g < -88) the exponent bits would overflow.
    g = np.array([[-1e30, -200.0, -100.0, -88.5, -87.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 100.0, 1e30]], np.float32)
    with np.errstate(over="ignore"):  # the reference's exp(-g) overflows to inf there: silu -> -0
        want = REF.act_mul(g, np.ones_like(g), "silu")
    got = cpu_float.act_mul(g, np.ones_like(g), "silu")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-36)


# A kernel numba compiles for a caller's first call inherits the caller's error model, and the disk cache keeps
# that compile: act_mul under error_model="numpy" (as the layer stack's region) with fast-math's no-infs had
# vectorized g / (1 + inf) into a reciprocal estimate that gives NaN.
_SILU_IN_A_CALLER = """
import sys
import numpy as np
from numba import njit
from bitnet_cpu import float_kernels as fk

@njit(error_model="numpy")
def caller(g, u, out):
    fk.act_mul(g, u, False, out)

g = np.repeat(np.array([[-1e30, -200.0, -100.0, -88.5]], np.float32), 16, axis=1)  # whole vectors
out = np.empty_like(g)
caller(g, np.ones_like(g), out)
sys.exit(0 if np.all(out == 0) else f"silu {out[0].tolist()}")
"""


def test_silu_holds_whichever_caller_compiles_it_first(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", _SILU_IN_A_CALLER], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("n", [1, 5])
def test_elementwise_kernels(cpu_float: CpuProvider, n: int) -> None:
    rng = np.random.default_rng(5 + n)
    x = (rng.standard_normal((n, 384)) * 4).astype(np.float32)
    y = rng.standard_normal((n, 384)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 384).astype(np.float32)
    assert rel_err(cpu_float.rmsnorm(x, w, 1e-5), REF.rmsnorm(x, w, 1e-5)) < 1e-6
    positions = np.arange(1000, 1000 + 7 * n, 7, dtype=np.int32)
    assert rel_err(cpu_float.rope(x, 3, 128, positions, 500000.0), REF.rope(x, 3, 128, positions, 500000.0)) < 1e-6
    for act in ("silu", "relu2"):
        assert rel_err(cpu_float.act_mul(x, y, act), REF.act_mul(x, y, act)) < 1e-6
    np.testing.assert_array_equal(cpu_float.add(x, y), REF.add(x, y))


def test_rope_angles_follow_the_positions(cpu_float: CpuProvider) -> None:
    # The provider keeps the last angles (every layer turns by the same ones): other positions of the
    # same shape, or another theta, must not reuse them.
    x = np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32)
    for positions, theta in [([0, 5, 9], 1e4), ([1, 6, 10], 1e4), ([1, 6, 10], 5e5), ([0, 5, 9], 1e4)]:
        p = np.array(positions, np.int32)
        assert rel_err(cpu_float.rope(x, 2, 128, p, theta), REF.rope(x, 2, 128, p, theta)) < 1e-6


# -- batch invariance: a row's result never depends on the other rows of its batch ---------------------------

def test_float_kernels_are_batch_invariant(cpu_float: CpuProvider) -> None:
    cpu, rng = cpu_float, np.random.default_rng(15)
    x, y = rng.standard_normal((2, 7, 512)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    ops = {"rmsnorm": lambda r: cpu.rmsnorm(r, norm, 1e-5), "relu2": lambda r: cpu.act_mul(r, r * 0.5, "relu2"),
           "silu": lambda r: cpu.act_mul(r, r * 0.5, "silu")}
    for dtype in (np.float16, np.float32):
        # 1501 rows: a task of 477, so one row past the last two-row pass; 7 tokens: passes of 4 and 3
        table = cpu.upload_float(rng.standard_normal((1501, 512)).astype(dtype))
        ops[f"lm_head_{np.dtype(dtype).name}"] = lambda r, table=table: cpu.lm_head(r, table)
        ops[f"lm_head_{np.dtype(dtype).name}_pairs"] = lambda r, table=table: np.concatenate(
            [cpu.lm_head(r[i:i + 2], table) for i in range(0, r.shape[0], 2)])
        # 116 columns: 3 whole steps of the row dot, 2 lane steps after them and 4 summed one by one
        narrow = cpu.upload_float(rng.standard_normal((300, 116)).astype(dtype))
        ops[f"lm_head_{np.dtype(dtype).name}_116"] = lambda r, table=narrow: cpu.lm_head(r[:, :116], table)
    head_q8 = q8_table(rng.standard_normal((1500, 512)).astype(np.float16))
    ops["lm_head_q8"] = lambda r: cpu.lm_head_q8(r, head_q8)
    for name, op in ops.items():
        np.testing.assert_array_equal(op(x), one_by_one(op, x), err_msg=name)
    positions = np.arange(100, 107, dtype=np.int32)
    rope = [cpu.rope(x[i:i + 1], 4, 128, positions[i:i + 1], 10000.0) for i in range(7)]
    np.testing.assert_array_equal(cpu.rope(x, 4, 128, positions, 10000.0), np.concatenate(rope))
    # Attention: a prefill of 7 rows gives each row what 7 one-token steps give it, with or without
    # another sequence's rows in the same batch.
    caches = [cpu.kv_cache(1, 16, 2, 64, n_seqs=2) for _ in range(3)]
    q, k = x[:, :256], y[:, :128]
    batch = cpu.attention(q, k, k * 2, caches[0], 0, *rows_at(0, 0, 7), 4, 2, 64)
    steps = [cpu.attention(q[i:i + 1], k[i:i + 1], k[i:i + 1] * 2, caches[1], 0, *rows_at(0, i, 1), 4, 2, 64)
             for i in range(7)]
    np.testing.assert_array_equal(batch, np.concatenate(steps))
    slots, positions = (np.concatenate(p) for p in zip(rows_at(1, 0, 4), rows_at(0, 0, 7), strict=True))
    beside = cpu.attention(np.concatenate([q[:4] * 3, q]), np.concatenate([k[:4], k]),
                           np.concatenate([k[:4], k]) * 2, caches[2], 0, slots, positions, 4, 2, 64)
    np.testing.assert_array_equal(beside[4:], batch)


def test_silus_division_is_vector_code() -> None:
    # python's error model checks every float division for zero, which kept the loop scalar (silu 1.8x slower).
    import numba

    from bitnet_cpu import float_kernels as fk

    fresh = numba.njit(**{k: v for k, v in fk.act_mul.targetoptions.items() if k != "nopython"})(fk.act_mul.py_func)
    x = np.ones((1, 64), np.float32)
    fresh(x, x, False, np.empty_like(x))
    ir = next(iter(fresh.inspect_llvm().values()))
    assert re.search(r"fdiv (fast |contract )*<\d+ x float>", ir), "act_mul's silu division is scalar"
