"""Chat through the engine, the Conversation and `bitnet-select chat` (scripted and on a real terminal)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bitnet
from bitnet.errors import UsageError
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.runtime.conversation import Conversation
from bitnet.runtime.engine import Engine
from conftest import cli_env, raised_in_c_call, run_cli

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_model(tmp_path_factory.mktemp("chat") / "m.gguf", SyntheticSpec(arch="bitnet-b1.58", n_ctx=256))
    with bitnet.load(str(path), device="cpu") as e:
        yield e


def test_apply_chat_template_text_and_ids(engine: Engine) -> None:
    text = engine.apply_chat_template(HELLO, tokenize=False)
    assert text == "<|begin_of_text|>User: Hello<|eot_id|>Assistant: "
    ids = engine.apply_chat_template(HELLO)
    assert ids[0] == engine.tokenizer.bos_id and ids.count(engine.tokenizer.bos_id) == 1
    assert engine.tokenizer.eot_id in ids  # parsed as the special token, not spelled out
    assert engine.apply_chat_template(HELLO, add_generation_prompt=False, tokenize=False).endswith("<|eot_id|>")


def test_generation_stops_at_the_end_of_turn_token(engine: Engine) -> None:
    eot = engine.tokenizer.eot_id
    assert "".join(engine.chat(HELLO, max_tokens=8, logit_bias={eot: 100})) == ""
    assert engine.stats.finish_reason == "stop" and engine.stats.generated_tokens == 1
    banned = {t: -100 for t in engine.tokenizer.eog_ids}
    list(engine.chat(HELLO, max_tokens=8, logit_bias=banned))
    assert engine.stats.finish_reason == "length" and engine.stats.generated_tokens == 8


def test_the_next_turn_prefills_only_its_own_tokens(engine: Engine) -> None:
    banned = {t: -100 for t in engine.tokenizer.eog_ids}
    conv = Conversation(engine, "Be brief.", max_tokens=6, logit_bias=banned)
    first = "".join(conv.reply("Hello"))
    n_first = engine.stats.prompt_tokens
    second = "".join(conv.reply("And again?"))
    s = engine.stats
    assert s.cached_tokens >= n_first - 1 and s.prompt_tokens > n_first
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.messages[2]["content"] == first
    # The cache changes nothing: the same turn computed from scratch gives the same reply.
    ids = engine.apply_chat_template(conv.messages[:4])
    engine.reset()
    assert "".join(engine.generate(ids, max_tokens=6, logit_bias=banned)) == second
    assert engine.stats.cached_tokens == 0


def test_a_prompt_stopped_part_way_keeps_its_finished_chunks(tmp_path: Path) -> None:
    # Ctrl-C in a long prompt (bitnet.repl: at once, while nothing has streamed) lands between two chunks or inside
    # one; the chunks that finished stay in the cache and the next run reuses them, with the same result.
    from bitnet.runtime.transformer import PREFILL_CHUNK

    path = write_model(tmp_path / "m.gguf", SyntheticSpec(arch="bitnet-b1.58", n_ctx=512))
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 200, 3 * PREFILL_CHUNK + 5)]
    with bitnet.load(str(path), device="cpu") as engine:
        tr, batches = engine.transformer, []
        run_batch = tr.forward_batch

        def interrupted(*args: Any) -> Any:
            batches.append(len(batches))
            if len(batches) == 3:
                raise KeyboardInterrupt
            return run_batch(*args)

        engine.reset()
        tr.forward_batch = interrupted  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                "".join(engine.generate(ids, max_tokens=4))
        finally:
            del tr.forward_batch
        assert engine._cached == ids[:2 * PREFILL_CHUNK]
        again = "".join(engine.generate(ids, max_tokens=4))
        assert engine.stats.cached_tokens == 2 * PREFILL_CHUNK
        engine.reset()
        assert "".join(engine.generate(ids, max_tokens=4)) == again


def test_a_full_context_drops_the_oldest_exchanges_and_keeps_the_system_prompt(engine: Engine) -> None:
    banned = {t: -100 for t in engine.tokenizer.eog_ids}
    conv = Conversation(engine, "Keep me.", max_tokens=40, logit_bias=banned)
    dropped = 0
    for i in range(12):
        "".join(conv.reply(f"message number {i} with some words in it"))
        assert len(engine.apply_chat_template(conv.messages[:-1])) + 40 <= engine.n_ctx
        dropped += conv.dropped
    assert dropped > 0
    assert conv.messages[0] == {"role": "system", "content": "Keep me."}
    assert conv.messages[-2]["content"] == "message number 11 with some words in it"
    with pytest.raises(UsageError, match="context holds 256"):
        "".join(conv.reply("word " * 400))
    assert conv.messages[-1]["role"] == "assistant"  # the refused message did not stay


def test_openai_shaped_chat_completion(engine: Engine) -> None:
    r = engine.create_chat_completion(HELLO, max_tokens=5, logprobs=True, top_logprobs=3)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == "m.gguf"
    choice = r["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    content = choice["logprobs"]["content"]
    n_prompt = len(engine.apply_chat_template(HELLO))
    assert r["usage"]["completion_tokens"] == len(content) and r["usage"]["prompt_tokens"] == n_prompt
    assert r["usage"]["total_tokens"] == n_prompt + len(content)
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    assert engine.create_chat_completion(HELLO, max_tokens=5)["choices"][0]["logprobs"] is None


def test_streamed_chunks_add_up_to_the_whole_reply(engine: Engine) -> None:
    whole = engine.create_chat_completion(HELLO, max_tokens=6, seed=3, temperature=0.9)
    chunks = list(engine.create_chat_completion(HELLO, max_tokens=6, seed=3, temperature=0.9, stream=True))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]


def test_openai_shaped_text_completion(engine: Engine) -> None:
    r = engine.create_completion("Hello", max_tokens=4, logprobs=2)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == r["usage"]["completion_tokens"]
    chunks = list(engine.create_completion("Hello", max_tokens=4, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]


@pytest.mark.parametrize("call, match", [
    (lambda e: e.create_chat_completion(HELLO, top_logprobs=2), "needs logprobs"),
    (lambda e: e.create_chat_completion(HELLO, logprobs=True, top_logprobs=99), "top_logprobs"),
    (lambda e: e.create_chat_completion(HELLO, stream="yes"), "stream must be"),
    (lambda e: e.create_chat_completion([], max_tokens=2), "non-empty list"),
    (lambda e: e.create_completion("x", best_of=2), "unknown sampling option"),
    (lambda e: e.create_completion("x", logit_bias={"99999": 1}), "out of range"),
    (lambda e: e.create_completion("x", max_tokens=10_000), "exceeds the context"),
    (lambda e: list(e.generate([5, 10**6])), "token id out of range"),
])
def test_bad_requests_are_usage_errors_before_any_compute(engine: Engine, call: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        call(engine)


# -- bitnet-select chat ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return cli_env(BITNET_CACHE_DIR=str(tmp_path_factory.mktemp("cache")), BITNET_DEVICE="cpu")


def run_chat(env: dict[str, str], stdin: str, *args: str) -> Any:
    import subprocess

    return subprocess.run([sys.executable, "-m", "bitnet", "chat", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def test_scripted_chat_prints_one_reply_per_line(env: dict[str, str]) -> None:
    r = run_chat(env, "Hello\nWhat did I just say?\n", "--max-tokens", "16", "--verbose", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2 and r.stdout.endswith("\n")
    turns = [ln for ln in r.stderr.splitlines() if ln.startswith("prompt ")]
    assert len(turns) == 2 and " 0 reused from the cache" in turns[0]
    first_prompt, reused = int(turns[0].split()[1]), int(turns[1].split(":")[1].split()[0])
    assert reused >= first_prompt, turns  # the first turn's prompt is not computed again
    assert "selected=cpu" in r.stderr and "Traceback" not in r.stderr


def test_scripted_commands(env: dict[str, str]) -> None:
    r = run_chat(env, "/system Be brief.\nHi\n/clear\n/nonsense\nHi\n/exit\nnever read\n", "-n", "4", "-v")
    assert r.returncode == 0, r.stderr
    assert "(system prompt set)" in r.stderr and "(conversation cleared)" in r.stderr
    assert "unknown command /nonsense" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("prompt ")]) == 2


def test_the_system_prompt_as_llama_cli_takes_it(env: dict[str, str]) -> None:
    """`chat -p TEXT` is the system prompt, as in llama-cli's and bitnet.cpp's conversation mode."""
    def first_prompt(*args: str) -> tuple[int, str]:
        r = run_chat(env, "Hi\n", "-n", "4", "-v", *args)
        assert r.returncode == 0, r.stderr
        return int(next(ln for ln in r.stderr.splitlines() if ln.startswith("prompt ")).split()[1]), r.stdout

    plain, system, short = first_prompt(), first_prompt("--system", "Be brief."), first_prompt("-p", "Be brief.")
    assert short == system and system[0] > plain[0]


def test_a_message_of_several_lines(env: dict[str, str]) -> None:
    """Between lines of triple quotes (ollama run) or with backslashes ending all lines but the last
    (llama-cli), lines make one message with its line breaks; a command inside a block is text."""
    def prompts(stdin: str) -> list[int]:
        r = run_chat(env, stdin, "-n", "2", "-v")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return [int(ln.split()[1]) for ln in r.stderr.splitlines() if ln.startswith("prompt ")]

    with bitnet.load(device="cpu") as e:  # the built-in model, as the chat runs with no -m
        want = len(e.apply_chat_template([{"role": "user", "content": "line one\nline two"}]))
        one_line = len(e.apply_chat_template([{"role": "user", "content": "line one line two"}]))
    assert want != one_line
    assert prompts('"""\nline one\nline two\n"""\n') == [want]
    assert prompts('"""line one\nline two"""\n') == [want]
    assert prompts("line one\\\nline two\n") == [want]
    assert prompts('"""\nline one\nline two\n') == [want]  # the input ends inside the block: sent as it is
    assert len(prompts('"""\n/clear\n"""\n')) == 1


