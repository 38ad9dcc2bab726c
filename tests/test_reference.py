"""The reference provider against formulas written from docs/design.md, and the CPU provider against it."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet.errors import UsageError
from bitnet.modelfile.ternary import TernaryMatrix, from_values
from bitnet.runtime.reference import ReferenceProvider, q8_table
from bitnet_cpu.provider import CpuProvider

MODES = ("row", "block256", "none")


def ternary(rng: np.random.Generator, rows: int, cols: int, scales: str) -> TernaryMatrix:
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    if scales == "tensor":
        return from_values(t, 0.75)
    if scales == "row":
        return from_values(t, rng.uniform(0.1, 2.0, rows).astype(np.float32))
    return from_values(t, rng.uniform(0.1, 2.0, (rows, cols // 256)).astype(np.float32))


def bitlinear_spec(x: np.ndarray, w: TernaryMatrix, act_quant: str) -> np.ndarray:
    """docs/design.md section 4 / 5b, one row and one block at a time, float64 after quantizing."""
    t, d_w = w.values().astype(np.int64), w.scales.astype(np.float64)
    out = np.zeros((x.shape[0], w.rows))
    for i, row in enumerate(x.astype(np.float32)):
        if act_quant == "none":
            out[i] = row.astype(np.float64) @ w.dequantize().astype(np.float64).T
            continue
        if act_quant == "row":
            amax = np.float32(np.max(np.abs(row)))
            s = np.float32(127) / amax if amax > 0 else np.float32(1)
            q = np.clip(np.rint(row * s), -128, 127).astype(np.int64)
        for b in range(w.cols // 256):
            blk = slice(256 * b, 256 * (b + 1))
            if act_quant == "row":
                out[i] += (t[:, blk] @ q[blk]) * d_w[:, b] / float(s)
            else:
                v = row[blk][np.argmax(np.abs(row[blk]))]
                if v == 0:
                    continue
                iscale = np.float32(-127) / v
                qb = np.clip(np.rint(row[blk] * iscale), -128, 127).astype(np.int64)
                out[i] += (t[:, blk] @ qb) * d_w[:, b] * float(np.float32(1) / iscale)
    return out


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("act_quant", MODES)
def test_bitlinear_matches_spec(act_quant: str, scales: str) -> None:
    rng = np.random.default_rng(1)
    w = ternary(rng, 48, 768, scales)
    x = rng.standard_normal((5, 768)).astype(np.float32) * np.float32(3)
    x[2] = 0  # an all-zero row must give zeros, not NaN
    x[3, 256:512] = 0  # an all-zero block (Q8_K's d = 0)
    p = ReferenceProvider()
    y = p.bitlinear(x, p.upload_ternary(w), act_quant)
    assert y.dtype == np.float32 and y.shape == (5, 48)
    np.testing.assert_allclose(y, bitlinear_spec(x, w, act_quant), rtol=1e-6, atol=1e-6)
    assert np.all(y[2] == 0)
    assert p.dispatches["ref.bitlinear"] == 1


def identity(n: int) -> TernaryMatrix:
    return from_values(np.eye(n, dtype=np.int8), 1.0)


def test_row_quantization_rounds_half_to_even() -> None:
    # max|x| = 127 makes s = 1, so x * s lands exactly on .5; an identity W returns q / s = q.
    x = np.zeros((1, 256), np.float32)
    x[0, :8] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]
    p = ReferenceProvider()
    y = p.bitlinear(x, p.upload_ternary(identity(256)), "row")
    assert y[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 3]


def test_row_quantization_scale() -> None:
    # s = 127 / 2 = 63.5: 1.0 -> 63.5 -> 64 (even); 0.5 -> 31.75 -> 32; y = q / s.
    x = np.zeros((1, 256), np.float32)
    x[0, :3] = [2.0, 1.0, 0.5]
    p = ReferenceProvider()
    y = p.bitlinear(x, p.upload_ternary(identity(256)), "row")
    np.testing.assert_allclose(y[0, :3], np.array([127, 64, 32]) / 63.5, rtol=1e-7)


@pytest.mark.parametrize("peak", [127.0, -127.0])
def test_q8k_quantization_rounds_half_to_even(peak: float) -> None:
    # v = +-127 makes iscale = -+1 and d = 1 / iscale, so each block returns rint(x) exactly.
    x = np.zeros((1, 512), np.float32)
    x[0, :7] = [peak, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5]
    x[0, 256:259] = [-4.0, 1.0, 2.5]  # second block: v = -4, iscale = 31.75, 2.5 * 31.75 = 79.375 -> 79
    p = ReferenceProvider()
    y = p.bitlinear(x, p.upload_ternary(identity(512)), "block256")
    assert y[0, :7].tolist() == [peak, 0, 2, 2, 0, -2, 126]
    np.testing.assert_allclose(y[0, 256:259], np.array([-127, 32, 79]) / 31.75, rtol=1e-7)


def test_bitlinear_rejects_unknown_mode() -> None:
    p = ReferenceProvider()
    with pytest.raises(UsageError):
        p.bitlinear(np.ones((1, 256), np.float32), p.upload_ternary(identity(256)), "int4")


def test_rope_neox_matches_formula() -> None:
    rng = np.random.default_rng(2)
    n, heads, hd, pos0, theta = 3, 2, 8, 5, 10000.0
    x = rng.standard_normal((n, heads * hd)).astype(np.float32)
    positions = np.array([pos0, 40, pos0 + 2], np.int32)  # any position per row
    y = ReferenceProvider().rope(x, heads, hd, positions, theta)
    want = np.zeros((n, heads * hd))
    for i in range(n):
        for h in range(heads):
            for j in range(hd // 2):
                a, b = x[i, h * hd + j], x[i, h * hd + j + hd // 2]
                ang = positions[i] * theta ** (-2 * j / hd)
                want[i, h * hd + j] = a * np.cos(ang) - b * np.sin(ang)
                want[i, h * hd + j + hd // 2] = a * np.sin(ang) + b * np.cos(ang)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def seq(pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots and positions of n rows of one sequence in slot 0 from position pos0."""
    return np.zeros(n, np.int32), np.arange(pos0, pos0 + n, dtype=np.int32)


