"""The CPU plugin's integer kernels against the NumPy reference: activation quantization, ternary BitLinear and
the int8 LM head, exact; their thread counts. (The float kernels: test_cpu_float_kernels.py; the layer region:
test_cpu_region.py.)

Every test of a ternary kernel runs at each instruction-set level this machine runs (`isa.host_levels()`:
avx2 and generic on an AVX2-only CPU; also avxvnni and avx512vnni on an AVX-512 VNNI one), in one process.
Integer paths are bit-exact against the reference and across levels. Float results carry a stated
tolerance: FLOAT_TOL for float32 sums taken in another order.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from cpu_support import REF, file_layout, one_by_one, provider, rel_err, ternary

from bitnet.modelfile import formats
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, from_values, reverse_fields
from bitnet.runtime import reference as ref_mod
from bitnet.runtime.reference import q8_table
from bitnet_cpu import dot_ir, isa
from bitnet_cpu.dot_ir import GROUP, TILE, WIDE
from bitnet_cpu.provider import CpuProvider, PackedTernary

LEVELS = isa.host_levels()
# float32 sums of the same terms in another order (BLAS blocking, SIMD width): within a few ulps of
# the largest output. A wrong layout or a lost field is off by O(1) of it.
FLOAT_TOL = 1e-6


def assert_same(got: np.ndarray, want: np.ndarray, mode: str) -> None:
    """Integer paths ("row", "block256") bit for bit; the float path ("none") within FLOAT_TOL."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    if mode == "none":
        assert rel_err(got, want) < FLOAT_TOL, rel_err(got, want)
    else:
        np.testing.assert_array_equal(got, want)


# -- quantization: the same int8 values and scales as the reference, bit for bit -------------------

# Byte order for weights whose fields are reversed (I2_S): field f holds the columns of field 3 - f.
_lane = np.arange(BLOCK)
MIRRORED_PERM = 128 * ((_lane % 64) // 32) + 32 * (3 - _lane // 64) + _lane % 32


def test_activation_rows_start_on_cache_lines() -> None:
    # A 512-bit load from a 16-byte aligned row spans two lines: a B=8 step's BitLinear ran at half speed.
    rows = isa.kernels(LEVELS[0]).int8_rows
    for n, cols in [(1, 64), (3, 2560), (8, 6912), (5, 256)] * 8:
        q = rows(n, cols)
        assert q.shape == (n, cols) and q.dtype == np.int8 and q.flags.c_contiguous
        assert q.ctypes.data % 64 == 0


@pytest.mark.parametrize("level", LEVELS)
def test_quantize_rows_is_bit_exact(level: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 100, (6, 1))).astype(np.float32)
    x[1] = 0.0  # an all-zero row: s = 1, q = 0
    x[2, :300] = np.arange(300, dtype=np.float32) / 2 - 75  # exact halves: ties round to even
    x[2, 300] = 127.0
    q, s, qsum = np.empty((6, 512), np.int8), np.empty(6, np.float32), np.empty((6, 2), np.int32)
    want_q, want_s = ref_mod.quantize_rows(x)
    want_q = want_q.reshape(6, 2, BLOCK)
    for rev, perm in ((False, dot_ir.PERM), (True, MIRRORED_PERM)):
        isa.kernels(level).quantize_rows(x, q, s, qsum, rev)
        np.testing.assert_array_equal(s, want_s)
        np.testing.assert_array_equal(q.reshape(6, 2, BLOCK), want_q[:, :, perm])
        np.testing.assert_array_equal(qsum, want_q.sum(axis=2))


@pytest.mark.parametrize("level", LEVELS)
def test_quantize_q8k_is_bit_exact(level: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[0, 256:512] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 5], x[1, 9] = -4.0, 4.0  # equal magnitudes: the first one sets the sign of iscale
    q, d, qsum = np.empty((3, 768), np.int8), np.empty((3, 3), np.float32), np.empty((3, 3), np.int32)
    isa.kernels(level).quantize_q8k(x, q, d, qsum, False)
    want_q, want_d = ref_mod.quantize_q8k(x)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(q.reshape(3, 3, BLOCK), want_q[:, :, dot_ir.PERM])
    np.testing.assert_array_equal(qsum, want_q.sum(axis=2))


