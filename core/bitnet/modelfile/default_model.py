"""The embedded default model: a small *synthetic* BitNet b1.58 model, written on first use.

It has random ternary weights, so it produces gibberish text; it exists so that
`bitnet.load()` and `bitnet-select run` work with no download, exercising every code path
(GQA, squared-ReLU FFN, I2_S weights, byte-level BPE tokenizer). The file is cached in
BITNET_CACHE_DIR (default ~/.cache/bitnet) under a name that hashes the spec and the code
that writes it, so a change to either writes a new file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

SPEC_FIELDS = dict(arch="bitnet-b1.58", n_layers=4, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=768, n_ctx=2048,
                   rope_theta=10000.0, weight_type="i2_s", embd_type="f16", tokenizer="gpt2", vocab_size=1024,
                   tied=True, seed=20250101)


def cache_dir() -> Path:
    return Path(os.environ.get("BITNET_CACHE_DIR") or Path.home() / ".cache" / "bitnet")


def _fingerprint() -> str:
    # The bytes written depend on the spec and on the writer, the format encoders and the
    # synthetic tokenizer: hash their sources rather than trust a version someone must bump.
    from bitnet.modelfile import formats, writer
    from bitnet.text import synthetic_vocab, tokenizer

    h = hashlib.sha256(repr(sorted(SPEC_FIELDS.items())).encode())
    for module in (writer, formats, synthetic_vocab, tokenizer):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.hexdigest()[:16]


def path() -> str:
    """The default model's file, written now if it is not in the cache yet."""
    from bitnet.modelfile.writer import SyntheticSpec, write_model

    directory = cache_dir()
    target = directory / f"bitnet-synthetic-{_fingerprint()}.gguf"
    if target.exists():
        return str(target)
    directory.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: readers never see a partial file, and
    # concurrent writers (pytest-xdist workers) each rename an identical complete file.
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write_model(tmp, SyntheticSpec(**SPEC_FIELDS))  # type: ignore[arg-type]
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(target)
