"""The OpenCL provider on every OpenCL implementation present against the NumPy ReferenceProvider.

Each test runs on the first device of each platform: PoCL (the portable paths of the kernel source) and
Intel's CPU runtime (intel-opencl-rt, installed by scripts/setup.sh: subgroup reductions, the integer dot
product and hardware f16 conversions), plus one build with the 128-bit loads that otherwise only CUDA
compiles. Float ops must agree within 1e-4 of the largest reference value; integer parts exactly. Each
test module (so each xdist worker) opens its own contexts; tests that close a provider open their own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest

from bitnet import gpu as kernels_src
from bitnet.errors import NoBackendError, UsageError
from bitnet.gpu import TILE_N
from bitnet.modelfile.ternary import from_values
from bitnet.plugins.types import Device
from bitnet.runtime.reference import ReferenceProvider
from bitnet_opencl.icd import use_installed_runtimes
from bitnet_opencl.probe import device_features
from bitnet_opencl.provider import OpenCLProvider
from conftest import opencl_builds, opencl_platforms

use_installed_runtimes()  # before this process's first OpenCL call, so Intel's runtime is listed too

MODES = ("row", "block256", "none")
VENDOR_OPENCL = Path(kernels_src.__file__).with_name("vendor_opencl.h").read_text(encoding="utf-8")
# A third party's header in miniature: OpenCL's, plus the 128-bit loads only vendor_cuda.h turns on.
WIDE_LOADS = "#define HAS_WIDE_LOADS 1\n" + VENDOR_OPENCL


def _devices() -> dict[str, Device]:
    """The first device of each platform whose compiler works here, by platform name."""
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return {}
    found = {}
    for p_index, platform in enumerate(platforms):
        try:
            dev = platform.get_devices()[0]
        except (cl.Error, IndexError):
            continue
        if platform.name.strip() not in opencl_platforms():
            continue
        found[platform.name.strip()] = Device("opencl", 0, dev.name.strip(),
                                              properties={"platform_index": p_index, "device_index": 0})
    return found


DEVICES = _devices()
# Not `not DEVICES`: where every platform's compiler fails, the left-out check below must still run.
pytestmark = [pytest.mark.opencl,
              pytest.mark.skipif(not opencl_builds(), reason="pyopencl finds no OpenCL platform with a device")]
# Every platform with its own features; the first one again with the wide loads.
BUILDS = [(name, None) for name in DEVICES] + [(name, "wide-loads") for name in list(DEVICES)[:1]]


@pytest.fixture(scope="module", params=BUILDS, ids=lambda b: "+".join(filter(None, b)))
def ocl(request):
    name, variant = request.param
    p = OpenCLProvider(DEVICES[name], source=kernels_src.source(WIDE_LOADS) if variant else None)
    yield p
    p.close()


@pytest.fixture(params=list(DEVICES))
def device(request) -> Device:
    return DEVICES[request.param]


@pytest.fixture
def fresh(device):
    p = OpenCLProvider(device)
    yield p
    p.close()


@pytest.fixture
def ref():
    return ReferenceProvider()


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-4) -> None:
    """Within rtol of the largest reference value (per-element relative error is meaningless where
    sums cancel to near zero)."""
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want))))


def ternary(rng: np.random.Generator, rows: int, cols: int):
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    return from_values(t, rng.uniform(0.5, 2.0, (rows, -(-cols // 256))).astype(np.float32))


# -- ternary matmul ----------------------------------------------------------------------------------
@pytest.mark.parametrize("act_quant", MODES)
@pytest.mark.parametrize("n", [1, 5, 2 * TILE_N + 3])
def test_bitlinear_matches_reference(ocl, ref, act_quant, n):
    rng = np.random.default_rng(n)
    w = ternary(rng, 203, 768)  # rows not a multiple of a work-group's rows
    x = rng.standard_normal((n, 768)).astype(np.float32)
    x[0, 256:512] = 0  # an all-zero block (Q8_K's d = 0)
    if n > 1:
        x[1] = 0  # an all-zero row (the row scale's 127 / 0)
    got = ocl.to_host(ocl.bitlinear(ocl.upload_float(x), ocl.upload_ternary(w), act_quant))
    assert_close(got, ref.bitlinear(x, w, act_quant))


@pytest.mark.parametrize("rows, cols", [(2560, 2560), (96, 6912), (100, 3200), (64, 8640)])  # + 1bitLLM 3B
def test_bitlinear_model_shapes(ocl, ref, rows, cols):
    rng = np.random.default_rng(rows)
    w, x = ternary(rng, rows, cols), rng.standard_normal((1, cols)).astype(np.float32)
    got = ocl.to_host(ocl.bitlinear(ocl.upload_float(x), ocl.upload_ternary(w), "row"))
    assert_close(got, ref.bitlinear(x, w, "row"))


@pytest.mark.parametrize("act_quant", ["row", "block256"])
@pytest.mark.parametrize("cols", [1024, 1000])  # 1000: not whole 256-blocks, zero-extended on the device
def test_integer_dot_is_exact(ocl, act_quant, cols):
    """With max|x| = 127 in every block and unit weight scales, both quantizers reduce to q = rint(x)
    (ties to even) and d = +-1, so the output is the integer dot itself, bit for bit."""
    rng = np.random.default_rng(7)
    n, rows = TILE_N + 1, 67
    x = rng.integers(-126, 127, size=(n, cols)).astype(np.float32)
    x += rng.choice(np.float32([0, 0.5]), size=x.shape)  # halves: round half to even decides
    x[:, ::256] = np.float32(127) * rng.choice([-1, 1], size=(n, -(-cols // 256)))
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    want = (np.rint(x).astype(np.int64) @ t.T.astype(np.int64)).astype(np.float32)
    got = ocl.to_host(ocl.bitlinear(ocl.upload_float(x), ocl.upload_ternary(from_values(t, 1.0)), act_quant))
    np.testing.assert_array_equal(got, want)


def test_bitlinear_rejects_unknown_mode(ocl):
    w = ternary(np.random.default_rng(0), 4, 256)
    with pytest.raises(UsageError, match="activation quantization"):
        ocl.bitlinear(ocl.upload_float(np.ones((1, 256), np.float32)), ocl.upload_ternary(w), "int4")


# -- row-wise, element-wise --------------------------------------------------------------------------
def test_rmsnorm(ocl, ref):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((6, 2560)).astype(np.float32), rng.standard_normal(2560).astype(np.float32)
    got = ocl.to_host(ocl.rmsnorm(ocl.upload_float(x), ocl.upload_float(w), 1e-5))
    assert_close(got, ref.rmsnorm(x, w, 1e-5))


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope(ocl, ref, theta):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 3 * 128)).astype(np.float32)
    # Consecutive runs from 0 and from 300 (past the table's first 256 positions: it grows), then rows of
    # several sequences at arbitrary positions, repeats and a jump back included.
    for positions in ([0, 1, 2, 3, 4, 5, 6], [300, 301, 302, 303, 304, 305, 306], [5, 0, 1000, 7, 7, 2, 299]):
        pos = np.array(positions, np.int32)
        got = ocl.to_host(ocl.rope(ocl.upload_float(x), 3, 128, pos, theta))
        assert_close(got, ref.rope(x, 3, 128, pos, theta))


@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_act_mul(ocl, ref, act):
    rng = np.random.default_rng(3)
    g, u = (rng.standard_normal((3, 1000)).astype(np.float32) * 4 for _ in range(2))
    got = ocl.to_host(ocl.act_mul(ocl.upload_float(g), ocl.upload_float(u), act))
    assert_close(got, ref.act_mul(g, u, act))


def test_add_and_rows(ocl, ref):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((5, 300)).astype(np.float32), rng.standard_normal((5, 300)).astype(np.float32)
    s = ocl.add(ocl.upload_float(a), ocl.upload_float(b))
    np.testing.assert_array_equal(ocl.to_host(s), ref.add(a, b))
    for index in ([4], [0], [0, 2, 3], [1, 2, 3, 4], [0, 1, 2, 3, 4]):  # runs of one row and of several
        idx = np.array(index, np.int32)
        np.testing.assert_array_equal(ocl.to_host(ocl.rows(s, idx)), ref.rows(ref.add(a, b), idx))
    for bad in ([], [5], [2, 1], [1, 1]):
        with pytest.raises(UsageError, match="ascending"):
            ocl.rows(s, np.array(bad, np.int32))


# -- embedding, LM head, argmax ------------------------------------------------------------------------
def test_embed_f16_converts_every_half_exactly(ocl):
    table = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)  # every bit pattern
    ids = np.random.default_rng(5).permutation(256).astype(np.int32)
    got = ocl.to_host(ocl.embed(ocl.upload_float(table), ids))
    want = table[ids].astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(np.signbit(got[nan]), np.signbit(want[nan]))
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0 and subnormals


def test_embed_f32(ocl, ref):
    table = np.random.default_rng(6).standard_normal((50, 200)).astype(np.float32)
    ids = np.array([3, 49, 0, 3], np.int32)
    np.testing.assert_array_equal(ocl.to_host(ocl.embed(ocl.upload_float(table), ids)), ref.embed(table, ids))
    with pytest.raises(UsageError, match="out of range"):
        ocl.embed(ocl.upload_float(table), np.array([50], np.int32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n, dim", [(1, 256), (TILE_N + 2, 204)])  # 204: a tail beyond 8-element chunks
def test_lm_head(ocl, ref, dtype, n, dim):
    rng = np.random.default_rng(dim)
    table = rng.standard_normal((1001, dim)).astype(dtype)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    got = ocl.to_host(ocl.lm_head(ocl.upload_float(x), ocl.upload_float(table)))
    assert_close(got, ref.lm_head(x, table))


def test_argmax_first_on_ties(ocl, ref):
    logits = np.random.default_rng(8).standard_normal((3, 50000)).astype(np.float32)
    logits[0, [7, 4000, 49999]] = 100.0
    logits[2] = -5.0
    got = ocl.argmax(ocl.upload_float(logits))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, ref.argmax(logits))
    assert list(got[[0, 2]]) == [7, 0]


# -- attention -------------------------------------------------------------------------------------------
# several chunks of head_dim positions; 100 is 1bitLLM 3B's head size, not a power of two
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("head_dim, prompt", [(16, 21), (128, 150), (100, 40)])
def test_attention_gqa_prefill_then_decode(ocl, ref, head_dim, prompt, kv_type):
    rng = np.random.default_rng(head_dim)
    n_heads, n_kv, n_layers, n_ctx = 8, 2, 2, prompt + 8
    c_ocl = ocl.kv_cache(n_layers, n_ctx, n_kv, head_dim, kv_type=kv_type)
    c_ref = ref.kv_cache(n_layers, n_ctx, n_kv, head_dim, kv_type=kv_type)
    pos0 = 0
    for n in (prompt, 1, 1, 1, 3):
        slots, positions = np.zeros(n, np.int32), np.arange(pos0, pos0 + n, dtype=np.int32)
        for layer in (1, 0):  # different data per layer: the cache's layer offset matters
            q = 3 * rng.standard_normal((n, n_heads * head_dim)).astype(np.float32)  # peaked softmax
            k, v = (rng.standard_normal((n, n_kv * head_dim)).astype(np.float32) for _ in range(2))
            dq, dk, dv = (ocl.upload_float(a) for a in (q, k, v))
            got = ocl.to_host(ocl.attention(dq, dk, dv, c_ocl, layer, slots, positions, n_heads, n_kv, head_dim))
            assert_close(got, ref.attention(q, k, v, c_ref, layer, slots, positions, n_heads, n_kv, head_dim))
        pos0 += n
    assert_same_cache(ocl, c_ocl, c_ref, {0: pos0})


def assert_same_cache(p, cache, ref_cache, written: dict[int, int]) -> None:
    """The device's cache holds the reference's values, bit for bit (F16: both round to nearest even),
    at positions 0..written[slot]-1 of each slot; the reference lays a slot out position-major."""
    assert cache.k.dtype == ref_cache.k.dtype
    for mine, theirs in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        got, want = p.to_host(mine), theirs.transpose(0, 1, 3, 2, 4).astype(np.float32)
        for slot, n in written.items():
            np.testing.assert_array_equal(got[:, slot, :, :n], want[:, slot, :, :n])


# Batches of rows from several sequences, as the scheduler makes them: (slot, first position, rows).
MIXED_STEPS = [
    [(2, 0, 9)],  # slot 2 prefills alone
    [(0, 0, 5), (2, 9, 1)],  # slot 0 prefills beside slot 2's decode
    [(2, 10, 1), (1, 0, 40), (0, 5, 1)],  # slot 1's prefill chunk (past a work-group of positions) between decodes
    [(0, 6, 1), (1, 40, 1), (2, 11, 1)],  # three decodes
    [(1, 41, 3), (2, 4, 2)],  # slot 2 rewinds to position 4 (a reused prefix), overwriting what followed
]


def run_mixed_steps(p, ref, kv_type: str = "f32") -> list[tuple[np.ndarray, np.ndarray]]:
    """MIXED_STEPS through attention on `p` and on the reference, two layers each: (got, want) per call.
    Then both caches hold the same values."""
    rng = np.random.default_rng(21)
    n_heads, n_kv, n_layers, n_ctx, n_seqs, head_dim = 4, 2, 2, 64, 3, 64
    c_p, c_ref = (x.kv_cache(n_layers, n_ctx, n_kv, head_dim, n_seqs, kv_type=kv_type) for x in (p, ref))
    out = []
    for step in MIXED_STEPS:
        slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in step])
        positions = np.concatenate([np.arange(p0, p0 + n, dtype=np.int32) for _, p0, n in step])
        for layer in (1, 0):
            q = 3 * rng.standard_normal((len(slots), n_heads * head_dim)).astype(np.float32)
            k, v = (rng.standard_normal((len(slots), n_kv * head_dim)).astype(np.float32) for _ in range(2))
            dq, dk, dv = (p.upload_float(a) for a in (q, k, v))
            got = p.to_host(p.attention(dq, dk, dv, c_p, layer, slots, positions, n_heads, n_kv, head_dim))
            out.append((got, ref.attention(q, k, v, c_ref, layer, slots, positions, n_heads, n_kv, head_dim)))
    assert_same_cache(p, c_p, c_ref, {0: 7, 1: 44, 2: 12})
    return out


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_attention_mixed_slots_and_positions(ocl, ref, kv_type):
    """Each row reads its own slot's history up to its own position: prefill chunks beside decodes, slots
    at different lengths, a rewind."""
    for got, want in run_mixed_steps(ocl, ref, kv_type):
        assert_close(got, want)


def test_a_q8_kv_cache_is_refused_in_one_line(ocl):
    # The GPU sources read float rows only; a q8 cache would be read as garbage, so it is refused before allocation.
    with pytest.raises(UsageError, match="in f32 or f16: kv_type .q8. runs on the CPU backends only"):
        ocl.kv_cache(1, 8, 2, 64, kv_type="q8")


def test_attention_reading_the_wrong_slot_fails_the_mixed_test(device, ref):
    """The mixed test can fail: with every row reading slot 0's history (a store into the right slot left
    as it is), attention goes wrong wherever a row is not in slot 0."""
    broken = kernels_src.source("opencl").replace("kv_head_base(layer, slots[i], h /", "kv_head_base(layer, 0, h /")
    assert broken != kernels_src.source("opencl")
    p = OpenCLProvider(device, source=broken)
    try:
        results = run_mixed_steps(p, ref)
    finally:
        p.close()
    wrong = [not np.allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max())) for got, want in results]
    assert all(wrong), wrong  # every call has rows outside slot 0


def test_attention_refuses_unwritten_or_overflowing_positions(ocl):
    cache = ocl.kv_cache(1, 4, 1, 16, n_seqs=2)
    x = ocl.upload_float(np.ones((2, 16), np.float32))

    def attend(slots, positions):
        return ocl.attention(x, x, x, cache, 0, np.array(slots, np.int32), np.array(positions, np.int32), 1, 1, 16)

    with pytest.raises(UsageError, match="position 1 of slot 0 follows only 0"):
        attend([0, 0], [1, 2])
    with pytest.raises(UsageError, match="position 2 of slot 1 follows only 0"):
        attend([0, 1], [0, 2])  # slot 0's rows do not fill slot 1
    attend([0, 0], [0, 1])
    with pytest.raises(UsageError, match="position 2 of slot 1 follows only 0"):
        attend([0, 1], [2, 2])  # slot 0 holds two positions, slot 1 none
    with pytest.raises(UsageError, match="position 4 is outside the context of 4"):
        attend([0, 0], [3, 4])
    with pytest.raises(UsageError, match="position -1 is outside the context of 4"):
        attend([0, 0], [-1, 0])
    with pytest.raises(UsageError, match="slot out of range 0..1"):
        attend([2, 2], [0, 1])
    with pytest.raises(UsageError, match="2 rows need 2 slots and positions"):
        attend([0], [0])
    assert cache.filled.tolist() == [[2, 0]]  # refused calls stored nothing
    attend([1, 1], [0, 1])
    attend([0, 0], [0, 1])  # a rewind of slot 0 to its start
    assert cache.filled.tolist() == [[2, 2]]


# -- the LM head's formats: the conversion kernel and the bf16 head ---------------------------------------------
SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, 1e30, -1e30, np.inf, -np.inf,
                    6.1035156e-05, 6.1e-05, 5.96e-08, 2.98e-08, 2.99e-08, 1e-10, -3e-06, 1.0009766, 1.0004883,
                    1.0014648, np.float32(1) + np.float32(2) ** -8, np.nan], np.float32)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, round to nearest even (NaN not handled: callers compare it apart)."""
    bits = a.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_table_conversion_rounds_to_nearest_even(ocl, fmt):
    """convert_table, bit for bit against NumPy: ties, overflow to infinity, subnormals, NaN."""
    rng = np.random.default_rng(11)
    values = np.concatenate([SPECIAL, rng.standard_normal(3000).astype(np.float32) * 1e3,
                             rng.standard_normal(3000).astype(np.float32) * 1e-6,
                             rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    table = values[: values.size // 10 * 10].reshape(-1, 10)
    ocl.lm_head_format = fmt
    try:
        converted = ocl._lm_table(ocl.upload_float(table))
        got = ocl._read(converted, np.uint16)
    finally:
        ocl.lm_head_format = None
    with np.errstate(over="ignore"):  # beyond 65504 NumPy rounds to infinity, as the kernel must
        want = table.astype(np.float16).view(np.uint16) if fmt == "f16" else _bf16_bits(table)
    nan = np.isnan(table)
    as_float = got.view(np.float16) if fmt == "f16" else (got.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(as_float[nan]).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_bf16_lm_head(ocl, ref):
    """An F32 table re-encoded as bf16 (what a CUDA device of CC >= 8.0 runs): the product of the rounded
    table, within 1e-4 of the largest logit."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((1001, 200)).astype(np.float32)  # 200: a tail beyond the 8-element chunks
    x = rng.standard_normal((3, 200)).astype(np.float32)
    ocl.lm_head_format = "bf16"
    try:
        got = ocl.to_host(ocl.lm_head(ocl.upload_float(x), ocl.upload_float(table)))
    finally:
        ocl.lm_head_format = None
    assert ocl.dispatches["lm_head_bf16"] >= 1
    rounded = (_bf16_bits(table).astype(np.uint32) << 16).view(np.float32)
    assert_close(got, ref.lm_head(x, rounded))


# -- feature macros: each fast path runs exactly where the device has its feature ------------------------------
def test_features_follow_the_extensions(ocl):
    ext = set(ocl.cl_device.extensions.split())
    assert ("HAS_SUBGROUP_REDUCE" in ocl.features) == bool(ext & {"cl_khr_subgroups", "cl_intel_subgroups"})
    assert ("HAS_F16" in ocl.features) == ("cl_khr_fp16" in ext)
    if "HAS_DP4A" in ocl.features:
        assert "cl_khr_integer_dot_product" in ext


BREAK = {  # a fast path's primitive made wrong, and an operation that goes through it
    "HAS_SUBGROUP_REDUCE": "#undef SG_SUM\n#define SG_SUM(v) ((v) - (v))\n",
    "HAS_DP4A": "#undef DOT4_U8_I8\n#define DOT4_U8_I8(c, q) 0\n",
    "HAS_F16": "#undef F16_TO_F32\n#define F16_TO_F32(h) 0.0f\n",
}


@pytest.mark.parametrize("feature", sorted(BREAK))
def test_a_fast_path_runs_exactly_where_its_feature_is(device, ref, feature):
    """With the feature's primitive broken in the header, results go wrong on a device that has the
    feature (its fast path ran) and stay right on one that has not (the portable path ran)."""
    p = OpenCLProvider(device, source=kernels_src.source(VENDOR_OPENCL + "\n" + BREAK[feature]))
    try:
        rng = np.random.default_rng(12)
        if feature == "HAS_SUBGROUP_REDUCE":
            x, w = rng.standard_normal((2, 512)).astype(np.float32), np.ones(512, np.float32)
            got, want = p.to_host(p.rmsnorm(p.upload_float(x), p.upload_float(w), 1e-5)), ref.rmsnorm(x, w, 1e-5)
        elif feature == "HAS_DP4A":
            w = ternary(rng, 64, 512)
            x = rng.standard_normal((2, 512)).astype(np.float32)
            got, want = p.to_host(p.bitlinear(p.upload_float(x), p.upload_ternary(w), "row")), \
                ref.bitlinear(x, w, "row")
        else:
            table = rng.standard_normal((10, 64)).astype(np.float16)
            got = p.to_host(p.embed(p.upload_float(table), np.arange(10, dtype=np.int32)))
            want = table.astype(np.float32)
        ran_fast = feature in device_features(p.cl_device)
    finally:
        p.close()
    right = np.allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert right != ran_fast, f"{feature} {'is' if ran_fast else 'is not'} on {device.name}, yet the result " \
                              f"is {'right' if right else 'wrong'}"


# -- program build, memory, receipts ----------------------------------------------------------------------
def test_build_failure_raises_with_build_log(device):
    broken = kernels_src.source("opencl") + "\nKERNEL broken(GLOBAL float* x) { x[0] = no_such_symbol; }\n"
    with pytest.raises(NoBackendError, match="no_such_symbol") as err:
        OpenCLProvider(device, source=broken)
    assert "build failed" in str(err.value)


UNUSABLE = {name: error for name, error in opencl_builds().items() if error is not None}


@pytest.mark.parametrize("name", list(UNUSABLE) or [pytest.param("none", marks=pytest.mark.skip(
    reason="every OpenCL compiler here builds kernels"))])
def test_a_platform_left_out_of_these_tests_cannot_build_our_kernels(name):
    """The tests leave out a platform whose compiler fails a trivial kernel (conftest.opencl_builds):
    the provider must fail there too, with that compiler's error, so nothing that runs is hidden."""
    p_index = [p.name.strip() for p in cl.get_platforms()].index(name)
    dev = Device("opencl", 0, name, properties={"platform_index": p_index, "device_index": 0})
    with pytest.raises(NoBackendError, match="build failed") as err:
        OpenCLProvider(dev)
    assert UNUSABLE[name] in str(err.value)


def test_from_host_makes_an_activation(fresh):
    x = np.random.default_rng(13).standard_normal((3, 100)).astype(np.float32)
    handle = fresh.from_host(x.astype(np.float64))  # any float input arrives as float32
    np.testing.assert_array_equal(fresh.to_host(handle), x)
    assert fresh.leaks() == ["activation (1200 bytes)"]  # an activation, counted until dropped
    del handle
    assert fresh.leaks() == []


def _layer_like(p: OpenCLProvider, w, norm, x) -> np.ndarray:
    h = p.rmsnorm(x, norm, 1e-5)
    y = p.add(x, p.bitlinear(h, w, "row"))
    return p.to_host(p.act_mul(y, y, "silu"))


def test_pool_reuses_buffers_and_close_leaves_nothing(fresh):
    rng = np.random.default_rng(9)
    w, norm = fresh.upload_ternary(ternary(rng, 512, 512)), fresh.upload_float(np.ones(512, np.float32))
    x = fresh.upload_float(rng.standard_normal((2, 512)).astype(np.float32))
    first = _layer_like(fresh, w, norm, x)
    allocations = fresh.pool.stats.allocations
    np.testing.assert_array_equal(_layer_like(fresh, w, norm, x), first)
    stats = fresh.pool.stats
    assert stats.allocations == allocations and stats.cache_hits > 0  # the steady state allocates nothing
    assert stats.peak >= stats.current > 0 and fresh.leaks() == []
    fresh.close()
    fresh.close()  # idempotent
    assert (stats.current, stats.in_use, fresh.leaks()) == (0, 0, [])


def test_held_activation_is_reported_as_leak(fresh):
    x = fresh.upload_float(np.ones((1, 64), np.float32))
    held = fresh.add(x, x)
    assert fresh.leaks() == ["activation (256 bytes)"]
    fresh.close()
    assert fresh.leaks() == ["activation (256 bytes)"] and fresh.pool.stats.current == 0
    del held  # its finalizer runs after close without touching released memory


def test_dispatches_record_what_ran(fresh):
    w = fresh.upload_ternary(ternary(np.random.default_rng(0), 8, 256))
    x = fresh.upload_float(np.ones((1, 256), np.float32))
    fresh.bitlinear(x, w, "block256")
    fresh.bitlinear(x, w, "none")
    fresh.argmax(fresh.rows(x, np.array([0], np.int32)))
    assert dict(fresh.dispatches) == {"quantize_i8": 1, "ternary_matmul_i8": 1, "ternary_matmul_f32": 1,
                                      "copy_rows": 1, "argmax_f32": 1}


# -- the portable source ------------------------------------------------------------------------------------
def test_kernel_body_is_vendor_neutral():
    """Vendor spellings belong in the vendor headers only, and fast paths key on features, not vendors."""
    body = kernels_src.source("opencl").split('#line 1 "bitnet_kernels.c"', 1)[1]
    for word in ("__kernel", "__global", "__local", "get_local_id", "get_group_id", "get_global_id",
                 "barrier(", "CLK_", "as_float(", "as_uint(", "vload", "sub_group", "__CUDACC__",
                 "__CUDA_ARCH__", "__shfl", "__dp4a", "__half", "threadIdx", "gridDim"):
        assert word not in body, f"{word!r} in the portable kernel body"
    assert kernels_src.source("cuda").startswith('#line 1 "vendor_cuda.h"')


def test_source_takes_a_third_partys_header(tmp_path):
    header = tmp_path / "vendor_metal.h"
    header.write_text("#define KERNEL kernel void\n")
    from_path = kernels_src.source(header)
    assert from_path.startswith('#line 1 "vendor_metal.h"\n#define KERNEL kernel void\n')
    assert from_path.endswith(kernels_src.source("opencl").split('#line 1 "bitnet_kernels.c"', 1)[1])
    assert kernels_src.source("#define KERNEL kernel void\n") == from_path.replace("vendor_metal.h", "vendor header")
    with pytest.raises(ValueError, match="vendor 'metal'"):
        kernels_src.source("metal")


def test_a_wrongly_rounded_f16_store_fails_the_cache_check(device, ref):
    """The cache comparison can fail: an F16 store that truncates instead of rounding to nearest even
    (on both the hardware and the portable path) leaves a cache that differs from the reference's."""
    truncating = "#undef F32_TO_F16\n#define F32_TO_F16(f) ((uint)as_ushort(convert_half_rtz(f)))\n"
    source = kernels_src.source(VENDOR_OPENCL + "\n" + truncating).replace(
        "return sign | ((a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13);", "return sign | ((a - 0x38000000u) >> 13);")
    assert source.count("0x38000000u") == 1
    p = OpenCLProvider(device, source=source)
    try:
        with pytest.raises(AssertionError, match="not equal"):
            run_mixed_steps(p, ref, "f16")
    finally:
        p.close()