def test_set_changes_the_next_replies_as_the_options_would(env: dict[str, str]) -> None:
    """/set (ollama's `/set parameter NAME VALUE`, or without `parameter`) gives the reply the same option
    on the command line gives; a bad name or value is one line and changes nothing."""
    flags = run_chat(env, "Hi\n", "-n", "8", "--ignore-eos", "--temp", "1", "--seed", "3")
    greedy = run_chat(env, "Hi\n", "-n", "8", "--ignore-eos")
    typed = run_chat(env, "/set parameter temperature 1\n/set seed 3\n/set temperature -1\n/set top_k x\n/set nope 1\n"
                          "/set seed\nHi\n/set num_predict 3\n/show\nHi\n", "-n", "8", "--ignore-eos", "-v")
    assert all(r.returncode == 0 and "Traceback" not in r.stderr for r in (flags, greedy, typed)), typed.stderr
    assert flags.stdout != greedy.stdout
    assert typed.stdout.startswith(flags.stdout) and len(typed.stdout) > len(flags.stdout)  # a reply may hold "\n"
    errors = [ln for ln in typed.stderr.splitlines() if ln.startswith(("error:", "usage:"))]
    assert len(errors) == 4 and "temperature" in errors[0] and "top_k takes an integer" in errors[1], errors
    assert "unknown parameter 'nope'" in errors[2] and errors[3].startswith("usage: /set")
    replies = [int(ln.split("reply ")[1].split()[0]) for ln in typed.stderr.splitlines() if ln.startswith("prompt ")]
    assert replies == [8, 3]
    assert any(ln.split() == ["max_tokens", "3"] for ln in typed.stderr.splitlines())


