"""The `bitnet-select chat` loop: read a message, stream the reply, keep the conversation.

On a terminal it prompts (`>>> `, with line editing where Python has readline); Ctrl-C ends the
reply being written, not the chat; Ctrl-D or /exit ends the chat. With stdin not a terminal each
line is one user message and only the replies are written, one per line, so it can be scripted.

A message of several lines, on a terminal or not: between lines of three double quotes, as in
`ollama run`, or with each line but the last ending in a backslash, as in llama-cli.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import TextIO

from bitnet.errors import UsageError, is_ctrl_c
from bitnet.runtime.conversation import Conversation

HELP = '''/clear          forget the conversation (the system prompt stays)
/system TEXT    set the system prompt (no TEXT: remove it)
/set [parameter] NAME VALUE
                set max_tokens (num_predict) or a sampling option: temperature, top_k, top_p,
                min_p, seed, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty
/show           the options the next reply runs with
/exit, /bye     end the chat (also Ctrl-D)
/help           this list
""" ... """     a message of several lines (or end each line but the last with a backslash)
Ctrl-C stops the reply after the current token (twice: at once, mid-prompt too).'''
QUOTES = '"""'



def run(conversation: Conversation, interactive: bool, verbose: bool, stdin: TextIO = sys.stdin,
        out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"chat with {conversation.engine.name} (/help for commands, Ctrl-D to quit)", file=err)
    while True:
        try:
            text, block = _message(interactive, stdin)
        except KeyboardInterrupt:  # at the prompt, or inside a message of several lines: a fresh prompt
            print("\n(/exit or Ctrl-D to quit)", file=err)
            continue
        if text is None:
            return
        if not text.strip():
            continue
        if text.startswith("/") and not block:
            if _command(conversation, text, err):
                return
            continue
        _turn(conversation, text, verbose, out, err)


def _message(interactive: bool, stdin: TextIO) -> tuple[str | None, bool]:
    """The next message (None at the end of input), and whether it came as a block of lines: a one-line
    message, or the lines of a triple-quoted or backslash-continued block. The quotes' own lines count
    only where they hold text. A block the input ends inside is sent as far as it got."""
    line = _read(interactive, stdin, ">>> ")
    if line is None or not (line.startswith(QUOTES) or line.endswith("\\")):
        return line, False
    lines = []
    if line.startswith(QUOTES):
        line = line[len(QUOTES):]
        while line is not None and not line.endswith(QUOTES):
            lines.append(line)
            line = _read(interactive, stdin, "... ")
        if line is not None:
            lines.append(line[:-len(QUOTES)])
        lines = lines[1:] if lines and not lines[0] else lines
        lines = lines[:-1] if lines and not lines[-1] else lines
        return "\n".join(lines), True
    while line is not None and line.endswith("\\"):
        lines.append(line[:-1])
        line = _read(interactive, stdin, "... ")
    return "\n".join(lines if line is None else [*lines, line]), True


def _read(interactive: bool, stdin: TextIO, prompt: str) -> str | None:
    """One line without its line break; None at the end of input."""
    if interactive:
        try:
            return input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return None
    line = stdin.readline()
    return line.rstrip("\r\n") if line else None


def _command(conversation: Conversation, text: str, err: TextIO) -> bool:
    """Run a /command; True when the chat should end."""
    name, _, arg = text.partition(" ")
    if name in ("/exit", "/bye", "/quit"):
        return True
    if name == "/clear":
        conversation.clear()
        print("(conversation cleared)", file=err)
    elif name == "/system":
        conversation.set_system(arg.strip())
        print("(system prompt set)" if arg.strip() else "(system prompt removed)", file=err)
    elif name == "/set":
        words = arg.split()
        words = words[1:] if words[:1] == ["parameter"] else words  # ollama's spelling
        if len(words) != 2:
            print("usage: /set [parameter] NAME VALUE", file=err)
            return False
        try:
            option = conversation.set_option(*words)
        except UsageError as exc:
            print(f"error: {exc}", file=err)
        else:
            print(f"({option} = {conversation.options()[option]})", file=err)
    elif name == "/show":
        for option, value in conversation.options().items():
            if option != "logit_bias":
                print(f"{option:<18}{value}", file=err)
    elif name == "/help":
        print(HELP, file=err)
    else:
        print(f"unknown command {name}: /help lists them", file=err)
    return False


def _turn(conversation: Conversation, text: str, verbose: bool, out: TextIO, err: TextIO) -> None:
    pieces = conversation.reply(text)
    interrupted = False
    try:
        with _StopOnCtrlC() as stop:
            for piece in pieces:
                stop.streaming = True
                out.write(piece)
                out.flush()
                if stop.pressed:
                    interrupted = True
                    break
    except (KeyboardInterrupt, SystemError) as exc:
        if not is_ctrl_c(exc):
            raise
        interrupted = True
    except UsageError as exc:  # e.g. one message longer than the whole context: the chat goes on
        print(f"error: {exc}", file=err)
        return
    finally:
        pieces.close()  # the reply joins the conversation as far as it got
    out.write("\n")
    out.flush()
    if interrupted:
        print("(reply stopped)", file=err)
    if conversation.dropped:
        print(f"(context full: dropped the {conversation.dropped} oldest message(s); the system prompt stays)",
              file=err)
    if verbose:
        s = conversation.engine.stats
        print(f"prompt {s.prompt_tokens} tokens: {s.cached_tokens} reused from the cache, "
              f"{s.prompt_tokens - s.cached_tokens} prefilled in {s.prefill_ms:.1f} ms; reply "
              f"{s.generated_tokens} tokens at {s.decode_tps:.1f} tokens/s", file=err)


class _StopOnCtrlC:
    """While a reply streams, the first Ctrl-C only asks it to stop after the current token.

    A KeyboardInterrupt raised where the signal lands can land inside a C call (a numba dispatch), which CPython
    then reports as a SystemError, and can leave a forward pass half done. A second Ctrl-C interrupts at once, and
    so does the first while the prompt is still being read (nothing streamed yet: a long prompt can take a
    minute); the engine keeps the prompt's finished chunks for the next turn."""

    def __init__(self) -> None:
        self.pressed = False
        self.streaming = False
        self._previous: object = None

    def __enter__(self) -> _StopOnCtrlC:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.pressed or not self.streaming:
            raise KeyboardInterrupt
        self.pressed = True