def attention_naive(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, pos0: int, n_heads: int,
                    n_kv: int, hd: int) -> np.ndarray:
    """Row i attends to positions 0..pos0+i; query head h reads KV head h // (n_heads // n_kv)."""
    out = np.zeros((q.shape[0], n_heads * hd))
    for i in range(q.shape[0]):
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            qv = q[i, h * hd:(h + 1) * hd].astype(np.float64)
            scores = [qv @ keys[t, kv * hd:(kv + 1) * hd] / np.sqrt(hd) for t in range(pos0 + i + 1)]
            w = np.exp(np.array(scores) - max(scores))
            w /= w.sum()
            out[i, h * hd:(h + 1) * hd] = sum(w[t] * vals[t, kv * hd:(kv + 1) * hd] for t in range(len(w)))
    return out


@pytest.mark.parametrize("provider_cls", [ReferenceProvider, CpuProvider])
def test_attention_gqa_with_cache(provider_cls: type) -> None:
    rng = np.random.default_rng(3)
    n_heads, n_kv, hd, n_ctx = 6, 2, 16, 16
    p = provider_cls()
    cache = p.kv_cache(2, n_ctx, n_kv, hd)
    q, k, v = (rng.standard_normal((9, w)).astype(np.float32) for w in (n_heads * hd, n_kv * hd, n_kv * hd))
    # Layer 1, in two calls: a prefill of 5 then 4 more rows at position 5.
    first = p.attention(q[:5], k[:5], v[:5], cache, 1, *seq(0, 5), n_heads, n_kv, hd)
    second = p.attention(q[5:], k[5:], v[5:], cache, 1, *seq(5, 4), n_heads, n_kv, hd)
    want = attention_naive(q, k, v, 0, n_heads, n_kv, hd)
    np.testing.assert_allclose(np.concatenate([first, second]), want, rtol=1e-5, atol=1e-6)
    assert not np.any(cache.k[0])  # layer 0 untouched


