"""The byte-level BPE pre-tokenizers, by their `tokenizer.ggml.pre` names: the regexes that split text
before merging, whether merges are skipped for whole-vocabulary words, and the default add_bos.
"""

from __future__ import annotations

# Pre-tokenizer regexes, copied from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe).
# LLAMA3 is llama.cpp's "adapted" form of the tokenizer.json regex: the case-insensitive
# group (?i:...) is spelled out so every regex engine reads it the same way.
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes applied one after another, each splitting
# the pieces the previous one produced.
DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# "falcon_e" (Falcon-E 1B/3B, base and instruct): the name microsoft/BitNet's
# utils/convert-hf-to-gguf-bitnet.py (get_vocab_base_pre) writes for that tokenizer. llama.cpp does
# not know it (it names the same tokenizer hash "falcon-h1", below). bitnet.cpp's llama.cpp fork
# (Eddie-Wang1120/llama.cpp as pinned by microsoft/BitNet from May 2025: src/llama.cpp llm_load_vocab
# maps it to LLAMA_VOCAB_PRE_TYPE_FALCON_E, src/llama-vocab.cpp llm_tokenizer_bpe gives the regexes)
# splits with these three regexes in turn, merges by rank (no ignore_merges) and does not add BOS
# unless the file says so. They are Falcon's Hugging Face pipeline: a run of punctuation
# (Punctuation, "contiguous"; ASCII symbols count as punctuation there), GPT-2's regex (ByteLevel's)
# and every ASCII digit on its own (Digits, individual_digits). The fork reads "falcon3" the same
# way; for "falcon3" this module follows llama.cpp (Llama-3's regex), which the tests cross-validate.
FALCON_E_REGEXES = (r"[\p{P}\$\+<=>\^~\|`]+", DEFAULT_REGEXES[1], r"[0-9]")

# tokenizer.ggml.pre value -> (regexes, ignore_merges, default add_bos), as in
# llama.cpp's llama_vocab::impl::load. A missing key means "default" (llama.cpp warns).
PRE_TYPES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (DEFAULT_REGEXES, False, False),
    "llama3": ((LLAMA3_REGEX,), True, True),
    "llama-v3": ((LLAMA3_REGEX,), True, True),
    "llama-bpe": ((LLAMA3_REGEX,), True, True),
    "falcon3": ((LLAMA3_REGEX,), True, True),
    "falcon-h1": ((LLAMA3_REGEX,), True, True),  # llama.cpp's name for Falcon-E's (and Falcon-H1's) hash
    "falcon_e": (FALCON_E_REGEXES, False, False),
    "dbrx": ((LLAMA3_REGEX,), False, False),
    "smaug-bpe": ((LLAMA3_REGEX,), False, False),
    "gpt-2": ((GPT2_REGEX,), False, False),
    "phi-2": ((GPT2_REGEX,), False, False),
}
