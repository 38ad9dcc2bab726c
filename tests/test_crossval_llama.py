"""Cross-validation against llama.cpp (llama-cpp-python): the oracle for the `bitnet` architecture.

Synthetic `bitnet` models from our writer are run by our engine and by llama.cpp (KV cache F32,
flash attention off, docs/design.md section 5b), and compared per position: the error of a position is
max|ours - llama| / max|llama| over its logits. What agreement to expect, measured on these models:

- Float weights in mode "none" (no activation quantization on either side): the two compute the
  same real numbers, so agreement is exact up to rounding -- about 1e-6 of the largest logit with
  an F32 token embedding. With an F16 embedding llama.cpp rounds the LM head's input to F16, which
  costs 2-4e-4. Every position must agree (RULE_FLOAT_F32, RULE_FLOAT_F16). The same bound holds
  for our TQ2_0/TQ1_0 decoding in mode "none" against llama.cpp on the model's F32 twin.
- TQ weights in mode "block256" (both sides quantize activations per 256 values, Q8_K): positions
  agree to ~1e-6 until one rounding decision differs. A value that sits within a rounding error
  of a half-integer step rounds one way here and the other way there; the next layer sees a
  perturbation of ~1e-3 and re-quantizes hundreds of values differently, so that position and,
  through the KV cache, many later ones differ by 0.5-3 % of the largest logit (the size of the
  quantization noise itself). Our own float32 CPU provider and our float64 reference provider
  differ from each other in exactly the same way. The first flip comes anywhere from position 1
  to beyond 200, so "95 % of positions within 1e-3" does not hold for long prompts (measured
  23-100 % on 50- and 200-token prompts, 67-100 % over sixteen 10-40-token prompts, 20 models);
  what holds is that most positions of short prompts agree tightly (RULE_Q8K). A systematic bug
  moves every position (row mode, one flipped weight: 0 % within 1e-3), so the fraction of tight
  positions is what catches it; the float tests above pin down attention, RoPE, norms, the KV
  cache and weight decoding at every position of prompts up to 200 tokens.
- Default mode "row" (BitNet b1.58 per-row int8) against llama.cpp's Q8_K: docs/design.md 5b's rule
  (RULE_ROW). It holds for these 2-layer dim-256 models; at dim 512 x 3 layers the difference
  already reaches 5-7 % of the largest logit, so the rule is only checked where it was measured.

llama.cpp's `bitnet` architecture has no output.weight (its LM head is always the token
embedding), so the untied model is checked through llama.cpp's final hidden states (the
embeddings output of the tied twin, which has the same tensors) times our output.weight.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python (the llama.cpp reference implementation) is not installed: "
                        "pip install llama-cpp-python")

import bitnet  # noqa: E402
from bitnet.modelfile.writer import SyntheticSpec, synthetic_weights, write_model  # noqa: E402
from bitnet.testing.crossval import LONG, SHORT, crossval_prompts, prompt_text  # noqa: E402

pytestmark = pytest.mark.llama

N_CTX = 512
GGML_TYPE_F32 = 0  # llama.cpp's KV cache type for type_k / type_v
LLAMA_POOLING_TYPE_NONE = 0  # embeddings output: one final hidden state per token


# -- the models ---------------------------------------------------------------------------------

def _spec(**kw: Any) -> SyntheticSpec:
    return SyntheticSpec(arch="bitnet", vocab_size=512, **kw)


MODELS: dict[str, SyntheticSpec] = {
    # GQA 4:2, F16 embedding, Llama-3 style BPE.
    "tq2_gqa": _spec(weight_type="tq2_0", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512,
                     embd_type="f16", tokenizer="gpt2", seed=11),
    # Multi-query (4:1), wider FFN, F32 embedding, SentencePiece vocabulary, .scale tensors.
    "tq1_mqa": _spec(weight_type="tq1_0", n_layers=2, dim=256, n_heads=4, n_kv_heads=1, ffn_dim=768,
                     embd_type="f32", tokenizer="llama", scales=True, seed=12),
    # F32 weights holding ternary values, their scales in .scale tensors; dim 512, 3 layers, GQA 8:2,
    # 2B-4T's RoPE base.
    "f32_gqa": _spec(weight_type="f32", scales=True, n_layers=3, dim=512, n_heads=8, n_kv_heads=2,
                     ffn_dim=1024, embd_type="f16", tokenizer="gpt2", rope_theta=500000.0, seed=13),
    # Separate output.weight; multi-head attention; 4 layers; another RMSNorm epsilon.
    "f32_untied": _spec(weight_type="f32", scales=True, n_layers=4, dim=256, n_heads=4, n_kv_heads=4,
                        ffn_dim=512, embd_type="f32", tokenizer="llama", tied=False, rms_eps=1e-6, seed=14),
}
# The same tensors in another form: F32 twins of the TQ models (the ternary values times their
# scale, what llama.cpp's converter writes), the tied twin llama.cpp can load, other seeds.
MODELS.update({
    "tq2_gqa.f32": dataclasses.replace(MODELS["tq2_gqa"], weight_type="f32"),
    "tq1_mqa.f32": dataclasses.replace(MODELS["tq1_mqa"], weight_type="f32"),
    "f32_untied.tied": dataclasses.replace(MODELS["f32_untied"], tied=True),
    "tq2_gqa.seed": dataclasses.replace(MODELS["tq2_gqa"], seed=99),
    "f32_gqa.seed": dataclasses.replace(MODELS["f32_gqa"], seed=99),
})
TQ_MODELS = ("tq2_gqa", "tq1_mqa")


class Lab:
    """Model files written on first use, and one engine / one llama.cpp context per model and mode."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ours: dict[tuple[str, str], Any] = {}
        self._llama: dict[tuple[str, bool], Any] = {}

    def path(self, name: str) -> Path:
        p = self.root / f"{name}.gguf"
        if not p.exists():
            write_model(p, MODELS[name])
        return p

    def ours(self, name: str, act_quant: str) -> Any:
        key = (name, act_quant)
        if key not in self._ours:
            path = str(self.path(name))
            self._ours[key] = bitnet.load(path, device="cpu", n_ctx=N_CTX, act_quant=act_quant)
        return self._ours[key]

    def llama(self, name: str, embedding: bool = False) -> Any:
        key = (name, embedding)
        if key not in self._llama:
            extra = {"embedding": True, "pooling_type": LLAMA_POOLING_TYPE_NONE} if embedding else {}
            # llama-cpp-python 0.3.x: type_k/type_v go to the context parameters (ggml type ids);
            # logits_all=True makes eval() keep every position's logits in .scores. flash_attn=False
            # (the wrapper's default, unlike the C library's "auto") is spelled out: it changes the numerics.
            self._llama[key] = llama_cpp.Llama(model_path=str(self.path(name)), n_ctx=N_CTX, n_batch=N_CTX,
                                               logits_all=True, n_threads=2, verbose=False, flash_attn=False,
                                               type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, **extra)
        return self._llama[key]

    def close(self) -> None:
        for eng in self._ours.values():
            eng.close()
        for llm in self._llama.values():
            llm.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    # Per module and per xdist worker: each worker writes only the models its tests use.
    lab = Lab(tmp_path_factory.mktemp("crossval"))
    yield lab
    lab.close()


