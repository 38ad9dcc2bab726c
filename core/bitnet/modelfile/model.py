"""Load a BitNet b1.58 GGUF file (docs/design.md section 4): validated, memory-mapped, weights kept packed.

Every problem with the file becomes one ModelError("<path>: <what>"). The whole file is
checked (header, tensor table, names, shapes, types, data ranges) before any weight is
converted, so a bad file fails fast and never triggers a large allocation.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from bitnet.errors import ModelError
from bitnet.modelfile import formats, huge_pages, load_cache
from bitnet.modelfile.ternary import TernaryMatrix

if TYPE_CHECKING:  # gguf is imported only to read a file whole (gguf_reader), not for a cached one
    from gguf.gguf_reader import ReaderTensor

    from bitnet.modelfile.gguf_reader import Reader

# Architecture -> default FFN activation. `llama` is what bitnet.cpp's converter writes for Llama3-8B-1.58
# and the Falcon3 / Falcon-E 1.58-bit models (no sub-norms), accepted only with ternary projections.
# `bitnet-b1.58` stays squared ReLU even for 1bitLLM's SiLU-trained models, which microsoft/BitNet's
# utils/convert-hf-to-gguf-bitnet.py (BitnetModel) labels so since July 2026 without a hidden_act:
# bitnet.cpp's llama.cpp fork runs that label through build_bitnet_158 (LLM_FFN_RELU_SQR) whatever
# the file holds, and no key of such a file tells the two apart.
ARCHITECTURES = {"bitnet": "silu", "bitnet-b1.58": "relu2", "bitnet-25": "relu2", "llama": "silu"}
# Architectures without attn_sub_norm / ffn_sub_norm.
_NO_SUB_NORMS = {"llama"}
_ACT_NAMES = {"silu": "silu", "swish": "silu",
              "relu2": "relu2", "relu_squared": "relu2", "squared_relu": "relu2"}
_FLOAT_TYPES = {formats.GGML_F32, formats.GGML_F16, formats.GGML_BF16}
_TERNARY_TYPES = {formats.GGML_TQ1_0, formats.GGML_TQ2_0, formats.GGML_I2_S} | _FLOAT_TYPES
# Quantized embedding types (llama-quantize writes Q4_K/Q6_K embeddings next to TQ projections):
# decoded to float32 with gguf's reference code.
_EMBD_QUANT_TYPES = {i for i, n in formats.GGML_TYPE_NAMES.items() if n in
                     ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
_PROJECTIONS = (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
                ("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down"))
_LAYER_NORMS = ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    activation: str  # "silu" | "relu2"


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: TernaryMatrix
    wk: TernaryMatrix
    wv: TernaryMatrix
    wo: TernaryMatrix
    attn_sub_norm: np.ndarray | None  # None for `llama`
    ffn_norm: np.ndarray
    w_gate: TernaryMatrix
    w_up: TernaryMatrix
    w_down: TernaryMatrix
    ffn_sub_norm: np.ndarray | None  # norms float32 1-D


@dataclass
class Model:
    path: str
    config: ModelConfig
    metadata: dict[str, Any]  # every GGUF KV field as a Python value
    token_embd: np.ndarray  # [vocab, dim] F16/F32 memory-mapped view; other types decoded to float32
    output_norm: np.ndarray  # float32 [dim]
    output: np.ndarray | None  # LM head [vocab, dim], None when tied to token_embd
    layers: list[LayerWeights]
    weight_types: dict[str, int]  # tensor count per ggml type name
    head_type: str  # ggml type name of the LM head as stored: output.weight, else token_embd.weight
    n_params: int
    file_size: int


def type_name(ggml_type: int) -> str:
    name = formats.GGML_TYPE_NAMES.get(ggml_type)
    if name is not None:
        return name
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def __getattr__(name: str) -> Any:
    if name == "_Reader":  # the reader, for the tests and tools that use it directly
        from bitnet.modelfile.gguf_reader import Reader

        return Reader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- reading the container ----------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, ModelError) else f"{type(e).__name__}: {text}"


def _open(path: str) -> Reader:
    from bitnet.modelfile.gguf_reader import Reader

    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelError(f"{path}: cannot open: {e.strerror or e}") from None
    if len(head) < 4 or head[:4] != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (no GGUF magic)")
    if len(head) < 8:
        raise ModelError(f"{path}: truncated file (no GGUF version)")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:
        raise ModelError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ModelError(f"{path}: unsupported GGUF version {version} (this reads versions 2 and 3, "
                         f"little-endian)")
    try:
        reader = Reader(path)
    except Exception as e:  # any failure of a parser on hostile bytes means a bad file
        raise ModelError(f"{path}: {_one_line(e)}") from e
    huge_pages.advise(reader.data)
    return reader


class _Tensor(NamedTuple):
    """A tensor of a file the load cache knows: gguf's ReaderTensor without the header field."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]  # GGUF order, innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray
    block_scale: float | None = None  # TQ2_0: the scale all its blocks share, as the full read saw