# -- BitLinear -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(1, 256), (65, 512), (130, 768)])
@pytest.mark.parametrize("n", [1, 2, 3, 6, 7, 9, 16])  # passes of 1, 2, TILE and WIDE tokens
def test_integer_sums_are_exact(cpu: CpuProvider, rows: int, cols: int, n: int) -> None:
    # Unit weight scales: y = isum / s, one rounding in both providers, so they agree bit for bit.
    rng = np.random.default_rng(rows * 1000 + n)
    w = ternary(rng, rows, cols, block_scales=False, unit=True)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    got = cpu.bitlinear(x, cpu.upload_ternary(w), "row")
    np.testing.assert_array_equal(got, REF.bitlinear(x, w, "row"))


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("block_scales", [False, True], ids=["rowscale", "blockscale"])
@pytest.mark.parametrize("rows, cols, n", [(64, 256, 1), (67, 512, 7), (200, 1280, 129), (5, 2560, 4)])
def test_bitlinear_matches_reference(cpu: CpuProvider, mode: str, block_scales: bool, rows: int, cols: int,
                                     n: int) -> None:
    # The integer paths follow the reference's float64 epilogue operation for operation: bit-exact.
    rng = np.random.default_rng(rows + cols + n)
    w = ternary(rng, rows, cols, block_scales)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    x[-1, :BLOCK] = 0.0  # an all-zero block (a zero Q8_K scale)
    if n > 2:
        x[1] = 0.0  # an all-zero row
    assert_same(cpu.bitlinear(x, cpu.upload_ternary(w), mode), REF.bitlinear(x, w, mode), mode)


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("rows, cols, n", [(3, 100, 2), (40, 3200, 3), (7, 8640, 1)])  # 1bitLLM 3B widths
def test_any_width_is_zero_extended(cpu: CpuProvider, mode: str, rows: int, cols: int, n: int) -> None:
    """Weights of a width that is not whole 256-blocks are held zero-extended; bitlinear zero-extends
    its input rows the same way, so the result is the unpadded product (integer paths bit-exact)."""
    rng = np.random.default_rng(cols)
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    w = from_values(t, np.float32(0.75))
    assert w.cols % BLOCK == 0 and w.cols > cols
    x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
    got = cpu.bitlinear(x, cpu.upload_ternary(w), mode)
    assert_same(got, REF.bitlinear(x, w, mode), mode)
    if mode == "row":  # the unpadded arithmetic, written out: same int8 values, same integer sums
        q, s = ref_mod.quantize_rows(x)
        want = (q.astype(np.int64) @ t.T.astype(np.int64)).astype(np.float64) * 0.75 / s.astype(np.float64)[:, None]
        np.testing.assert_array_equal(got, want.astype(np.float32))
    elif mode == "none":
        want = x.astype(np.float64) @ (t.astype(np.float64) * 0.75).T
        assert rel_err(got, want.astype(np.float32)) < FLOAT_TOL
    with pytest.raises(ValueError, match="exceeds"):
        cpu.bitlinear(np.zeros((1, w.cols + 1), np.float32), cpu.upload_ternary(w), mode)


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("layout", ["tq2_0", "i2_s"])
def test_bitlinear_reads_weights_in_file_layouts(cpu: CpuProvider, mode: str, layout: str) -> None:
    # "none" sums float32 products with BLAS, whose order follows the column permutation of the
    # layout: I2_S and canonical results differ in the last bits (1.5e-5 of outputs ~100 on an EPYC).
    rng = np.random.default_rng(11)
    w = ternary(rng, 70, 768, block_scales=True)
    strided = file_layout(rng, w, layout)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    for rows in (slice(0, 1), slice(0, 5)):  # decode and prefill
        got = cpu.bitlinear(x[rows], cpu.upload_ternary(strided), mode)
        assert_same(got, cpu.bitlinear(x[rows], cpu.upload_ternary(w), mode), mode)
        assert_same(got, REF.bitlinear(x[rows], w, mode), mode)


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("layout", ["tq2_0", "i2_s"])
def test_a_group_runs_in_one_call_as_its_projections_would(cpu: CpuProvider, mode: str, layout: str) -> None:
    # Q, K, V heights as in 2B-4T (4:1:1), from the file layouts; prefill rows cross the 64-row tasks'
    # boundaries between projections (64 + 16 + 16 rows).
    rng = np.random.default_rng(13)
    ws = [file_layout(rng, ternary(rng, rows, 768, block_scales=layout == "tq2_0"), layout) for rows in (64, 16, 16)]
    group = cpu.upload_ternary_group(ws)
    assert isinstance(group, PackedTernary) and group.rows == 96
    x = rng.standard_normal((5, 768)).astype(np.float32)
    for rows in (slice(0, 1), slice(0, 5)):
        calls = sum(cpu.dispatches.values())
        got = cpu.bitlinear_group(x[rows], group, mode)
        assert sum(cpu.dispatches.values()) == calls + 1
        for w, y in zip(ws, got, strict=True):
            np.testing.assert_array_equal(y, cpu.bitlinear(x[rows], cpu.upload_ternary(w), mode))


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
def test_a_tensor_wide_scale_stays_one_value(cpu: CpuProvider, mode: str) -> None:
    # I2_S (and TQ2_0 whose blocks share a scale) hold one scale per tensor: a broadcast, never a
    # [rows, blocks] array (27 MB of fresh pages for 2B-4T), stacked as a view of the row scales.
    rng = np.random.default_rng(15)
    ts = [(rng.integers(-1, 2, (rows, 768)).astype(np.int8), scale) for rows, scale in ((64, 0.5), (16, 2.0))]
    ws = [formats.i2s_to_ternary(formats.ternary_to_i2s(t, s), len(t), 768) for t, s in ts]
    assert all(w.scales.strides == (0, 0) for w in ws)
    group = cpu.upload_ternary_group(ws)
    assert isinstance(group, PackedTernary) and np.shares_memory(group.scales, group.row_scales)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    for w, y in zip(ws, cpu.bitlinear_group(x, group, mode), strict=True):
        assert_same(y, REF.bitlinear(x, TernaryMatrix(w.codes, w.scales.copy(), True), mode), mode)


