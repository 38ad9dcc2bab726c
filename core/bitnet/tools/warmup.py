"""`bitnet-select warmup`: run a device's kernels once on small models of every weight layout, activation
quantization and LM head, so that the first real run finds them compiled.

A JIT backend compiles a kernel per argument type on first use (numba for the CPU plugin: 7-9 s on a
2-core machine for one model's kernels) and caches it on disk. The types follow the file's layout, not
its size: a 4-layer model built like 2B-4T compiles exactly what 2B-4T will call. `scripts/setup.sh`
runs this once at install time.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bitnet.modelfile import default_model
from bitnet.modelfile.writer import SyntheticSpec, write_model

# The built-in model (I2_S, F16 embedding tied as the head, squared ReLU, sub-norms: 2B-4T's layout), a
# TQ2_0 file as llama.cpp converts (SiLU, a strided view of 66-byte blocks), and one whose embedding is
# stored quantized (decoded to float32 at load: the F32 head and its int8 copy). None: the built-in file.
_MODELS: tuple[tuple[str, SyntheticSpec | None], ...] = (
    ("i2_s", None),
    ("tq2_0", SyntheticSpec(arch="bitnet", weight_type="tq2_0", n_layers=1)),
    ("q8_0 embedding", SyntheticSpec(arch="bitnet-b1.58", weight_type="i2_s", embd_type="q8_0", n_layers=1)),
)
# Attention depends on the KV cache's element type alone, and so does a few tokens' pass through the layers (the CPU
# plugin runs it in one kernel for "row" quantization, the warmup's prompts included): each type once per model for
# "row" and once for "block256" (attention alone) is enough, beside each LM head. (The CPU plugin compiles one kernel
# for every type: a cache reaches it as bytes. A GPU backend builds a program per type.)
HEAD_KV = (("f16", "f32"), ("q8", "f16"), ("f16", "q8"))
# Longer than a few tokens (13-16 in these vocabularies): the CPU plugin runs up to 8 tokens through one
# layer-stack kernel and a longer prompt through its per-operation kernels, and a first run must find both.
PROMPT = "To be, or not to be, that is the question"
CASES = tuple((model, act_quant, lm_head, kv_type) for model, _ in _MODELS for act_quant in ("row", "block256")
              for lm_head, kv_type in HEAD_KV)


def _files(root: Path) -> Iterator[tuple[str, str]]:
    for name, spec in _MODELS:
        yield name, default_model.path() if spec is None else str(write_model(root / f"{name.split()[0]}.gguf", spec))


def warmup(device: str | None, report: Callable[[str, str, str, str, float], None]) -> float:
    """Load each case on `device` and run a prefill, a decode step and two sequences decoded together;
    report(model, act_quant, lm_head, kv_type, seconds) after each. Returns the total seconds."""
    from bitnet.runtime.engine import load

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bitnet-warmup-") as tmp:
        for name, path in _files(Path(tmp)):
            for act_quant in ("row", "block256"):
                for lm_head, kv_type in HEAD_KV:
                    t0 = time.perf_counter()
                    with load(path, device=device, n_ctx=64, act_quant=act_quant, lm_head=lm_head,
                              kv_type=kv_type) as engine:
                        never_end = {t: -100.0 for t in engine.tokenizer.eog_ids}  # so that decode steps run
                        "".join(engine.generate(PROMPT, max_tokens=3, logit_bias=never_end))
                        engine.generate_batch(["Hello", "O Romeo"], max_tokens=3, logit_bias=never_end)
                    report(name, act_quant, lm_head, kv_type, time.perf_counter() - t0)
    return time.perf_counter() - start
