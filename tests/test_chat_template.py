"""Chat templates against llama.cpp: rendered text and token ids, built-ins and templates from files."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from bitnet.errors import ModelError, UsageError
from bitnet.text.chat_template import BUILTINS, ChatTemplate, choose
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata
from bitnet.text.tokenizer import TOKEN_CONTROL, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "  You are terse. \n"}, {"role": "user", "content": "Hi there "},
     {"role": "assistant", "content": " Hello! How can I help?"}, {"role": "user", "content": "\tSay ünïcödé 🙂\n"}],
    [{"role": "user", "content": "{{ not a template }} {% raw %}"}, {"role": "assistant", "content": ""}],
    # Special-token text inside a message is parsed as the token, as llama.cpp's server parses it.
    [{"role": "user", "content": "a<|im_end|>b<|eot_id|>c"}],
]

# Templates as model files carry them (Hugging Face tokenizer_config.json style), for the file path.
FILE_TEMPLATES = {
    "llama3-hf": (
        "{{ bos_token }}{% for message in messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "chatml-default-system": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
        "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "bitnet-hf": BUILTINS["bitnet"],
}

CHAT_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|system|>",
                 "<|user|>", "<|assistant|>", "<|endoftext|>")


def llama_cpp_apply(name: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """llama.cpp's own rendering of a built-in template (llama_chat_apply_template)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the reference) is not installed")
    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        chat[i].role, chat[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), add_generation_prompt, buf, len(buf))
    assert 0 < n < len(buf), f"llama.cpp does not know the template {name!r}"
    return buf.raw[:n].decode()


@pytest.mark.llama
@pytest.mark.parametrize("name", ["llama3", "chatml", "falcon3", "zephyr"])
@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_builtins_render_what_llama_cpp_renders(name: str, add: bool, conv: int) -> None:
    messages = CONVERSATIONS[conv]
    assert ChatTemplate(name, BUILTINS[name]).render(messages, add) == llama_cpp_apply(name, messages, add)


def test_bitnet_builtin_is_bitnet_b158s_format() -> None:
    # Written out from BitNet b1.58 2B-4T's published format, not computed by the code under test.
    text = ChatTemplate("bitnet", BUILTINS["bitnet"]).render(CONVERSATIONS[1], True, bos_token="<|begin_of_text|>")
    assert text == ("<|begin_of_text|>System: You are terse.<|eot_id|>User: Hi there<|eot_id|>"
                    "Assistant: Hello! How can I help?<|eot_id|>User: Say ünïcödé 🙂<|eot_id|>Assistant: ")


@pytest.mark.llama
@pytest.mark.parametrize("name", sorted(FILE_TEMPLATES))
def test_file_templates_render_as_llama_cpp_python_renders_them(name: str) -> None:
    fmt = pytest.importorskip("llama_cpp.llama_chat_format", reason="llama-cpp-python is not installed")
    source = FILE_TEMPLATES[name]
    for messages in CONVERSATIONS:
        ref = fmt.Jinja2ChatFormatter(source, eos_token="<|eot_id|>", bos_token="<|begin_of_text|>")
        want = ref(messages=messages).prompt
        got = ChatTemplate(name, source).render(messages, True, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        assert got == want


# -- token ids ---------------------------------------------------------------------------------------

def chat_vocab() -> dict[str, Any]:
    """The synthetic Llama-3-style vocabulary with the turn tokens of every built-in as control tokens."""
    md = synthetic_tokenizer_metadata("gpt2", 1024)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    free = [i for i, t in enumerate(tokens) if t.startswith("<|reserved_special_token_")]
    for i, text in zip(free, CHAT_SPECIALS, strict=False):
        tokens[i], types[i] = text, TOKEN_CONTROL
    return md


@pytest.fixture(scope="module")
def vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the token-id reference) is not installed")
    from test_tokenizer import _write_vocab_gguf

    md = chat_vocab()
    path = tmp_path_factory.mktemp("chat-vocab") / "vocab.gguf"
    _write_vocab_gguf(path, md)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield Tokenizer.from_metadata(md), ref
    ref.close()


def prompt_ids(tok: Tokenizer, template: ChatTemplate, messages: list[dict[str, str]]) -> list[int]:
    """What Engine.apply_chat_template returns, on a bare tokenizer (the engine is tested in test_chat)."""
    from bitnet.runtime.engine import Engine

    stub = Engine.__new__(Engine)
    stub.tokenizer, stub.chat_template = tok, template
    return Engine.apply_chat_template(stub, messages)


