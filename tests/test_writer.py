"""The synthetic GGUF writer: deterministic, readable by gguf's own reader, realistic magnitudes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from bitnet.modelfile.formats import ternary_to_i2s
from bitnet.modelfile.model import _Reader, load_model
from bitnet.modelfile.writer import (
    PRESETS,
    SyntheticSpec,
    _plan,
    _tensor_type,
    main,
    synthetic_weights,
    tensor_nbytes,
    write_model,
)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_given_the_seed(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf", SyntheticSpec(seed=7))
    b = write_model(tmp_path / "b.gguf", SyntheticSpec(seed=7))
    c = write_model(tmp_path / "c.gguf", SyntheticSpec(seed=8))
    assert digest(a) == digest(b) != digest(c)
    wa, wc = synthetic_weights(SyntheticSpec(seed=7)), synthetic_weights(SyntheticSpec(seed=8))
    assert not np.array_equal(wa["blk.0.attn_q.weight"], wc["blk.0.attn_q.weight"])


def test_weights_look_like_bitnet() -> None:
    w = synthetic_weights(SyntheticSpec())
    for i in range(2):
        for name in ("attn_q", "attn_k", "ffn_gate", "ffn_down"):
            t = w[f"blk.{i}.{name}.weight"]
            assert t.dtype == np.int8 and set(np.unique(t).tolist()) == {-1, 0, 1}
            assert 0.28 < np.mean(t == 0) < 0.39
            s = float(w[f"blk.{i}.{name}.scale"][0])
            assert 0.01 < s < 1
            assert float(np.float16(s)) == s  # exact in every format, so loads compare exactly
        norm = w[f"blk.{i}.attn_norm.weight"]
        assert norm.dtype == np.float32 and abs(float(norm.mean()) - 1) < 0.05 and 0.03 < norm.std() < 0.3
    embd = w["token_embd.weight"].astype(np.float32)
    assert embd.shape == (512, 256) and abs(embd.std() * np.sqrt(256) - 2) < 0.1
    # tied LM head on a normalized hidden state: logits spread a few units
    h = embd[:16] / np.sqrt(np.mean(embd[:16] ** 2, axis=1, keepdims=True))
    spread = (h @ embd.T).std(axis=1)
    assert np.all((spread > 1) & (spread < 5))


@pytest.mark.parametrize("weight_type, qtype", [("tq2_0", GGMLQuantizationType.TQ2_0),
                                                ("tq1_0", GGMLQuantizationType.TQ1_0),
                                                ("f16", GGMLQuantizationType.F16),
                                                ("bf16", GGMLQuantizationType.BF16)])
def test_gguf_reader_sees_the_synthetic_values(tmp_path: Path, weight_type: str,
                                               qtype: GGMLQuantizationType) -> None:
    spec = SyntheticSpec(weight_type=weight_type, tied=False, n_kv_heads=4, scales=True)
    reader = GGUFReader(write_model(tmp_path / "m.gguf", spec))  # gguf's own reader: independent of ours
    ref = synthetic_weights(spec)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {name for name, _, _ in _plan(spec)}
    q = tensors["blk.1.attn_v.weight"]
    assert q.tensor_type == qtype and q.shape.tolist() == [256, 256]
    # with scales=True the weights carry scale 1 and the .scale tensor holds the scale
    assert np.array_equal(dequantize(q.data, qtype), ref["blk.1.attn_v.weight"].astype(np.float32))
    assert tensors["blk.1.attn_v.scale"].data.tolist() == ref["blk.1.attn_v.scale"].tolist()
    assert tensors["token_embd.weight"].tensor_type == GGMLQuantizationType.F16
    assert tensors["output.weight"].shape.tolist() == [256, 512]
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "bitnet"
    hparams = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv")
    assert [fields[f"bitnet.{k}"] for k in hparams] == [2, 256, 512, 4, 4]
    assert fields["bitnet.rope.freq_base"] == 10000.0
    assert len(fields["tokenizer.ggml.tokens"]) == 512


def test_i2s_tensors_hold_the_design_layout(tmp_path: Path) -> None:
    spec = SyntheticSpec(weight_type="i2_s", arch="bitnet-b1.58")
    path = write_model(tmp_path / "m.gguf", spec)
    with pytest.raises(ValueError):
        GGUFReader(path)  # gguf does not know type 36: the writer had to declare it itself
    ref = synthetic_weights(spec)
    t = {x.name: x for x in _Reader(path).tensors}["blk.0.ffn_down.weight"]
    assert int(t.tensor_type) == 36 and t.shape.tolist() == [512, 256]  # logical dims [cols, rows]
    assert t.n_bytes == 256 * 512 // 4 + 32
    expected = ternary_to_i2s(ref["blk.0.ffn_down.weight"], float(ref["blk.0.ffn_down.scale"][0]))
    assert np.array_equal(t.data, expected)


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float_master"):
        write_model(tmp_path / "m.gguf", SyntheticSpec(weight_type="tq2_0", float_master=True))
    with pytest.raises(ValueError, match="weight_type"):
        synthetic_weights(SyntheticSpec(weight_type="q4_0"))
    with pytest.raises(ValueError, match="scales"):
        synthetic_weights(SyntheticSpec(weight_type="f16", float_master=True, scales=True))
    with pytest.raises(ValueError, match="q6_k"):  # 256-value blocks
        synthetic_weights(SyntheticSpec(embd_type="q6_k", dim=128, n_heads=2, n_kv_heads=1))


def test_2b4t_preset_shape_and_size() -> None:
    spec = PRESETS["2b4t"]
    assert (spec.n_layers, spec.dim, spec.n_heads, spec.n_kv_heads, spec.ffn_dim, spec.vocab_size) == \
        (30, 2560, 20, 5, 6912, 128256)
    assert (spec.embd_type, spec.tokenizer, spec.rope_theta) == ("f16", "llama3", 500000.0)
    plan = _plan(spec)
    assert len(plan) == 2 + 30 * 11
    total = sum(tensor_nbytes(_tensor_type(spec, kind), shape) for _, kind, shape in plan)
    assert 1.1e9 < total < 1.25e9


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    args = [str(out), "--preset", "tiny", "--weight-type", "i2_s", "--arch", "bitnet-25", "--layers", "1"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    m = load_model(out)
    assert (m.config.arch, m.config.n_layers, m.config.activation) == ("bitnet-25", 1, "relu2")
    assert m.weight_types["I2_S"] == 7
    with pytest.raises(SystemExit) as ei:
        main([str(out), "--weight-type", "q4_0"])
    assert ei.value.code == 2