def test_chat_errors_are_one_line(env: dict[str, str], tmp_path: Path) -> None:
    r = run_chat(env, "Hi\n", "--chat-template", "nope")
    assert r.returncode == 2 and "neither a built-in" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    r = run_chat(env, "Hi\n", "--chat-template", str(bad))
    assert r.returncode == 0 and "error: chat template" in r.stderr  # the chat goes on after a bad turn
    r = run_chat(env, "Hi\n", "--min-p", "3")
    assert r.returncode == 2 and "min_p" in r.stderr


def test_terminal_chat_ctrl_c_ends_the_reply_not_the_chat(env: dict[str, str]) -> None:
    pexpect = pytest.importorskip("pexpect", reason="pexpect drives the terminal")
    # Ctrl-C as a terminal gives it to a program started in the foreground, even where this run was started in the
    # background (which ignores SIGINT; a child inherits that, and Python then leaves Ctrl-C ignored at the prompt).
    child = pexpect.spawn(sys.executable, ["-m", "bitnet", "chat", "--n-ctx", "2048", "-n", "2000", "--ignore-eos"],
                          env=env, encoding="utf-8", timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect_exact(">>> ")
        child.sendline("Hello")
        child.expect(r"(\S+\s+){6}")  # the reply is streaming (the echoed "Hello" is one word)
        t0 = time.monotonic()
        child.sendintr()
        child.expect_exact("(reply stopped)")
        assert time.monotonic() - t0 < 30
        child.expect_exact(">>> ")  # the chat goes on
        child.sendline("/clear")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(">>> ")
        child.sendline('"""')  # a message of several lines: continuation prompts until the closing quotes
        child.expect_exact("... ")
        child.sendline("Hello")
        child.expect_exact("... ")
        child.sendline('again"""')
        child.expect(r"(\S+\s+){6}")
        child.sendintr()
        child.expect_exact("(reply stopped)")
        child.expect_exact(">>> ")
        child.sendintr()  # at the prompt: a hint, not an exit
        child.expect_exact("(/exit or Ctrl-D to quit)")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)  # ends this process group's child by its own pid, whatever happened
    assert child.exitstatus == 0, child.before


