"""Synthetic BitNet GGUF models: deterministic random weights in every supported format.

Tests build references from `synthetic_weights(spec)`; benchmarks write the realistic 2B-4T
shape with `python -m bitnet.modelfile.writer OUT.gguf --preset 2b4t`. Tensors are generated and
written one at a time (the token embedding in row chunks), so even the 1.2 GB preset never
holds more than one tensor in memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import TensorInfo, WriterState
from gguf.quants import dequantize, quantize

from bitnet.modelfile import formats
from bitnet.modelfile.q6_k import quantize_q6_k
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata

WEIGHT_TYPES = ("tq2_0", "tq1_0", "i2_s", "f32", "f16", "bf16")
EMBD_TYPES = ("f16", "f32", "bf16", "q8_0", "q6_k")
_GGML_TYPE = {"tq2_0": formats.GGML_TQ2_0, "tq1_0": formats.GGML_TQ1_0, "i2_s": formats.GGML_I2_S,
              **{name: int(GGMLQuantizationType[name.upper()]) for name in ("f32", "f16", "bf16", "q8_0", "q6_k")}}
_EMBD_ROWS_PER_CHUNK = 4096  # fixed, so the embedding is the same however it is consumed


@dataclass
class SyntheticSpec:
    arch: str = "bitnet"
    n_layers: int = 2
    dim: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 512
    n_ctx: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    weight_type: str = "tq2_0"  # tq2_0 | tq1_0 | i2_s | f32 | f16 | bf16
    embd_type: str = "f16"  # f16 | f32 (also bf16, q8_0, q6_k: loaded as float32)
    tokenizer: str = "gpt2"  # gpt2 | llama3 (gpt2 grown to Llama 3's size) | llama
    vocab_size: int = 512
    tied: bool = True  # False writes output.weight
    scales: bool = False  # write <proj>.scale tensors; the weights then carry scale 1
    hidden_act: str | None = None
    float_master: bool = False  # f32/f16/bf16 only: non-ternary master weights (absmean path)
    seed: int = 0
    head_dim: int | None = None  # written as attention.key_length / value_length (Falcon3); default dim / n_heads
    tokenizer_pre: str | None = ""  # "" keeps the tokenizer's own, None drops the key (as 2B-4T has none)
    rope_freqs: bool = False  # a rope_freqs tensor of ones (the older bitnet-25 upload of 2B-4T has one)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


PRESETS: dict[str, SyntheticSpec] = {
    "tiny": SyntheticSpec(),
    # BitNet b1.58 2B-4T as Microsoft ships it (docs/design.md section 4), its vocabulary Llama 3's size.
    "2b4t": SyntheticSpec(arch="bitnet-b1.58", n_layers=30, dim=2560, n_heads=20, n_kv_heads=5, ffn_dim=6912,
                          n_ctx=4096, rope_theta=500000.0, weight_type="i2_s", tokenizer="llama3", vocab_size=128256),
}


# -- what the model holds -----------------------------------------------------------------------

def _check(spec: SyntheticSpec) -> None:
    if spec.weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type {spec.weight_type!r} not in {WEIGHT_TYPES}")
    if spec.embd_type not in EMBD_TYPES:
        raise ValueError(f"embd_type {spec.embd_type!r} not in {EMBD_TYPES}")
    if spec.embd_type == "q6_k" and spec.dim % 256:
        raise ValueError("q6_k embeddings are 256-value blocks: dim must be a multiple of 256")
    if spec.float_master and spec.weight_type not in ("f32", "f16", "bf16"):
        raise ValueError("float_master needs weight_type f32, f16 or bf16")
    if spec.float_master and spec.scales:
        raise ValueError("float_master weights have no separate scale: do not combine with scales")
    if (spec.head_dim is None and spec.dim % spec.n_heads) or spec.n_heads % spec.n_kv_heads:
        raise ValueError("n_heads must divide dim (or head_dim be given) and n_kv_heads must divide n_heads")
    widths = (spec.dim, spec.ffn_dim, spec.head_size * spec.n_heads)
    if spec.weight_type in ("tq2_0", "tq1_0") and any(c % 256 for c in widths):
        # TQ rows are 256-value blocks: llama.cpp's converter writes F16 for other widths (1bitLLM 3B).
        raise ValueError(f"{spec.weight_type} needs dim, ffn_dim and the attention width to be multiples of 256")
    kv = spec.head_size * spec.n_kv_heads
    if spec.weight_type == "i2_s" and any(r * c % 128 for r, c in ((kv, spec.dim), (spec.ffn_dim, spec.dim))):
        raise ValueError("i2_s blocks are 128 values of the flat tensor: every projection needs a multiple of 128")


def _plan(spec: SyntheticSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, numpy shape) of every tensor, in file order; kind is embd | norm | proj | scale."""
    q, kv = spec.head_size * spec.n_heads, spec.head_size * spec.n_kv_heads
    sub_norms = spec.arch != "llama"  # bitnet.cpp's `llama` files (Llama3-8B-1.58, Falcon3) have none
    plan: list[tuple[str, str, tuple[int, ...]]] = [
        ("token_embd.weight", "embd", (spec.vocab_size, spec.dim)),
        ("output_norm.weight", "norm", (spec.dim,)),
    ]
    if spec.rope_freqs:
        plan.append(("rope_freqs.weight", "ones", (spec.head_size // 2,)))
    if not spec.tied:
        plan.append(("output.weight", "embd", (spec.vocab_size, spec.dim)))
    proj = {"attn_q": (q, spec.dim), "attn_k": (kv, spec.dim), "attn_v": (kv, spec.dim),
            "attn_output": (spec.dim, q), "ffn_gate": (spec.ffn_dim, spec.dim),
            "ffn_up": (spec.ffn_dim, spec.dim), "ffn_down": (spec.dim, spec.ffn_dim)}
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", "norm", (spec.dim,)))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            plan.append((p + n + ".weight", "proj", proj[n]))
            if spec.scales:
                plan.append((p + n + ".scale", "scale", (1,)))
        if sub_norms:
            plan.append((p + "attn_sub_norm.weight", "norm", (q,)))
        plan.append((p + "ffn_norm.weight", "norm", (spec.dim,)))
        for n in ("ffn_gate", "ffn_up", "ffn_down"):
            plan.append((p + n + ".weight", "proj", proj[n]))
            if spec.scales:
                plan.append((p + n + ".scale", "scale", (1,)))
        if sub_norms:
            plan.append((p + "ffn_sub_norm.weight", "norm", (spec.ffn_dim,)))
    return plan


def _rng(spec: SyntheticSpec, name: str, chunk: int = 0) -> np.random.Generator:
    # Seeded per tensor (and chunk), so any tensor can be regenerated alone, in any order.
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode()), chunk])


