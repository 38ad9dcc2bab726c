"""Partial backends: operations a provider does not implement run on the host reference, counted.

The fallback is judged against the reference provider itself: a partial provider whose
bitlinear is the reference's must give the same logits to the bit, so any loss in crossing
between device handles and the host would show.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from float_reference import random_model

from bitnet.errors import NoBackendError
from bitnet.plugins.registry import Registry
from bitnet.runtime.provider import OPERATIONS, KernelProvider, native_operations
from bitnet.runtime.reference import ReferenceProvider
from bitnet.runtime.transformer import Transformer
from bitnet.testing import check_provider, operation_support
from conftest import ROOT

IDS = np.array([5, 17, 250, 3, 3, 99, 0, 299, 42])
N_LAYERS = 2
NOT_IMPLEMENTED = "not implemented by backend 'boxed'"


@dataclass
class Box:
    """An opaque device handle: the reference cannot read it, so a missed crossing fails loudly."""

    a: Any


class BoxedBitlinear(KernelProvider):
    """The minimum a device backend implements: its memory methods and bitlinear."""

    def __init__(self) -> None:
        super().__init__("boxed", None)
        self.ref = ReferenceProvider()
        self.float_uploads: list[tuple[int, ...]] = []
        self.to_host_shapes: list[tuple[int, ...]] = []

    def upload_ternary(self, w: Any) -> Box:
        return Box(w)

    def upload_float(self, a: np.ndarray) -> Box:
        self.float_uploads.append(a.shape)
        return Box(np.array(a, dtype=np.float32))

    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, n_seqs: int = 1) -> Any:
        raise AssertionError("attention runs on the host, so its KV cache must live there too")

    def to_host(self, x: Box) -> np.ndarray:
        self.to_host_shapes.append(x.a.shape)
        return np.array(x.a, dtype=np.float32)

    def from_host(self, a: np.ndarray) -> Box:
        return Box(np.array(a, dtype=np.float32))

    def bitlinear(self, x: Box, w: Box, act_quant: str) -> Box:
        self.record("boxed.bitlinear")
        return Box(self.ref.bitlinear(x.a, w.a, act_quant))


class BoxedWithEmbedAndNorm(BoxedBitlinear):
    def embed(self, table: Box, ids: np.ndarray) -> Box:
        self.record("boxed.embed")
        return Box(self.ref.embed(table.a, ids))

    def rmsnorm(self, x: Box, w: Box, eps: float) -> Box:
        self.record("boxed.rmsnorm")
        return Box(self.ref.rmsnorm(x.a, w.a, eps))


def fallback_counts(provider: KernelProvider) -> dict[str, int]:
    return {op: n for (op, _), n in provider.fallbacks.items()}


@pytest.mark.parametrize("act_quant", ["row", "block256", "none"])
def test_bitlinear_only_gives_the_reference_logits_to_the_bit(act_quant: str) -> None:
    model = random_model(seed=5, n_layers=N_LAYERS, tied=False)
    ref, part = (Transformer(model, p, 16, act_quant) for p in (ReferenceProvider(), BoxedBitlinear()))
    want = ref.forward(IDS, 0, all_logits=True)
    got = part.provider.to_host(part.forward(IDS, 0, all_logits=True))
    np.testing.assert_array_equal(got, want)
    # Then decode through the KV cache, which lives on the host beside the attention that reads it.
    for pos in (len(IDS), len(IDS) + 1):
        np.testing.assert_array_equal(part.provider.to_host(part.forward(IDS[:1], pos, all_logits=False)),
                                      ref.forward(IDS[:1], pos, all_logits=False))


def test_each_fallback_is_counted_with_its_reason_as_it_runs() -> None:
    model = random_model(seed=5, n_layers=N_LAYERS)
    p = BoxedBitlinear()
    tr = Transformer(model, p, 16, "row")
    assert not p.fallbacks  # loading computes nothing
    tr.forward(IDS, 0, all_logits=False)
    L = N_LAYERS
    assert fallback_counts(p) == {"embed": 1, "rmsnorm": 4 * L + 1, "rope": 2 * L, "attention": L,
                                  "act_mul": L, "add": 2 * L, "rows": 1, "lm_head": 1}
    assert {why for _, why in p.fallbacks} == {NOT_IMPLEMENTED}
    assert p.dispatches == {"boxed.bitlinear": 7 * L}  # the host's work is not listed as the device's
    assert p.argmax(tr.forward(IDS[:1], len(IDS), all_logits=False)).shape == (1,)
    assert fallback_counts(p)["argmax"] == 1 and fallback_counts(p)["embed"] == 2


def test_weights_stay_on_the_side_that_reads_them() -> None:
    model = random_model(seed=5, n_layers=N_LAYERS, tied=True)
    p = BoxedBitlinear()
    tr = Transformer(model, p, 16, "row")
    assert p.float_uploads == []  # every float weight is read by a host operation
    assert tr.lm_head is model.token_embd and tr.layers[0].attn_norm is model.layers[0].attn_norm
    tr.forward(IDS, 0, all_logits=False)
    # Only activations come back: n rows (or the last one), never the [vocab, dim] LM head.
    assert {s[0] for s in p.to_host_shapes} == {len(IDS), 1}

    p = BoxedWithEmbedAndNorm()
    tr = Transformer(model, p, 16, "row")
    assert len(p.float_uploads) == 1 + 4 * N_LAYERS + 1  # the table (for embed) and every norm
    assert isinstance(tr.token_embd, Box) and tr.lm_head is model.token_embd  # tied, read on two sides
    assert "embed" not in fallback_counts(p)


def test_a_provider_that_implements_everything_is_called_directly() -> None:
    p = ReferenceProvider()
    assert native_operations(p) == set(OPERATIONS)
    # Bound methods of its own class: nothing between the transformer and the kernels.
    assert all(getattr(p, op).__func__ is getattr(ReferenceProvider, op) for op in OPERATIONS)
    tr = Transformer(random_model(seed=5, n_layers=1), p, 16, "row")
    tr.forward(IDS, 0, all_logits=False)
    assert not p.fallbacks


def test_operation_support_says_native_or_fallback() -> None:
    assert set(operation_support(ReferenceProvider()).values()) == {"native"}
    support = operation_support(BoxedWithEmbedAndNorm())
    assert [op for op, where in support.items() if where == "native"] == ["embed", "rmsnorm", "bitlinear"]
    # A subclass can hand an operation back to core by naming the default.
    class NoRope(ReferenceProvider):
        rope = KernelProvider.rope

    assert operation_support(NoRope()) == {op: "fallback" if op == "rope" else "native" for op in OPERATIONS}


def test_bitlinear_is_the_minimum() -> None:
    class Nothing(KernelProvider):
        pass

    with pytest.raises(TypeError, match="bitlinear"):
        Nothing("nothing", None)  # type: ignore[abstract]


def test_conformance_kit_passes_a_partial_provider_and_catches_a_bad_crossing() -> None:
    assert check_provider(BoxedBitlinear())["rope"] == "fallback"

    class LossyFromHost(BoxedBitlinear):
        def from_host(self, a: np.ndarray) -> Box:
            return Box(a.astype(np.float16).astype(np.float32))

    with pytest.raises(AssertionError, match="rmsnorm"):
        check_provider(LossyFromHost())


def test_strict_mode_refuses_a_partial_backend_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITNET_STRICT_MODE", "1")
    model = random_model(seed=5, n_layers=1)
    p = BoxedWithEmbedAndNorm()
    with pytest.raises(NoBackendError) as err:
        Transformer(model, p, 16, "row")
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == 3
    assert "backend 'boxed'" in msg and "rope, attention, act_mul, add, rows, lm_head, argmax" in msg
    assert p.float_uploads == []  # refused before anything was uploaded
    Transformer(model, ReferenceProvider(), 16, "row").forward(IDS, 0, all_logits=False)  # complete: runs
    # A fallback a provider reports itself is refused as it would happen.
    with pytest.raises(NoBackendError, match=r"would run act_mul on the host \(no relu2 kernel\)"):
        ReferenceProvider().record_fallback("act_mul", "no relu2 kernel")


def test_the_int8_lm_head_falls_back_like_any_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every operation but lm_head_q8, as the GPU backends: the int8 head runs on the host, counted, to the bit.
    class NoQ8(ReferenceProvider):
        lm_head_q8 = KernelProvider.lm_head_q8

    model = random_model(seed=5, n_layers=N_LAYERS)
    p = NoQ8()
    got = Transformer(model, p, 16, "row", lm_head="q8").forward(IDS, 0, all_logits=True)
    want = Transformer(model, ReferenceProvider(), 16, "row", lm_head="q8").forward(IDS, 0, all_logits=True)
    np.testing.assert_array_equal(got, want)
    assert fallback_counts(p) == {"lm_head_q8": 1}
    # Strict mode refuses it at load, and only when the model runs the int8 head.
    monkeypatch.setenv("BITNET_STRICT_MODE", "1")
    Transformer(model, NoQ8(), 16, "row", lm_head="f16")
    with pytest.raises(NoBackendError, match="would run lm_head_q8 on the host"):
        Transformer(model, NoQ8(), 16, "row", lm_head="q8")


def test_a_device_provider_falls_back_through_its_own_handles() -> None:
    """A real GPU provider with rope and attention left to core: the same logits, counted fallbacks."""
    registry = Registry()
    probe = registry.probe("opencl")
    if not probe.devices:
        pytest.skip(f"opencl: {probe.reason}")
    full = registry.entries["opencl"].backend.open(probe.devices[0])
    cls = type(full)
    try:
        if cls.from_host is KernelProvider.from_host:
            pytest.skip(f"{cls.__name__} has no from_host yet (the shared GPU host layer brings it)")
        partial = type(f"{cls.__name__}WithoutRopeAttention", (cls,),
                       {"rope": KernelProvider.rope, "attention": KernelProvider.attention})(probe.devices[0])
        try:
            model = random_model(seed=5, n_layers=N_LAYERS)
            want, got = (p.to_host(Transformer(model, p, 16, "row").forward(IDS, 0, all_logits=True))
                         for p in (full, partial))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
            assert fallback_counts(partial) == {"rope": 2 * N_LAYERS, "attention": N_LAYERS}
        finally:
            partial.close()
    finally:
        full.close()


# -- the example third-party plugin's provider (its packaging is tested in test_third_party.py) ------------

@pytest.fixture(scope="module")
def example_provider_cls() -> type[KernelProvider]:
    sys.path.insert(0, str(ROOT / "examples/bitnet-example"))
    try:
        from bitnet_example.provider import ExampleProvider
    finally:
        sys.path.remove(str(ROOT / "examples/bitnet-example"))
    return ExampleProvider


@pytest.mark.parametrize("act_quant", ["row", "block256", "none"])
def test_example_plugin_matches_the_reference(example_provider_cls: type, act_quant: str) -> None:
    model = random_model(seed=6, n_layers=N_LAYERS, block_scales=True, arch="bitnet-b1.58", activation="relu2")
    providers = ReferenceProvider(), example_provider_cls("example", None)
    ref, ex = (Transformer(model, p, 16, act_quant) for p in providers)
    want, got = ref.forward(IDS, 0, all_logits=True), ex.forward(IDS, 0, all_logits=True)
    if act_quant == "none":  # float64 products in another order: equal to float32 rounding, not to the bit
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:  # the same integer sums, then the same float64 scaling
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_example_plugin_passes_the_conformance_kit(example_provider_cls: type) -> None:
    p = example_provider_cls("example", None)
    support = check_provider(p)
    assert [op for op, where in support.items() if where == "native"] == ["bitlinear"]
    assert {why for _, why in p.fallbacks} == {"not implemented by backend 'example'"}
