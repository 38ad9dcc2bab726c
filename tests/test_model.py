"""The transformer against the independent float64 forward pass, and its KV cache against batch prefill."""

from __future__ import annotations

import numpy as np
import pytest
from float_reference import forward, random_model

from bitnet.errors import UsageError
from bitnet.runtime import transformer
from bitnet.runtime.reference import ReferenceProvider
from bitnet.runtime.transformer import Transformer
from bitnet_cpu.provider import CpuProvider

PROVIDERS = [ReferenceProvider, CpuProvider]
IDS = [5, 17, 250, 3, 3, 99, 0, 299, 42, 7, 128]


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("provider_cls", PROVIDERS)
@pytest.mark.parametrize("arch, activation", [("bitnet", "silu"), ("bitnet-b1.58", "relu2")])
@pytest.mark.parametrize("act_quant, tol", [("none", 1e-5), ("row", 1e-4), ("block256", 1e-4)])
def test_forward_matches_float_reference(provider_cls: type, arch: str, activation: str, act_quant: str,
                                         tol: float) -> None:
    model = random_model(seed=1, arch=arch, activation=activation, block_scales=activation == "relu2",
                         tied=activation == "silu")
    tr = Transformer(model, provider_cls(), 32, act_quant)
    logits = tr.provider.to_host(tr.forward(np.array(IDS), 0, all_logits=True))
    assert logits.dtype == np.float32 and logits.shape == (len(IDS), 300)
    assert rel_err(logits, forward(model, IDS, act_quant)) < tol


def test_quantization_modes_are_distinguishable() -> None:
    # The tolerances above must be able to tell the modes apart, or the comparison proves little.
    model = random_model(seed=1)
    ref = {m: forward(model, IDS, m) for m in ("none", "row", "block256")}
    assert rel_err(ref["row"], ref["none"]) > 1e-3
    assert rel_err(ref["block256"], ref["row"]) > 1e-3


class WrongKvHead(ReferenceProvider):
    """A plausible bug: query head h reading KV head h % n_kv instead of h // group."""

    def attention(self, q, k, v, cache, layer, slots, positions, n_heads, n_kv_heads, head_dim):  # type: ignore[no-untyped-def]
        group = n_heads // n_kv_heads
        perm = np.arange(n_heads).reshape(group, n_kv_heads).T.reshape(-1)
        qp = q.reshape(q.shape[0], n_heads, head_dim)[:, perm].reshape(q.shape)
        out = super().attention(qp, k, v, cache, layer, slots, positions, n_heads, n_kv_heads, head_dim)
        inv = np.argsort(perm)
        return out.reshape(q.shape[0], n_heads, head_dim)[:, inv].reshape(q.shape)


class NoRope(ReferenceProvider):
    def rope(self, x, n_heads, head_dim, positions, theta):  # type: ignore[no-untyped-def]
        return x


@pytest.mark.parametrize("broken", [WrongKvHead, NoRope])
def test_float_reference_catches_broken_kernels(broken: type) -> None:
    model = random_model(seed=1)
    tr = Transformer(model, broken(), 32, "none")
    assert rel_err(tr.forward(np.array(IDS), 0, all_logits=True), forward(model, IDS, "none")) > 1e-3


@pytest.mark.parametrize("provider_cls", PROVIDERS)
@pytest.mark.parametrize("act_quant", ["row", "block256", "none"])
def test_prefill_equals_decode(provider_cls: type, act_quant: str) -> None:
    model = random_model(seed=2, n_kv_heads=1, tied=False)
    tr = Transformer(model, provider_cls(), 16, act_quant)
    ids = np.array(IDS)
    batch = tr.provider.to_host(tr.forward(ids, 0, all_logits=True))
    tr.reset()
    steps = [tr.provider.to_host(tr.forward(ids[i:i + 1], i, all_logits=False)) for i in range(len(ids))]
    np.testing.assert_allclose(np.concatenate(steps), batch, rtol=1e-4, atol=1e-4 * np.abs(batch).max())
    # Chunked prefill (4 then 7) ends at the same last-position logits.
    tr.reset()
    tr.forward(ids[:4], 0, all_logits=False)
    last = tr.provider.to_host(tr.forward(ids[4:], 4, all_logits=False))
    assert last.shape == (1, 300)
    np.testing.assert_allclose(last[0], batch[-1], rtol=1e-4, atol=1e-4 * np.abs(batch).max())


@pytest.mark.parametrize("provider_cls", PROVIDERS)
def test_long_prompt_runs_in_chunks(provider_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Transformer(random_model(seed=2, n_kv_heads=1, tied=False), provider_cls(), 16, "row")
    ids, p = np.array(IDS), tr.provider
    at = np.arange(len(ids), dtype=np.int32)
    whole = p.to_host(tr.forward_batch(ids, np.zeros(len(ids), np.int32), at, at))
    sizes: list[int] = []
    embed = p.embed
    monkeypatch.setattr(p, "embed", lambda table, i: sizes.append(len(i)) or embed(table, i))
    monkeypatch.setattr(transformer, "PREFILL_CHUNK", 4)
    tr.reset()
    np.testing.assert_array_equal(p.to_host(tr.forward(ids, 0, all_logits=True)), whole)
    assert sizes == [4, 4, 3]
    tr.reset()
    np.testing.assert_array_equal(p.to_host(tr.forward(ids, 0, all_logits=False)), whole[-1:])
    assert sizes == [4, 4, 3] * 2 and tr.filled == [len(ids)]
    tr.reset()  # a bad token in the last chunk is refused before the first chunk writes the cache
    with pytest.raises(UsageError, match="out of range"):
        tr.forward(np.array([*IDS[:-1], 300]), 0, all_logits=False)
    assert tr.filled == [0] and sizes == [4, 4, 3] * 2


def test_records_every_operation_as_dispatched() -> None:
    model = random_model(seed=3, n_layers=3)
    p = ReferenceProvider()
    tr = Transformer(model, p, 16, "row")
    assert sum(p.dispatches.values()) == 0  # uploads are not operations
    tr.forward(np.array([1, 2, 3]), 0, all_logits=False)
    d = p.dispatches
    assert d["ref.bitlinear"] == 7 * 3 and d["ref.attention"] == 3 and d["ref.rope"] == 6
    assert d["ref.rmsnorm"] == 4 * 3 + 1 and d["ref.rows"] == 1 and d["ref.lm_head"] == 1


def test_context_limit_and_bad_input() -> None:
    tr = Transformer(random_model(seed=4, n_layers=1), ReferenceProvider(), 8, "row")
    with pytest.raises(UsageError, match="prompt of 9 tokens exceeds the context of 8"):
        tr.forward(np.arange(9), 0, all_logits=False)
    tr.forward(np.arange(8), 0, all_logits=False)
    with pytest.raises(UsageError, match="context of 8"):
        tr.forward(np.array([1]), 8, all_logits=False)
    tr.reset()
    with pytest.raises(UsageError, match="cached"):
        tr.forward(np.array([1]), 3, all_logits=False)  # positions 0..2 were never written
    with pytest.raises(UsageError, match="out of range"):
        tr.forward(np.array([300]), 0, all_logits=False)
    with pytest.raises(UsageError):
        Transformer(random_model(seed=4, n_layers=1), ReferenceProvider(), 8, "int4")
