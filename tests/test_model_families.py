"""The coverage matrix (README `## Models`): one test per model family, on synthetic replicas.

No weights can be downloaded here, so each row is a file our writer makes with what that row's
converter writes: architecture string, metadata keys, tensor names and types, tokenizer kind
(microsoft/BitNet utils/convert-*-bitnet.py, llama.cpp convert_hf_to_gguf.py). Shapes are scaled
down except where the row is about shapes (1bitLLM 3B: hidden 3200, FFN 8640, head size 100).

Wherever llama.cpp runs the file (`bitnet` and `llama` in TQ or F16/F32 form) the logits are
cross-validated with the rules of test_crossval_llama (docs/design.md 5b); an I2_S file, which
llama.cpp cannot read, must give exactly the logits of its TQ2_0 (or F16) twin: the same ternary
values through the same kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from float_reference import forward

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama.cpp oracle) is not installed")

from test_crossval_llama import (  # noqa: E402
    GGML_TYPE_F32,
    LLAMA_POOLING_TYPE_NONE,
    RULE_FLOAT_F16,
    RULE_FLOAT_F32,
    RULE_Q8K,
    RULE_Q8K_LONG,
    Rule,
    judge,
    llama_hidden,
    llama_logits,
)

import bitnet  # noqa: E402
from bitnet.errors import ModelError  # noqa: E402
from bitnet.modelfile.writer import SyntheticSpec, synthetic_weights, write_model  # noqa: E402
from bitnet.testing.crossval import SHORT, crossval_prompts  # noqa: E402

pytestmark = pytest.mark.llama
N_CTX = 128  # the short prompts reach 67 tokens in a 512-token vocabulary
TEXT = "BitNet ternary weights: the 1.58-bit llama, 12345 naïve café!"

SMALL: dict[str, Any] = {"n_layers": 2, "dim": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 512, "vocab_size": 512}
# BitNet b1.58 2B-4T as on the Hub: bitnet-b1.58, I2_S, F16 embedding, Llama-3 BPE without tokenizer.ggml.pre.
B2B4T = SyntheticSpec(arch="bitnet-b1.58", weight_type="i2_s", embd_type="f16", tokenizer="gpt2", tokenizer_pre=None,
                      rope_theta=500000.0, seed=21, **SMALL)
# bitnet.cpp's --quant-embd variant of 2B-4T: the token embedding (the tied LM head) as Q6_K
# (microsoft/BitNet src/README.md: llama-quantize --token-embedding-type Q6_K ... I2_S 1 1).
B2B4T_Q6K = dataclasses.replace(B2B4T, embd_type="q6_k")
# llama.cpp multiplies a quantized LM head by its input quantized to 8 bits (Q8_K for Q6_K), which
# moves every logit: measured median 8e-3, worst 0.013 of the largest logit on TEXT (0.026 over 633
# positions of 16 short prompts), with our q8 or float head alike; a wrong Q6_K layout moves them by ~1.
RULE_Q8K_QHEAD = Rule("block256 vs Q8_K, 8-bit LM head input", tight=0.02, min_fraction=0.9, worst=0.05,
                      margin=0.03)
# 1bitLLM bitnet_b1_58-large as llama.cpp converts it: bitnet, SiLU, sub-norms, SentencePiece vocabulary.
LARGE = SyntheticSpec(arch="bitnet", weight_type="tq2_0", embd_type="f16", tokenizer="llama", seed=22, **SMALL)
# 1bitLLM bitnet_b1_58-large as bitnet.cpp's converter writes it since July 2026 (microsoft/BitNet
# utils/convert-hf-to-gguf-bitnet.py, BitnetModel: model_arch = MODEL_ARCH.BITNET_B158, before that
# MODEL_ARCH.BITNET): `bitnet-b1.58`, the label of 2B-4T, and no hidden_act key, though its Hugging Face
# config says SiLU. Multi-head attention (16 + 16 heads in the real model), RoPE base 10000.
LARGE_B158 = SyntheticSpec(arch="bitnet-b1.58", weight_type="i2_s", embd_type="f16", tokenizer="llama", seed=27,
                           **{**SMALL, "n_kv_heads": SMALL["n_heads"]})
# 1bitLLM bitnet_b1_58-3B's real widths (one layer): not multiples of 256, nor of 128 for the FFN.
WIDE = SyntheticSpec(arch="bitnet", weight_type="f16", embd_type="f32", tokenizer="llama", n_layers=1, dim=3200,
                     n_heads=32, n_kv_heads=32, ffn_dim=8640, vocab_size=512, seed=23)
# bitnet.cpp's `llama` files: Llama3-8B-1.58 (Llama-3 BPE, untied head, RoPE 500000), Falcon3 1.58-bit
# (head size 256 in key_length, RoPE base 1000042, the falcon3 pre-tokenizer), Falcon-E (falcon_e).
LLAMA = {
    "llama3-8b-1.58": SyntheticSpec(arch="llama", weight_type="i2_s", tokenizer="gpt2", tokenizer_pre="llama-bpe",
                                    tied=False, rope_theta=500000.0, seed=24, **SMALL),
    "falcon3-1.58bit": SyntheticSpec(arch="llama", weight_type="i2_s", tokenizer="gpt2", tokenizer_pre="falcon3",
                                     n_layers=2, dim=512, n_heads=2, n_kv_heads=1, head_dim=256, ffn_dim=768,
                                     vocab_size=512, rope_theta=1000042.0, tied=False, seed=25),
}


class Files:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str, spec: SyntheticSpec) -> str:
        p = self.root / f"{name}.gguf"
        if not p.exists():
            write_model(p, spec)
        return str(p)

    def ours(self, name: str, spec: SyntheticSpec, act_quant: str = "row") -> np.ndarray:
        eng = bitnet.load(self.path(name, spec), device="cpu", n_ctx=N_CTX, act_quant=act_quant)
        try:
            return eng.logits(eng.tokenize(TEXT))
        finally:
            eng.close()

    def llama(self, name: str, spec: SyntheticSpec, prompts: list[list[int]]) -> tuple[list[int], np.ndarray]:
        """llama.cpp's token ids of TEXT, and its logits of TEXT's ids and then of each prompt's."""
        llm = llama_cpp.Llama(model_path=self.path(name, spec), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True,
                              n_threads=2, verbose=False, flash_attn=False, type_k=GGML_TYPE_F32,
                              type_v=GGML_TYPE_F32)
        try:
            ids = list(llm.tokenize(TEXT.encode(), add_bos=True, special=False))
            return ids, np.concatenate([llama_logits(llm, p) for p in [ids, *prompts]])
        finally:
            llm.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Files]:
    yield Files(tmp_path_factory.mktemp("families"))


