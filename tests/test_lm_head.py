"""The int8 LM head end to end (docs/design.md section 4): bitnet.load(lm_head=...), what "auto" picks,
its agreement with the F16 head, and the CLI's --lm-head. The kernels themselves are checked against
the reference in test_reference.py and test_cpu_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import bitnet
from bitnet.errors import UsageError
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.testing.crossval import agreement, crossval_prompts
from conftest import cli_env, run_cli

# Measured on the default synthetic spec (seeds 0-2, F16 and Q8_0 embeddings, 633 positions of the
# cross-validation prompts): top-1 agreement 98.6-99.2 %, mean KL divergence 1.7-2.0e-4 nats.
MIN_TOP1 = 0.97
MAX_MEAN_KL = 1e-3


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A synthetic model with an F16 embedding (the tied LM head) and its twin stored as Q8_0."""
    d = tmp_path_factory.mktemp("lm-head")
    return {embd: write_model(d / f"{embd}.gguf", SyntheticSpec(embd_type=embd)) for embd in ("f16", "q8_0")}


def test_q8_agrees_with_the_f16_head(cpu_env: None, files: dict[str, Path]) -> None:
    with bitnet.load(files["f16"], lm_head="f16") as f16, bitnet.load(files["f16"], lm_head="q8") as q8:
        prompts = crossval_prompts(f16.tokenize)
        want = np.concatenate([f16.logits(ids) for ids in prompts])
        got = np.concatenate([q8.logits(ids) for ids in prompts])
        assert "cpu.lm_head_q8" in q8.provider.dispatches and "cpu.lm_head_q8" not in f16.provider.dispatches
    same, kl = agreement(want, got)
    assert same.mean() >= MIN_TOP1 and kl.mean() <= MAX_MEAN_KL, (same.mean(), kl.mean())
    # The bounds can fail: a head whose scales are 20 % off (a plausible bug) breaks the KL bound.
    with bitnet.load(files["f16"], lm_head="q8") as broken:
        broken.transformer.lm_head.scale[::2] *= np.float32(1.2)
        bad = np.concatenate([broken.logits(ids) for ids in prompts])
    assert agreement(want, bad)[1].mean() > MAX_MEAN_KL


def test_auto_picks_q8_only_for_a_head_stored_quantized(cpu_env: None, files: dict[str, Path]) -> None:
    for embd, want in (("f16", "f16"), ("q8_0", "q8")):
        with bitnet.load(files[embd]) as e:
            assert e.model.head_type == embd.upper() and e.transformer.lm_head_format == want
    with bitnet.load(files["q8_0"], lm_head="f16") as e:  # asked for: the decoded float table
        assert e.transformer.lm_head_format == "f16"


def test_an_unknown_lm_head_is_a_usage_error(cpu_env: None, files: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="unknown LM head 'int4'; expected one of f16, q8, auto"):
        bitnet.load(files["f16"], lm_head="int4")
    r = run_cli("run", "-m", str(files["f16"]), "-p", "hi", "--lm-head", "int4", env=cli_env(BITNET_DEVICE="cpu"))
    assert r.returncode == 2 and "Invalid value for '--lm-head'" in r.stderr and "Traceback" not in r.stderr


def test_the_cli_runs_the_head_it_is_asked_for(files: dict[str, Path], tmp_path: Path) -> None:
    receipt = tmp_path / "r.json"
    r = run_cli("--device", "cpu", "run", "-m", str(files["f16"]), "-p", "hi", "-n", "2", "--lm-head", "q8",
                "--receipt", str(receipt), env=cli_env())
    assert r.returncode == 0, r.stderr
    assert "cpu.lm_head_q8" in {k["name"] for k in json.loads(receipt.read_text())["kernels"]}
