"""The CUDA provider's host code.

Without a GPU (here and in CI) it runs against a recording fake of pycuda (tests/fake_pycuda.py):
every launch must match its kernel's signature in the shared source, every device-to-host copy must
follow a stream synchronisation, the LM-head format must follow the compute capability, and the pool
must account for every byte. With a CUDA device (tests marked `cuda`) it runs for real: the
conformance kit and an end-to-end comparison of logits with the CPU backend.
"""

from __future__ import annotations

import importlib
import re
import sys

import fake_pycuda
import numpy as np
import pytest

from bitnet import gpu as kernels_src
from bitnet.errors import NoBackendError, UsageError
from bitnet.modelfile.ternary import from_values
from bitnet.plugins.types import Device
from bitnet.runtime.reference import ReferenceProvider
from bitnet.testing import operation_support


def signatures() -> dict[str, str]:
    """Each kernel's parameter format from the source text: P pointer, i int, f float, Q 64-bit count."""
    out = {}
    for m in re.finditer(r"^KERNEL\s+(\w+)\s*\(([^)]*)\)", kernels_src.source("cuda"), re.M):
        params = [" ".join(p.split()) for p in m.group(2).split(",")]
        out[m.group(1)] = "".join("P" if "*" in p else "Q" if p.startswith("U64")
                                  else "f" if p.startswith("float") else "i" if p.startswith("int") else "?"
                                  for p in params)
    return out


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("BITNET_CUDA_LM_HEAD", raising=False)
    state = fake_pycuda.Driver()
    fake_pycuda.install(monkeypatch, state)
    module = importlib.import_module("bitnet_cuda.provider")
    monkeypatch.setitem(sys.modules, "bitnet_cuda.provider", module)  # dropped again after the test
    state.module = module
    return state


def open_fake(state, capability=(8, 6), source=None):
    state.capability = capability
    return state.module.CudaProvider(Device("cuda", 0, "Fake GPU"), source=source)


def launches(state, name=None):
    return [e for e in state.log if e[0] == "launch" and (name is None or e[1] == name)]