def test_projections_that_cannot_share_a_call_run_one_by_one() -> None:
    cpu, rng = CpuProvider(n_threads=1), np.random.default_rng(14)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    per_row, per_block = ternary(rng, 32, 512, block_scales=False), ternary(rng, 32, 512, block_scales=True)
    for ws in ([per_row, per_block], [per_row, file_layout(rng, per_row, "i2_s")]):  # scale kinds, byte orders
        group = cpu.upload_ternary_group(ws)
        assert not isinstance(group, PackedTernary)
        for w, y in zip(ws, cpu.bitlinear_group(x, group, "row"), strict=True):
            np.testing.assert_array_equal(y, REF.bitlinear(x, w, "row"))
    assert not isinstance(cpu.upload_ternary_group([per_row, ternary(rng, 32, 768, False)]), PackedTernary)


@pytest.mark.parametrize("mode", ["row", "none"])
def test_a_misread_layout_fails_the_layout_check(cpu_float: CpuProvider, mode: str) -> None:
    # What test_bitlinear_reads_weights_in_file_layouts guards against, shown to fail it: I2_S bytes
    # read in canonical field order, and TQ2_0 blocks read two bytes late (scale bytes as codes).
    rng = np.random.default_rng(11)
    w = ternary(rng, 70, 768, block_scales=True)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    want = cpu_float.bitlinear(x, cpu_float.upload_ternary(w), mode)
    raw = rng.integers(0, 256, (70, 3, 66), dtype=np.uint8)
    raw[:, :, :64] = w.blocks()
    for broken in (TernaryMatrix(reverse_fields(w.packed()), w.scales, fields_reversed=False),
                   TernaryMatrix(raw[:, :, 2:], w.scales)):
        with pytest.raises(AssertionError):
            assert_same(cpu_float.bitlinear(x, cpu_float.upload_ternary(broken), mode), want, mode)