def crossval(files: Files, name: str, spec: SyntheticSpec, act_quant: str, rule: Rule) -> None:
    """Our logits against llama.cpp's on the same file: TEXT's token ids, then the 16 short prompts the
    rules were measured on. TEXT alone is too few positions for a fraction: one Q8_K rounding flip at its
    position 16 left 36 % of its 44 positions tight against llama.cpp's AVX-512 build on a Zen 5."""
    eng = bitnet.load(files.path(name, spec), device="cpu", n_ctx=N_CTX, act_quant=act_quant)
    try:
        prompts = crossval_prompts(eng.tokenize, SHORT)
        ids, ref = files.llama(name, spec, prompts)
        assert eng.tokenize(TEXT) == ids
        verdict = judge(np.concatenate([eng.logits(p) for p in [ids, *prompts]]), ref, rule)
    finally:
        eng.close()
    assert verdict.ok, str(verdict)


def twin(spec: SyntheticSpec, **kw: Any) -> SyntheticSpec:
    return dataclasses.replace(spec, **kw)


# -- BitNet b1.58 2B-4T -----------------------------------------------------------------------------

def test_2b4t_official_i2s(files: Files) -> None:
    eng = bitnet.load(files.path("2b4t", B2B4T), device="cpu", n_ctx=N_CTX)
    assert eng.model.config.activation == "relu2" and "tokenizer.ggml.pre" not in eng.model.metadata
    assert eng.model.weight_types == {"F32": 1 + 4 * 2, "F16": 1, "I2_S": 14}  # norms; embedding
    eng.close()
    # llama.cpp has no bitnet-b1.58: the I2_S file gives exactly its TQ2_0 twin's logits.
    assert np.array_equal(files.ours("2b4t", B2B4T), files.ours("2b4t.tq2", twin(B2B4T, weight_type="tq2_0")))


def test_2b4t_bitnet25_upload_with_rope_freqs(files: Files) -> None:
    spec = twin(B2B4T, arch="bitnet-25", rope_freqs=True)
    assert np.array_equal(files.ours("2b4t.b25", spec), files.ours("2b4t", B2B4T))