# -- llama.cpp side -----------------------------------------------------------------------------------

def llama_tokenize(llm: Any, text: str) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=True, special=False))


def llama_logits(llm: Any, ids: Sequence[int]) -> np.ndarray:
    """float32 [n, vocab]: llama.cpp's logits of every position, one batch from position 0."""
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def llama_hidden(llm: Any, ids: Sequence[int]) -> np.ndarray:
    """float64 [n, dim]: the final hidden states after output_norm (a context made with embedding=True)."""
    llm.reset()
    llm.eval(list(ids))
    n, dim = len(ids), llm.n_embd()
    ptr = llama_cpp.llama_get_embeddings(llm.ctx)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n * dim,)) \
        .reshape(n, dim).astype(np.float64)


def llama_greedy(llm: Any, ids: Sequence[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens decoded one at a time (the KV-cache path), and the logits each was chosen from."""
    llm.reset()
    llm.eval(list(ids))
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(row)
        out.append(int(np.argmax(row)))
        llm.eval([out[-1]])
    return out, np.stack(rows)


# -- prompts ---------------------------------------------------------------------------------------

# Edge cases for the tokenizers beyond the generated prompts.
TOKENIZER_TEXTS = [
    "", " ", "  leading spaces", "trailing spaces   ", "\n", "line one\nline two\r\nthree", "\ttab\t",
    "Hello, world!", "12345678901234567890", "3.14159 and 2.71828", "naïve café — Zürich", "日本語のテキスト",
    "emoji 🦙🤖 and ZWJ 👩‍💻", "<|begin_of_text|>literal special text<|eot_id|>", "<s> </s> <unk>",
    "it's they'll I'M we'VE", "a" * 100, "   \n\n\t  mixed   whitespace \n", "x=y+z; foo_bar(baz) -> qux",
]


# -- the comparison ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """What ours must meet against llama.cpp; every bound is relative to the position's max|llama logit|."""

    name: str
    tight: float  # a position agrees tightly when its error is at most this
    min_fraction: float  # ... and at least this fraction of positions must
    worst: float  # no position may differ by more
    margin: float  # arg-max must be equal wherever llama.cpp's top-two margin exceeds this


# Float weights, mode "none", F32 token embedding: measured median 1e-6, worst 7e-6.
RULE_FLOAT_F32 = Rule("float, F32 LM head", tight=3e-5, min_fraction=1.0, worst=3e-5, margin=6e-5)
# The same with an F16 embedding, which llama.cpp multiplies in F16: measured median 2e-4, worst 3.8e-4.
RULE_FLOAT_F16 = Rule("float, F16 LM head", tight=1e-3, min_fraction=1.0, worst=1e-3, margin=2e-3)
# TQ weights, mode "block256", over 16 prompts of 10-40 tokens: measured 67-100 % of positions within
# 1e-3 (20 models, CPU and float64 providers), worst 0.035; arg-max flips only below a 0.011 margin.
RULE_Q8K = Rule("block256 vs Q8_K", tight=1e-3, min_fraction=0.5, worst=0.05, margin=0.03)
# Long prompts accumulate flips (23-100 % tight per prompt): only the worst case and the arg-max.
RULE_Q8K_LONG = dataclasses.replace(RULE_Q8K, name="block256 vs Q8_K, long prompts", min_fraction=0.0)
# docs/design.md 5b for the default mode "row".
RULE_ROW = Rule("row vs Q8_K (design 5b)", tight=0.05, min_fraction=0.98, worst=0.5, margin=0.05)


def float_rule(spec: SyntheticSpec) -> Rule:
    return RULE_FLOAT_F16 if spec.embd_type == "f16" else RULE_FLOAT_F32


@dataclass
class Verdict:
    rule: Rule
    errors: np.ndarray  # per position: max|ours - llama| / max|llama|
    argmax_mismatches: list[int] = field(default_factory=list)  # positions where a clear winner differs
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def tight_fraction(self) -> float:
        return float(np.mean(self.errors <= self.rule.tight))

    def __str__(self) -> str:
        e, r = self.errors, self.rule
        head = (f"{r.name}: {len(e)} positions, within {r.tight:g}: {self.tight_fraction:.1%}, "
                f"median {np.median(e):.2e}, worst {e.max():.2e} at {int(e.argmax())}")
        return head + "".join(f"\n  FAIL {f}" for f in self.failures)


def judge(ours: np.ndarray, ref: np.ndarray, rule: Rule) -> Verdict:
    """Compare logits [n, vocab] position by position under `rule`."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        return Verdict(rule, np.full(1, np.inf), failures=[f"shape {ours.shape} != {ref.shape}"])
    scale = np.abs(ref).max(axis=1)
    errors = np.abs(ours - ref).max(axis=1) / scale
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / scale > rule.margin
    mismatches = [int(i) for i in np.nonzero(clear & (ours.argmax(axis=1) != ref.argmax(axis=1)))[0]]
    v = Verdict(rule, errors, mismatches)
    if v.tight_fraction < rule.min_fraction:
        v.failures.append(f"{v.tight_fraction:.1%} of positions within {rule.tight:g}, "
                          f"need {rule.min_fraction:.0%}")
    if errors.max() > rule.worst:
        v.failures.append(f"position {int(errors.argmax())} differs by {errors.max():.3g} > {rule.worst:g}")
    if mismatches:
        v.failures.append(f"arg-max differs at positions {mismatches[:10]} where llama's top-two margin > "
                          f"{rule.margin:g}")
    return v


def compare_prompts(ours: Any, llm: Any, prompts: Sequence[Sequence[int]], rule: Rule) -> Verdict:
    """One verdict over every position of every prompt (each prompt a fresh pass from position 0)."""
    got = np.concatenate([ours.logits(ids) for ids in prompts])
    want = np.concatenate([llama_logits(llm, ids) for ids in prompts])
    return judge(got, want, rule)


def prompts_for(lab: Lab, name: str, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    return crossval_prompts(lab.ours(name, "none").tokenize, lengths, seed)


# -- tokenization ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tq2_gqa", "tq1_mqa"])  # gpt2 (Llama-3 BPE) and llama (SentencePiece)
def test_tokenization_identical(lab: Lab, name: str) -> None:
    eng, llm = lab.ours(name, "none"), lab.llama(name)
    texts = TOKENIZER_TEXTS + [prompt_text(eng.tokenize, n, seed) for seed, n in enumerate((10, 50, 200))]
    for text in texts:
        assert eng.tokenize(text) == llama_tokenize(llm, text), f"{MODELS[name].tokenizer} vocab: {text!r}"


# -- float weights: exact agreement at every position ---------------------------------------------------

@pytest.mark.parametrize("name", ["f32_gqa", "tq2_gqa.f32", "tq1_mqa.f32"])
def test_float_weights_match(lab: Lab, name: str) -> None:
    prompts = prompts_for(lab, name, LONG)
    v = compare_prompts(lab.ours(name, "none"), lab.llama(name), prompts, float_rule(MODELS[name]))
    print(v)
    assert v.ok, str(v)


@pytest.mark.parametrize("name", TQ_MODELS)
def test_tq_decoding_matches_f32_twin(lab: Lab, name: str) -> None:
    # Our TQ2_0/TQ1_0 decoding, unquantized activations, against llama.cpp on the same values stored
    # as F32: every position must agree as tightly as float weights do.
    prompts = prompts_for(lab, name, LONG)
    v = compare_prompts(lab.ours(name, "none"), lab.llama(f"{name}.f32"), prompts, float_rule(MODELS[name]))
    print(v)
    assert v.ok, str(v)


def test_untied_output_weight(lab: Lab) -> None:
    spec = MODELS["f32_untied"]
    prompts = prompts_for(lab, "f32_untied", LONG)
    llm = lab.llama("f32_untied.tied", embedding=True)
    weights = synthetic_weights(spec)
    out_w = weights["output.weight"].astype(np.float64)
    embd = weights["token_embd.weight"].astype(np.float64)
    ours = np.concatenate([lab.ours("f32_untied", "none").logits(ids) for ids in prompts])
    hidden = np.concatenate([llama_hidden(llm, ids) for ids in prompts])
    # The route itself: llama.cpp's own logits are its hidden states times the token embedding.
    own = np.concatenate([llama_logits(lab.llama("f32_untied.tied"), ids) for ids in prompts])
    assert judge(hidden @ embd.T, own, RULE_FLOAT_F32).ok
    v = judge(ours, hidden @ out_w.T, RULE_FLOAT_F32)
    print(v)
    assert v.ok, str(v)
    # And ours really reads output.weight: the tied LM head would be far off.
    assert not judge(ours, hidden @ embd.T, RULE_ROW).ok


# -- TQ weights, quantized activations ----------------------------------------------------------------

@pytest.mark.parametrize("name", TQ_MODELS)
def test_block256_matches_q8k(lab: Lab, name: str) -> None:
    ours, llm = lab.ours(name, "block256"), lab.llama(name)
    v = compare_prompts(ours, llm, prompts_for(lab, name, SHORT), RULE_Q8K)
    v_long = compare_prompts(ours, llm, prompts_for(lab, name, LONG[1:], seed=100), RULE_Q8K_LONG)
    print(f"{v}\n{v_long}")
    assert v.ok, str(v)
    assert v_long.ok, str(v_long)


@pytest.mark.parametrize("name", TQ_MODELS)
def test_row_mode_design_rule(lab: Lab, name: str) -> None:
    prompts = prompts_for(lab, name, LONG + SHORT[:3])
    v = compare_prompts(lab.ours(name, "row"), lab.llama(name), prompts, RULE_ROW)
    print(v)
    assert v.ok, str(v)


@pytest.mark.parametrize("name, act_quant, rule", [
    ("tq2_gqa", "block256", RULE_Q8K),
    ("tq2_gqa", "row", RULE_ROW),
    ("tq1_mqa", "block256", RULE_Q8K),
    ("f32_gqa", "none", RULE_FLOAT_F16),
])
def test_greedy_teacher_forced(lab: Lab, name: str, act_quant: str, rule: Rule) -> None:
    # llama.cpp decodes 32 tokens greedily one at a time; we run its whole sequence as one batch and
    # must pick its token at every step where its choice is clear.
    eng, llm = lab.ours(name, act_quant), lab.llama(name)
    ids = eng.tokenize(prompt_text(eng.tokenize, 12, seed=7))
    gen, llama_rows = llama_greedy(llm, ids, 32)
    ours = eng.logits(ids + gen[:-1])[len(ids) - 1:]
    v = judge(ours, llama_rows, dataclasses.replace(rule, min_fraction=0.0, worst=np.inf))
    print(v, f"\n  generated {gen}")
    assert not v.argmax_mismatches, str(v)
    assert len(set(gen)) > 1, "a degenerate continuation proves little"


# -- each gate fails on broken input ---------------------------------------------------------------------

def flip_one_weight(src: Path, dst: Path, tensor: str) -> None:
    """Copy src to dst with one nonzero ternary weight of `tensor` negated (F32 or TQ2_0 data)."""
    from gguf import GGMLQuantizationType, GGUFReader

    shutil.copyfile(src, dst)
    info = next(t for t in GGUFReader(src).tensors if t.name == tensor)
    data = np.memmap(dst, dtype=np.uint8, mode="r+", offset=int(info.data_offset), shape=(int(info.n_bytes),))
    if info.tensor_type == GGMLQuantizationType.F32:
        w = data.view(np.float32)
        i = int(np.flatnonzero(w)[0])
        w[i] = -w[i]
    elif info.tensor_type == GGMLQuantizationType.TQ2_0:
        # 2-bit codes 0 and 2 are -1 and +1 (docs/design.md 5); bytes 0..63 of block 0 hold its 256 codes.
        byte, shift = next((b, s) for b in range(64) for s in (0, 2, 4, 6) if (data[b] >> s) & 3 != 1)
        data[byte] ^= np.uint8(2 << shift)  # code 0 <-> 2
    else:
        raise ValueError(f"cannot flip a weight of type {info.tensor_type!r}")
    data.flush()


@pytest.mark.parametrize("name, act_quant, tensor", [
    ("f32_gqa", "none", "blk.0.attn_q.weight"),
    ("tq2_gqa", "none", "blk.1.ffn_gate.weight"),
    ("tq2_gqa", "block256", "blk.0.ffn_down.weight"),
])
def test_gate_detects_one_flipped_weight(lab: Lab, tmp_path: Path, name: str, act_quant: str,
                                         tensor: str) -> None:
    broken = tmp_path / "flipped.gguf"
    flip_one_weight(lab.path(name), broken, tensor)
    ref_name = f"{name}.f32" if MODELS[name].weight_type != "f32" and act_quant == "none" else name
    rule = float_rule(MODELS[name]) if act_quant == "none" else RULE_Q8K
    prompts = prompts_for(lab, name, LONG if act_quant == "none" else SHORT)
    eng = bitnet.load(str(broken), device="cpu", n_ctx=N_CTX, act_quant=act_quant)
    try:
        v = compare_prompts(eng, lab.llama(ref_name), prompts, rule)
    finally:
        eng.close()
    print(v)
    assert not v.ok, "one flipped weight went unnoticed"


@pytest.mark.parametrize("name, other, act_quant, rule", [
    ("tq2_gqa", "tq2_gqa.seed", "row", RULE_ROW),
    ("tq2_gqa", "tq2_gqa.seed", "block256", RULE_Q8K),
    ("f32_gqa", "f32_gqa.seed", "none", RULE_FLOAT_F16),
])
def test_gate_detects_another_model(lab: Lab, name: str, other: str, act_quant: str, rule: Rule) -> None:
    prompts = prompts_for(lab, name, SHORT[:2] + (50,))
    v = compare_prompts(lab.ours(other, act_quant), lab.llama(name), prompts, rule)
    print(v)
    assert not v.ok and v.argmax_mismatches


@pytest.mark.parametrize("name", TQ_MODELS)
def test_block256_gate_rejects_row_mode(lab: Lab, name: str) -> None:
    # The matched-mode gate must tell the modes apart, or it could not catch a mode that is ignored.
    prompts = prompts_for(lab, name, SHORT)
    v = compare_prompts(lab.ours(name, "row"), lab.llama(name), prompts, RULE_Q8K)
    print(v)
    assert not v.ok and v.tight_fraction < 0.05


# -- found while writing this suite: fails until the writer is fixed ------------------------------------

def test_writer_rejects_widths_its_format_cannot_hold(tmp_path: Path) -> None:
    # TQ2_0/TQ1_0 pack 256 values per block (I2_S 128): a projection width that is not a multiple
    # cannot be written. writer._check lets dim=384 through, then gguf raises QuantError midway and
    # a truncated file is left at the path, where anything that reuses files by name picks it up.
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError):
        write_model(path, SyntheticSpec(weight_type="tq2_0", dim=384, n_heads=6, n_kv_heads=2, ffn_dim=768))
    assert not path.exists()
