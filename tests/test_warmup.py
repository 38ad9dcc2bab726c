"""`bitnet-select warmup` compiles at install time what a first run would: afterwards, runs of every
weight layout and LM head on a fresh process compile nothing."""

from __future__ import annotations

from pathlib import Path

from bitnet.modelfile.writer import SyntheticSpec, write_model
from conftest import cli_env, run_cli

ANNOUNCEMENT = "bitnet-cpu: compiling CPU kernels for this machine"


def _run(env: dict[str, str], *args: str) -> str:
    # A prompt of more than 8 tokens: the CPU plugin runs fewer through its layer-stack kernel alone.
    r = run_cli("-d", "cpu", "run", "-p", "O Romeo, Romeo, wherefore art thou Romeo?", "-n", "3", *args, env=env)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_after_warmup_a_first_run_compiles_nothing(tmp_path: Path) -> None:
    # A model the warmup never saw, in a layout it did (TQ2_0, 2 layers, another width and vocabulary).
    model = str(write_model(tmp_path / "other.gguf", SyntheticSpec(n_layers=2, dim=512, ffn_dim=768, seed=5)))
    cold = cli_env(NUMBA_CACHE_DIR=str(tmp_path / "cold"))
    assert ANNOUNCEMENT in _run(cold, "-m", model)  # the check sees a compile when one happens

    env = cli_env(NUMBA_CACHE_DIR=str(tmp_path / "warm"))
    r = run_cli("-d", "cpu", "warmup", env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("warmup done in ") and "[18/18]" in r.stderr
    for args in ((), ("-m", model), ("-m", model, "--act-quant", "block256", "--lm-head", "q8"),
                 ("-m", model, "--kv-type", "f16"), ("--kv-type", "f32"), ("-m", model, "--kv-type", "q8"),
                 ("-m", model, "--act-quant", "block256", "--kv-type", "q8")):
        assert ANNOUNCEMENT not in _run(env, *args)


def test_warmup_of_an_unknown_device_is_one_line(tmp_path: Path) -> None:
    r = run_cli("-d", "nosuch", "warmup", env=cli_env(NUMBA_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 3 and r.stderr.startswith("error: no backend satisfies --device nosuch"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