def test_2b4t_quant_embd_q6_k(files: Files) -> None:
    eng = bitnet.load(files.path("2b4t.q6k", B2B4T_Q6K), device="cpu", n_ctx=N_CTX)
    assert eng.model.weight_types == {"F32": 1 + 4 * 2, "Q6_K": 1, "I2_S": 14}
    assert eng.transformer.lm_head_format == "q8"  # auto: the head is stored quantized
    eng.close()
    assert np.array_equal(files.ours("2b4t.q6k", B2B4T_Q6K),
                          files.ours("2b4t.q6k.tq2", twin(B2B4T_Q6K, weight_type="tq2_0")))
    # llama.cpp has no bitnet-b1.58; its `bitnet` twins (SiLU) hold the same Q6_K bytes. Its token
    # lookups decode them exactly: on the F32 twin its final hidden states times our decoding of the
    # table give our float-head logits as tightly as float weights agree.
    spec = twin(B2B4T_Q6K, arch="bitnet", weight_type="f32")
    table = synthetic_weights(spec)["token_embd.weight"].astype(np.float64)
    ours = bitnet.load(files.path("q6k.bitnet.f32", spec), device="cpu", n_ctx=N_CTX, act_quant="none",
                       lm_head="f16")
    try:
        llm = llama_cpp.Llama(model_path=files.path("q6k.bitnet.f32", spec), n_ctx=N_CTX, n_batch=N_CTX,
                              n_threads=2, verbose=False, flash_attn=False, type_k=GGML_TYPE_F32,
                              type_v=GGML_TYPE_F32, embedding=True, pooling_type=LLAMA_POOLING_TYPE_NONE)
        try:
            ids = ours.tokenize(TEXT)
            verdict = judge(ours.logits(ids), llama_hidden(llm, ids) @ table.T, RULE_FLOAT_F32)
        finally:
            llm.close()
    finally:
        ours.close()
    assert verdict.ok, str(verdict)  # measured worst 7e-7
    # And its own logits, through its Q6_K x Q8_K dot products, on the TQ2_0 twin.
    crossval(files, "q6k.bitnet.tq2_0", twin(spec, weight_type="tq2_0"), "block256", RULE_Q8K_QHEAD)


# -- 1bitLLM bitnet_b1_58-large and -3B --------------------------------------------------------------

# F16 weights: llama.cpp rounds every layer's input to F16 before its F16 products, not only the LM head's:
# measured median 6.4e-4, worst 1.2e-3 of the largest logit over the 704 positions of crossval's prompts.
RULE_FLOAT_F16_WEIGHTS = dataclasses.replace(RULE_FLOAT_F16, name="float, F16 weights", tight=2e-3, worst=2e-3)


@pytest.mark.parametrize("weight_type, act_quant, rule", [
    ("tq2_0", "block256", RULE_Q8K), ("tq1_0", "block256", RULE_Q8K), ("f16", "none", RULE_FLOAT_F16_WEIGHTS)])
def test_1bitllm_large_as_llamacpp_converts_it(files: Files, weight_type: str, act_quant: str, rule: Rule) -> None:
    crossval(files, f"large.{weight_type}", twin(LARGE, weight_type=weight_type), act_quant, rule)


def test_1bitllm_large_as_bitnetcpp_converts_it(files: Files) -> None:
    assert np.array_equal(files.ours("large.i2s", twin(LARGE, weight_type="i2_s")), files.ours("large.tq2_0", LARGE))


def test_1bitllm_large_as_bitnetcpp_converts_it_today(files: Files) -> None:
    """bitnet.cpp runs such a file with squared ReLU: its llama.cpp fork (Eddie-Wang1120/llama.cpp,
    src/llama.cpp) sends LLM_ARCH_BITNET_B158 to build_bitnet_158, whose FFN is LLM_FFN_RELU_SQR, and
    reads no activation key (LLM_ARCH_BITNET's build_bitnet is LLM_FFN_SILU). Nothing else in the
    file tells the two models apart, so we do the same."""
    eng = bitnet.load(files.path("large.b158", LARGE_B158), device="cpu", n_ctx=N_CTX, act_quant="none")
    try:
        cfg = eng.model.config
        assert (cfg.arch, cfg.activation) == ("bitnet-b1.58", "relu2")
        assert "bitnet-b1.58.hidden_act" not in eng.model.metadata and eng.model.layers[0].ffn_sub_norm is not None
        ids = eng.tokenize(TEXT)
        got = eng.logits(ids)
        # The float64 reference with squared ReLU (measured 6e-7); with SiLU it is 0.4 of the largest logit off.
        want = forward(eng.model, ids, "none")
        silu = forward(dataclasses.replace(eng.model, config=dataclasses.replace(cfg, activation="silu")), ids, "none")
    finally:
        eng.close()
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert np.abs(got - silu).max() > 0.1 * np.abs(silu).max()
    assert np.array_equal(files.ours("large.b158", LARGE_B158),
                          files.ours("large.b158.tq2", twin(LARGE_B158, weight_type="tq2_0")))