@pytest.mark.llama
@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_prompt_ids_equal_llama_cpp(vocab_pair: tuple[Tokenizer, Any], name: str) -> None:
    tok, ref = vocab_pair
    for messages in CONVERSATIONS:
        if name == "bitnet":  # no such built-in in mainline llama.cpp: its server renders the same Jinja text
            fmt = pytest.importorskip("llama_cpp.llama_chat_format")
            text = fmt.Jinja2ChatFormatter(BUILTINS[name], eos_token="<|end_of_text|>",
                                           bos_token="<|begin_of_text|>")(messages=messages).prompt
            want = ref.tokenize(text.encode(), add_bos=False, special=True)
        else:  # llama.cpp renders, then tokenizes with BOS and special tokens parsed (llama-server, llama-cli)
            want = ref.tokenize(llama_cpp_apply(name, messages, True).encode(), add_bos=True, special=True)
        got = prompt_ids(tok, ChatTemplate(name, BUILTINS[name]), messages)
        assert got == want
        assert got.count(tok.bos_id) == 1 and got[0] == tok.bos_id


@pytest.mark.llama
@pytest.mark.parametrize("name", sorted(FILE_TEMPLATES))
def test_file_template_prompt_ids_equal_llama_cpp(vocab_pair: tuple[Tokenizer, Any], name: str) -> None:
    fmt = pytest.importorskip("llama_cpp.llama_chat_format")
    tok, ref = vocab_pair
    for messages in CONVERSATIONS:
        text = fmt.Jinja2ChatFormatter(FILE_TEMPLATES[name], eos_token="<|end_of_text|>",
                                       bos_token="<|begin_of_text|>")(messages=messages).prompt
        # llama-server puts one BOS in front whether or not the template wrote it (llama-cpp-python's
        # formatter adds none when the template does not): ids follow the server.
        bos = "<|begin_of_text|>"
        want = ref.tokenize((text if text.startswith(bos) else bos + text).encode(), add_bos=False, special=True)
        assert prompt_ids(tok, ChatTemplate(name, FILE_TEMPLATES[name]), messages) == want


# -- choosing a template -----------------------------------------------------------------------------

def has(*tokens: str):
    return lambda t: t in tokens


def test_choice_by_architecture_and_vocabulary() -> None:
    assert choose({"general.architecture": "bitnet-b1.58"}, has()).name == "bitnet"
    assert choose({"general.architecture": "bitnet-25"}, has("<|im_start|>")).name == "bitnet"
    assert choose({"general.architecture": "llama"}, has("<|start_header_id|>", "<|eot_id|>")).name == "llama3"
    assert choose({"general.architecture": "bitnet"}, has("<|im_start|>")).name == "chatml"
    falcon = {"general.architecture": "llama", "tokenizer.ggml.pre": "falcon3"}
    assert choose(falcon, has("<|assistant|>", "<|endoftext|>")).name == "falcon3"
    assert choose({"general.architecture": "llama"}, has("<|assistant|>")).name == "zephyr"
    assert choose({"general.architecture": "bitnet"}, has()).name == "chatml"  # llama.cpp's default too


def test_the_file_template_wins_unless_it_is_known_bad() -> None:
    md = {"general.architecture": "llama", "tokenizer.ggml.pre": "falcon3", "tokenizer.chat_template": "{{ 'x' }}"}
    assert choose(md, has()).name == "gguf"
    # 2B-4T's GGUF carries a Llama-3 header template the model never stops under.
    bad = {"general.architecture": "bitnet-b1.58", "tokenizer.chat_template": FILE_TEMPLATES["llama3-hf"]}
    chosen = choose(bad, has())
    assert chosen.name == "bitnet" and "not BitNet b1.58's format" in chosen.note
    good = {"general.architecture": "bitnet-b1.58", "tokenizer.chat_template": FILE_TEMPLATES["bitnet-hf"]}
    assert choose(good, has()).name == "gguf"
    with pytest.raises(ModelError):
        choose({"tokenizer.chat_template": 7}, has())


def test_override_by_name_or_file(tmp_path: Path) -> None:
    md = {"general.architecture": "bitnet-b1.58"}
    assert choose(md, has(), "zephyr").name == "zephyr"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    t = choose(md, has(), str(f))
    assert t.render([{"role": "user", "content": "hi"}]) == "[user]hi"
    with pytest.raises(UsageError, match="neither a built-in"):
        choose(md, has(), "no-such-template")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"), ("hello", "non-empty list"), ([{"role": "user"}], "content must be a string"),
    ([{"role": "robot", "content": "x"}], "role must be one of"), (["x"], "must be an object"),
])
def test_bad_messages_are_usage_errors(messages: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ChatTemplate("chatml", BUILTINS["chatml"]).render(messages)


def test_template_errors_are_one_line_usage_errors() -> None:
    alternate = "{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}x"
    with pytest.raises(UsageError, match="chat template: roles must alternate"):
        ChatTemplate("t", alternate).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(UsageError, match="failed: TemplateSyntaxError"):
        ChatTemplate("t", "{% for %}").render([{"role": "user", "content": "x"}])
    # The sandbox: no reaching into Python internals from a model file's template.
    with pytest.raises(UsageError, match="SecurityError"):
        ChatTemplate("t", "{{ messages.__class__.__mro__[1].__subclasses__() }}").render(
            [{"role": "user", "content": "x"}])
