"""The embedded default model, shipped inside bitnet-core: a small BitNet b1.58 trained on Shakespeare.

training/train_default_model.py trained it from scratch, quantization-aware, with the architecture
of BitNet b1.58 2B-4T (4 layers, width 256, a 4096-token byte-level BPE, a 256-token context) on
40 of Shakespeare's works, and wrote it as I2_S. It writes Shakespeare-like text; it does not
answer questions. Tests that need random weights or odd shapes write their own with
bitnet.modelfile.writer.
"""

from __future__ import annotations

from pathlib import Path

from bitnet.errors import ModelError

FILE = Path(__file__).with_name("data") / "default-model.gguf"


def path() -> str:
    """The default model's file."""
    if not FILE.is_file():
        raise ModelError(f"the embedded default model {FILE} is missing: reinstall bitnet-core, or give a model")
    return str(FILE)
