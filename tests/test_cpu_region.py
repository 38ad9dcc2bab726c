"""The CPU plugin's layer region (`layer_regions.layers_row_rowscale`): a decode step's tokens through every layer in
one parallel region give the bits, and the cache, of the operations one by one, at each level this host runs and
at 1 and 2 threads; how its threads claim, stamp and prefetch their work. (The kernels alone: test_cpu_kernels.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_support import file_layout, provider, ternary

from bitnet.modelfile.ternary import TernaryMatrix
from bitnet.runtime.provider import KernelProvider, LayerWeights
from bitnet.runtime.reference import q8_kv_rows
from bitnet_cpu import isa
from bitnet_cpu.dot_ir import WIDE
from bitnet_cpu.provider import CpuProvider

LEVELS = isa.host_levels()


def layer_stack(cpu: CpuProvider, rng: np.random.Generator, n_layers: int, layout: str, sub: bool,
                block_scales: bool = False) -> list[LayerWeights]:
    """n_layers layers as 2B-4T's, narrower: dim 512, 4 query heads over 2 KV heads of 128, FFN 768 (gate/up 24
    tasks, down 8: both threads claim from both shares), weights in a file layout."""
    def w(rows: int, cols: int) -> TernaryMatrix:
        return file_layout(rng, ternary(rng, rows, cols, block_scales), layout)

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    return [LayerWeights(norm(512), cpu.upload_ternary_group([w(512, 512), w(256, 512), w(256, 512)]),
                         cpu.upload_ternary(w(512, 512)), norm(512) if sub else None, norm(512),
                         cpu.upload_ternary_group([w(768, 512), w(768, 512)]), cpu.upload_ternary(w(512, 768)),
                         norm(768) if sub else None)
            for _ in range(n_layers)]


def run_stack(cpu: CpuProvider, layers: list[LayerWeights], x: np.ndarray, cache: object, slots: list[int],
              positions: list[int], act: str, own: bool = True, mode: str = "row") -> np.ndarray:
    """x's rows at their slots and positions through the stack: the provider's, or the composition."""
    run = cpu.layer_stack if own else lambda *a: KernelProvider.layer_stack(cpu, *a)
    return run(x, layers, cache, np.array(slots, np.int32), np.array(positions, np.int32), 4, 2, 128, 10000.0, 1e-5,
               act, mode)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
@pytest.mark.parametrize("sub,act", [(True, "relu2"), (False, "silu")], ids=["sub_norm_relu2", "silu"])
@pytest.mark.parametrize("layout", ["tq2_0", "i2_s"])
def test_a_few_tokens_run_through_the_layers_in_one_region_as_their_operations_would(
        cpu: CpuProvider, kv_type: str, sub: bool, act: str, layout: str) -> None:
    rng = np.random.default_rng(23)
    layers = layer_stack(cpu, rng, 3, layout, sub)
    x = (rng.standard_normal((12, 512)) * 3).astype(np.float32)
    caches = [cpu.kv_cache(3, 16, 2, 128, 2, kv_type) for _ in "ab"]
    steps = (  # rows of x, their slots and positions
        (slice(0, 9), [1] * 9, list(range(9))),  # a prompt of more tokens than a region takes: the operations
        (slice(9, 10), [1], [9]),  # a decode step
        (slice(0, 3), [0, 0, 0], [0, 1, 2]),  # a short prompt
        (slice(10, 12), [0, 1], [3, 10]),  # two sequences' decode steps together
    )
    for rows, slots, positions in steps:
        fused = cpu.dispatches["cpu.layer_stack_rowscale_row"]
        got = run_stack(cpu, layers, x[rows], caches[0], slots, positions, act)
        want = run_stack(cpu, layers, x[rows], caches[1], slots, positions, act, own=False)
        assert cpu.dispatches["cpu.layer_stack_rowscale_row"] == fused + (len(slots) < 9)
        np.testing.assert_array_equal(got, want)
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            np.testing.assert_array_equal(a, b)
    assert np.all(np.any(caches[0].k[:, :, 3] != 0, axis=(2, 3)))  # every layer stored both slots' K
    for mode in ("block256", "none"):  # other quantizations run as the operations
        got = run_stack(cpu, layers, x[:1], caches[0], [1], [11], act, True, mode)
        want = run_stack(cpu, layers, x[:1], caches[1], [1], [11], act, False, mode)
        assert cpu.dispatches["cpu.layer_stack_rowscale_row"] == 3
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("level", LEVELS)
def test_one_tokens_runs_of_tasks_give_each_tasks_floats(level: str) -> None:
    # token_tasks runs each run of tasks adjacent in memory and in the output as one loop of dots: its floats are
    # rowscale_task's, task by task, in order (one run across two arrays where they are adjacent), reversed (no
    # runs), with a task's rows moved in memory (its output still next) and with its output moved (its rows still
    # next): a run ends at either.
    p, k = provider(1, level), isa.kernels(level)
    rng = np.random.default_rng(41)
    w = p.upload_ternary_group([ternary(rng, 200, 512, False), ternary(rng, 100, 512, False)])
    tasks, bstride, cols = w.row_tasks, w.row_bstride, 512
    nb, rev = k.row_blocks(cols), w.fields_reversed
    q, s, qsum, qtot = k._activations(1, cols)
    k._quantize((rng.standard_normal((1, cols)) * 3).astype(np.float32), rev, q, s, qsum, qtot)
    scales = np.tile(w.row_scales, 3)  # room for an output moved past the stack
    rows_moved, out_moved = tasks.copy(), tasks.copy()
    rows_moved[1, 0] += 8 * rows_moved[1, 1]  # task 1 reads 8 rows further on
    out_moved[1, 4] += 300  # task 1 writes 300 rows further on
    for table in (tasks, tasks[::-1].copy(), rows_moved, out_moved):
        want, got = np.zeros(len(scales), np.float32), np.zeros(len(scales), np.float32)
        isum, acc = np.empty(2 * WIDE, np.int32), np.empty((WIDE, 1, 64), np.int32)
        for task in range(len(table)):
            k.rowscale_task(table, task, nb, bstride, q, qtot, s, scales, want, 1, isum, acc)
        k.token_tasks(table, 0, len(table), nb, bstride, q, qtot, s, scales, got, isum,
                      np.empty((1, 1, len(scales)), np.int32))
        assert np.count_nonzero(want) > 250
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
def test_a_long_sequences_attention_in_parts_runs_in_the_region_as_the_operation_would(
        cpu: CpuProvider, kv_type: str) -> None:
    # A sequence past 2 * CHUNK positions (its attention in three parts a head) beside a short one.
    from bitnet_cpu import attention as attn

    rng = np.random.default_rng(29)
    layers = layer_stack(cpu, rng, 2, "i2_s", True)
    n_ctx = 2 * attn.CHUNK + 32
    caches = [cpu.kv_cache(2, n_ctx, 2, 128, 2, kv_type) for _ in "ab"]
    for name in "kv":
        filled = rng.standard_normal((*getattr(caches[0], name).shape[:-1], 128)).astype(np.float32)
        for c in caches:
            getattr(c, name)[...] = {"f32": filled, "f16": filled.astype(np.float16), "q8": q8_kv_rows(filled)}[kv_type]
    x = (rng.standard_normal((2, 512)) * 3).astype(np.float32)
    slots, positions = [0, 1], [n_ctx - 5, 7]
    got = run_stack(cpu, layers, x, caches[0], slots, positions, "relu2")
    want = run_stack(cpu, layers, x, caches[1], slots, positions, "relu2", own=False)
    assert cpu.dispatches["cpu.layer_stack_rowscale_row"] == 1
    np.testing.assert_array_equal(got, want)


def test_every_cache_type_reaches_the_kernels_as_one_array_type() -> None:
    # The region and the operations' attention take a cache as its bytes and its elements' width, so one compile
    # serves every cache type (the region had compiled for 56-60 s of the warmup per type). Their results on each
    # type are the tests above.
    from numba import typeof

    from bitnet_cpu import attention as attn

    cpu, seen = provider(1, LEVELS[0]), {}
    for kv_type, width in (("f32", 4), ("f16", 2), ("q8", 1)):
        cache = cpu.kv_cache(2, 16, 2, 128, 1, kv_type)
        (stack, w), (layer, _) = attn.cache_bytes(cache.k), attn.cache_bytes(cache.v[1])
        assert w == width and stack.flags.c_contiguous
        seen[kv_type] = typeof(stack), typeof(layer)
    assert seen["f32"] == seen["f16"] == seen["q8"]


def test_layers_the_region_cannot_run_run_as_their_operations() -> None:
    cpu, rng = provider(2, LEVELS[0]), np.random.default_rng(19)
    per_block = layer_stack(cpu, rng, 2, "tq2_0", True, block_scales=True)
    mixed = layer_stack(cpu, rng, 2, "tq2_0", True)
    mixed[1].attn_sub_norm = None  # one layer without its sub-norms: not every layer alike
    x = rng.standard_normal((1, 512)).astype(np.float32)
    for layers in (per_block, mixed):
        caches = [cpu.kv_cache(2, 16, 2, 128, 2) for _ in "ab"]
        np.testing.assert_array_equal(run_stack(cpu, layers, x, caches[0], [0], [0], "silu"),
                                      run_stack(cpu, layers, x, caches[1], [0], [0], "silu", own=False))
    assert "cpu.layer_stack_rowscale_row" not in cpu.dispatches

    class OwnActivation(CpuProvider):  # a subclass's own operation: the region would bypass it
        def act_mul(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
            return super().act_mul(gate, up, act) * np.float32(2)

    own = OwnActivation(n_threads=2, isa=LEVELS[0])
    layers = layer_stack(own, np.random.default_rng(19), 2, "tq2_0", True)
    caches = [own.kv_cache(2, 16, 2, 128, 2) for _ in "ab"]
    np.testing.assert_array_equal(run_stack(own, layers, x, caches[0], [0], [0], "silu"),
                                  run_stack(own, layers, x, caches[1], [0], [0], "silu", own=False))
    assert "cpu.layer_stack_rowscale_row" not in own.dispatches


def test_the_region_stamps_every_phase_of_every_layer_and_thread(cpu: CpuProvider) -> None:
    from bitnet_cpu import stack_phases

    rng = np.random.default_rng(31)
    layers = layer_stack(cpu, rng, 3, "i2_s", True)
    cache = cpu.kv_cache(3, 16, 2, 128, 2, "f32")
    run_stack(cpu, layers, (rng.standard_normal((1, 512)) * 3).astype(np.float32), cache, [0], [0], "relu2")
    marks = cpu.stack_marks.copy()
    assert marks.shape == (3, cpu.n_threads, stack_phases.MARKS)
    assert (marks > 0).all()  # every stamp taken (rdtsc on x86)
    s = stack_phases.seconds(marks, 1e9)  # in each thread's order, else ValueError
    kinds = ("projection", "attention", "serial", "wait")
    assert s["projection"] > 0 and s["attention"] > 0
    assert sum(s[k] for k in kinds) <= s["total"]  # the segments tile each layer; the span adds the steps between
    assert sum(s[k] for k in ("qkv", "wo", "gate_up", "down")) == pytest.approx(s["projection"], rel=1e-12)


@pytest.mark.parametrize("part, n_parts", [(1, 3), (0, 1)])
def test_a_waiting_thread_requests_the_rows_its_share_starts_on(part: int, n_parts: int) -> None:
    # Two projections stacked (300 rows, then 200 of another array): part 1 of 3 starts on the first one's last two
    # tasks (one short) and goes on into the second; one part alone has more rows than FETCH_BYTES.
    from bitnet_cpu.provider import _tasks

    a, b = np.zeros((300, 10, 64), np.uint8), np.zeros((200, 10, 64), np.uint8)
    tasks = np.concatenate([_tasks(a, 0), _tasks(b, 300)])
    k = isa.kernels(LEVELS[0])
    lo, hi = part * len(tasks) // n_parts, (part + 1) * len(tasks) // n_parts
    rows = [np.arange(w + r0 * stride, w + r1 * stride, 64) for w, stride, r0, r1, _, _ in tasks[lo:hi]]
    want = np.concatenate(rows)[:k.FETCH_BYTES // 64]
    got = k.fetch_lines(tasks, part, n_parts, False)
    assert len(want) == (1720 if n_parts == 3 else k.FETCH_BYTES // 64)
    np.testing.assert_array_equal(got, want)
    assert len(k.fetch_lines(tasks, part, n_parts, True)) == 0  # the flag already up: straight to the work
