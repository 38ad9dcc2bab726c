"""The CPU plugin's numba kernels against the NumPy reference: exact integer sums, tight float tolerances."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, from_values, reverse_fields
from bitnet.runtime import reference as ref_mod
from bitnet.runtime.reference import ReferenceProvider
from bitnet_cpu import ternary_kernels as tk
from bitnet_cpu.provider import CpuProvider

REF = ReferenceProvider()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def cpu(request: pytest.FixtureRequest) -> CpuProvider:
    if request.param > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba runs at most {numba.config.NUMBA_NUM_THREADS} threads here")
    return CpuProvider(n_threads=request.param)


def ternary(rng: np.random.Generator, rows: int, cols: int, block_scales: bool, unit: bool = False):
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    if unit:
        scale = np.float32(1.0)
    elif block_scales:
        scale = rng.uniform(0.5, 2.0, size=(rows, cols // BLOCK)).astype(np.float32)
    else:
        scale = rng.uniform(0.5, 2.0, size=rows).astype(np.float32)
    return from_values(t, scale)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))


# -- quantization: the same int8 values and scales as the reference, bit for bit -------------------

# Byte order for weights whose fields are reversed (I2_S): field f holds the columns of field 3 - f.
_lane = np.arange(BLOCK)
MIRRORED_PERM = 128 * ((_lane % 64) // 32) + 32 * (3 - _lane // 64) + _lane % 32


def test_quantize_rows_is_bit_exact() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 100, (6, 1))).astype(np.float32)
    x[1] = 0.0  # an all-zero row: s = 1, q = 0
    x[2, :300] = np.arange(300, dtype=np.float32) / 2 - 75  # exact halves: ties round to even
    x[2, 300] = 127.0
    q, s, qsum = np.empty((6, 512), np.int8), np.empty(6, np.float32), np.empty((6, 2), np.int32)
    want_q, want_s = ref_mod.quantize_rows(x)
    want_q = want_q.reshape(6, 2, BLOCK)
    for rev, perm in ((False, tk.PERM), (True, MIRRORED_PERM)):
        tk.quantize_rows(x, q, s, qsum, rev)
        np.testing.assert_array_equal(s, want_s)
        np.testing.assert_array_equal(q.reshape(6, 2, BLOCK), want_q[:, :, perm])
        np.testing.assert_array_equal(qsum, want_q.sum(axis=2))


def test_quantize_q8k_is_bit_exact() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[0, 256:512] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 5], x[1, 9] = -4.0, 4.0  # equal magnitudes: the first one sets the sign of iscale
    q, d, qsum = np.empty((3, 768), np.int8), np.empty((3, 3), np.float32), np.empty((3, 3), np.int32)
    tk.quantize_q8k(x, q, d, qsum, False)
    want_q, want_d = ref_mod.quantize_q8k(x)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(q.reshape(3, 3, BLOCK), want_q[:, :, tk.PERM])
    np.testing.assert_array_equal(qsum, want_q.sum(axis=2))


# -- BitLinear -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(1, 256), (65, 512), (130, 768)])
@pytest.mark.parametrize("n", [1, 3, 7])
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
    rng = np.random.default_rng(rows + cols + n)
    w = ternary(rng, rows, cols, block_scales)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    x[-1, :BLOCK] = 0.0  # an all-zero block (a zero Q8_K scale)
    if n > 2:
        x[1] = 0.0  # an all-zero row
    got = cpu.bitlinear(x, cpu.upload_ternary(w), mode)
    want = REF.bitlinear(x, w, mode)
    assert got.dtype == np.float32 and got.shape == (n, rows)
    assert rel_err(got, want) < (1e-5 if mode == "none" else 1e-6)


@pytest.mark.parametrize("mode", ["row", "block256", "none"])
@pytest.mark.parametrize("layout", ["tq2_0", "i2_s"])
def test_bitlinear_reads_weights_in_file_layouts(cpu: CpuProvider, mode: str, layout: str) -> None:
    # TQ2_0 weights stay in the file: 64 code bytes, then 2 scale bytes (random here, so a kernel
    # that ignored the block stride would read them as codes and be wrong). I2_S bytes hold
    # their four codes in reverse order.
    rng = np.random.default_rng(11)
    w = ternary(rng, 70, 768, block_scales=True)
    if layout == "tq2_0":
        raw = rng.integers(0, 256, (70, 3, 66), dtype=np.uint8)
        raw[:, :, :64] = w.blocks()
        strided = TernaryMatrix(raw[:, :, :64], w.scales)
    else:
        strided = TernaryMatrix(reverse_fields(w.packed()), w.scales, fields_reversed=True)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    for rows in (slice(0, 1), slice(0, 5)):  # decode and prefill
        got = cpu.bitlinear(x[rows], cpu.upload_ternary(strided), mode)
        np.testing.assert_array_equal(got, cpu.bitlinear(x[rows], cpu.upload_ternary(w), mode))
        assert rel_err(got, REF.bitlinear(x[rows], w, mode)) < (1e-5 if mode == "none" else 1e-6)


def test_extreme_codes_and_zero_weights(cpu: CpuProvider) -> None:
    # Every weight +1 or every weight -1 with maximal activations: the largest block sums.
    cols = 1024
    t = np.ones((4, cols), np.int8)
    t[1] = -1
    t[2] = 0
    t[3, ::2] = -1
    w = from_values(t, np.float32(0.75))
    x = np.full((2, cols), 3.0, np.float32)
    x[1, ::3] = -3.0
    for mode in ("row", "block256"):
        got = cpu.bitlinear(x, cpu.upload_ternary(w), mode)
        np.testing.assert_allclose(got, REF.bitlinear(x, w, mode), rtol=1e-6, atol=0)
        assert np.all(got[:, 2] == 0)


def test_dispatches_name_the_kernel(cpu: CpuProvider) -> None:
    rng = np.random.default_rng(3)
    w_row, w_block = ternary(rng, 8, 512, False), ternary(rng, 8, 512, True)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    cpu.bitlinear(x, cpu.upload_ternary(w_row), "row")
    cpu.bitlinear(x, cpu.upload_ternary(w_block), "row")
    cpu.bitlinear(x, cpu.upload_ternary(w_row), "block256")
    assert {"cpu.bitlinear_rowscale_row", "cpu.bitlinear_blockscale_row",
            "cpu.bitlinear_blockscale_block256"} <= set(cpu.dispatches)


# -- float kernels -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("vocab, n", [(1, 1), (1000, 1), (1537, 3)])
def test_lm_head(cpu: CpuProvider, dtype: type, vocab: int, n: int) -> None:
    rng = np.random.default_rng(vocab + n)
    table = rng.standard_normal((vocab, 320)).astype(dtype)
    table[0, :5] = [np.finfo(np.float16).tiny / 4, -0.0, 65504.0 / 512, 1e-7, -6e-8]  # F16 subnormals too
    x = rng.standard_normal((n, 320)).astype(np.float32)
    got = cpu.lm_head(x, cpu.upload_float(table))
    want = REF.lm_head(x, REF.upload_float(table))
    assert got.shape == (n, vocab) and rel_err(got, want) < 1e-5
    assert np.array_equal(cpu.argmax(got), REF.argmax(want))


def test_attention_prefill_then_decode(cpu: CpuProvider) -> None:
    rng = np.random.default_rng(4)
    heads, kv_heads, hd = 8, 2, 64
    caches = cpu.kv_cache(2, 40, kv_heads, hd), REF.kv_cache(2, 40, kv_heads, hd)
    pos = 0
    for n in (7, 1, 1, 29):
        q = rng.standard_normal((n, heads * hd)).astype(np.float32) * 3
        k = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
        v = rng.standard_normal((n, kv_heads * hd)).astype(np.float32)
        got = cpu.attention(q, k, v, caches[0], 1, pos, heads, kv_heads, hd)
        want = REF.attention(q, k, v, caches[1], 1, pos, heads, kv_heads, hd)
        assert rel_err(got, want) < 1e-5, (pos, n)
        pos += n


@pytest.mark.parametrize("n", [1, 5])
def test_elementwise_kernels(cpu: CpuProvider, n: int) -> None:
    rng = np.random.default_rng(5 + n)
    x = (rng.standard_normal((n, 384)) * 4).astype(np.float32)
    y = rng.standard_normal((n, 384)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 384).astype(np.float32)
    assert rel_err(cpu.rmsnorm(x, w, 1e-5), REF.rmsnorm(x, w, 1e-5)) < 1e-6
    assert rel_err(cpu.rope(x, 3, 128, 1000, 500000.0), REF.rope(x, 3, 128, 1000, 500000.0)) < 1e-6
    for act in ("silu", "relu2"):
        assert rel_err(cpu.act_mul(x, y, act), REF.act_mul(x, y, act)) < 1e-6
    np.testing.assert_array_equal(cpu.add(x, y), REF.add(x, y))


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


# -- the other instruction sets, and the import cost ---------------------------------------------------

_ISA_CHECK = textwrap.dedent("""
    import numpy as np
    from bitnet.runtime.reference import ReferenceProvider
    from bitnet.modelfile.ternary import from_values
    from bitnet_cpu import ternary_kernels as tk
    from bitnet_cpu.provider import CpuProvider
    assert tk.ISA == "{isa}", tk.ISA
    rng = np.random.default_rng(0)
    cpu, ref = CpuProvider(), ReferenceProvider()
    for rows, cols, n, scale in [(5, 256, 1, 1.0), (70, 768, 6, rng.uniform(0.5, 2, (70, 3)))]:
        w = from_values(rng.integers(-1, 2, (rows, cols)).astype(np.int8), np.float32(scale))
        x = rng.standard_normal((n, cols)).astype(np.float32)
        for mode in ("row", "block256"):
            got, want = cpu.bitlinear(x, cpu.upload_ternary(w), mode), ref.bitlinear(x, w, mode)
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 1e-6, (rows, mode, err)
    print("ok")
""")


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_other_instruction_sets(isa: str) -> None:
    from llvmlite import binding

    if isa == "avx2" and not binding.get_host_cpu_features().get("avx2"):
        pytest.skip("the host has no AVX2")
    env = {**os.environ, "BITNET_CPU_ISA": isa}  # also turns the disk cache off for that process
    r = subprocess.run([sys.executable, "-c", _ISA_CHECK.format(isa=isa)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_import_does_not_load_numba() -> None:
    code = "import sys, bitnet_cpu; bitnet_cpu.probe(); assert 'numba' not in sys.modules, 'numba imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
