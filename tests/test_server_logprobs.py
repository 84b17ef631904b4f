"""Logprobs rendering against scripted engine output, on the real SmolLM2 tokenizer: a
character split over two byte-level tokens (its pieces' bytes, the chunk that has no text
yet), text offsets across chunks, and a log-probability JSON cannot carry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from attrs import define, field

from asyncinfer.core import TokenLogprob
from asyncinfer.outputs import RequestOutput, StreamDelta
from asyncinfer.params import SamplingParams
from asyncinfer.server import create_app
from asyncinfer.tokenizer import Tokenizer
from tests.test_server import StubEngine, sse_events

TEXT = "A你"    # "A", then 你 as two byte-level tokens


@define(slots=False)
class ScriptedEngine(StubEngine):
    """Answers every request with ``script``'s tokens, one delta each, their logprobs
    ``values`` (the alternatives: the token itself)."""

    script: list[int] = field(factory=list)
    values: list[float] = field(factory=list)

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None):
        assert isinstance(prompt, list)
        tok = self.tokenizer
        entries = [TokenLogprob(t, v, ((t, v),)) for t, v in zip(self.script, self.values)]
        detok = tok.detokenizer(params or SamplingParams(), prompt)
        for i, (token, entry) in enumerate(zip(self.script, entries)):
            text = detok.push([token])
            last = i == len(self.script) - 1
            output = None
            if last:
                text += detok.finish()
                output = RequestOutput(0, None, prompt, detok.text, list(self.script),
                                       "length", logprobs=entries)
            yield StreamDelta(text, [token], "length" if last else None, output, [entry])


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
async def client(tok: Tokenizer):
    script = tok.encode(TEXT)
    assert [tok.piece(t)[0] for t in script] == ["A", "bytes:\\xe4\\xbd", "bytes:\\xa0"]
    engine = ScriptedEngine(tokenizer=tok, script=script, values=[-0.5, -math.inf, -1.5])
    async with TestClient(TestServer(create_app(engine))) as c:
        yield c


async def chunks(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_a_split_character_streams_its_pieces_bytes_before_its_text(
        client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1}
    parts = [(c["choices"][0]["delta"].get("content"), c["choices"][0]["logprobs"])
             for c in await chunks(client, "/v1/chat/completions", body)]
    # The first half of 你 has no text yet, but its chunk carries its logprob.
    assert [content for content, _ in parts] == ["A", None, "你"]
    entries = [e for _, logprobs in parts for e in logprobs["content"]]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == TEXT
    assert [e["token"] for e in entries] == ["A", "bytes:\\xe4\\xbd", "bytes:\\xa0"]
    assert [e["logprob"] for e in entries] == [-0.5, -9999.0, -1.5]
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]

    whole = await client.post("/v1/chat/completions", json=body)
    choice = (await whole.json())["choices"][0]
    assert choice["message"]["content"] == TEXT
    assert choice["logprobs"]["content"] == entries


async def test_text_offsets_run_on_over_chunks_and_count_a_split_character_once(
        client: TestClient, tok: Tokenizer) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 0, "echo": True}
    streamed = await chunks(client, "/v1/completions", body)
    offsets = [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]]
    text = "".join(c["choices"][0]["text"] for c in streamed)
    assert text == "hi" + TEXT
    # The prompt "hi" first (its first logprob null), then A at 2 and both halves of 你 at 3.
    assert tokens == [tok.piece(t)[0] for t in tok.encode("hi")] + [
        "A", "bytes:\\xe4\\xbd", "bytes:\\xa0"]
    assert offsets[-3:] == [2, 3, 3]
    assert streamed[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    whole = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    assert whole["text"] == text
    assert whole["logprobs"]["text_offset"] == offsets
    assert whole["logprobs"]["top_logprobs"][-3:] == [
        {"A": -0.5}, {"bytes:\\xe4\\xbd": -9999.0}, {"bytes:\\xa0": -1.5}]
