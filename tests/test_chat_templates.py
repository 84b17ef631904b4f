"""Chat templates as users drive them (``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``): their refusals, the tokenizer's rendering, and ``asyncinfer
serve`` on a tiny random Qwen3 with a Qwen3-style template, against transformers' rendering
and greedy tokens."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncinfer.errors import InvalidRequestError
from asyncinfer.server import create_app
from tests.test_server import StubEngine, assert_error_shape

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


@pytest.fixture(scope="module")
def qwen3_server(tiny_qwen3_chat_dir: Path) -> Iterator[str]:
    from tests.test_server_process import start_server

    proc, url = start_server(tiny_qwen3_chat_dir)
    try:
        yield url
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
        qwen3_server: str, tiny_qwen3_chat_dir: Path, case: str,
        messages: list[dict[str, str]], extra: dict[str, Any]) -> None:
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from tests.hf_reference import hf_greedy, load_hf
    from tests.test_server_process import NAME

    hf_tok = AutoTokenizer.from_pretrained(tiny_qwen3_chat_dir)
    kwargs = extra.get("chat_template_kwargs", {})
    continued = bool(extra.get("continue_final_message"))
    prompt = hf_tok.apply_chat_template(
        messages, add_generation_prompt=extra.get("add_generation_prompt", not continued),
        continue_final_message=continued, tokenize=True, return_dict=False, **kwargs)
    expected = hf_tok.decode(hf_greedy(load_hf(tiny_qwen3_chat_dir), prompt, MAX_TOKENS),
                             skip_special_tokens=True, clean_up_tokenization_spaces=False)

    client = openai.OpenAI(base_url=f"{qwen3_server}/v1", api_key="unused", max_retries=0)
    body = {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"ignore_eos": True, **extra}}
    whole = client.chat.completions.create(**body)
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert whole.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
