"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered with Jinja2 in a sandbox, or a built-in.

Rendering follows transformers and llama-cpp-python (`ImmutableSandboxedEnvironment`, `trim_blocks`,
`lstrip_blocks`, `loopcontrols`, a `tojson` that keeps non-ASCII text, `raise_exception`,
`strftime_now`), so a template from a model file renders here as it does there.

The built-ins render exactly what llama.cpp's `llama_chat_apply_template` renders for the same name
(`llama3`, `chatml`, `falcon3`, `zephyr`; checked in tests/test_chat_template.py). `bitnet` is
BitNet b1.58 2B-4T's own format ("User: ...<|eot_id|>Assistant: "), the template of its Hugging
Face tokenizer: mainline llama.cpp has no built-in of that name. The GGUF Microsoft ships for
2B-4T carries a Llama-3 header template the model was not trained on (it then never stops), so
for the BitNet b1.58 architectures a template without the "Assistant: " turn marker is replaced by
the `bitnet` built-in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bitnet.errors import ModelError, UsageError

ROLES = ("system", "user", "assistant")

BUILTINS: dict[str, str] = {
    "bitnet": (
        "{% for message in messages %}"
        "{% set content = message['role'] | capitalize + ': ' + message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
    ),
    "llama3": (
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "falcon3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
    "zephyr": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}

BITNET_ARCHS = ("bitnet-b1.58", "bitnet-25")


@dataclass(frozen=True)
class ChatTemplate:
    """A template and where it came from: a built-in's name, "gguf", or the file it was read from."""

    name: str
    source: str
    note: str = ""  # why this one was chosen, when that is worth saying (e.g. a file's template replaced)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "") -> str:
        check_messages(messages)
        try:
            template = _environment().from_string(self.source)
            return template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token)
        except UsageError:
            raise
        except Exception as exc:  # jinja2's TemplateError and whatever a template's own code raises
            raise UsageError(f"chat template {self.name!r} failed: {type(exc).__name__}: {exc}") from None


def check_messages(messages: Any) -> None:
    """Messages are a non-empty list of {"role": system|user|assistant, "content": str}."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise UsageError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise UsageError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise UsageError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise UsageError(f"messages[{i}].content must be a string")


def _raise_exception(message: str) -> None:
    raise UsageError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV: Any = None


def _environment() -> Any:
    global _ENV
    if _ENV is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


def _builtin_for(arch: str, pre: str, has: Callable[[str], bool]) -> str:
    """A built-in by architecture, then by the turn tokens the vocabulary has (llama.cpp's default is chatml)."""
    if arch in BITNET_ARCHS:
        return "bitnet"
    if has("<|start_header_id|>") and has("<|eot_id|>"):
        return "llama3"
    if has("<|im_start|>"):
        return "chatml"
    if has("<|assistant|>"):
        return "falcon3" if pre == "falcon3" else "zephyr"
    return "chatml"


def choose(metadata: Mapping[str, Any], has_token: Callable[[str], bool], override: str | None = None) -> ChatTemplate:
    """The template for a model: `override` (a built-in name or a file), else the file's own unless it
    is known to be bad, else a built-in chosen by architecture and vocabulary."""
    if override:
        if override in BUILTINS:
            return ChatTemplate(override, BUILTINS[override])
        path = Path(override)
        if not path.is_file():
            raise UsageError(f"--chat-template {override!r} is neither a built-in ({', '.join(BUILTINS)}) nor a file")
        try:
            return ChatTemplate(str(path), path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read chat template {override!r}: {exc}") from None
    arch = str(metadata.get("general.architecture", ""))
    own = metadata.get("tokenizer.chat_template")
    if own is not None and not isinstance(own, str):
        raise ModelError("tokenizer.chat_template is not a string")
    if own:
        if arch in BITNET_ARCHS and "Assistant: " not in own:
            return ChatTemplate("bitnet", BUILTINS["bitnet"],
                                note="the file's chat template is not BitNet b1.58's format; using the bitnet built-in")
        return ChatTemplate("gguf", own)
    name = _builtin_for(arch, str(metadata.get("tokenizer.ggml.pre", "")), has_token)
    return ChatTemplate(name, BUILTINS[name])