def ternary(rng, rows, cols):
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    return from_values(t, rng.uniform(0.5, 2.0, size=(rows, cols // 256)).astype(np.float32))


def run_every_op(p, rng):
    """Each operation once or more, the way the transformer calls them."""
    dim, heads, kv_heads, head_dim = 256, 4, 2, 64
    table = p.upload_float(rng.standard_normal((300, dim)).astype(np.float16))
    x = p.embed(table, np.array([1, 5, 7], np.int32))
    h = p.rmsnorm(x, p.upload_float(np.ones(dim, np.float32)), 1e-5)
    for mode in ("row", "block256", "none"):
        p.bitlinear(h, p.upload_ternary(ternary(rng, 384, dim)), mode)
    def proj(rows):
        return p.bitlinear(h, p.upload_ternary(ternary(rng, rows, dim)), "row")

    slots, positions = np.array([2, 0, 0], np.int32), np.array([0, 0, 1], np.int32)  # two sequences
    q = p.rope(proj(heads * head_dim), heads, head_dim, positions, 1e4)
    k = p.rope(proj(kv_heads * head_dim), kv_heads, head_dim, positions, 1e4)
    v = proj(kv_heads * head_dim)
    a = p.attention(q, k, v, p.kv_cache(2, 16, kv_heads, head_dim, 3), 1, slots, positions, heads, kv_heads, head_dim)
    p.attention(q, k, v, p.kv_cache(2, 16, kv_heads, head_dim, 3, kv_type="f16"), 1, slots, positions, heads,
                kv_heads, head_dim)
    y = p.add(a, p.act_mul(a, a, "relu2"))
    y = p.act_mul(y, y, "silu")
    logits = p.lm_head(p.rows(y, np.array([0, 2], np.int32)), table)  # each sequence's last row
    p.lm_head(y, p.upload_float(rng.standard_normal((300, dim)).astype(np.float32)))
    return p.to_host(logits), p.argmax(logits)


def test_every_launch_matches_its_kernel_signature_and_limits(fake):
    p = open_fake(fake)
    run_every_op(p, np.random.default_rng(0))
    sigs, seen = signatures(), set()
    for _, name, grid, block, fmt, args in launches(fake):
        seen.add(name)
        assert fmt == sigs[name], f"{name}: launched with {fmt}, the kernel takes {sigs[name]}"
        local = block[0]
        assert block[1:] == (1, 1) and local & (local - 1) == 0 and 1 <= local <= 256, (name, block)
        assert len(grid) == 2 and all(isinstance(g, int) and g >= 1 for g in grid) and grid[1] <= 65535
        assert all(a % 256 == 0 for a, f in zip(args, fmt, strict=True) if f == "P"), "an unaligned pointer"
    # F16 embedding; the F32 table runs as bf16; widths of whole 256-blocks need no zero extension
    assert seen == set(sigs) - {"embed_f32", "lm_head_f32", "zero_extend_f32"}
    assert sum(p.dispatches.values()) == len(launches(fake)) + 1  # + copy_rows, device copies
    assert p.dispatches["copy_rows"] == 1
    assert [e for e in fake.log if e[0] == "dtod"] == [("dtod", 4 * 256)] * 2  # rows 0 and 2: two runs, in bounds


def test_every_read_waits_for_the_stream(fake):
    """The seed's race (#432 there): a copy to the host overtaking the kernel that writes its source.
    Here each device-to-host copy comes right after a synchronisation of the one stream."""
    p = open_fake(fake)
    run_every_op(p, np.random.default_rng(1))
    reads = [i for i, e in enumerate(fake.log) if e[0] == "dtoh"]
    assert len(reads) == 2  # to_host and argmax, nothing else reads
    for i in reads:
        assert fake.log[i - 1] == ("sync",), fake.log[i - 3:i + 1]


def test_every_call_runs_with_the_context_current_and_leaves_the_stack_as_it_was(fake):
    p = open_fake(fake)
    run_every_op(p, np.random.default_rng(2))  # the fake asserts a current context at each driver call
    p.close()
    assert fake.depth == 0


def test_nvtx_range_per_operation(fake, monkeypatch):
    ranges = []

    class Recorder:
        @staticmethod
        def push_range(message, domain=None):
            ranges.append(("push", message, domain))

        @staticmethod
        def pop_range(domain=None):
            ranges.append(("pop", domain))

    monkeypatch.setattr(fake.module, "nvtx", Recorder)
    p = open_fake(fake)
    x = p.upload_float(np.ones((2, 64), np.float32))
    with p.region("layer 0"):
        p.add(x, x)
    assert ranges == [("push", "upload_float", "bitnet"), ("pop", "bitnet"), ("push", "layer 0", "bitnet"),
                      ("push", "add", "bitnet"), ("pop", "bitnet"), ("pop", "bitnet")]


@pytest.mark.parametrize("capability, table, kernel, converted", [
    ((9, 0), np.float32, "lm_head_bf16", (0, 2)),
    ((8, 0), np.float32, "lm_head_bf16", (0, 2)),
    ((7, 5), np.float32, "lm_head_f16", (0, 1)),
    ((6, 0), np.float32, "lm_head_f16", (0, 1)),
    ((5, 2), np.float32, "lm_head_f32", None),
    ((8, 6), np.float16, "lm_head_f16", None),  # F16 stays F16: bf16 would lose bits and save no bytes
])
def test_lm_head_format_follows_compute_capability(fake, capability, table, kernel, converted):
    p = open_fake(fake, capability)
    t = p.upload_float(np.zeros((100, 64), table))
    x = p.upload_float(np.zeros((1, 64), np.float32))
    p.lm_head(x, t)
    p.lm_head(x, t)
    assert [e[1] for e in launches(fake) if e[1].startswith("lm_head")] == [kernel, kernel]
    conversions = launches(fake, "convert_table")
    if converted is None:
        assert conversions == []
    else:  # once per table, source and destination formats as the kernel numbers them
        assert len(conversions) == 1
        args = conversions[0][5]
        assert (args[2], args[5], args[6]) == (*converted, 100 * 64)


@pytest.mark.parametrize("forced, table, kernel", [("f32", np.float16, "lm_head_f32"),
                                                   ("bf16", np.float16, "lm_head_bf16"),
                                                   ("F16", np.float32, "lm_head_f16")])
def test_lm_head_format_can_be_forced(fake, monkeypatch, forced, table, kernel):
    monkeypatch.setenv("BITNET_CUDA_LM_HEAD", forced)
    p = open_fake(fake, (8, 6))
    assert p.lm_head_reason == "BITNET_CUDA_LM_HEAD"
    p.lm_head(p.upload_float(np.zeros((1, 64), np.float32)), p.upload_float(np.zeros((10, 64), table)))
    assert [e[1] for e in launches(fake) if e[1].startswith("lm_head")] == [kernel]


def test_lm_head_format_rejects_an_unknown_value(fake, monkeypatch):
    monkeypatch.setenv("BITNET_CUDA_LM_HEAD", "fp8")
    with pytest.raises(UsageError, match="BITNET_CUDA_LM_HEAD='fp8'"):
        open_fake(fake)


def test_device_out_of_memory_is_a_clear_error(fake):
    p = open_fake(fake)
    fake.memory = 1 << 20
    p.upload_float(np.zeros((512,), np.float32))
    with pytest.raises(NoBackendError, match=r"out of memory: float \(1024, 1024\) needs 4\.0 MiB"):
        p.upload_float(np.zeros((1024, 1024), np.float32))


def test_out_of_memory_gives_cached_buffers_back_first(fake):
    p = open_fake(fake)
    x = p.upload_float(np.ones((1, 1000), np.float32))
    for _ in range(3):
        p.add(x, x)  # each result is dropped at once: one cached 4000-byte buffer
    fake.memory = fake.used + 1000  # room only if the cache is trimmed
    p.add(p.upload_float(np.ones((1, 250), np.float32)), p.upload_float(np.ones((1, 250), np.float32)))
    assert ("free", 4000) in fake.log


def test_pool_reuses_buffers_and_close_leaves_nothing(fake):
    p = open_fake(fake)
    rng = np.random.default_rng(3)
    w, norm = p.upload_ternary(ternary(rng, 512, 512)), p.upload_float(np.ones(512, np.float32))
    x = p.upload_float(rng.standard_normal((2, 512)).astype(np.float32))

    def step():
        y = p.add(x, p.bitlinear(p.rmsnorm(x, norm, 1e-5), w, "row"))
        return p.to_host(p.act_mul(y, y, "silu"))

    step()
    allocations = p.pool.stats.allocations
    step()
    stats = p.pool.stats
    assert stats.allocations == allocations and stats.cache_hits > 0  # the steady state allocates nothing
    assert stats.peak >= stats.current > 0 and p.leaks() == []
    assert p.memory_stats()["peak_bytes"] == stats.peak
    p.close()
    p.close()  # idempotent
    assert (stats.current, stats.in_use, p.leaks(), fake.used) == (0, 0, [], 0)


def test_held_activation_is_reported_as_leak(fake):
    p = open_fake(fake)
    x = p.upload_float(np.ones((1, 64), np.float32))
    held = p.add(x, x)
    assert p.leaks() == ["activation (256 bytes)"]
    p.close()
    assert p.leaks() == ["activation (256 bytes)"] and fake.used == 0
    del held  # its finalizer runs after close without touching released memory


def test_build_failure_raises_with_the_compiler_log(fake):
    fake.fail_source = "no_such_symbol"
    broken = kernels_src.source("cuda") + "\nKERNEL broken(GLOBAL float* x) { x[0] = no_such_symbol; }\n"
    with pytest.raises(NoBackendError, match="no_such_symbol") as err:
        open_fake(fake, source=broken)
    assert "CUDA kernel build failed on Fake GPU (sm_86)" in str(err.value)


def test_module_is_built_once_per_process_with_the_options_ci_checks(fake):
    from bitnet_cuda import nvcc_options

    a, b = open_fake(fake), open_fake(fake)
    assert len(fake.module._MODULES) == 1
    (module,) = fake.module._MODULES.values()
    assert module.options == nvcc_options(256) and module.no_extern_c
    assert a.kernels.keys() == b.kernels.keys() == set(signatures())


def test_batches_beyond_the_grid_limit_are_refused(fake):
    p = open_fake(fake)
    x = p.upload_float(np.zeros((70000, 8), np.float32))
    with pytest.raises(UsageError, match="grid limit"):
        p.rope(x, 1, 8, np.arange(70000, dtype=np.int32), 1e4)


def test_index_arrays_go_to_the_device_once_per_forward(fake):
    """The transformer passes the same slots and positions to every layer: they are copied to the device
    when their values change, not at every rope and attention call."""
    p = open_fake(fake)
    cache = p.kv_cache(4, 32, 1, 16, 2)
    x = p.upload_float(np.ones((3, 16), np.float32))

    def forward(slots, positions):
        before = len([e for e in fake.log if e[0] == "htod"])
        for layer in range(4):
            q = p.rope(x, 1, 16, positions, 1e4)
            p.attention(q, q, x, cache, layer, slots, positions, 1, 1, 16)
        return len([e for e in fake.log if e[0] == "htod"]) - before

    slots, positions = np.array([0, 0, 1], np.int32), np.array([0, 1, 0], np.int32)
    assert forward(slots, positions) == 2 + 2  # slots and positions, and the rope tables on first use
    assert forward(slots, np.array([2, 3, 1], np.int32)) == 1  # a decode step: only the positions changed
    assert forward(np.array([1, 1, 0], np.int32), np.array([2, 3, 1], np.int32)) == 1


# -- on a real CUDA device -----------------------------------------------------------------------------
def _cuda_probe():
    from bitnet_cuda.probe import probe

    return probe()


PROBE = _cuda_probe()


@pytest.fixture
def cuda():
    from bitnet_cuda.provider import CudaProvider

    p = CudaProvider(PROBE.devices[0])
    yield p
    p.close()


@pytest.mark.parametrize("lm_head", ["auto", "f32"])
@pytest.mark.cuda
@pytest.mark.skipif(not PROBE.devices, reason=f"no CUDA device: {PROBE.reason}")
def test_conformance_kit_on_cuda(monkeypatch, lm_head):
    from bitnet.testing import check_provider
    from bitnet_cuda.provider import CudaProvider

    if lm_head != "auto":
        monkeypatch.setenv("BITNET_CUDA_LM_HEAD", lm_head)
    p = CudaProvider(PROBE.devices[0])
    try:
        check_provider(p)  # its LM-head table is F16: exact in every format but bf16, which auto never picks
        assert p.leaks() == []
    finally:
        p.close()


@pytest.mark.cuda
@pytest.mark.skipif(not PROBE.devices, reason=f"no CUDA device: {PROBE.reason}")
@pytest.mark.parametrize("forced, rtol", [("f32", 1e-5), ("f16", 2e-3), ("bf16", 1.6e-2)])
def test_lm_head_formats_on_cuda(monkeypatch, forced, rtol):
    from bitnet_cuda.provider import CudaProvider

    monkeypatch.setenv("BITNET_CUDA_LM_HEAD", forced)
    rng = np.random.default_rng(5)
    table = rng.standard_normal((5000, 2560)).astype(np.float32)
    x = rng.standard_normal((3, 2560)).astype(np.float32)
    p = CudaProvider(PROBE.devices[0])
    try:
        got = p.to_host(p.lm_head(p.upload_float(x), p.upload_float(table)))
    finally:
        p.close()
    want = ReferenceProvider().lm_head(x, table)
    assert np.abs(got - want).max() <= rtol * np.abs(want).max()


@pytest.mark.cuda
@pytest.mark.skipif(not PROBE.devices, reason=f"no CUDA device: {PROBE.reason}")
def test_every_read_sees_the_work_before_it(cuda):
    """Back-to-back launch and read, many times: a read that overtook its kernel would see stale data."""
    ref = ReferenceProvider()
    rng = np.random.default_rng(6)
    w = ternary(rng, 2560, 2560)
    dw = cuda.upload_ternary(w)
    for _ in range(50):
        x = rng.standard_normal((1, 2560)).astype(np.float32)
        got = cuda.to_host(cuda.bitlinear(cuda.upload_float(x), dw, "row"))
        np.testing.assert_allclose(got, ref.bitlinear(x, w, "row"), rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not PROBE.devices, reason=f"no CUDA device: {PROBE.reason}")
def test_logits_match_the_cpu_backend_end_to_end(cpu_env, monkeypatch):
    import bitnet

    ids = list(range(1, 40))
    with bitnet.load(device="cpu") as cpu_engine:
        want = cpu_engine.logits(ids)
    with bitnet.load(device="cuda") as cuda_engine:
        got = cuda_engine.logits(ids)
        # An operation the provider stopped implementing would run on the host and be counted.
        support = operation_support(cuda_engine.provider)
        assert support.pop("lm_head_q8") == "fallback"  # GPUs run the int8 head on the host (design.md 4)
        assert set(support.values()) == {"native"}
        assert cuda_engine.provider.backend == "cuda" and not cuda_engine.provider.fallbacks
        assert cuda_engine.provider.leaks() == []
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