@dataclass
class _Mapped:
    """A file the load cache knows, mapped: what _build needs of a Reader, without parsing the header."""

    data: np.memmap
    tensors: list[_Tensor]


def _mapped(path: str, entry: load_cache.Entry) -> _Mapped | None:
    """The file as the entry describes it, if the mapped file still is that file."""
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError):
        return None
    if not load_cache.matches(entry, path, data):
        return None
    huge_pages.advise(data)
    plain = data.view(np.ndarray)
    try:
        tensors = [_Tensor(name, ggml_type, tuple(dims), n, n_bytes, offset,
                           plain[offset:offset + n_bytes].view(dtype).reshape(shape), block_scale)
                   for name, ggml_type, dims, n, n_bytes, offset, dtype, shape, block_scale in entry.tensors]
    except (ValueError, TypeError):
        return None
    return _Mapped(data, tensors)


def _tensor_infos(reader: Reader, model: Model) -> list[tuple]:
    """What the cache keeps of each tensor to map it again: name, type, dims, sizes, offset, view and,
    for a TQ2_0 projection whose blocks all share one scale, that scale (a hit then reads none of its
    66-byte blocks: 0.54 GB of strided reads for 2B-4T)."""
    names = {t.name for t in reader.tensors}
    shared = {}
    for i, layer in enumerate(model.layers):
        for field, n in _PROJECTIONS:
            scales = getattr(layer, field).scales
            if f"blk.{i}.{n}.scale" not in names and (scales == scales.flat[0]).all():  # (else folded in)
                shared[f"blk.{i}.{n}.weight"] = float(scales.flat[0])
    return [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes),
             int(t.data_offset), t.data.dtype.str, t.data.shape,
             shared.get(t.name) if int(t.tensor_type) == formats.GGML_TQ2_0 else None) for t in reader.tensors]


# -- from tensors to the model ------------------------------------------------------------------

_ARRAY, _STRING = 9, 8  # GGUFValueType