def _exact_scale(x: float) -> float:
    """x rounded to 7 significant bits: exact in F16, BF16 and F32, so every format stores it unchanged."""
    m, e = np.frexp(x)
    return float(np.ldexp(np.round(m * 128) / 128, e))


def _scale(spec: SyntheticSpec, name: str, cols: int) -> float:
    """A per-tensor scale like real BitNet's, sized so outputs of unit-RMS inputs stay near unit size."""
    return _exact_scale(_rng(spec, name, 1).uniform(0.5, 1.5) / np.sqrt(2 / 3 * cols))


def _projection(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """Ternary values, uniform over {-1, 0, 1} (so about a third zeros), and the tensor's scale."""
    t = _rng(spec, name).integers(-1, 2, size=shape, dtype=np.int8)
    return t, _scale(spec, name, shape[1])


def _master(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Non-ternary float weights as stored (already rounded to the file's type), as float32."""
    rng = _rng(spec, name)
    std = np.float32(1.25 * rng.uniform(0.5, 1.5) / np.sqrt(shape[1]))  # absmean scale ~ 0.8 std
    w = rng.standard_normal(shape, dtype=np.float32) * std
    if spec.weight_type == "f16":
        return w.astype(np.float16).astype(np.float32)
    if spec.weight_type == "bf16":
        return formats.bf16_to_float32(formats.float32_to_bf16(w))
    return w


def _norm(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return (1 + 0.1 * _rng(spec, name).standard_normal(shape)).astype(np.float32)


def _embd_chunks(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The embedding as stored (F16/F32 arrays, BF16/Q8_0/Q6_K bytes), a fixed number of rows at a time."""
    # std 2/sqrt(dim): with a tied LM head, logits of a normalized hidden state spread a few units.
    std = np.float32(2 / np.sqrt(shape[1]))
    for k, r in enumerate(range(0, shape[0], _EMBD_ROWS_PER_CHUNK)):
        n = min(_EMBD_ROWS_PER_CHUNK, shape[0] - r)
        x = _rng(spec, name, k).standard_normal((n, shape[1]), dtype=np.float32) * std
        if spec.embd_type == "bf16":
            yield formats.float32_to_bf16(x)
        elif spec.embd_type == "q8_0":
            yield quantize(x, GGMLQuantizationType.Q8_0)
        elif spec.embd_type == "q6_k":  # gguf-py cannot quantize Q6_K
            yield quantize_q6_k(x)
        else:
            yield x.astype(np.float16 if spec.embd_type == "f16" else np.float32)


def _decode_embd(spec: SyntheticSpec, chunk: np.ndarray) -> np.ndarray:
    """A stored embedding chunk as the loader returns it (F16/F32 unchanged, the others as float32)."""
    if spec.embd_type == "bf16":
        return formats.bf16_to_float32(chunk)
    if spec.embd_type in ("q8_0", "q6_k"):
        return dequantize(chunk, GGMLQuantizationType[spec.embd_type.upper()])
    return chunk


def synthetic_weights(spec: SyntheticSpec) -> dict[str, np.ndarray]:
    """Every tensor of the model `write_model(path, spec)` writes, as tests should see it after loading.

    Projections: "<name>.weight" int8 ternary values and "<name>.scale" a float32 [1] holding
    the effective per-tensor scale (whether or not the file has .scale tensors). With
    float_master, "<name>.master" holds the stored float weights and the ternary values and
    scale are their absmean ternarization. Norms float32; embeddings in their stored dtype.
    """
    _check(spec)
    out: dict[str, np.ndarray] = {}
    for name, kind, shape in _plan(spec):
        if kind == "embd":
            out[name] = np.concatenate([_decode_embd(spec, c) for c in _embd_chunks(spec, name, shape)])
        elif kind == "norm":
            out[name] = _norm(spec, name, shape)
        elif kind == "proj":
            base = name[:-len(".weight")]
            if spec.float_master:
                w = _master(spec, name, shape)
                out[base + ".master"] = w
                t, s = formats.absmean_ternary(w)
            else:
                t, s = _projection(spec, name, shape)
            out[name] = t
            out[base + ".scale"] = np.array([s], dtype=np.float32)
    return out


# -- writing --------------------------------------------------------------------------------------

def _llama_rows(spec: SyntheticSpec, name: str, w: np.ndarray) -> np.ndarray:
    """Q/K rows of a `llama` file in the converters' order: each head's rotate-halves rows
    interleaved into pairs (LlamaModel.permute), which llama.cpp's `llama` RoPE expects."""
    if spec.arch != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return w
    hd = spec.head_size
    heads = w.shape[0] // hd
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode_projection(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if spec.float_master:
        w = _llama_rows(spec, name, _master(spec, name, shape))
        return formats.float32_to_bf16(w) if spec.weight_type == "bf16" else w.astype(_float_dtype(spec))
    t, s = _projection(spec, name, shape)
    t = _llama_rows(spec, name, t)
    if spec.scales:
        s = 1.0  # the scale lives in the <name>.scale tensor instead
    wt = spec.weight_type
    if wt == "tq2_0":
        return formats.ternary_to_tq2_0(t, s)
    if wt == "tq1_0":
        return formats.ternary_to_tq1_0(t, s)
    if wt == "i2_s":
        return formats.ternary_to_i2s(t, s)
    w = t.astype(np.float32) * np.float32(s)  # what llama.cpp's converter writes for F32/F16/BF16
    return formats.float32_to_bf16(w) if wt == "bf16" else w.astype(_float_dtype(spec))


def _float_dtype(spec: SyntheticSpec) -> type:
    return np.float16 if spec.weight_type == "f16" else np.float32


def _tensor_type(spec: SyntheticSpec, kind: str) -> int:
    if kind in ("norm", "scale", "ones"):
        return int(GGMLQuantizationType.F32)
    return _GGML_TYPE[spec.embd_type if kind == "embd" else spec.weight_type]


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and numpy shape occupies, known before any data exists."""
    n = int(np.prod(shape))
    if ggml_type == formats.GGML_I2_S:
        return formats.i2s_nbytes(n)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return n // block * size


class _StreamingWriter(GGUFWriter):
    """GGUFWriter that takes tensor infos up front (any ggml type, I2_S included, which
    add_tensor_info cannot express) and then tensor data in pieces, in the same order."""

    def add_raw_tensor_info(self, name: str, shape: tuple[int, ...], ggml_type: int, nbytes: int) -> None:
        self.tensors[-1][name] = TensorInfo(shape=shape, dtype=ggml_type, nbytes=nbytes)  # type: ignore[arg-type]

    def write_tensor_pieces(self, pieces: Iterator[np.ndarray]) -> None:
        assert self.fout is not None and len(self.fout) == 1
        fout = self.fout[0]
        ti = self.tensors[0].pop(next(iter(self.tensors[0])))
        self.write_padding(fout, fout.tell())
        written = 0
        for piece in pieces:
            piece.tofile(fout)
            written += piece.nbytes
        if written != ti.nbytes:
            raise AssertionError(f"wrote {written} bytes of a {ti.nbytes}-byte tensor")
        self.write_padding(fout, written)
        self.state = WriterState.WEIGHTS


def _add_kv(w: GGUFWriter, key: str, value: Any) -> None:
    # The GGUF types llama.cpp reads these keys as (see synthetic_tokenizer_metadata).
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list) and value:
        sub = {str: GGUFValueType.STRING, float: GGUFValueType.FLOAT32, int: GGUFValueType.INT32}
        w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub[type(value[0])])
    else:
        raise ValueError(f"cannot write metadata {key} = {value!r}")


# A tensor to write: name, ggml type, numpy shape, and a callable yielding its bytes in pieces
# (called once, when its turn comes, so that a large tensor never has to be held whole).
TensorSource = tuple[str, int, tuple[int, ...], Callable[[], Iterable[np.ndarray]]]


def write_gguf(path: str | Path, arch: str, metadata: dict[str, Any], tensors: Sequence[TensorSource]) -> Path:
    """Write a GGUF v3 file (little-endian): general.architecture = arch, then metadata in
    order (Python int -> uint32, float -> float32, str, bool, lists of those), then tensors."""
    path = Path(path)
    # Written beside the target and renamed at the end: a failure never leaves a partial model.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = _StreamingWriter(tmp, arch)
    for key, value in metadata.items():
        _add_kv(w, key, value)
    for name, ggml_type, shape, _ in tensors:
        w.add_raw_tensor_info(name, shape, ggml_type, tensor_nbytes(ggml_type, shape))
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, _, _, pieces in tensors:
            w.write_tensor_pieces(iter(pieces()))
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path


def write_model(path: str | Path, spec: SyntheticSpec) -> Path:
    """Write the synthetic model described by spec to path (GGUF v3, little-endian)."""
    _check(spec)
    arch = spec.arch
    md: dict[str, Any] = {"general.name": "bitnet-synthetic"}
    for key, value in {
        "block_count": spec.n_layers, "context_length": spec.n_ctx, "embedding_length": spec.dim,
        "feed_forward_length": spec.ffn_dim, "attention.head_count": spec.n_heads,
        "attention.head_count_kv": spec.n_kv_heads, "rope.dimension_count": spec.head_size,
        "vocab_size": spec.vocab_size,
        **({"attention.key_length": spec.head_dim, "attention.value_length": spec.head_dim} if spec.head_dim else {}),
        "rope.freq_base": float(spec.rope_theta), "attention.layer_norm_rms_epsilon": float(spec.rms_eps),
        **({"hidden_act": spec.hidden_act} if spec.hidden_act is not None else {}),
    }.items():
        md[f"{arch}.{key}"] = value
    tok = dict(synthetic_tokenizer_metadata(spec.tokenizer, spec.vocab_size))
    if spec.tokenizer_pre is None:
        tok.pop("tokenizer.ggml.pre", None)
    elif spec.tokenizer_pre:
        tok["tokenizer.ggml.pre"] = spec.tokenizer_pre
    md.update(tok)

    plan = _plan(spec)
    shapes = {name: shape for name, _, shape in plan}

    def pieces(name: str, kind: str, shape: tuple[int, ...]) -> Callable[[], Iterable[np.ndarray]]:
        if kind == "embd":
            return lambda: _embd_chunks(spec, name, shape)
        if kind == "norm":
            return lambda: [_norm(spec, name, shape)]
        if kind == "ones":
            return lambda: [np.ones(shape, np.float32)]
        if kind == "scale":
            weight = name[:-len(".scale")] + ".weight"
            return lambda: [np.array([_scale(spec, weight, shapes[weight][1])], dtype=np.float32)]
        return lambda: [_encode_projection(spec, name, shape)]

    return write_gguf(path, arch, md, [(name, _tensor_type(spec, kind), shape, pieces(name, kind, shape))
                                       for name, kind, shape in plan])


# -- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bitnet.modelfile.writer",
                                 description="Write a synthetic BitNet GGUF model.")
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--weight-type", choices=WEIGHT_TYPES)
    ap.add_argument("--arch", choices=("bitnet", "bitnet-b1.58", "bitnet-25", "llama"))
    ap.add_argument("--embd-type", choices=EMBD_TYPES)
    ap.add_argument("--tokenizer", choices=("gpt2", "llama3", "llama"))
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--untied", action="store_true", help="write a separate output.weight")
    ap.add_argument("--scales", action="store_true", help="write <proj>.scale tensors (bitnet arch)")
    ap.add_argument("--float-master", action="store_true", help="non-ternary F32/F16/BF16 master weights")
    ap.add_argument("--hidden-act")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    overrides: dict[str, Any] = {"seed": args.seed}
    for field, value in (("weight_type", args.weight_type), ("arch", args.arch),
                         ("embd_type", args.embd_type), ("tokenizer", args.tokenizer),
                         ("n_layers", args.layers), ("hidden_act", args.hidden_act)):
        if value is not None:
            overrides[field] = value
    if args.untied:
        overrides["tied"] = False
    if args.scales:
        overrides["scales"] = True
    if args.float_master:
        overrides["float_master"] = True
    spec = replace(PRESETS[args.preset], **overrides)
    t0 = time.perf_counter()
    try:
        path = write_model(args.out, spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size_mb = path.stat().st_size / 1e6
    elapsed = time.perf_counter() - t0
    print(f"wrote {path} ({size_mb:.1f} MB, {spec.arch}, {spec.weight_type}) in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
