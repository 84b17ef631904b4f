"""Chat templates as users drive them (``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``) and the reasoning parsers (``--reasoning-parser``): the parser
alone, through the openai SDK over a scripted engine, and through ``asyncinfer serve`` on a
tiny random Qwen3 with a Qwen3-style template, against transformers' rendering and greedy
tokens."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.api import RequestOutput
from asyncinfer.errors import ConfigError, InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.server import create_app
from asyncinfer.server.options import ServerOptions
from asyncinfer.server.reasoning import PARSERS, parser
from tests.test_server import Delta, StubEngine, assert_error_shape

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "2 + 2?"}]

# Qwen3's template, cut to what these tests need: ChatML turns, and with enable_thinking
# false the assistant's turn opens with an empty think block, so the model answers at once.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if not loop.last or message.role != 'assistant' or add_generation_prompt %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


# ---- the parser alone ---------------------------------------------------------------------

def _streamed(name: str, pieces: list[str], thinking: bool = True) -> tuple[str, str]:
    stream = parser(name, thinking=thinking).stream()
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("qwen3", "<think>\nstep one\n</think>\n\nThe answer.", "\nstep one\n", "\n\nThe answer."),
    ("qwen3", "The answer.", None, "The answer."),
    ("qwen3", "\n<think>why</think>so", "why", "so"),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "step one\n</think>\n\nThe answer.", "step one\n", "\n\nThe answer."),
    ("deepseek_r1", "<think>step one</think>The answer.", "step one", "The answer."),
    ("deepseek_r1", "no end tag", "no end tag", ""),
    ("deepseek_r1", "</think>only content", "", "only content"),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
])
def test_a_parser_splits_the_reasoning_block_off(name: str, text: str, reasoning: str | None,
                                                  content: str) -> None:
    split = parser(name).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    assert _streamed(name, list(text)) == (reasoning or "", content)


@pytest.mark.parametrize("name", PARSERS)
def test_without_thinking_everything_is_content(name: str) -> None:
    text = "<think>a</think>b"
    split = parser(name, thinking=False).split(text)
    assert (split.reasoning, split.content) == (None, text)
    assert _streamed(name, [text[:3], text[3:]], thinking=False) == ("", text)


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think", "ink>", ">", "/",
                           "\n", " ", "a", "bc", "é", "日本"])


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(PARSERS), thinking=st.booleans(),
       text=st.one_of(st.lists(_PIECES, max_size=14).map("".join), st.text(max_size=20)),
       data=st.data())
def test_any_cut_into_deltas_gives_the_whole_texts_split(name: str, thinking: bool, text: str,
                                                         data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = parser(name, thinking=thinking).split(text)
    assert _streamed(name, pieces, thinking) == (whole.reasoning or "", whole.content)


def test_an_unknown_parser_is_a_cli_error_naming_the_known_ones() -> None:
    result = subprocess.run([sys.executable, "-m", "asyncinfer.cli", "serve",
                             "--reasoning-parser", "qwen2"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "--reasoning-parser" in result.stderr
    assert all(name in result.stderr for name in PARSERS), result.stderr
    with pytest.raises(ConfigError, match="deepseek_r1, qwen3"):
        ServerOptions(reasoning_parser="qwen2")


# ---- through the openai SDK, over an engine whose output is scripted ----------------------

class ScriptedEngine(StubEngine):
    """Answers every request with the same text, in the given deltas."""

    script: list[str]

    async def stream(self, prompt: str | list[int],  # type: ignore[override]
                     params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        assert isinstance(prompt, list)
        self.prompts.append(prompt)
        text = ""
        for i, piece in enumerate(self.script):
            text += piece
            last = i == len(self.script) - 1
            output = RequestOutput(len(self.prompts), None, prompt, text,
                                   list(range(i + 1)), "stop") if last else None
            yield Delta(piece, [i], "stop" if last else None, output)


SCRIPT = ["<thi", "nk>\nLet me", " think.\n</", "think>\n\nIt is", " 4."]


@pytest.fixture
async def sdk(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, ScriptedEngine]]:
    openai = pytest.importorskip("openai")
    engine = ScriptedEngine()
    engine.script = SCRIPT
    options = ServerOptions(reasoning_parser=request.param)
    async with TestClient(TestServer(create_app(engine, options=options))) as client, \
            openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                               max_retries=0) as sdk_client:
        yield sdk_client, engine


@pytest.mark.parametrize("sdk", ["qwen3", "deepseek_r1"], indirect=True)
@pytest.mark.parametrize("thinking", [None, True, False])
async def test_reasoning_content_whole_and_streamed(sdk: tuple[Any, ScriptedEngine],
                                                    thinking: bool | None) -> None:
    client, _ = sdk
    extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    whole = (await client.chat.completions.create(
        model="stub-model", messages=ASK, extra_body=extra)).choices[0].message
    chunks = [c async for c in await client.chat.completions.create(
        model="stub-model", messages=ASK, stream=True, extra_body=extra)]
    deltas = [c.choices[0].delta for c in chunks]
    streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    if thinking is False:  # no block asked for: everything is the answer
        assert (whole.reasoning_content, whole.content) == (None, "".join(SCRIPT))
        assert (streamed_reasoning, streamed_content) == ("", "".join(SCRIPT))
        return
    assert (whole.reasoning_content, whole.content) == ("\nLet me think.\n", "\n\nIt is 4.")
    assert (streamed_reasoning, streamed_content) == ("\nLet me think.\n", "\n\nIt is 4.")
    # The reasoning comes first, then the content; no delta holds a piece of a tag.
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, reverse=True) and {"r", "c"} == set(kinds)
    assert deltas[0].role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None)
                                                    or "") for d in deltas)


async def test_without_a_parser_the_think_block_stays_in_content() -> None:
    engine = ScriptedEngine()
    engine.script = SCRIPT
    async with TestClient(TestServer(create_app(engine))) as client:
        resp = await client.post(CHAT, json={"messages": ASK})
        message = (await resp.json())["choices"][0]["message"]
    assert message["content"] == "".join(SCRIPT)
    assert "reasoning_content" not in message


# ---- the fields' refusals -----------------------------------------------------------------

ASSISTANT_LAST = [*ASK, {"role": "assistant", "content": "It is"}]


def _nested(depth: int) -> list[Any]:
    """``depth`` lists, one inside the other."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": ASSISTANT_LAST, "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message", "both"),
    ({"messages": ASK, "continue_final_message": True}, "continue_final_message", "'user'"),
    ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "'messages'"),
    ({"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs", "add_generation_prompt"),
    ({"messages": ASK, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs",
     "'tokenize'"),
    ({"messages": ASK, "chat_template_kwargs": {"not-a-name": 1}}, "chat_template_kwargs",
     "'not-a-name'"),
    ({"messages": ASK, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
     None),
    ({"messages": ASK, "chat_template_kwargs": {"deep": _nested(32)}}, "chat_template_kwargs",
     "deeper than 32"),
    ({"messages": ASK, "add_generation_prompt": "no"}, "add_generation_prompt", None),
    ({"messages": ASK, "continue_final_message": 1}, "continue_final_message", None),
    ({"messages": ASK, "chat_template_kwargs": {"x": "y" * 70}}, "messages", "characters"),
])
async def test_bad_template_fields_are_a_400_naming_the_field(
        body: dict[str, Any], param: str, says: str | None) -> None:
    engine = StubEngine()
    async with TestClient(TestServer(create_app(engine))) as client:
        resp = await client.post(CHAT, json=body)
        assert resp.status == 400
        error = assert_error_shape(await resp.json())
        assert error["param"] == param
        if says is not None:
            assert says in error["message"]
        assert not engine.prompts
        assert (await client.post(CHAT, json={"messages": ASK, "max_tokens": 2})).status == 200


async def test_continue_final_message_alone_implies_no_generation_prompt() -> None:
    """The stub's template marks the assistant's new turn with ``<assistant>``."""
    engine = StubEngine()
    async with TestClient(TestServer(create_app(engine))) as client:
        for body in ({"messages": ASSISTANT_LAST, "continue_final_message": True},
                     {"messages": ASSISTANT_LAST, "continue_final_message": True,
                      "add_generation_prompt": False},
                     {"messages": ASK, "add_generation_prompt": False},
                     {"messages": ASK}):
            resp = await client.post(CHAT, json={**body, "max_tokens": 1})
            assert resp.status == 200, await resp.text()
    rendered = ["".join(map(chr, p)) for p in engine.prompts]
    assert rendered == ["<user>2 + 2?<assistant>It is", "<user>2 + 2?<assistant>It is",
                        "<user>2 + 2?", "<user>2 + 2?<assistant>"]


# ---- the tokenizer: transformers' rendering, user text kept as text -----------------------

@pytest.fixture(scope="module")
def qwen3_style_tokenizer(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer with the Qwen3-style template."""
    path = tmp_path_factory.mktemp("qwen3-style-tokenizer")
    _tokenizer_files(smollm2_dir, path)
    return path


def _tokenizer_files(smollm2_dir: Path, path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    (path / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)


RENDERINGS = [  # messages, options, how the rendered text ends
    (ASK, {}, "user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"),
    (ASK, {"template_kwargs": {"enable_thinking": False}},
     "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (ASK, {"template_kwargs": {"enable_thinking": True}}, "<|im_start|>assistant\n"),
    (ASK, {"add_generation_prompt": False}, "user\n2 + 2?<|im_end|>\n"),
    (ASSISTANT_LAST, {"add_generation_prompt": False, "continue_final_message": True},
     "<|im_end|>\n<|im_start|>assistant\nIt is"),
]


@pytest.mark.parametrize("special_tokens", [True, False])
@pytest.mark.parametrize(("messages", "options", "ending"), RENDERINGS)
def test_the_chat_renders_as_transformers_renders_it(
        qwen3_style_tokenizer: Path, messages: list[dict[str, str]], options: dict[str, Any],
        ending: str, special_tokens: bool) -> None:
    from transformers import AutoTokenizer

    from asyncinfer.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_style_tokenizer)
    ours = Tokenizer.from_pretrained(qwen3_style_tokenizer)
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
        tokenize=True, return_dict=False, **options.get("template_kwargs", {}))
    assert ours.apply_chat_template(messages, special_tokens, **options) == expected
    assert hf.decode(expected).endswith(ending)


def test_a_template_variable_spelling_a_control_token_stays_text(
        qwen3_style_tokenizer: Path) -> None:
    from asyncinfer.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(qwen3_style_tokenizer)
    ours.hf.chat_template = QWEN3_STYLE_TEMPLATE + "{{- note }}"
    im_end = ours.hf.convert_tokens_to_ids("<|im_end|>")
    kwargs = {"note": "<|im_end|>", "enable_thinking": False}
    as_text = ours.apply_chat_template(ASK, False, template_kwargs=kwargs)
    trusted = ours.apply_chat_template(ASK, True, template_kwargs=kwargs)
    assert trusted.count(im_end) == as_text.count(im_end) + 1
    assert ours.decode(as_text, False) == ours.decode(trusted, False)
    # The other variables keep their meaning on that path (enable_thinking false).
    assert ours.decode(as_text, False).endswith("</think>\n\n<|im_end|>")


def test_a_template_that_drops_the_last_message_cannot_continue_it(
        qwen3_style_tokenizer: Path) -> None:
    from asyncinfer.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(qwen3_style_tokenizer)
    ours.hf.chat_template = "{%- for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="cannot be continued") as caught:
        ours.apply_chat_template(ASSISTANT_LAST, add_generation_prompt=False,
                                 continue_final_message=True)
    assert caught.value.param == "continue_final_message"


def test_a_template_failing_on_a_variable_is_an_invalid_request(
        qwen3_style_tokenizer: Path) -> None:
    from asyncinfer.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(qwen3_style_tokenizer)
    ours.hf.chat_template = QWEN3_STYLE_TEMPLATE + "{{- depth + 1 }}"
    with pytest.raises(InvalidRequestError) as caught:
        ours.apply_chat_template(ASK, template_kwargs={"depth": {"a": 1}})
    assert caught.value.param == "chat_template_kwargs"


# ---- asyncinfer serve on a tiny Qwen3: the prompt ids and tokens transformers gives --------

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_qwen3_chat_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Qwen3 over SmolLM2's vocabulary, its tokenizer and the Qwen3-style
    template."""
    from transformers import Qwen3Config

    from tests.conftest import _save_tiny

    config = Qwen3Config(
        vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2,
        bos_token_id=1)
    path = _save_tiny(config, tmp_path_factory.mktemp("tiny-qwen3-chat"))
    _tokenizer_files(smollm2_dir, path)
    return path


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def served(request: pytest.FixtureRequest, tiny_qwen3_chat_dir: Path) -> Iterator[
        tuple[str, str]]:
    """The server's URL and its --reasoning-parser."""
    from tests.test_server_process import start_server

    proc, url = start_server(tiny_qwen3_chat_dir, "--reasoning-parser", request.param)
    try:
        yield url, request.param
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


SERVED = [
    ("thinking off", ASK, {"chat_template_kwargs": {"enable_thinking": False}}),
    ("thinking on", ASK, {"chat_template_kwargs": {"enable_thinking": True}}),
    ("no generation prompt", ASK, {"add_generation_prompt": False}),
    ("continued", ASSISTANT_LAST, {"continue_final_message": True}),
]


@pytest.mark.parametrize(("case", "messages", "extra"), SERVED, ids=[s[0] for s in SERVED])
def test_the_server_renders_and_generates_as_transformers(
        served: tuple[str, str], tiny_qwen3_chat_dir: Path, case: str,
        messages: list[dict[str, str]], extra: dict[str, Any]) -> None:
    """The random model writes no tags: qwen3 finds no block (all is content); deepseek_r1
    starts inside one that never closes (all is reasoning), unless thinking is off."""
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_greedy, load_hf
    from tests.test_server_process import NAME

    url, reasoning_parser = served
    hf_tok = AutoTokenizer.from_pretrained(tiny_qwen3_chat_dir)
    kwargs = extra.get("chat_template_kwargs", {})
    continued = bool(extra.get("continue_final_message"))
    prompt = hf_tok.apply_chat_template(
        messages, add_generation_prompt=extra.get("add_generation_prompt", not continued),
        continue_final_message=continued, tokenize=True, return_dict=False, **kwargs)
    expected = hf_tok.decode(hf_greedy(load_hf(tiny_qwen3_chat_dir), prompt, MAX_TOKENS),
                             skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "<think>" not in expected and "</think>" not in expected
    as_reasoning = reasoning_parser == "deepseek_r1" and kwargs.get("enable_thinking") is not False

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    body = {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"ignore_eos": True, **extra}}
    whole = client.chat.completions.create(**body)
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == MAX_TOKENS
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (
        (expected, "") if as_reasoning else (None, expected))
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True)
              if c.choices]
    streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas))
    assert streamed == ((expected, "") if as_reasoning else ("", expected))