def _metadata(reader: Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            if field.types == [_ARRAY, _STRING]:  # decode the views, no copies
                out[name] = [str(field.parts[i], "utf-8") for i in field.data]
            else:
                out[name] = field.contents()
        except UnicodeDecodeError:
            raise ModelError(f"metadata {name} is not valid UTF-8") from None
    return out


def _hparams(md: dict[str, Any], arch: str, key: str, kind: type, default: Any = None) -> Any:
    full = f"{arch}.{key}"
    v = md.get(full, default)
    if v is None:
        raise ModelError(f"missing metadata {full}")
    if kind is int:
        if isinstance(v, list) and v and len(set(v)) == 1:
            v = v[0]  # some converters write a per-layer array of equal values
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 31:
            raise ModelError(f"metadata {full} = {v!r} is not a valid count")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelError(f"metadata {full} = {v!r} is not a positive number")
    return float(v)


def _config(md: dict[str, Any], tensors: dict[str, ReaderTensor]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    act = ARCHITECTURES[arch]
    if f"{arch}.hidden_act" in md:
        given = md[f"{arch}.hidden_act"]
        act = _ACT_NAMES.get(str(given).strip().lower(), "")
        if not act:
            raise ModelError(f"unsupported {arch}.hidden_act {given!r} (supported: silu, relu2)")
    n_layers = _hparams(md, arch, "block_count", int)
    if n_layers * (len(_PROJECTIONS) + len(_layer_norms(arch))) > len(tensors):
        raise ModelError(f"{arch}.block_count = {n_layers}, but the file holds only {len(tensors)} tensors")
    dim = _hparams(md, arch, "embedding_length", int)
    n_heads = _hparams(md, arch, "attention.head_count", int)
    n_kv = _hparams(md, arch, "attention.head_count_kv", int, n_heads)
    if n_heads % n_kv:
        raise ModelError(f"{n_kv} KV heads do not divide {n_heads} heads")
    # key_length gives the head size where it is not dim / n_heads (Falcon3 writes 256 explicitly).
    if f"{arch}.attention.key_length" not in md and dim % n_heads:
        raise ModelError(f"{n_heads} heads do not divide embedding length {dim} and there is no "
                         f"{arch}.attention.key_length")
    head_dim = _hparams(md, arch, "attention.key_length", int, dim // n_heads)
    if head_dim % 2:
        raise ModelError(f"head size {head_dim} is odd: RoPE rotates pairs")
    for key in ("rope.dimension_count", "attention.value_length"):
        if md.get(f"{arch}.{key}", head_dim) != head_dim:
            raise ModelError(f"{arch}.{key} = {md[f'{arch}.{key}']} differs from the head size {head_dim}")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelError("missing tensor token_embd.weight")
    if len(embd.shape) != 2 or int(embd.shape[0]) != dim:
        raise ModelError(f"tensor token_embd.weight has shape {_dims(embd)}, expected [{dim}, vocab]")
    return ModelConfig(
        arch=arch, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=_hparams(md, arch, "feed_forward_length", int), vocab_size=int(embd.shape[1]),
        n_ctx_train=_hparams(md, arch, "context_length", int),
        rope_theta=_hparams(md, arch, "rope.freq_base", float, 10000.0),
        rms_eps=_hparams(md, arch, "attention.layer_norm_rms_epsilon", float, 1e-5),
        activation=act,
    )


def _layer_norms(arch: str) -> tuple[str, ...]:
    return ("attn_norm", "ffn_norm") if arch in _NO_SUB_NORMS else _LAYER_NORMS


def _dims(t: ReaderTensor) -> list[int]:
    return [int(d) for d in t.shape]


def _expected(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], set[int] | None]]:
    """Tensor name -> (numpy shape, allowed types or None for any float-decodable type)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    want: dict[str, tuple[tuple[int, ...], set[int] | None]] = {
        "token_embd.weight": ((cfg.vocab_size, cfg.dim), None),
        "output_norm.weight": ((cfg.dim,), _FLOAT_TYPES),
    }
    d, f = cfg.dim, cfg.ffn_dim
    proj = {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
            "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    norms = {"attn_norm": cfg.dim, "attn_sub_norm": q, "ffn_norm": cfg.dim, "ffn_sub_norm": cfg.ffn_dim}
    for i in range(cfg.n_layers):
        for n in _layer_norms(cfg.arch):
            size = norms[n]
            want[f"blk.{i}.{n}.weight"] = ((size,), _FLOAT_TYPES)
        for n, shape in proj.items():
            want[f"blk.{i}.{n}.weight"] = (shape, _TERNARY_TYPES)
    return want


def _check_tensor(t: ReaderTensor, shape: tuple[int, ...], types: set[int] | None) -> None:
    ggml_type = int(t.tensor_type)
    if tuple(reversed(_dims(t))) != shape:
        raise ModelError(f"tensor {t.name} has shape {_dims(t)}, expected {list(reversed(shape))}")
    if types is None:
        if ggml_type not in _FLOAT_TYPES | _EMBD_QUANT_TYPES:
            raise ModelError(f"tensor {t.name} has type {type_name(ggml_type)}, which cannot be decoded")
    elif ggml_type not in types:
        allowed = ", ".join(sorted(type_name(x) for x in types))
        raise ModelError(f"tensor {t.name} has type {type_name(ggml_type)} (supported: {allowed})")


def _finite_rows(name: str, a: np.ndarray) -> None:
    """Reject NaN/Inf, a slice of rows at a time (a whole-tensor mask could be 100s of MB)."""
    step = max(1, (1 << 18) // max(1, a.shape[-1]))  # temporaries of a chunk stay in L2
    for r in range(0, a.shape[0], step):
        chunk = a[r:r + step]
        if chunk.dtype == np.float16:
            # Exponent all ones: bits 0x7C00-0x7FFF, the largest int16 values, or 0xFC00-0xFFFF, the
            # largest uint16 ones. Two reductions and no temporary: 0.66 GB of F16 in ~0.1 s.
            bad = int(chunk.view(np.int16).max()) >= 0x7C00 or int(chunk.view(np.uint16).max()) >= 0xFC00
        else:
            bad = not np.all(np.isfinite(chunk))
        if bad:
            raise ModelError(f"tensor {name} holds NaN or infinite values")


def _float_tensor(t: ReaderTensor, keep_view: bool = False, check: bool = True) -> np.ndarray:
    """A float tensor as float32 (or as its memory-mapped F16/F32 view when keep_view); `check`
    rejects NaN/Inf (skipped for a file the load cache says passed)."""
    ggml_type = int(t.tensor_type)
    data = t.data
    if ggml_type in (formats.GGML_F32, formats.GGML_F16):
        out = data if keep_view else np.array(data, dtype=np.float32)
    elif ggml_type == formats.GGML_BF16:
        out = formats.bf16_to_float32(data)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = np.empty(data.shape[:-1] + (int(t.shape[0]),), dtype=np.float32)
        step = max(1, (1 << 22) // int(t.shape[0]))
        for r in range(0, data.shape[0], step):
            out[r:r + step] = dequantize(data[r:r + step], GGMLQuantizationType(ggml_type))
    if check:
        _finite_rows(t.name, out.reshape(-1, out.shape[-1]))
    return out


def _ternary(t: ReaderTensor, scale: ReaderTensor | None, master_ok: bool, check: bool = True) -> TernaryMatrix:
    rows, cols = (int(d) for d in reversed(_dims(t)))
    ggml_type = int(t.tensor_type)
    floats = _float_tensor(t, keep_view=True) if ggml_type in _FLOAT_TYPES else None
    try:
        if floats is not None:
            m = formats.float_to_ternary(floats, master_ok)
        elif ggml_type == formats.GGML_TQ2_0:
            m = formats.tq2_0_to_ternary(t.data, rows, cols, check, getattr(t, "block_scale", None))
        elif ggml_type == formats.GGML_TQ1_0:
            m = formats.tq1_0_to_ternary(t.data, rows, cols)
        else:
            m = formats.i2s_to_ternary(t.data, rows, cols, check)
    except ModelError as e:
        raise ModelError(f"tensor {t.name}: {e}") from None
    if scale is not None:
        # llama.cpp multiplies the projection output by this scalar; folding it into the weight
        # scale is the same product and keeps one code path for every kernel.
        s = _float_tensor(scale).reshape(-1)[0]
        m = dataclasses.replace(m, scales=(m.scales * s).astype(np.float32))
    return m


def _neox_rows(m: TernaryMatrix, n_heads: int, head_dim: int) -> TernaryMatrix:
    """Undo the converters' permutation of `llama` Q/K rows.

    Both converters reorder each head's rows from Hugging Face's rotate-halves order to the
    adjacent pairs llama.cpp's `llama` RoPE rotates. Putting them back lets the one NEOX RoPE of
    the transformer run: q.k is the same sum whichever order both operands share.
    """
    half = head_dim // 2
    j, i = np.divmod(np.arange(head_dim), half)  # HF row j*half + i came from GGUF row 2i + j
    order = (np.arange(n_heads)[:, None] * head_dim + (2 * i + j)[None, :]).reshape(-1)
    blocks = m.blocks()
    return dataclasses.replace(m, codes=np.ascontiguousarray(blocks[order]), scales=m.scales[order].copy())


def _check_rope_freqs(t: ReaderTensor | None, cfg: ModelConfig) -> None:
    """llama.cpp divides each RoPE frequency by rope_freqs (Llama 3.1 scaling); the transformer has
    no such factors, so only a file whose factors are all 1 (or absent) runs as written."""
    if t is None:
        return
    f = _float_tensor(t).reshape(-1)
    if f.size != cfg.head_dim // 2 or not np.all(f == 1):
        raise ModelError("tensor rope_freqs.weight holds RoPE frequency factors other than 1 "
                         "(Llama 3.1-style RoPE scaling), which this engine does not implement")


def mapped_span(a: np.ndarray) -> tuple[np.memmap, int, int] | None:
    """The memory-mapped file array `a` is a view of, and the byte range of the file it spans."""
    base = a
    while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
        base = base.base
    if not isinstance(base, np.memmap):  # a copy in memory
        return None
    lo = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    last = sum((n - 1) * step for n, step in zip(a.shape, a.strides, strict=True))  # views step forward
    return base, lo, lo + last + a.itemsize


def release_pages(a: np.ndarray) -> None:
    """Drop the file pages under `a`, a view of a mapped file, from this process's resident set.

    For data read once and kept in another form (a projection converted to the canonical layout, an
    LM head copied to int8), so that it does not count twice toward the peak RSS. The data stays in
    the page cache and re-faults if read again. Anything else (an array in memory) is left alone.
    """
    span = mapped_span(a) if a.size else None
    mapping = getattr(span[0], "_mmap", None) if span else None
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base, lo, hi = span
    skip = int(base.offset) % mmap.ALLOCATIONGRANULARITY  # where NumPy's mapping puts the array's first byte
    page = mmap.PAGESIZE
    start, end = -(-(skip + lo) // page) * page, (skip + hi) // page * page
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def map_pages(model: Model, float_head: bool = True, also: Sequence[np.ndarray] = (),
              codes: bool = True) -> threading.Thread:
    """Fault in the file pages of every tensor the model uses in place, and of the mapped arrays in `also`
    (an int8 LM head mapped from its cache), on a thread of its own: one NumPy read per 4 KB page, without
    the GIL. Join it before the first forward pass.

    A file the load cache knows is not read during load_model, so without this its page faults
    (~0.08 s of one core for 1.1 GB) would land in the first token. (llama.cpp maps its file with
    MAP_POPULATE at load.) Beside the tokenizer's build they cost no time. Without `float_head` (the
    int8 head runs) the embedding tables are left alone: a token reads one row, and a 2B-4T F16 table
    is 657 MB that would stay resident beside the int8 copy. Without `codes` (the provider reads codes of its own,
    in `also`) the projections' are left alone too.
    """
    spans: dict[int, tuple[np.memmap, list[tuple[int, int]]]] = {}  # per mapped file: byte ranges
    tables = [model.token_embd, model.output] if float_head else []
    projections = [getattr(layer, field).codes for layer in model.layers for field, _ in _PROJECTIONS] if codes else []
    arrays = [*tables, *projections, *also]
    for a in arrays:
        span = mapped_span(a) if isinstance(a, np.ndarray) else None
        if span is not None:
            spans.setdefault(id(span[0]), (span[0], []))[1].append(span[1:])
    regions = []
    for base, ranges in spans.values():
        ranges.sort()
        merged = [list(ranges[0])]
        for lo, hi in ranges[1:]:
            if lo - merged[-1][1] < 1 << 20:  # the norms in between are a few KB: one read covers all
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        regions += [(base.view(np.ndarray).reshape(-1).view(np.uint8), lo, hi) for lo, hi in merged]  # bytes

    def touch() -> None:
        for plain, lo, hi in regions:
            int(plain[lo:hi:mmap.PAGESIZE].max(initial=0))

    thread = threading.Thread(target=touch, name="bitnet-map-pages", daemon=True)
    thread.start()
    return thread


def load_model(path: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None) -> Model:
    """Read and validate a GGUF model; ternary projections become TernaryMatrix, embeddings stay mapped.

    A file loaded before and unchanged since skips the metadata parse and the data checks (load_cache)."""
    path = os.fspath(path)
    ident = load_cache.identity(path)  # taken before reading: a file changed meanwhile is never a hit later
    known = load_cache.lookup(path, ident)
    reader: Reader | _Mapped | None = _mapped(path, known) if known is not None else None
    if reader is None:
        known, reader = None, _open(path)
    try:
        model = _build(path, reader, progress, known)
    except ModelError as e:
        raise ModelError(f"{path}: {e}") from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        raise ModelError(f"{path}: invalid model: {_one_line(e)}") from e
    if known is None:
        load_cache.store(path, ident, reader.data, reader.data_offset, model.metadata, _tensor_infos(reader, model))
        huge_pages.recache(path, reader.data)  # the pages come back as map_pages or the first token reads them
    return model


def _build(path: str, reader: Reader | _Mapped, progress: Callable[[int, int], None] | None,
           known: load_cache.Entry | None = None) -> Model:
    md = _metadata(reader) if known is None else known.metadata
    check = known is None  # an entry exists only for a file whose data passed every check
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(md, tensors)

    # Validate every tensor before converting any, so a bad file costs no allocation.
    want = _expected(cfg)
    if "output.weight" in tensors:
        want["output.weight"] = ((cfg.vocab_size, cfg.dim), None)
    for name, (shape, types) in want.items():
        if name not in tensors:
            raise ModelError(f"missing tensor {name}")
        _check_tensor(tensors[name], shape, types)
    scales = {}  # projection weight name -> its optional one-value .scale tensor
    for name, (_, types) in want.items():
        t = tensors.get(name[:-len(".weight")] + ".scale")
        if types is _TERNARY_TYPES and t is not None:
            if t.n_elements != 1 or int(t.tensor_type) not in _FLOAT_TYPES:
                raise ModelError(f"tensor {t.name} must be one F32/F16/BF16 value, "
                                 f"has shape {_dims(t)} and type {type_name(int(t.tensor_type))}")
            scales[name] = t

    llama = cfg.arch == "llama"
    if llama:
        _check_rope_freqs(tensors.get("rope_freqs.weight"), cfg)

    def convert(name: str) -> TernaryMatrix:
        # A float `llama` file may be an ordinary full-precision Llama: never ternarize it silently.
        m = _ternary(tensors[name], scales.get(name), master_ok=not llama, check=check)
        if not np.may_share_memory(m.codes, tensors[name].data):  # a copy: the file pages are spent
            release_pages(tensors[name].data)
        if llama and name.endswith(("attn_q.weight", "attn_k.weight")):
            m = _neox_rows(m, m.rows // cfg.head_dim, cfg.head_dim)
        return m

    # Conversion is NumPy work that releases the GIL: one thread per core converts the
    # projections (and checks the embedding), 0.73 -> 0.40 s for 2B-4T TQ2_0 on 2 cores.
    # Results are taken in file order, so the first bad tensor is the one reported.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        try:
            embd = pool.submit(_float_tensor, tensors["token_embd.weight"], True, check)
            out = (pool.submit(_float_tensor, tensors["output.weight"], True, check)
                   if "output.weight" in tensors else None)
            # One task per layer, its projections in file order: 7x fewer futures (~15 ms of GIL time).
            pending = [pool.submit(lambda i: {field: convert(f"blk.{i}.{n}.weight") for field, n in _PROJECTIONS}, i)
                       for i in range(cfg.n_layers)]
            token_embd, output = embd.result(), None if out is None else out.result()
            layers = []
            for i, projections in enumerate(pending):
                norms = {n: tensors.get(f"blk.{i}.{n}.weight") for n in _LAYER_NORMS}
                if llama:
                    norms["attn_sub_norm"] = norms["ffn_sub_norm"] = None
                layers.append(LayerWeights(**{n: None if t is None else _float_tensor(t) for n, t in norms.items()},
                                           **projections.result()))
                if progress is not None:
                    progress(i + 1, cfg.n_layers)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise

    return Model(
        path=path, config=cfg, metadata=md, token_embd=token_embd,
        output_norm=_float_tensor(tensors["output_norm.weight"]), output=output, layers=layers,
        weight_types=dict(Counter(type_name(int(t.tensor_type)) for t in reader.tensors)),
        head_type=type_name(int(tensors.get("output.weight", tensors["token_embd.weight"]).tensor_type)),
        n_params=sum(t.n_elements for t in reader.tensors), file_size=len(reader.data),
    )
