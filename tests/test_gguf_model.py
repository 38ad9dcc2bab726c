"""Loading GGUF models: every format to the same TernaryMatrix, and every bad file to one ModelError line."""

from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from bitnet.errors import ModelError
from bitnet.modelfile.model import LayerWeights, Model, _finite_rows, _Reader, load_model
from bitnet.modelfile.writer import SyntheticSpec, synthetic_weights, write_model
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata

PROJ = (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
        ("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down"))


def write(tmp_path: Path, name: str = "m.gguf", **spec: object) -> Path:
    return write_model(tmp_path / name, SyntheticSpec(**spec))  # type: ignore[arg-type]


def bad_load(path: Path, *fragments: str) -> str:
    """Load must fail with one ModelError line naming the file and saying what is wrong."""
    with pytest.raises(ModelError) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    for f in fragments:
        assert f in msg[len(f"{path}: "):], msg
    return msg


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def tensor_offsets(path: Path, name: str, reader: type[GGUFReader] = GGUFReader) -> dict[str, int]:
    """File offsets of one tensor's info fields and data, found with gguf's own reader."""
    for t in reader(path).tensors:
        if t.name == name:
            out, offs = {"data": t.data_offset}, t.field.offset
            keys = ("name_len", "name", "n_dims", "dims", "type", "offset")
            for key, part in zip(keys, t.field.parts, strict=True):
                out[key] = offs
                offs += part.nbytes
            return out
    raise KeyError(name)


def kv_value_offset(path: Path, key: str) -> int:
    """File offset of a metadata value (for an array: of its item type)."""
    field = GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


# -- loading good files --------------------------------------------------------------------------

def test_load_tiny_model(tmp_path: Path) -> None:
    spec = SyntheticSpec()
    path = write_model(tmp_path / "m.gguf", spec)
    calls: list[tuple[int, int]] = []
    m = load_model(path, progress=lambda done, total: calls.append((done, total)))
    assert isinstance(m, Model) and m.path == str(path)
    c = m.config
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("bitnet", 2, 256, 4, 2, 64, 512, 512)
    assert (c.n_ctx_train, c.rope_theta, c.activation) == (512, 10000.0, "silu")
    assert c.rms_eps == pytest.approx(1e-5)
    assert calls == [(1, 2), (2, 2)]
    assert m.weight_types == {"F16": 1, "F32": 9, "TQ2_0": 14}
    assert m.file_size == os.path.getsize(path)
    assert m.n_params == 512 * 256 + 256 + 2 * (3 * 256 + 512 + 2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)

    ref = synthetic_weights(spec)
    # the embedding is the file's bytes, mapped, not a copy
    assert m.token_embd.dtype == np.float16 and not m.token_embd.flags.owndata
    assert not m.token_embd.flags.writeable
    assert np.array_equal(m.token_embd, ref["token_embd.weight"])
    assert m.output is None
    assert m.output_norm.dtype == np.float32 and np.array_equal(m.output_norm, ref["output_norm.weight"])
    for i, layer in enumerate(m.layers):
        assert isinstance(layer, LayerWeights)
        for norm in ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm"):
            assert np.array_equal(getattr(layer, norm), ref[f"blk.{i}.{norm}.weight"])
        for field, name in PROJ:
            w = getattr(layer, field)
            assert np.array_equal(w.values(), ref[f"blk.{i}.{name}.weight"])
            assert np.all(w.scales == ref[f"blk.{i}.{name}.scale"])

    tok = synthetic_tokenizer_metadata("gpt2", 512)
    for key, value in tok.items():
        assert m.metadata[key] == value, key
    assert m.metadata["general.architecture"] == "bitnet"
    assert m.metadata["bitnet.block_count"] == 2


def _projections(m: Model) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(getattr(layer, f).packed(), getattr(layer, f).scales) for layer in m.layers for f, _ in PROJ]


