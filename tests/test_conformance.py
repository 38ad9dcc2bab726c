"""The conformance kit (bitnet.testing) run against every bundled backend, and shown to fail."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet.plugins.types import Backend, Device, ProbeResult
from bitnet.runtime.provider import OPERATIONS, KernelProvider
from bitnet.runtime.reference import Q8Table, ReferenceProvider
from bitnet.testing import check_probe, check_provider, operation_support
from bitnet.testing.suite import *  # noqa: F403 (the kit's tests, parametrized below)


@pytest.fixture(params=["cpu", "opencl", "cuda"])
def backend_name(request):
    return request.param


def test_kit_rejects_a_probe_without_reason():
    b = Backend("x", "cpu", 1, lambda: ProbeResult(), lambda d: None)
    with pytest.raises(AssertionError, match="must say why"):
        check_probe(b)


def test_kit_rejects_bad_device_indices():
    b = Backend("x", "cpu", 1, lambda: ProbeResult((Device("x", 1, "d"),)), lambda d: None)
    with pytest.raises(AssertionError, match="indices"):
        check_probe(b)


class OffByOneRmsnorm(ReferenceProvider):
    def rmsnorm(self, x, w, eps):
        return super().rmsnorm(x, w, eps) * np.float32(1.001)


class WrongRoundingBitlinear(ReferenceProvider):
    def bitlinear(self, x, w, act_quant):
        return super().bitlinear(x * np.float32(1.01), w, act_quant)


class CorruptQ8Scale(ReferenceProvider):
    def lm_head_q8(self, x, table):
        scale = table.scale.copy()
        scale[7] *= np.float32(1.01)  # one row's scale off by 1 %
        return super().lm_head_q8(x, Q8Table(table.q, scale))


class GroupOffByOneUlp(ReferenceProvider):
    def bitlinear_group(self, x, group, act_quant):  # a fused kernel that sums in another order
        q, k, v = super().bitlinear_group(x, group, act_quant)
        return q, np.nextafter(k, np.float32(np.inf)), v


class StackWithoutLastFfn(ReferenceProvider):
    def layer_stack(self, x, layers, *args):  # a fused stack that forgot the last layer's feed-forward half
        return super().layer_stack(x, layers[:-1], *args) if len(layers) > 1 else super().layer_stack(x, layers, *args)


class FfnOffByOneUlp(ReferenceProvider):
    def ffn(self, *args):
        return np.nextafter(super().ffn(*args), np.float32(np.inf))


@pytest.mark.parametrize("broken, op", [(OffByOneRmsnorm, "rmsnorm"), (WrongRoundingBitlinear, "bitlinear"),
                                        (CorruptQ8Scale, "lm_head_q8"), (GroupOffByOneUlp, "projection k"),
                                        (StackWithoutLastFfn, "layer_stack"), (FfnOffByOneUlp, "layer_stack")])
def test_kit_rejects_a_broken_kernel(broken, op):
    with pytest.raises(AssertionError, match=op):
        check_provider(broken())


def test_bundled_backends_run_every_operation_natively(backend_name, bitnet_registry):
    probe = bitnet_registry.probe(backend_name)
    if not probe.devices:
        pytest.skip(f"{backend_name}: {probe.reason}")
    provider = bitnet_registry.entries[backend_name].backend.open(probe.devices[0])
    # The GPU backends leave the int8 LM head to the host (docs/design.md section 4).
    host = {"lm_head_q8"} if backend_name in ("opencl", "cuda") else set()
    try:
        assert operation_support(provider) == {op: "fallback" if op in host else "native" for op in OPERATIONS}
    finally:
        provider.close()


class AttentionLeftToCore(ReferenceProvider):
    attention = KernelProvider.attention


def test_kit_reports_an_operation_left_to_core_as_fallback():
    provider = AttentionLeftToCore()
    support = check_provider(provider)
    assert support == {op: "fallback" if op == "attention" else "native" for op in OPERATIONS}
    assert {op for op, _ in provider.fallbacks} == {"attention"}
