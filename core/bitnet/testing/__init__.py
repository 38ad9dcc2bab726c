"""Conformance kit for backend authors.

Run it against your plugin from your own test suite::

    # tests/test_bitnet_conformance.py
    import pytest
    from bitnet.testing.suite import *  # noqa: F401,F403  (the tests)

    @pytest.fixture(params=["mybackend"])
    def backend_name(request):
        return request.param

The checks are also plain functions (`check_probe`, `check_selection`, `check_provider`)
that raise AssertionError with a message saying what broke the contract, and
`operation_support(provider)` says which operations a provider runs natively and which
core runs on the host by fallback.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.modelfile.ternary import from_values
from bitnet.plugins.registry import Registry
from bitnet.plugins.selection import select
from bitnet.plugins.types import Backend, Device, ProbeResult
from bitnet.runtime.fallback import kv_cache_for, place_weight
from bitnet.runtime.provider import KV_TYPES, OPERATIONS, KernelProvider, LayerWeights, native_operations

NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


def check_probe(backend: Backend, max_seconds: float = 10.0) -> ProbeResult:
    """The probe contract: cheap, never raises, devices indexed 0..n-1, or a reason."""
    assert NAME.match(backend.name), f"backend name {backend.name!r} must be lower-case [a-z0-9_-]"
    for alias in backend.aliases:
        assert NAME.match(alias), f"alias {alias!r} must be lower-case [a-z0-9_-]"
    assert isinstance(backend.priority, int), "priority must be an int (cpu 10, opencl 50, cuda 100)"
    assert backend.kind, "kind must be set ('gpu', 'cpu', ...)"
    start = time.perf_counter()
    result = backend.probe()
    elapsed = time.perf_counter() - start
    assert isinstance(result, ProbeResult), f"probe returned {type(result).__name__}, not ProbeResult"
    assert elapsed < max_seconds, f"probe took {elapsed:.1f} s; it must be cheap"
    if not result.devices:
        assert result.reason, "a probe that finds no device must say why"
    for i, d in enumerate(result.devices):
        assert isinstance(d, Device), f"device {i} is {type(d).__name__}, not Device"
        assert d.index == i, f"device indices must be 0..n-1, got {d.index} at position {i}"
        assert d.backend == backend.name, f"device {i} names backend {d.backend!r}, not {backend.name!r}"
        assert d.name, f"device {i} has no name"
    return result


def check_selection(name: str, registry: Registry | None = None) -> None:
    """The backend is selectable by its name, each alias and name:index; beyond the last index it is not."""
    registry = registry or Registry()
    backend = registry.entries[name].backend
    devices = registry.probe(name).devices
    for token in (backend.name, *backend.aliases):
        sel = select(token, registry)
        if devices:
            assert sel.backend is backend, f"--device {token} selected {sel.selected}, not {name}"
        else:
            assert sel.backend is None, f"--device {token} selected {sel.selected} though {name} has no device"
    for d in devices:
        assert select(f"{name}:{d.index}", registry).device == d
    assert select(f"{name}:{len(devices)}", registry).backend is None, "an index past the last device was accepted"


def _random_case(rng: np.random.Generator, n: int, rows: int, cols: int) -> tuple[np.ndarray, Any]:
    x = rng.standard_normal((n, cols)).astype(np.float32)
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    scales = rng.uniform(0.5, 2.0, size=(rows, cols // 256)).astype(np.float32)
    return x, from_values(t, scales)


def operation_support(provider: KernelProvider) -> dict[str, str]:
    """Where each operation runs: "native" (the provider's own kernel) or "fallback" (core's
    NumPy reference on the host, counted in `provider.fallbacks`)."""
    native = native_operations(provider)
    return {op: "native" if op in native else "fallback" for op in OPERATIONS}


def check_provider(provider: KernelProvider, rtol: float = 1e-4, seed: int = 0) -> dict[str, str]:
    """Every operation against the NumPy reference on random inputs, within rtol of the largest value.

    Native operations check the provider's kernels; fallback operations check that activations
    cross to the host and back (`to_host`, `from_host`) intact. Returns operation_support.
    """
    from bitnet.runtime.reference import ReferenceProvider, q8_table

    ref = ReferenceProvider()
    rng = np.random.default_rng(seed)

    def same(op: str, got: Any, want: Any) -> None:
        got_h, want_h = provider.to_host(got), ref.to_host(want)
        assert got_h.shape == want_h.shape, f"{op}: shape {got_h.shape}, reference {want_h.shape}"
        scale = max(float(np.abs(want_h).max()), 1e-6)
        err = float(np.abs(got_h - want_h).max()) / scale
        assert err <= rtol, f"{op}: max error {err:.2e} of the largest value exceeds {rtol:.0e}"

    dim, heads, kv_heads, head_dim, vocab = 256, 4, 2, 64, 300
    table = rng.standard_normal((vocab, dim)).astype(np.float16)
    # Weights go where the transformer puts them: on the device only for a native operation.
    embd, head = place_weight(provider, "embed", table), place_weight(provider, "lm_head", table)
    head_q8 = place_weight(provider, "lm_head_q8", table)
    ids = rng.integers(0, vocab, size=5).astype(np.int32)
    same("embed", provider.embed(embd, ids), ref.embed(table, ids))
    for n in (1, 7):
        x = rng.standard_normal((n, dim)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
        xg = provider.upload_float(x)
        same("rmsnorm", provider.rmsnorm(xg, place_weight(provider, "rmsnorm", w), 1e-5), ref.rmsnorm(x, w, 1e-5))
        positions = rng.permutation(1000)[:n].astype(np.int32)  # any position, in any order
        same("rope", provider.rope(xg, heads, head_dim, positions, 10000.0),
             ref.rope(x, heads, head_dim, positions, 10000.0))
        y = rng.standard_normal((n, dim)).astype(np.float32)
        yg = provider.upload_float(y)
        same("add", provider.add(xg, yg), ref.add(x, y))
        for act in ("silu", "relu2"):
            same(f"act_mul[{act}]", provider.act_mul(xg, yg, act), ref.act_mul(x, y, act))
        index = np.array([n - 1], np.int32) if n == 1 else np.array([0, 2, n - 1], np.int32)
        same("rows", provider.rows(xg, index), ref.rows(x, index))
        same("lm_head", provider.lm_head(xg, head), ref.lm_head(x, table))
        same("lm_head_q8", provider.lm_head_q8(xg, head_q8), ref.lm_head_q8(x, q8_table(table)))
        got_arg, want_arg = provider.argmax(provider.lm_head(xg, head)), ref.argmax(ref.lm_head(x, table))
        assert list(got_arg) == list(want_arg), f"argmax: {list(got_arg)} != reference {list(want_arg)}"
        xq, w3 = _random_case(rng, n, 384, 512)
        # Q/K/V-like groups of other heights: a scale per block, and a scale per row (as I2_S).
        wa, wb = _random_case(rng, n, 64, 512)[1], _random_case(rng, n, 320, 512)[1]
        ra, rb = (from_values(w.values(), np.repeat(w.scales[:, :1], 2, axis=1)) for w in (wa, wb))
        xqg = provider.upload_float(xq)
        for mode in ("row", "block256", "none"):
            same(f"bitlinear[{mode}]", provider.bitlinear(xqg, provider.upload_ternary(w3), mode),
                 ref.bitlinear(xq, w3, mode))
            for ws in ([w3, wa, wb], [ra, rb]):
                got = provider.bitlinear_group(xqg, provider.upload_ternary_group(ws), mode)
                assert len(got) == len(ws), f"bitlinear_group[{mode}]: {len(got)} results for a group of {len(ws)}"
                for name, w, g in zip("qkv", ws, got, strict=False):
                    alone = provider.bitlinear(xqg, provider.upload_ternary(w), mode)
                    assert np.array_equal(provider.to_host(g), provider.to_host(alone)), \
                        f"bitlinear_group[{mode}]: projection {name} differs from its bitlinear"
    # Attention over three sequence slots: slot 1 prefills 5 positions, then a batch decodes slot 1 beside a
    # 3-token prefill of slot 2 and a first token of slot 0, then a batch decodes all three. An F16 and a q8 cache
    # too, where the provider offers them (refusing one is allowed; a wrong result is not).
    for kv_type in KV_TYPES:
        try:
            mine = kv_cache_for(provider, 2, 16, kv_heads, head_dim, 3, kv_type=kv_type)
        except UsageError:
            if kv_type == "f32":
                raise
            continue
        caches = (mine, ref.kv_cache(2, 16, kv_heads, head_dim, 3, kv_type=kv_type))
        for slots, positions in [([1] * 5, range(5)), ([1, 2, 2, 2, 0], [5, 0, 1, 2, 0]), ([0, 1, 2], [1, 6, 3])]:
            n = len(slots)
            q = rng.standard_normal((n, heads * head_dim)).astype(np.float32)
            k = rng.standard_normal((n, kv_heads * head_dim)).astype(np.float32)
            v = rng.standard_normal((n, kv_heads * head_dim)).astype(np.float32)
            s, pos = np.array(slots, np.int32), np.array(list(positions), np.int32)
            outs = [p.attention(p.upload_float(q), p.upload_float(k), p.upload_float(v), c, 1, s, pos, heads,
                                kv_heads, head_dim) for p, c in zip((provider, ref), caches, strict=True)]
            same(f"attention[{kv_type}, slots={slots}, positions={list(pos)}]", *outs)
    _check_layer_stack(provider, rng)
    assert provider.dispatches, "the provider recorded no kernel dispatch"
    return operation_support(provider)


def _check_layer_stack(provider: KernelProvider, rng: np.random.Generator) -> None:
    """`layer_stack`, with a provider's own `attention_block` and `ffn` inside it, gives the bits of the
    operations one by one, step after step: a 3-token prompt, a decode step, two sequences' steps together;
    with a scale per weight row (as I2_S) and sub-norms in one stack, a scale per block and none in the other."""
    dim, heads, kv_heads, head_dim, hidden = 256, 4, 2, 64, 512

    def weights(rows: int, cols: int, per_row: bool) -> Any:
        w = _random_case(rng, 1, rows, cols)[1]
        return from_values(w.values(), np.repeat(w.scales[:, :1], cols // 256, axis=1)) if per_row else w

    def norm(n: int) -> Any:
        return place_weight(provider, "rmsnorm", rng.uniform(0.5, 1.5, n).astype(np.float32))

    for per_row in (True, False):
        layers = [LayerWeights(norm(dim), provider.upload_ternary_group([weights(r, dim, per_row) for r in
                                                                         (heads * head_dim, 128, 128)]),
                               provider.upload_ternary(weights(dim, heads * head_dim, per_row)),
                               norm(heads * head_dim) if per_row else None, norm(dim),
                               provider.upload_ternary_group([weights(hidden, dim, per_row) for _ in "gu"]),
                               provider.upload_ternary(weights(dim, hidden, per_row)),
                               norm(hidden) if per_row else None) for _ in range(2)]
        caches = [kv_cache_for(provider, 2, 8, kv_heads, head_dim, 2) for _ in "ab"]
        for slots, positions in (([0, 0, 0], [0, 1, 2]), ([0], [3]), ([1, 0], [0, 4])):
            x = provider.upload_float(rng.standard_normal((len(slots), dim)).astype(np.float32))
            args = (np.array(slots, np.int32), np.array(positions, np.int32), heads, kv_heads, head_dim, 10000.0,
                    1e-5, "relu2" if per_row else "silu", "row")
            got = provider.to_host(provider.layer_stack(x, layers, caches[0], *args))
            want = provider.to_host(_composed_stack(provider, x, layers, caches[1], *args))
            assert np.array_equal(got, want), \
                f"layer_stack (slots {slots}, positions {positions}) differs from its operations one by one"


def _composed_stack(p: KernelProvider, x: Any, layers: list[LayerWeights], cache: Any, slots: np.ndarray,
                    positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int, theta: float, eps: float,
                    act: str, act_quant: str) -> Any:
    """The stack as the provider's operations one by one: core's layer_stack, attention_block and ffn."""
    for i, w in enumerate(layers):
        x = KernelProvider.attention_block(p, x, w.attn_norm, w.qkv, w.attn_sub_norm, w.wo, cache, i, slots,
                                           positions, n_heads, n_kv_heads, head_dim, theta, eps, act_quant)
        x = KernelProvider.ffn(p, x, w.ffn_norm, w.gate_up, w.ffn_sub_norm, w.w_down, eps, act, act_quant)
    return x