@pytest.mark.parametrize("weight_type", ["i2_s", "tq1_0", "f32", "f16", "bf16"])
def test_every_format_loads_to_the_same_ternary_matrices(tmp_path: Path, weight_type: str) -> None:
    base = _projections(load_model(write(tmp_path, "tq2_0.gguf", weight_type="tq2_0")))
    other = _projections(load_model(write(tmp_path, f"{weight_type}.gguf", weight_type=weight_type)))
    assert len(base) == len(other) == 14
    for (c1, s1), (c2, s2) in zip(base, other, strict=True):
        assert np.array_equal(c1, c2)
        assert s1.shape == s2.shape and np.array_equal(s1, s2)


@pytest.mark.parametrize("weight_type", ["tq2_0", "i2_s", "f16"])
def test_scale_tensors_are_folded_into_the_weights(tmp_path: Path, weight_type: str) -> None:
    plain = _projections(load_model(write(tmp_path, "a.gguf", weight_type=weight_type)))
    m = load_model(write(tmp_path, "b.gguf", weight_type=weight_type, scales=True))
    assert m.weight_types["F32"] == 9 + 14
    for (c1, s1), (c2, s2) in zip(plain, _projections(m), strict=True):
        assert np.array_equal(c1, c2) and np.array_equal(s1, s2)


@pytest.mark.parametrize("weight_type", ["f32", "f16", "bf16"])
def test_master_weights_are_ternarized_with_absmean(tmp_path: Path, weight_type: str) -> None:
    spec = SyntheticSpec(weight_type=weight_type, float_master=True)
    m = load_model(write_model(tmp_path / "m.gguf", spec))
    ref = synthetic_weights(spec)
    w = m.layers[1].w_down
    master = ref["blk.1.ffn_down.master"]
    assert w.scales[0, 0] == pytest.approx(np.mean(np.abs(master)), rel=1e-6)
    assert np.array_equal(w.values(), np.clip(np.rint(master / w.scales[0, 0]), -1, 1))
    assert np.array_equal(w.values(), ref["blk.1.ffn_down.weight"])


@pytest.mark.parametrize("embd_type", ["f32", "bf16", "q8_0", "q6_k"])  # loaded as float32
def test_untied_output_and_embedding_types(tmp_path: Path, embd_type: str) -> None:
    spec = SyntheticSpec(embd_type=embd_type, tied=False)
    m = load_model(write_model(tmp_path / "m.gguf", spec))
    ref = synthetic_weights(spec)
    assert m.output is not None and m.output.dtype == np.float32 and m.token_embd.dtype == np.float32
    assert np.array_equal(m.output, ref["output.weight"])
    assert np.array_equal(m.token_embd, ref["token_embd.weight"])


@pytest.mark.parametrize("arch, hidden_act, expected", [
    ("bitnet", None, "silu"), ("bitnet-b1.58", None, "relu2"), ("bitnet-25", None, "relu2"),
    ("bitnet-b1.58", "silu", "silu"), ("bitnet", "relu_squared", "relu2"),
    ("bitnet-25", "squared_relu", "relu2"), ("bitnet-b1.58", "relu2", "relu2"),
])
def test_architectures_and_activation(tmp_path: Path, arch: str, hidden_act: str | None,
                                      expected: str) -> None:
    m = load_model(write(tmp_path, arch=arch, hidden_act=hidden_act, weight_type="i2_s", tokenizer="llama"))
    assert (m.config.arch, m.config.activation) == (arch, expected)
    assert m.metadata["tokenizer.ggml.model"] == "llama"


# -- bad files -----------------------------------------------------------------------------------

