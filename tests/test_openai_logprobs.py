"""Logprobs and echo through `asyncinfer serve`, driven by the official openai client, equal
transformers' log_softmax on the same weights (float32, within 1e-4): chat and completions,
streamed and whole, the echoed prompt's logprobs of a pure scoring request, and the 400s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy, load_hf
from tests.test_server_process import NAME

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
TOLERANCE = 1e-4
NEW = 8


@pytest.fixture(scope="module")
def server(plain_server: str) -> str:
    return plain_server


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(served_model: Path) -> torch.nn.Module:
    return load_hf(served_model)


@pytest.fixture(scope="module")
def tok(served_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(served_model)


@torch.inference_mode()
def log_softmax(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities of the token after ``ids[: i + 1]``."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def close(got: float | None, want: float) -> bool:
    return got is not None and abs(got - want) <= TOLERANCE


def check_top(got: dict[str, float], row: torch.Tensor, k: int, chosen: str,
              tok: Tokenizer) -> None:
    """A legacy ``top_logprobs`` entry: the k most probable tokens and the chosen one."""
    values, ids = row.topk(k)
    want = {tok.piece(int(i))[0]: float(v) for v, i in zip(values, ids)}
    assert set(got) == set(want) | {chosen}
    assert all(close(got[text], value) for text, value in want.items())


def legacy_stream(chunks: Any) -> tuple[str, dict[str, list[Any]]]:
    """The text and the logprobs of a streamed completion, its chunks joined."""
    text = ""
    joined: dict[str, list[Any]] = {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            for key, values in joined.items():
                values.extend(getattr(choice.logprobs, key))
    return text, joined


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_equal_transformers(client: Any, hf: torch.nn.Module,
                                                tok: Tokenizer, stream: bool) -> None:
    prompt = tok.encode(PROMPT)
    out = hf_greedy(hf, prompt, NEW)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0.0,
            "logprobs": 5, "extra_body": {"ignore_eos": True}}
    if stream:
        text, logprobs = legacy_stream(client.completions.create(**body, stream=True))
    else:
        choice = client.completions.create(**body).choices[0]
        text, logprobs = choice.text, choice.logprobs.model_dump()
    rows = log_softmax(hf, prompt + out)[len(prompt) - 1:]
    assert logprobs["tokens"] == [tok.piece(t)[0] for t in out]
    assert text == tok.decode(out)
    for i, token in enumerate(out):
        assert close(logprobs["token_logprobs"][i], float(rows[i, token]))
        check_top(logprobs["top_logprobs"][i], rows[i], 5, logprobs["tokens"][i], tok)
        assert text[logprobs["text_offset"][i]:].startswith(logprobs["tokens"][i])
    assert logprobs["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_equal_transformers(client: Any, hf: torch.nn.Module, tok: Tokenizer,
                                          stream: bool) -> None:
    prompt = tok.apply_chat_template(CHAT)
    out = hf_greedy(hf, prompt, NEW)
    body = {"model": NAME, "messages": CHAT, "max_tokens": NEW, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    if stream:
        content: list[Any] = []
        text = ""
        for chunk in client.chat.completions.create(**body, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    content += chunk.choices[0].logprobs.content
    else:
        choice = client.chat.completions.create(**body).choices[0]
        text, content = choice.message.content, choice.logprobs.content
    rows = log_softmax(hf, prompt + out)[len(prompt) - 1:]
    assert len(content) == NEW
    assert text == tok.decode(out)
    for i, (token, entry) in enumerate(zip(out, content)):
        assert (entry.token, bytes(entry.bytes)) == tok.piece(token)
        assert close(entry.logprob, float(rows[i, token]))
        values, ids = rows[i].topk(3)
        assert [e.token for e in entry.top_logprobs] == [tok.piece(int(t))[0] for t in ids]
        assert all(close(e.logprob, float(v)) for e, v in zip(entry.top_logprobs, values))
        assert all(bytes(e.bytes) == tok.piece(int(t))[1]
                   for e, t in zip(entry.top_logprobs, ids))


def test_chat_logprobs_without_alternatives_and_none_unasked(client: Any) -> None:
    body = {"model": NAME, "messages": CHAT, "max_tokens": 3, "temperature": 0.0}
    plain = client.chat.completions.create(**body).choices[0]
    assert plain.logprobs is None
    asked = client.chat.completions.create(**body, logprobs=True).choices[0]
    assert asked.message.content == plain.message.content
    assert [e.top_logprobs for e in asked.logprobs.content] == [[], [], []]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_max_tokens_0_scores_the_prompt(client: Any, hf: torch.nn.Module,
                                                  tok: Tokenizer, stream: bool) -> None:
    prompt = tok.encode(PROMPT + " Paris, and the capital of Spain is Madrid.")
    body = {"model": NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    if stream:
        text, logprobs = legacy_stream(client.completions.create(**body, stream=True))
    else:
        response = client.completions.create(**body)
        assert response.usage.completion_tokens == 0
        assert response.choices[0].finish_reason == "length"
        text, logprobs = response.choices[0].text, response.choices[0].logprobs.model_dump()
    assert text == tok.decode(prompt)
    assert logprobs["tokens"] == [tok.piece(t)[0] for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    rows = log_softmax(hf, prompt)
    for i in range(1, len(prompt)):
        assert close(logprobs["token_logprobs"][i], float(rows[i - 1, prompt[i]]))
        check_top(logprobs["top_logprobs"][i], rows[i - 1], 2, logprobs["tokens"][i], tok)
        assert text[logprobs["text_offset"][i]:].startswith(logprobs["tokens"][i])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_one_new_token_as_lm_eval_sends_it(client: Any, hf: torch.nn.Module,
                                                    tok: Tokenizer, stream: bool) -> None:
    # lm-evaluation-harness's loglikelihood: token ids in a list, echo, logprobs 1,
    # max_tokens 1; it sums token_logprobs[context:-1]. Twice: the prompt's pages are in the
    # prefix cache the second time, and it is scored the same.
    prompt = tok.encode(PROMPT + " Paris")
    rows = log_softmax(hf, prompt)
    body = {"model": NAME, "prompt": [prompt], "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0.0, "seed": 1234}
    for _ in range(2):
        if stream:
            text, logprobs = legacy_stream(client.completions.create(**body, stream=True))
        else:
            choice = client.completions.create(**body).choices[0]
            text, logprobs = choice.text, choice.logprobs.model_dump()
        values = logprobs["token_logprobs"]
        assert len(values) == len(prompt) + 1 and values[0] is None
        assert all(close(values[i], float(rows[i - 1, prompt[i]]))
                   for i in range(1, len(prompt)))
        assert close(values[-1], float(rows[-1].max()))
        assert text.startswith(tok.decode(prompt))
        assert logprobs["text_offset"][-1] == len(tok.decode(prompt))


def test_echo_without_logprobs_prepends_the_prompt(client: Any) -> None:
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4,
                                      temperature=0.0).choices[0]
    echoed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, echo=True,
                                       temperature=0.0).choices[0]
    assert echoed.text == PROMPT + plain.text
    assert echoed.logprobs is None


def test_bad_logprobs_fields_are_400s_naming_them(client: Any, server: str) -> None:
    import requests

    context = requests.get(f"{server}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    cases = [
        (client.chat.completions.create, {"messages": CHAT, "logprobs": True,
                                          "top_logprobs": 21}, "top_logprobs"),
        (client.chat.completions.create, {"messages": CHAT, "top_logprobs": 2},
         "top_logprobs"),
        (client.completions.create, {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        (client.completions.create, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        (client.completions.create, {"prompt": [1] * (context + 1), "echo": True,
                                     "logprobs": 1, "max_tokens": 0}, "prompt"),
        (client.completions.create, {"prompt": "Paris " * context, "echo": True,
                                     "logprobs": 1, "max_tokens": 1}, "prompt"),
    ]
    for create, body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=NAME, **body)
        assert caught.value.body["param"] == param, body
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1).choices


def test_chat_echo_puts_the_assistant_turn_first(client: Any) -> None:
    turn = "The three colours are"
    messages = [*CHAT, {"role": "assistant", "content": turn}]
    body = {"model": NAME, "messages": messages, "max_tokens": 3, "temperature": 0.0}
    plain = client.chat.completions.create(**body).choices[0].message.content
    echoed = client.chat.completions.create(**body, extra_body={"echo": True})
    assert echoed.choices[0].message.content == turn + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **body, extra_body={"echo": True}, stream=True) if c.choices)
    assert streamed == turn + plain
    # Echo repeats only the assistant's own turn: after a user turn there is nothing to add.
    after_user = client.chat.completions.create(**{**body, "messages": CHAT},
                                                extra_body={"echo": True})
    assert after_user.choices[0].message.content == client.chat.completions.create(
        **{**body, "messages": CHAT}).choices[0].message.content