@pytest.mark.parametrize("provider_cls", [ReferenceProvider, CpuProvider])
def test_attention_rows_of_several_sequences_read_only_their_own_slot(provider_cls: type) -> None:
    rng = np.random.default_rng(9)
    n_heads, n_kv, hd = 4, 2, 16
    p = provider_cls()
    q, k, v = (rng.standard_normal((12, w)).astype(np.float32) for w in (n_heads * hd, n_kv * hd, n_kv * hd))
    batched = p.kv_cache(1, 16, n_kv, hd, 3)
    # Sequence A (slot 2): 6 tokens; B (slot 0): 3; then A and B each decode one more in one batch.
    p.attention(q[:6], k[:6], v[:6], batched, 0, np.full(6, 2, np.int32), np.arange(6, dtype=np.int32),
                n_heads, n_kv, hd)
    p.attention(q[6:9], k[6:9], v[6:9], batched, 0, np.zeros(3, np.int32), np.arange(3, dtype=np.int32),
                n_heads, n_kv, hd)
    mixed = p.attention(q[9:11], k[9:11], v[9:11], batched, 0, np.array([2, 0], np.int32),
                        np.array([6, 3], np.int32), n_heads, n_kv, hd)
    rows_a, rows_b = [0, 1, 2, 3, 4, 5, 9], [6, 7, 8, 10]
    want_a = attention_naive(q[rows_a], k[rows_a], v[rows_a], 0, n_heads, n_kv, hd)[-1]
    want_b = attention_naive(q[rows_b], k[rows_b], v[rows_b], 0, n_heads, n_kv, hd)[-1]
    np.testing.assert_allclose(mixed, np.stack([want_a, want_b]), rtol=1e-5, atol=1e-6)
    assert not np.any(batched.k[0, 1])  # slot 1 untouched


def test_attention_overflowing_cache_is_usage_error() -> None:
    p = ReferenceProvider()
    cache = p.kv_cache(1, 4, 1, 8, 2)
    x = np.ones((3, 8), np.float32)
    with pytest.raises(UsageError, match="position out of range"):
        p.attention(x, x, x, cache, 0, *seq(2, 3), 1, 1, 8)
    with pytest.raises(UsageError, match="slot out of range"):
        p.attention(x, x, x, cache, 0, np.full(3, 2, np.int32), np.arange(3, dtype=np.int32), 1, 1, 8)