@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write(tmp_path, weight_type="f32")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("this is not a model\n" * 10)
    bad_load(p, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    bad_load(empty, "not a GGUF file")


def test_missing_file(tmp_path: Path) -> None:
    bad_load(tmp_path / "nope.gguf", "cannot open")
    bad_load(tmp_path, "cannot open")  # a directory


@pytest.mark.parametrize("version, fragment", [(1, "unsupported GGUF version 1"), (7, "version 7"),
                                               (3 << 24, "big-endian")])
def test_unsupported_gguf_version(model: Path, version: int, fragment: str) -> None:
    patch(model, 4, struct.pack("<I", version))
    bad_load(model, fragment)


def test_truncated_file(tmp_path: Path) -> None:
    full = write(tmp_path, "full.gguf").read_bytes()
    reader = GGUFReader(tmp_path / "full.gguf")
    last_info = reader.tensors[-1].field
    header_end = last_info.offset + sum(part.nbytes for part in last_info.parts)
    data_start = reader.data_offset
    tokens = kv_value_offset(tmp_path / "full.gguf", "tokenizer.ggml.tokens")
    cuts = [6, 10, 20, 30, 60, tokens + 6, tokens + 500, header_end - 30, header_end - 1, data_start - 1,
            data_start + 1000, len(full) // 2, len(full) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(full[:cut])
        # cut in the header: a read runs short; cut in the data: the first tensor that does not fit is named
        bad_load(p, "truncated" if cut < header_end else "past the end of the file")


def test_unsupported_architecture(tmp_path: Path) -> None:
    bad_load(write(tmp_path, arch="falcon"), "unsupported architecture 'falcon'")


@pytest.mark.parametrize("weight_type", ["i2_s", "tq2_0", "f16"])
def test_llama_architecture_with_ternary_projections(tmp_path: Path, weight_type: str) -> None:
    # Falcon3's shape in small: head size 128 given by key_length, wider than dim / n_heads.
    spec = SyntheticSpec(arch="llama", weight_type=weight_type, dim=256, n_heads=4, n_kv_heads=2, head_dim=128,
                         tied=False, tokenizer_pre="falcon3")
    m = load_model(write_model(tmp_path / "m.gguf", spec))
    assert (m.config.arch, m.config.activation, m.config.head_dim) == ("llama", "silu", 128)
    assert m.layers[0].attn_sub_norm is None and m.layers[0].ffn_sub_norm is None
    ref = synthetic_weights(spec)
    assert "blk.0.attn_sub_norm.weight" not in ref
    for i, layer in enumerate(m.layers):
        for field, name in PROJ:  # Q and K rows are back in rotate-halves order, as generated
            assert np.array_equal(getattr(layer, field).values(), ref[f"blk.{i}.{name}.weight"]), (i, name)
    assert m.layers[0].wq.rows == 512 and m.layers[0].wo.cols == 512


def test_llama_qk_rows_are_reordered(tmp_path: Path) -> None:
    # The file holds Q/K rows interleaved (what llama.cpp's llama RoPE rotates); a loader that
    # forgot to undo it would give other rows than the generated ones.
    spec = SyntheticSpec(arch="llama", weight_type="tq2_0")
    p = write_model(tmp_path / "m.gguf", spec)
    stored = GGUFReader(p).tensors
    raw_q = next(t for t in stored if t.name == "blk.0.attn_q.weight")
    from bitnet.modelfile.formats import tq2_0_to_ternary
    as_stored = tq2_0_to_ternary(np.asarray(raw_q.data), 256, 256).values()
    loaded = load_model(p).layers[0].wq.values()
    assert not np.array_equal(as_stored, loaded)
    assert np.array_equal(as_stored[[0, 2, 4]], loaded[[0, 1, 2]])  # pair rows 2i, 2i+1 -> i, half + i
    assert np.array_equal(as_stored[1], loaded[32])


def test_full_precision_llama_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, arch="llama", weight_type="f16", float_master=True)
    bad_load(p, "blk.0.attn_q.weight", "not ternary", "refused rather than silently ternarized")
    # The same float weights under `bitnet` are BitNet master weights: absmean, as before.
    assert load_model(write(tmp_path, "b.gguf", weight_type="f16", float_master=True)).config.arch == "bitnet"


def test_llama_rope_freqs_other_than_one_are_refused(tmp_path: Path) -> None:
    p = write(tmp_path, arch="llama", weight_type="i2_s", rope_freqs=True)
    assert load_model(p).config.arch == "llama"  # all ones: nothing to apply
    patch(p, tensor_offsets(p, "rope_freqs.weight", _Reader)["data"], struct.pack("<f", 8.0))
    bad_load(p, "rope_freqs", "RoPE frequency factors other than 1")


@pytest.mark.parametrize("tl_type", [38, 39, 42])  # TL1/TL2 ids of the fork's versions (39 is MXFP4 to gguf)
def test_tl_files_say_what_they_are(tmp_path: Path, tl_type: int) -> None:
    from bitnet.modelfile.writer import _StreamingWriter

    p = tmp_path / "tl.gguf"
    w = _StreamingWriter(p, "llama")
    w.add_raw_tensor_info("blk.0.attn_q.weight", (256, 256), tl_type, 256 * 256 // 8)
    w.add_raw_tensor_info("blk.0.attn_q.weight_scale", (1,), 0, 4)
    w.write_header_to_file(p)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_pieces(iter([np.zeros(256 * 256 // 8, np.uint8)]))
    w.write_tensor_pieces(iter([np.ones(1, np.float32)]))
    w.close()
    bad_load(p, "blk.0.attn_q.weight", "TL1/TL2", "I2_S")


@pytest.mark.parametrize("ggml_type", [31, 99, 2**31])
def test_unknown_tensor_type(model: Path, ggml_type: int) -> None:
    patch(model, tensor_offsets(model, "blk.0.attn_q.weight")["type"], struct.pack("<I", ggml_type))
    bad_load(model, "blk.0.attn_q.weight", f"unknown ggml type {ggml_type}")


def test_unsupported_ternary_type(tmp_path: Path) -> None:
    p = write(tmp_path, weight_type="f32")
    offs = tensor_offsets(p, "blk.0.attn_k.weight")
    patch(p, offs["type"], struct.pack("<I", 24))  # I8: same size as nothing we read, wrong kind
    bad_load(p, "blk.0.attn_k.weight", "type I8")


def test_missing_tensor(model: Path) -> None:
    offs = tensor_offsets(model, "blk.1.ffn_up.weight")
    patch(model, offs["name"], b"blk.1.ffn_uq.weight")
    bad_load(model, "missing tensor blk.1.ffn_up.weight")


def test_duplicate_tensor(model: Path) -> None:
    patch(model, tensor_offsets(model, "blk.0.attn_k.weight")["name"], b"blk.0.attn_q.weight")
    bad_load(model, "blk.0.attn_q.weight", "twice")


@pytest.mark.parametrize("name, dims, fragment", [
    ("blk.0.ffn_sub_norm.weight", [256], "has shape [256], expected [512]"),
    ("blk.1.ffn_down.weight", [256, 512], "has shape [256, 512], expected [512, 256]"),
    ("token_embd.weight", [128, 512], "token_embd.weight has shape [128, 512]"),
])
def test_wrong_shape(model: Path, name: str, dims: list[int], fragment: str) -> None:
    patch(model, tensor_offsets(model, name)["dims"], struct.pack(f"<{len(dims)}Q", *dims))
    bad_load(model, fragment)


def test_data_past_end_of_file(model: Path) -> None:
    offs = tensor_offsets(model, "blk.0.ffn_gate.weight")
    data_rel = offs["data"] - min(t.data_offset for t in GGUFReader(model).tensors)
    patch(model, offs["offset"], struct.pack("<Q", data_rel + (1 << 24)))
    bad_load(model, "tensor blk.0.ffn_gate.weight", "past the end of the file")


@pytest.mark.parametrize("dims, fragment", [
    ([1 << 40, 1 << 40], "absurd dimensions"),
    ([(1 << 63) + 1, 1 << 63], "absurd dimensions"),
    ([256, 0], "invalid dimensions"),
])
def test_absurd_dimensions_allocate_nothing(model: Path, dims: list[int], fragment: str) -> None:
    patch(model, tensor_offsets(model, "token_embd.weight")["dims"], struct.pack("<2Q", *dims))
    tracemalloc.start()
    try:
        bad_load(model, "token_embd.weight", fragment)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


def test_too_many_dimensions(model: Path) -> None:
    patch(model, tensor_offsets(model, "output_norm.weight")["n_dims"], struct.pack("<I", 1 << 30))
    bad_load(model, "truncated")


@pytest.mark.parametrize("where", ["array", "tensor_count", "kv_count", "string"])
def test_huge_counts_fail_fast(model: Path, where: str) -> None:
    if where == "array":
        patch(model, kv_value_offset(model, "tokenizer.ggml.token_type") + 4, struct.pack("<Q", 1 << 62))
    elif where == "string":
        patch(model, kv_value_offset(model, "general.architecture"), struct.pack("<Q", 1 << 62))
    else:
        patch(model, 8 if where == "tensor_count" else 16, struct.pack("<Q", 1 << 50))
    bad_load(model)


def test_bad_metadata(model: Path) -> None:
    patch(model, kv_value_offset(model, "bitnet.block_count"), struct.pack("<I", 0))
    bad_load(model, "bitnet.block_count = 0")


def test_missing_metadata(model: Path) -> None:
    field = GGUFReader(model).fields["bitnet.embedding_length"]
    patch(model, field.offset + 8, b"bitnet.embedding_lengtx")
    bad_load(model, "missing metadata bitnet.embedding_length")


def test_unknown_hidden_act(tmp_path: Path) -> None:
    bad_load(write(tmp_path, hidden_act="gelu"), "hidden_act 'gelu'")


@pytest.mark.parametrize("weight_type, tensor, at, value, fragment", [
    ("f32", "blk.0.attn_v.weight", 123 * 4, struct.pack("<f", float("nan")), "blk.0.attn_v.weight"),
    ("f16", "blk.1.ffn_up.weight", 10 * 2, np.float16("inf").tobytes(), "blk.1.ffn_up.weight"),
    ("f32", "blk.1.ffn_norm.weight", 7 * 4, struct.pack("<f", float("-inf")), "blk.1.ffn_norm.weight"),
    ("tq2_0", "token_embd.weight", 1000 * 2, np.float16("nan").tobytes(), "token_embd.weight"),
    ("tq2_0", "token_embd.weight", 5 * 2, np.float16("-inf").tobytes(), "token_embd.weight"),
    ("tq2_0", "token_embd.weight", 77 * 2, b"\x01\xfe", "token_embd.weight"),  # a negative NaN
    ("tq2_0", "blk.0.ffn_down.weight", 66 * 3 + 64, np.float16("inf").tobytes(), "blk.0.ffn_down.weight"),
    ("tq1_0", "blk.0.attn_q.weight", 52, np.float16("nan").tobytes(), "blk.0.attn_q.weight"),
    ("i2_s", "blk.1.attn_k.weight", 128 * 256 // 4, struct.pack("<f", float("nan")), "blk.1.attn_k.weight"),
])
def test_nan_and_inf_weights(tmp_path: Path, weight_type: str, tensor: str, at: int, value: bytes,
                             fragment: str) -> None:
    p = write(tmp_path, weight_type=weight_type)
    reader = _Reader if weight_type == "i2_s" else GGUFReader  # gguf's own reader refuses I2_S
    patch(p, tensor_offsets(p, tensor, reader)["data"] + at, value)
    bad_load(p, fragment, "NaN or infinite")


def test_nan_scale_tensor(tmp_path: Path) -> None:
    p = write(tmp_path, scales=True)
    patch(p, tensor_offsets(p, "blk.0.attn_output.scale")["data"], struct.pack("<f", float("nan")))
    bad_load(p, "blk.0.attn_output.scale", "NaN or infinite")


def test_invalid_i2s_code(tmp_path: Path) -> None:
    p = write(tmp_path, weight_type="i2_s")
    patch(p, tensor_offsets(p, "blk.1.ffn_gate.weight", _Reader)["data"] + 77, b"\xff")
    bad_load(p, "blk.1.ffn_gate.weight", "invalid code")


def test_scale_tensor_must_hold_one_value(tmp_path: Path) -> None:
    p = write(tmp_path, scales=True)
    patch(p, tensor_offsets(p, "blk.1.ffn_up.scale")["dims"], struct.pack("<Q", 2))
    bad_load(p, "blk.1.ffn_up.scale", "must be one F32/F16/BF16 value")


def test_f16_finite_check_boundaries() -> None:
    bits = np.array([0x7BFF, 0xFBFF, 0x0000, 0x8000, 0x0001], dtype=np.uint16)  # +-65504, +-0, subnormal
    _finite_rows("t", bits.view(np.float16).reshape(1, -1))
    for bad in (0x7C00, 0xFC00, 0x7C01, 0xFFFF):
        with pytest.raises(ModelError, match="NaN or infinite"):
            _finite_rows("t", np.append(bits, np.uint16(bad)).view(np.float16).reshape(1, -1))