def test_1bitllm_3b_widths(files: Files) -> None:
    """3200 / 8640 / head size 100: the F16 file (what llama.cpp's converter falls back to for rows
    that are not whole TQ blocks) agrees with llama.cpp; bitnet.cpp's I2_S file equals it in row mode."""
    # llama.cpp multiplies F16 weights in F16: measured worst 7.1e-4 of the largest logit, as with an F16 head.
    crossval(files, "3b.f16", WIDE, "none", RULE_FLOAT_F16)
    assert np.array_equal(files.ours("3b.i2s", twin(WIDE, weight_type="i2_s")), files.ours("3b.f16", WIDE))


# -- the llama architecture: Llama3-8B-1.58, Falcon3 1.58-bit, Falcon-E --------------------------------

@pytest.mark.parametrize("family", sorted(LLAMA))
def test_llama_family(files: Files, family: str) -> None:
    spec = LLAMA[family]
    eng = bitnet.load(files.path(family, spec), device="cpu", n_ctx=N_CTX)
    assert (eng.model.config.arch, eng.model.layers[0].attn_sub_norm) == ("llama", None)
    eng.close()
    # llama.cpp holds the same weights as TQ: cross-validated. Falcon3's 512-wide, 256-per-head layers
    # flip a Q8_K rounding early (measured 23 % of positions within 1e-3, worst 0.014): only the worst
    # case and the arg-max hold there, as for long prompts (test_crossval_llama's RULE_Q8K_LONG).
    rule = RULE_Q8K_LONG if spec.head_dim else RULE_Q8K
    for wt in ("tq2_0", "tq1_0"):
        crossval(files, f"{family}.{wt}", twin(spec, weight_type=wt), "block256", rule)
    assert np.array_equal(files.ours(family, spec), files.ours(f"{family}.tq2_0", twin(spec, weight_type="tq2_0")))


def test_llama_float_twin_agrees_and_full_precision_is_refused(files: Files) -> None:
    spec = twin(LLAMA["falcon3-1.58bit"], weight_type="f32", embd_type="f32")
    crossval(files, "falcon3.f32", spec, "none", RULE_FLOAT_F32)
    with pytest.raises(ModelError, match="not ternary"):
        bitnet.load(files.path("falcon3.master", twin(spec, float_master=True)), device="cpu", n_ctx=N_CTX)


def test_falcon_e(files: Files) -> None:
    """Falcon-E as bitnet.cpp's converter writes it: `llama`, I2_S, tokenizer.ggml.pre "falcon_e"
    (microsoft/BitNet utils/convert-hf-to-gguf-bitnet.py, get_vocab_base_pre). Its regexes are
    checked against Falcon's Hugging Face pipeline in test_tokenizer (llama.cpp cannot be the
    oracle: it refuses the name); llama.cpp's own converter calls the same tokenizer "falcon-h1"."""
    spec = twin(LLAMA["falcon3-1.58bit"], tokenizer_pre="falcon_e", seed=26)
    eng = bitnet.load(files.path("falcon-e", spec), device="cpu", n_ctx=N_CTX)
    try:
        assert eng.tokenizer.pre == "falcon_e"
        # Digits one at a time: this vocabulary has "19" and "99", which Llama-3's regex would use.
        ids = eng.tokenize("$19.99")
        assert [eng.tokenizer.token_text(i) for i in ids[1:]] == list("$19.99")
    finally:
        eng.close()
    with pytest.raises(ValueError, match="Failed to load model"):  # llama.cpp: unknown pre-tokenizer type
        llama_cpp.Llama(model_path=files.path("falcon-e", spec), vocab_only=True, verbose=False)
    # The same weights named as llama.cpp names the tokenizer: cross-validated, ids and logits.
    crossval(files, "falcon-h1.tq2_0", twin(spec, tokenizer_pre="falcon-h1", weight_type="tq2_0"), "block256",
             RULE_Q8K_LONG)
    assert np.array_equal(files.ours("falcon-e", spec), files.ours("falcon-e.tq2_0", twin(spec, weight_type="tq2_0")))