def test_elementwise_ops_match_formulas() -> None:
    rng = np.random.default_rng(4)
    p = ReferenceProvider()
    x, w = rng.standard_normal((3, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(p.rmsnorm(x, w, 1e-5), want, rtol=1e-6)
    g, u = x, x[::-1].copy()
    np.testing.assert_allclose(p.act_mul(g, u, "silu"), g / (1 + np.exp(-x64)) * u, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(p.act_mul(g, u, "relu2"), np.maximum(x64, 0) ** 2 * u, rtol=1e-6)
    np.testing.assert_array_equal(p.add(g, u), g + u)
    np.testing.assert_array_equal(p.rows(x, np.array([2], np.int32)), x[2:])
    np.testing.assert_array_equal(p.rows(x, np.array([0, 2], np.int32)), x[[0, 2]])
    table = rng.standard_normal((10, 64)).astype(np.float16)
    rows = p.embed(table, np.array([3, 3, 9], np.int32))
    np.testing.assert_array_equal(rows, table[[3, 3, 9]].astype(np.float32))
    np.testing.assert_allclose(p.lm_head(x, table), x64 @ table.astype(np.float64).T, rtol=1e-6, atol=1e-5)
    logits = np.array([[1, 5, 5, 0], [2, 1, 0, 2]], np.float32)
    assert p.argmax(logits).tolist() == [1, 0]  # first index on ties
    assert set(p.dispatches) >= {"ref.rmsnorm", "ref.act_mul", "ref.add", "ref.rows", "ref.embed",
                                 "ref.lm_head", "ref.argmax"}


def test_q8_lm_head_follows_the_spec() -> None:
    # The table: per row q = clamp(rint(w * 127/max|w|)) in float32, scale = 1/s; a zero row stays zero.
    rng = np.random.default_rng(9)
    table = (rng.standard_normal((50, 96)) * 0.05).astype(np.float16)
    table[3] = 0
    table[4, 5] = 65504.0  # one huge value: the rest of its row rounds to small codes
    t = q8_table(table)
    w = table.astype(np.float32)
    amax = np.abs(w).max(axis=1)
    s = np.float32(127) / np.where(amax > 0, amax, np.float32(127))
    np.testing.assert_array_equal(t.q, np.clip(np.rint(w * s[:, None]), -127, 127).astype(np.int8))
    np.testing.assert_array_equal(t.scale, np.float32(1) / s)
    assert t.q.dtype == np.int8 and not t.q[3].any() and np.abs(t.q[np.arange(50) != 3]).max(axis=1).min() == 127
    # The logits: the activations' row codes times the table's, summed exactly (int64 here), then
    # * scale / s in float64.
    x = rng.standard_normal((3, 96)).astype(np.float32) * 4
    ax = np.abs(x).max(axis=1)
    sx = np.float32(127) / ax
    qx = np.clip(np.rint(x * sx[:, None]), -128, 127).astype(np.int64)
    isum = qx @ t.q.astype(np.int64).T
    want = (isum * t.scale.astype(np.float64) / sx.astype(np.float64)[:, None]).astype(np.float32)
    got = ReferenceProvider().lm_head_q8(x, t)
    np.testing.assert_array_equal(got, want)
    f16 = ReferenceProvider().lm_head(x, table)
    ok = np.arange(50) != 4  # the row with one huge value kept little else
    assert np.abs(got - f16)[:, ok].max() < 0.02 * np.abs(f16[:, ok]).max()


# -- the CPU provider against the reference, op by op --------------------------------------------

@pytest.mark.parametrize("scales", ["tensor", "block"])
@pytest.mark.parametrize("act_quant", MODES)
@pytest.mark.parametrize("n", [1, 7])
def test_cpu_bitlinear_matches_reference(act_quant: str, scales: str, n: int) -> None:
    rng = np.random.default_rng(5)
    w = ternary(rng, 300, 1024, scales)
    x = rng.standard_normal((n, 1024)).astype(np.float32)
    ref, cpu = ReferenceProvider(), CpuProvider()
    want = ref.bitlinear(x, ref.upload_ternary(w), act_quant)
    got = cpu.bitlinear(x, cpu.upload_ternary(w), act_quant)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    assert sum(cpu.dispatches.values()) == 1 and next(iter(cpu.dispatches)).startswith("cpu.bitlinear_")


def test_cpu_bitlinear_chunks_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import bitnet_cpu.provider as mod

    monkeypatch.setattr(mod, "_CHUNK_BYTES", 4 * 256 * 7)  # 7 rows per chunk: 300 rows -> a ragged last one
    rng = np.random.default_rng(6)
    w, x = ternary(rng, 300, 256, "block"), rng.standard_normal((3, 256)).astype(np.float32)
    ref, cpu = ReferenceProvider(), CpuProvider()
    np.testing.assert_allclose(cpu.bitlinear(x, cpu.upload_ternary(w), "row"),
                               ref.bitlinear(x, ref.upload_ternary(w), "row"), rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cpu_lm_head_matches_reference(dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    import bitnet_cpu.provider as mod

    monkeypatch.setattr(mod, "_LM_HEAD_ROWS", 100)
    rng = np.random.default_rng(7)
    table = rng.standard_normal((1000, 128)).astype(dtype)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    want = ReferenceProvider().lm_head(x, table)
    got = CpuProvider().lm_head(x, table)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_cpu_attention_matches_reference() -> None:
    rng = np.random.default_rng(8)
    n_heads, n_kv, hd = 4, 1, 32
    ref, cpu = ReferenceProvider(), CpuProvider()
    caches = [p.kv_cache(1, 32, n_kv, hd) for p in (ref, cpu)]
    widths = (n_heads * hd, n_kv * hd, n_kv * hd)
    for pos0, n in [(0, 6), (6, 1), (7, 3)]:
        q, k, v = (rng.standard_normal((n, w)).astype(np.float32) for w in widths)
        want, got = (p.attention(q, k, v, c, 0, *seq(pos0, n), n_heads, n_kv, hd)
                     for p, c in zip((ref, cpu), caches, strict=True))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cpu_records_its_own_kernel_names() -> None:
    cpu = CpuProvider()
    x, w = np.ones((1, 8), np.float32), np.ones(8, np.float32)
    cpu.rmsnorm(x, w, 1e-5)
    cpu.argmax(x)
    assert set(cpu.dispatches) == {"cpu.rmsnorm", "cpu.argmax"}
    assert cpu.backend == "cpu"
