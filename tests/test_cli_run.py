"""`bitnet-select run` end to end: output streams, timings, and one-line errors with exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bitnet.modelfile.writer import SyntheticSpec, write_model
from conftest import cli_env, run_cli


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return cli_env(BITNET_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "m.gguf", SyntheticSpec(n_ctx=64))


def one_error_line(r: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    # The selection summary may precede the error: it is information, not part of the error.
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("requested=")]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("device", ["cpu", "opencl"])
def test_run_on_the_default_model(env, device):
    r = run_cli("--device", device, "run", "--prompt", "Hello", "--max-tokens", "8", env=env)
    assert r.returncode == 0, r.stderr
    assert f"requested={device} " in r.stderr and f"selected={device}" in r.stderr
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr
    assert r.stdout.endswith("\n")
    # The trained default model writes words: letters, and no bytes that are not UTF-8.
    assert sum(c.isalpha() for c in r.stdout) >= 4 and "\ufffd" not in r.stdout, r.stdout


def test_greedy_text_is_the_same_on_cpu_and_opencl(env, model):
    args = ("run", "--model", str(model), "--prompt", "The cat", "--max-tokens", "12")
    cpu = run_cli("--device", "cpu", *args, env=env)
    ocl = run_cli("--device", "opencl", *args, env=env)
    assert cpu.returncode == ocl.returncode == 0
    assert cpu.stdout == ocl.stdout


def test_seeded_sampling_repeats(env, model):
    args = ("--device", "cpu", "run", "--model", str(model), "--prompt", "a", "-n", "16", "--temperature", "1",
            "--seed", "5")
    assert run_cli(*args, env=env).stdout == run_cli(*args, env=env).stdout


def test_not_a_gguf_exits_4(env, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model" * 10)
    one_error_line(run_cli("--device", "cpu", "run", "--model", str(bad), "--prompt", "x", env=env), 4, str(bad))


def test_truncated_model_exits_4(env, model, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    one_error_line(run_cli("--device", "cpu", "run", "--model", str(cut), "--prompt", "x", env=env), 4)


def test_missing_model_exits_4(env, tmp_path):
    r = run_cli("--device", "cpu", "run", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x", env=env)
    one_error_line(r, 4, "nope.gguf")


def test_prompt_longer_than_the_context_exits_2(env, model):
    r = run_cli("--device", "cpu", "run", "--model", str(model), "--prompt", "word " * 200, env=env)
    one_error_line(r, 2, "context")


@pytest.mark.parametrize("device", ["cpu", "opencl"])
def test_a_context_larger_than_the_device_exits_2_before_allocating(env, model, device):
    # 2 layers x 2 KV heads x 64 x K,V float32 = 2 KiB a position: 10**9 positions are 1907 GiB.
    r = run_cli("--device", device, "run", "-m", str(model), "-p", "hi", "--n-ctx", "1000000000", env=env)
    one_error_line(r, 2, "n_ctx=1000000000 needs a 1907.3 GiB KV cache", f"GiB of {device}:0")


def test_invalid_utf8_prompt_exits_2(env, model):
    r = subprocess.run([sys.executable, "-m", "bitnet", "--device", "cpu", "run", "--model", str(model),
                        "--prompt", b"\xff\xfeabc"], capture_output=True, text=True, env=env, timeout=120)
    one_error_line(r, 2, "UTF-8")


def test_unknown_device_exits_3(env):
    one_error_line(run_cli("--device", "tpu", "run", "--prompt", "x", env=env), 3, "tpu")


def test_bad_sampling_parameters_exit_2(env):
    one_error_line(run_cli("--device", "cpu", "run", "--prompt", "x", "--top-p", "1.5", env=env), 2, "top_p")
    one_error_line(run_cli("--device", "cpu", "run", "--prompt", "x", "--temperature", "-1", env=env), 2)


def test_debug_shows_the_traceback(env, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    r = run_cli("--debug", "--device", "cpu", "run", "--model", str(bad), "--prompt", "x", env=env)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_threads_flag_reaches_the_cpu_backend(env):
    r = run_cli("--threads", "1", "devices", "--json", env=env)
    cpu = next(row for row in json.loads(r.stdout) if row["backend"] == "cpu")
    assert cpu["device"]["properties"]["threads"] == 1
    assert run_cli("--threads", "0", env=env).returncode == 2
    bad = run_cli("--device", "cpu", "run", "-p", "x", "-t", "0", env=env)  # after the command too
    assert bad.returncode == 2 and "'--threads' / '-t': 0 is not in the range" in bad.stderr, bad.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_threads_flag_after_the_command_too(env, tmp_path, where):
    """`run -t 1`, as llama.cpp's tools take it, runs on one thread as `-t 1 run` does: its receipt says so."""
    receipt = tmp_path / "r.json"
    args = ["run", "-p", "Hello", "-n", "2", "--receipt", str(receipt)]
    args = ["--device", "cpu", *(["-t", "1", *args] if where == "before" else [*args, "-t", "1"])]
    r = run_cli(*args, env={**env, "BITNET_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    assert json.loads(receipt.read_text())["selection"]["device"]["properties"]["threads"] == 1


def test_the_run_script_keeps_its_default_prompt_beside_other_options(env, tmp_path):
    """`scripts/run.sh --max-tokens 4` starts from "ROMEO:" as the bare script does; a prompt given replaces it."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".venv" / "bin" / "bitnet-select").exists():
        pytest.skip("scripts/run.sh runs the repository's .venv, which is not set up here")

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(root / "scripts" / "run.sh"), *args], capture_output=True, text=True,
                              env=env, timeout=300, stdin=subprocess.DEVNULL)

    greedy = ("--max-tokens", "6", "--temperature", "0")
    romeo = run_cli("--device", "cpu", "run", "--prompt", "ROMEO:", *greedy, env=env)
    juliet = run_cli("--device", "cpu", "run", "--prompt", "JULIET:", *greedy, env=env)
    assert romeo.returncode == juliet.returncode == 0 and romeo.stdout != juliet.stdout
    bare = script(*greedy)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == romeo.stdout
    prompt_file = tmp_path / "juliet.txt"
    prompt_file.write_text("JULIET:\n")
    for given in (("-p", "JULIET:"), ("--prompt=JULIET:",), ("-f", str(prompt_file))):
        r = script(*given, *greedy)
        assert r.returncode == 0 and r.stdout == juliet.stdout, (given, r.stderr)


def test_llama_cpp_spellings_of_context_and_temperature(env):
    """`-c`/`--ctx-size` set the context and `--temp` the temperature, as in llama.cpp's tools."""
    for flag in ("-c", "--ctx-size"):
        one_error_line(run_cli("--device", "cpu", "run", "-p", "Hello", "-n", "8", flag, "4", env=env), 2,
                       "exceeds the context of 4")
    one_error_line(run_cli("--device", "cpu", "run", "-p", "x", "--temp", "-1", env=env), 2, "temperature")
    seeded = [run_cli("--device", "cpu", "run", "-p", "ROMEO:", "-n", "8", "--temp", "0.9", *flag, env=env).stdout
              for flag in (("--seed", "3"), ("-s", "3"), ("-s", "4"))]
    assert seeded[0] == seeded[1] != seeded[2]


def test_the_prompt_from_a_file(env, tmp_path):
    """`run -f FILE` (llama-cli's -f) reads the prompt from a file, one final newline dropped; '-' is stdin.
    Exactly one of --prompt and --file; a file that is not UTF-8 is a usage error."""
    greedy = ("-n", "6", "--temperature", "0")
    direct = run_cli("--device", "cpu", "run", "-p", "ROMEO:\nWhat", *greedy, env=env)
    assert direct.returncode == 0, direct.stderr
    path = tmp_path / "p.txt"
    path.write_bytes(b"ROMEO:\nWhat\n")
    for args, stdin in ((("-f", str(path)), None), (("--file", "-"), "ROMEO:\nWhat\n")):
        r = subprocess.run([sys.executable, "-m", "bitnet", "--device", "cpu", "run", *args, *greedy],
                           capture_output=True, text=True, env=env, input=stdin, timeout=300)
        assert r.returncode == 0 and r.stdout == direct.stdout, (args, r.stderr)
    one_error_line(run_cli("--device", "cpu", "run", *greedy, env=env), 2, "--prompt/-p or --file/-f")
    one_error_line(run_cli("--device", "cpu", "run", "-p", "x", "-f", str(path), *greedy, env=env), 2, "one of them")
    path.write_bytes(b"ROMEO:\xff\n")
    one_error_line(run_cli("--device", "cpu", "run", "-f", str(path), *greedy, env=env), 2, "not UTF-8")