def test_run_accepts_the_new_sampling_options() -> None:
    r = run_cli("--device", "cpu", "run", "-p", "Hi", "-n", "4", "--min-p", "0.1", "--repeat-penalty", "1.2",
                "--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--temperature", "0.7", "--seed", "1")
    assert r.returncode == 0, r.stderr


class _Replying:
    """A Conversation whose reply is `stream()`."""

    dropped = 0

    def __init__(self, stream: Callable[[], Iterator[str]]) -> None:
        self.stream = stream

    def reply(self, text: str) -> Iterator[str]:
        return self.stream()


def _turn_of(stream: Callable[[], Iterator[str]]) -> tuple[str, str]:
    """What the chat writes (reply, then notes) for one turn whose reply is `stream()`."""
    from io import StringIO

    from bitnet.repl import _turn

    out, err = StringIO(), StringIO()
    _turn(_Replying(stream), "Hello", False, out, err)  # type: ignore[arg-type]
    return out.getvalue(), err.getvalue()


def _two_pieces_then(error: BaseException) -> Callable[[], Iterator[str]]:
    """A reply that streams two pieces, then raises `error` as Ctrl-C at that point would."""
    def stream() -> Iterator[str]:
        yield "one "
        yield "two "
        raise error

    return stream


@pytest.mark.parametrize("error", [KeyboardInterrupt(), raised_in_c_call(KeyboardInterrupt()),
                                   raised_in_c_call(raised_in_c_call(KeyboardInterrupt()))],
                         ids=["plain", "inside_a_c_call", "inside_nested_c_calls"])
def test_ctrl_c_stops_the_reply_wherever_it_lands(error: BaseException) -> None:
    out, err = _turn_of(_two_pieces_then(error))
    assert out == "one two \n" and "(reply stopped)" in err


def test_a_system_error_of_another_cause_is_not_taken_for_ctrl_c() -> None:
    with pytest.raises(SystemError):
        _turn_of(_two_pieces_then(raised_in_c_call(ValueError("bug"))))


def test_the_first_ctrl_c_stops_a_long_prompt_at_once() -> None:
    """Before the first piece (the prompt still being read) one Ctrl-C stops the reply at once, not after a token."""

    def stream() -> Iterator[str]:
        signal.raise_signal(signal.SIGINT)
        while True:
            yield "more "

    out, err = _turn_of(stream)
    assert out == "\n" and "(reply stopped)" in err


@pytest.mark.parametrize(("presses", "written"), [(1, "one more \n"), (2, "one \n")])
def test_ctrl_c_stops_after_the_current_token_and_twice_at_once(presses: int, written: str) -> None:
    """Once: the reply ends at the next token, so the interrupt never lands inside a kernel. Twice: at once."""

    before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN in a job started in the background

    def stream() -> Iterator[str]:  # streams forever; the terminal sends SIGINT `presses` times after one piece
        yield "one "
        for _ in range(presses):
            signal.raise_signal(signal.SIGINT)
        while True:
            yield "more "

    out, err = _turn_of(stream)
    assert out == written and "(reply stopped)" in err
    assert signal.getsignal(signal.SIGINT) is before  # the prompt's Ctrl-C is what it was again