@pytest.mark.parametrize("mode", ["row", "block256"])
@pytest.mark.parametrize("layout", ["canonical", "tq2_0", "i2_s"])
def test_levels_agree_bit_for_bit(mode: str, layout: str) -> None:
    rng = np.random.default_rng(12)
    w = ternary(rng, 130, 1280, block_scales=layout != "canonical")
    w = w if layout == "canonical" else file_layout(rng, w, layout)
    x = (rng.standard_normal((6, 1280)) * 3).astype(np.float32)
    for rows in (slice(0, 1), slice(0, 6)):
        outs = {level: provider(1, level).bitlinear(x[rows], provider(1, level).upload_ternary(w), mode)
                for level in LEVELS}
        for level, got in outs.items():
            np.testing.assert_array_equal(got, outs["generic"], err_msg=f"{level} differs from generic")


@pytest.mark.skipif("avx512vnni" not in LEVELS, reason="this CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("rows", [1, 4])
def test_one_tokens_pass_of_either_row_count_gives_the_generic_bits(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # One token's pass takes four rows on Intel's AVX-512 VNNI and one elsewhere (dot_ir.ONE_TOKEN_ROWS): the pass this
    # host does not take is built here uncached, so both are checked on either vendor. 130 rows: a tail of two.
    monkeypatch.setattr(dot_ir, "ONE_TOKEN_ROWS", {"avx512vnni": rows})
    built = CpuProvider(n_threads=1, isa="avx512vnni")
    built._tk = isa.build("avx512vnni", cache=False)
    rng = np.random.default_rng(14)
    w = ternary(rng, 130, 1280, block_scales=False)  # a scale per row: the pass with ONE_TOKEN_ROWS
    x = (rng.standard_normal((1, 1280)) * 3).astype(np.float32)
    generic = provider(1, "generic")
    want = generic.bitlinear(x, generic.upload_ternary(w), "row")
    np.testing.assert_array_equal(built.bitlinear(x, built.upload_ternary(w), "row"), want)


@pytest.mark.parametrize("level", LEVELS)
def test_a_dot_product_that_drops_a_field_fails(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checks above can fail: the same kernels built from IR that ignores the fourth 2-bit field
    # of every code byte (uncached, so the broken machine code never reaches the disk cache).
    from llvmlite import ir

    real_codes = dot_ir._Block.codes

    def drop_last_field(self: dot_ir._Block, wptr: ir.Value, x4: bool = False) -> list[ir.Value]:
        return [ir.Constant(c.type, None) if i % 4 == 3 else c for i, c in enumerate(real_codes(self, wptr, x4=x4))]

    monkeypatch.setattr(dot_ir._Block, "codes", drop_last_field)
    broken = CpuProvider(n_threads=1, isa=level)
    broken._tk = isa.build(level, cache=False)
    rng = np.random.default_rng(13)
    w = ternary(rng, 9, 512, block_scales=False, unit=True)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    got = broken.bitlinear(x, broken.upload_ternary(w), "row")
    with pytest.raises(AssertionError):
        assert_same(got, REF.bitlinear(x, w, "row"), "row")
    assert rel_err(got, REF.bitlinear(x, w, "row")) > 0.05  # a quarter of the weights lost, not rounding


@pytest.mark.parametrize("blocks", [GROUP + 2, 2 * GROUP + 2], ids=["wide", "tiled"])
def test_extreme_codes_and_zero_weights(cpu: CpuProvider, blocks: int) -> None:
    # Every weight +1 or every weight -1 with maximal activations of either sign: the largest block sums, over
    # more blocks than AVX2's int16 partial sums span (GROUP; two blocks in the one-token pass, an odd count
    # here), at 1, 2, TILE and (rows narrow enough) WIDE tokens.
    cols = 256 * blocks
    cpu.wide_bytes = 24 << 10  # (a 32 KB L1's parts: isa.wide_bytes)
    assert (cols * WIDE <= cpu.wide_bytes) == (blocks == GROUP + 2)  # both kinds of pass are covered
    t = np.ones((4, cols), np.int8)
    t[1] = -1
    t[2] = 0
    t[3, ::2] = -1
    w = from_values(t, np.float32(0.75))
    x = np.full((WIDE, cols), 3.0, np.float32)
    x[1, ::3] = -3.0
    x[WIDE - 1, ::5] = -3.0
    for mode in ("row", "block256"):
        for n in (1, 2, TILE, WIDE):
            for a in (x[:n], -x[:n]):
                got = cpu.bitlinear(a, cpu.upload_ternary(w), mode)
                np.testing.assert_allclose(got, REF.bitlinear(a, w, mode), rtol=1e-6, atol=0)
                assert np.all(got[:, 2] == 0)


def test_column_parts_change_no_bit(cpu: CpuProvider) -> None:
    """A WIDE pass over a row in 1, 2, 3 or 27 column parts (isa.wide_bytes, from the host's L1) gives the same sums."""
    rng = np.random.default_rng(21)
    w = ternary(rng, 70, 27 * 256, block_scales=False)
    x = rng.standard_normal((WIDE + 3, 27 * 256)).astype(np.float32)
    packed = cpu.upload_ternary(w)
    results = []
    for parts in (1, 2, 3, 27):
        cpu.wide_bytes = -(-27 * 256 * WIDE // parts)
        results.append(cpu.bitlinear(x, packed, "row"))
    for got in results[1:]:
        np.testing.assert_array_equal(got.view(np.uint32), results[0].view(np.uint32))
    np.testing.assert_allclose(results[0], REF.bitlinear(x, w, "row"), rtol=1e-6, atol=0)


def test_dispatches_name_the_kernel(cpu: CpuProvider) -> None:
    rng = np.random.default_rng(3)
    w_row, w_block = ternary(rng, 8, 512, False), ternary(rng, 8, 512, True)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    cpu.bitlinear(x, cpu.upload_ternary(w_row), "row")
    cpu.bitlinear(x, cpu.upload_ternary(w_block), "row")
    cpu.bitlinear(x, cpu.upload_ternary(w_row), "block256")
    assert {"cpu.bitlinear_rowscale_row", "cpu.bitlinear_blockscale_row",
            "cpu.bitlinear_blockscale_block256"} <= set(cpu.dispatches)


# -- the int8 LM head ----------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, dim, n", [(1, 64, 1), (1000, 320, 1), (513, 100, 1), (9000, 100, 1), (1537, 100, 4),
                                            (700, 2560, 9), (300, 256, 6)])
def test_q8_lm_head_is_bit_exact(cpu: CpuProvider, vocab: int, dim: int, n: int) -> None:
    # An integer path: the reference's logits to the bit, at every level and thread count (n = 9: two
    # groups of four tokens and one more; dim 100: no whole SIMD register at the end of a row, also for one token,
    # whose rows of whole registers take a pass of their own; vocab 9000: one token's tasks, the last one short).
    rng = np.random.default_rng(vocab + dim + n)
    table = (rng.standard_normal((vocab, dim)) * 0.05).astype(np.float16)
    table[vocab // 2] = 0
    x = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
    x[0, :3] = [40.0, -40.0, 0.5]  # both extreme codes
    if n > 1:  # the activations' own rounding: a zero row (scale 1), and halves at scale 1 (to even, as NumPy's rint)
        x[1] = 0
        x[-1] = np.clip(x[-1], -100, 100)
        x[-1, :5] = [127.0, 2.5, -3.5, 0.5, -0.5]
    got = cpu.lm_head_q8(x, cpu.upload_q8(table))
    np.testing.assert_array_equal(got, REF.lm_head_q8(x, q8_table(table)))
    assert "cpu.lm_head_q8" in cpu.dispatches


# -- batch invariance: a row's result never depends on the other rows of its batch ---------------------------

@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("block_scales", [False, True], ids=["rowscale", "blockscale"])
def test_bitlinear_is_batch_invariant(cpu: CpuProvider, mode: str, block_scales: bool) -> None:
    rng = np.random.default_rng(14)
    w = cpu.upload_ternary(ternary(rng, 300, 1280, block_scales))
    x = rng.standard_normal((9, 1280)).astype(np.float32)  # 9: two full prefill tiles and a ragged one
    np.testing.assert_array_equal(cpu.bitlinear(x, w, mode), one_by_one(lambda r: cpu.bitlinear(r, w, mode), x))


def test_threads_give_the_same_results() -> None:
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread only")
    rng = np.random.default_rng(6)
    w = ternary(rng, 300, 768, True)
    x = rng.standard_normal((9, 768)).astype(np.float32)
    table = rng.standard_normal((2000, 768)).astype(np.float16)
    outs = []
    for threads in (1, 2):
        p = CpuProvider(n_threads=threads)
        y = p.bitlinear(x, p.upload_ternary(w), "block256")
        outs.append((y, p.lm_head(x[:1], p.upload_float(table))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_thread_count_applies_in_any_calling_thread() -> None:
    # numba's thread count is per Python thread: a server thread must still get the provider's.
    import threading

    p = CpuProvider(n_threads=1)
    rng = np.random.default_rng(7)
    w, x = ternary(rng, 8, 256, False), rng.standard_normal((1, 256)).astype(np.float32)
    seen: list[int] = []
    worker = threading.Thread(target=lambda: (p.bitlinear(x, p.upload_ternary(w), "row"),
                                              seen.append(numba.get_num_threads())))
    worker.start()
    worker.join()
    assert seen == [1]


def test_providers_of_different_thread_counts_take_turns_in_one_thread() -> None:
    # The count a provider set is remembered per thread (asking numba is slow): a second provider's must
    # still replace it, and the first's come back.
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread only")
    rng = np.random.default_rng(8)
    w, x = ternary(rng, 8, 256, False), rng.standard_normal((1, 256)).astype(np.float32)
    one, two = CpuProvider(n_threads=1), CpuProvider(n_threads=2)
    seen = []
    for p in (one, two, one, two):
        p.bitlinear(x, p.upload_ternary(w), "row")
        seen.append(numba.get_num_threads())
    assert seen == [1, 2, 1, 2]


def test_long_tasks_are_handed_out_a_few_at_a_time() -> None:
    # A prefill's BitLinear tasks go one by one to whichever thread is free, and the LM heads' a few at a time,
    # so a core a co-tenant takes does fewer of them; a decode step's short tasks, and the other kernels, keep
    # one share per thread.
    from bitnet_cpu.provider import _LM_HEAD_CHUNK, _LONG_TASK_TOKENS

    p = provider(2)
    rng = np.random.default_rng(9)
    w = p.upload_ternary(ternary(rng, 200, 256, False))
    table = rng.standard_normal((300, 256)).astype(np.float16)
    x = rng.standard_normal((_LONG_TASK_TOKENS, 256)).astype(np.float32)
    seen = []
    for n in (_LONG_TASK_TOKENS, _LONG_TASK_TOKENS - 1, _LONG_TASK_TOKENS):
        p.bitlinear(x[:n], w, "row")
        seen.append(numba.get_parallel_chunksize())
    q8 = p.upload_q8(table)
    for run in (lambda: p.lm_head(x[:1], table), lambda: p.bitlinear(x[:1], w, "row"),
                lambda: p.lm_head_q8(x[:1], q8), lambda: p.bitlinear(x[:1], w, "row")):
        run()
        seen.append(numba.get_parallel_chunksize())
    assert _LM_HEAD_CHUNK > 1 and seen == [1, 0, 1, _LM_HEAD_CHUNK, 0, _LM_HEAD_CHUNK, 0]
