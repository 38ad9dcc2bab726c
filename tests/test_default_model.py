"""The embedded default model: trained weights whose perplexity the engine must reproduce.

training/train_default_model.py evaluated the exported ternary model with PyTorch on a held-out
excerpt (tests/data/default_model_heldout.json: the text, its token count, the perplexity with
per-token int8 activations as trained, and with float activations). The engine computes the same
through bitnet.load(...).logits on every backend that runs here. Tolerance: 1 % of the perplexity
(the issue's bound; measured agreement is about 1e-5). This covers the squared ReLU, the sub-norms,
I2_S, the tokenizer and the trained scales together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

import bitnet
from bitnet.errors import UsageError
from bitnet.modelfile import default_model
from bitnet.tools import perplexity as perplexity_tool
from bitnet.tools.perplexity import perplexity, text_perplexity
from conftest import opencl_platforms, run_cli

REPORT = json.loads((Path(__file__).parent / "data" / "default_model_heldout.json").read_text())
TOLERANCE = 0.01
DEVICES = [("cpu", None)] + [("opencl", p) for p in opencl_platforms()]


def test_the_shipped_file_is_the_one_that_was_evaluated() -> None:
    digest = hashlib.sha256(Path(default_model.path()).read_bytes()).hexdigest()
    assert digest == REPORT["model_sha256"]
    assert Path(default_model.path()).stat().st_size < 10e6


@pytest.fixture(scope="module", params=DEVICES, ids=[d if p is None else f"{d}-{p}" for d, p in DEVICES])
def device(request: pytest.FixtureRequest) -> str:
    name, platform = request.param
    if platform is not None:
        mp = pytest.MonkeyPatch()
        mp.setenv("BITNET_OPENCL_PLATFORM", platform)
        request.addfinalizer(mp.undo)
    return name


@pytest.mark.parametrize("act_quant", ["row", "none"])
def test_held_out_perplexity_equals_the_training_framework(device: str, act_quant: str) -> None:
    with bitnet.load(device=device, act_quant=act_quant) as engine:
        assert len(engine.tokenizer.encode(REPORT["excerpt"], add_bos=False)) == REPORT["excerpt_tokens"]
        got = text_perplexity(engine, REPORT["excerpt"], REPORT["window"])
    want = REPORT["excerpt_perplexity"][act_quant]
    assert got.tokens == REPORT["excerpt_tokens"]
    assert abs(got.value / want - 1) < TOLERANCE, (got, want)


def test_the_check_rejects_a_wrong_activation() -> None:
    """The same weights with SiLU in place of the squared ReLU miss the trained perplexity by far."""
    with bitnet.load(device="cpu") as engine:
        t = engine.transformer
        t.config = dataclasses.replace(t.config, activation="silu")
        got = text_perplexity(engine, REPORT["excerpt"], REPORT["window"])
    assert abs(got.value / REPORT["excerpt_perplexity"]["row"] - 1) > TOLERANCE


def test_perplexity_takes_a_windows_rows_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slices of 7 rows (a window of 255 positions: 37 slices, the last of 3) give what one slice of the window gives.
    with bitnet.load(device="cpu") as engine:
        ids = engine.tokenizer.encode(REPORT["excerpt"], add_bos=False)
        monkeypatch.setattr(perplexity_tool, "ROWS", 10**6)
        whole = perplexity(engine, ids, REPORT["window"])
        monkeypatch.setattr(perplexity_tool, "ROWS", 7)
        sliced = perplexity(engine, ids, REPORT["window"])
    assert sliced.tokens == whole.tokens and abs(sliced.value / whole.value - 1) < 1e-12


def test_perplexity_input_errors() -> None:
    with bitnet.load(device="cpu") as engine:
        with pytest.raises(UsageError, match="exceeds the context"):
            perplexity(engine, [1, 2, 3], engine.n_ctx + 1)
        with pytest.raises(UsageError, match="predicts nothing"):
            perplexity(engine, [1, 2, 3], 0)
        with pytest.raises(UsageError, match="too short"):
            perplexity(engine, [], 8)


def test_run_writes_shakespeare_like_text() -> None:
    r = run_cli("--device", "cpu", "run", "--prompt", "ROMEO:", "--max-tokens", "48")
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert len(words) >= 10 and "\ufffd" not in r.stdout, r.stdout
    assert "\n" in r.stdout.strip(), r.stdout  # verse and speakers come in lines


def test_perplexity_command(tmp_path: Path) -> None:
    text = tmp_path / "heldout.txt"
    text.write_text(REPORT["excerpt"], encoding="utf-8")
    r = run_cli("--device", "cpu", "perplexity", str(text), "--window", str(REPORT["window"]))
    assert r.returncode == 0, r.stderr
    value = float(r.stdout.split()[1])
    assert abs(value / REPORT["excerpt_perplexity"]["row"] - 1) < TOLERANCE, r.stdout
    assert f"over {REPORT['excerpt_tokens']} tokens" in r.stdout


def test_perplexity_command_refuses_bad_input_on_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, fragment in ((binary, "not UTF-8"), (empty, "too short")):
        r = run_cli("--device", "cpu", "perplexity", str(path))
        lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("requested=")]
        assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr
