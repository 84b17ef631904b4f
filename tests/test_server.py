"""The HTTP server against a stub engine: OpenAI shapes, SSE framing, errors, auth, metrics,
and that a client going away aborts its request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from attrs import define, field, frozen

from asyncinfer.api import RequestMetrics, RequestOutput
from asyncinfer.errors import EngineError
from asyncinfer.outputs import EngineStats
from asyncinfer.params import SamplingParams
from asyncinfer.server import create_app
from asyncinfer.server.operations import METRICS
from asyncinfer.server.options import ServerOptions
from tests.conftest import engine_under_test

CONTEXT = 64
VOCAB = 256


class StubTokenizer:
    """One token per character: id = code point (ASCII only in these tests)."""

    vocab_size = VOCAB
    max_token_chars = 1

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], special_tokens: bool = True,
                            *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@frozen
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    output: RequestOutput | None
    logprobs: list[Any] | None = None           # the stub computes none
    prompt_logprobs: list[Any] | None = None
    index: int = 0


def Stats() -> EngineStats:
    """The engine's own stats type, so the stub cannot fall behind the fields /metrics reads."""
    return EngineStats(
        waiting=1, running=2, kv_pages_used=3, kv_pages_total=40, batches_prefill=5,
        batches_decode=6, prefix_cache_queries=7, prefix_cache_hits=2,
        prefix_cache_query_tokens=90, prefix_cache_hit_tokens=32, rounds=12,
        round_host_seconds=0.25, round_wait_seconds=0.75, device_busy_seconds=0.5,
        batches_mixed=4, kv_event_batches=9, kv_event_batches_dropped=1)


@define(slots=False)
class StubEngine:
    """Generates 'a', 'b', 'c', ... up to max_tokens (clamped to the context); records what it
    was asked and which requests were aborted before they finished."""

    token_delay: float = 0.0
    refuse: str | None = None           # finish every request at once with this error
    explode: bool = False               # raise an unexpected exception
    model_name: str = "stub-model"
    context_len: int = CONTEXT
    tokenizer: StubTokenizer = field(factory=StubTokenizer)
    params: list[SamplingParams] = field(factory=list)
    prompts: list[list[int]] = field(factory=list)
    aborted: list[int] = field(factory=list)
    started: asyncio.Event = field(factory=asyncio.Event)
    abort_everything: asyncio.Event = field(factory=asyncio.Event)

    alive: bool = True

    def stats(self) -> Stats:
        return Stats()

    def abort_all(self) -> None:
        self.abort_everything.set()

    async def generate(self, prompt: str | list[int],
                       params: SamplingParams | None = None) -> RequestOutput:
        async for delta in self.stream(prompt, params):
            if delta.output is not None:
                return delta.output
        raise AssertionError("the stream ended without an output")

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None):
        if self.explode:
            raise RuntimeError("boom")
        assert isinstance(prompt, list), "the server sends token ids"
        params = params or SamplingParams()
        uid = len(self.prompts)
        self.prompts.append(prompt)
        self.params.append(params)
        arrival = time.perf_counter()
        if self.refuse is not None:
            yield Delta("", [], "error", RequestOutput(uid, None, prompt, "", [], "error",
                                                       self.refuse))
            return
        n = min(params.max_tokens, self.context_len - len(prompt))
        tokens: list[int] = []
        first = None
        finished = False
        self.started.set()
        if n == 0:  # max_tokens 0: a scoring request, finished with no token
            yield Delta("", [], "length", RequestOutput(
                uid, None, prompt, "", [], "length",
                metrics=RequestMetrics(arrival, None, time.perf_counter())))
            return
        try:
            for i in range(n):
                await asyncio.sleep(self.token_delay)
                if self.abort_everything.is_set():
                    finished = True
                    output = RequestOutput(uid, None, prompt, "".join(map(chr, tokens)),
                                           list(tokens), "abort")
                    yield Delta("", [], "abort", output)
                    return
                tokens.append(ord("a") + i % 26)
                first = first or time.perf_counter()
                output = None
                if i == n - 1:
                    finished = True
                    output = RequestOutput(
                        uid, None, prompt, "".join(map(chr, tokens)), list(tokens), "length",
                        metrics=RequestMetrics(arrival, first, time.perf_counter()))
                yield Delta(chr(tokens[-1]), [tokens[-1]], "length" if output else None,
                            output)
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self.aborted.append(uid)
            raise


@pytest.fixture
def engine() -> StubEngine:
    return StubEngine()


@pytest.fixture
async def client(engine: StubEngine):
    async with TestClient(TestServer(create_app(engine))) as c:
        yield c


def assert_error_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), "every SSE event ends with a blank line"
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
OK_CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body (bytes: sent raw), status, param, code)
    (C, b"{not json", 400, None, None),
    (C, b"\xff\xfe", 400, None, None),
    (C, b"[1, 2]", 400, None, None),
    (C, b"[" * 100_000, 400, None, None),
    (C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    (C, {"prompt": "hi", "top_k": 1.5}, 400, "top_k", None),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed", None),
    (C, {"prompt": "hi", "priority": 1.5}, 400, "priority", None),
    (C, {"prompt": "hi", "priority": "high"}, 400, "priority", None),
    (C, {"prompt": "hi", "priority": True}, 400, "priority", None),
    (C, {"prompt": "hi", "user": 7}, 400, "user", None),
    (C, {"prompt": "hi", "user": "u" * 257}, 400, "user", None),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop", None),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    (C, {"prompt": "hi", "n": 17}, 400, "n", None),
    (C, {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of", None),
    (C, {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", None),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    (C, {"prompt": "hi", "stream": True, "stream_options": "x"}, 400, "stream_options", None),
    (C, {"prompt": "hi", "echo": "yes"}, 400, "echo", None),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (C, {"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs", None),
    (C, {"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs", None),
    (C, {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens", None),
    (C, {"prompt": "x" * 70, "echo": True, "max_tokens": 0}, 400, "prompt",
     "context_length_exceeded"),
    (C, {"prompt": list(range(1, CONTEXT + 1)), "echo": True, "logprobs": 1,
         "max_tokens": 0}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": ["a", ""]}, 400, "prompt[1]", None),
    (C, {"prompt": [[1], []]}, 400, "prompt[1]", None),
    (C, {"prompt": ["a"] * 9, "n": 16}, 400, "prompt", None),
    (C, {"prompt": ["a", "b"], "echo": True, "logprobs": 1}, 400, "echo", None),
    (C, {"prompt": "hi", "n": 2, "echo": True, "logprobs": 1}, 400, "echo", None),
    (C, {}, 400, "prompt", None),
    (C, {"prompt": 12}, 400, "prompt", None),
    (C, {"prompt": ""}, 400, "prompt", None),
    (C, {"prompt": [1, VOCAB]}, 400, "prompt", None),
    (C, {"prompt": "x" * 70}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": "x" * 70, "stream": True}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (C, {"prompt": "hi", "model": 7}, 400, "model", None),
    (CHAT, {}, 400, "messages", None),
    (CHAT, {"messages": "hi"}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None),
    (CHAT, {"messages": OK_CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens",
     None),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 70}]}, 400, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": OK_CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     None),
    (CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": OK_CHAT, "logprobs": False, "top_logprobs": 0}, 400, "top_logprobs",
     None),
    (CHAT, {"messages": OK_CHAT, "logprobs": 1}, 400, "logprobs", None),
    (CHAT, {"messages": OK_CHAT, "echo": 1}, 400, "echo", None),
    (GEN, {"prompt": "hi", "input_ids": [1]}, 400, "prompt", None),
    (GEN, {"input_ids": "abc"}, 400, "input_ids", None),
    (GEN, {"prompt": "hi", "sampling_params": {"temp": 1}}, 400, "sampling_params.temp", None),
    (GEN, {"prompt": "hi", "sampling_params": {"max_tokens": 0}}, 400,
     "sampling_params.max_tokens", None),
    (GEN, {"prompt": "hi", "sampling_params": []}, 400, "sampling_params", None),
    (GEN, {"prompt": "hi", "sampling_params": {"ignore_eos": 1}}, 400,
     "sampling_params.ignore_eos", None),
    (GEN, {"prompt": "hi", "sampling_params": {"stop": [1]}}, 400, "sampling_params.stop",
     None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_INPUTS)
async def test_bad_input_gets_its_status_in_openai_shape_and_the_server_keeps_serving(
        client: TestClient, engine: StubEngine, path: str, body: Any, status: int,
        param: str | None, code: str | None) -> None:
    if isinstance(body, bytes):
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await client.post(path, json=body)
    assert resp.status == status
    assert resp.content_type == "application/json"
    error = assert_error_shape(await resp.json())
    assert error["param"] == param
    assert error["code"] == code
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert not engine.prompts, "a bad request never reaches the engine"
    ok = await client.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status == 200


async def test_prompt_too_long_names_both_lengths(client: TestClient) -> None:
    resp = await client.post(C, json={"prompt": "x" * 70})
    message = assert_error_shape(await resp.json())["message"]
    assert "70" in message and str(CONTEXT) in message


async def test_unknown_route_and_wrong_method_are_openai_shaped(client: TestClient) -> None:
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert_error_shape(await resp.json())
    resp = await client.get(C)
    assert resp.status == 405
    assert_error_shape(await resp.json())


async def test_unexpected_exception_is_a_logged_500_in_the_same_shape(
        client: TestClient, engine: StubEngine, caplog: pytest.LogCaptureFixture) -> None:
    engine.explode = True
    with caplog.at_level(logging.ERROR, logger="asyncinfer.server"):
        resp = await client.post(C, json={"prompt": "hi"})
    assert resp.status == 500
    assert assert_error_shape(await resp.json())["type"] == "server_error"
    assert any("boom" in (r.exc_text or "") for r in caplog.records)


async def test_engine_error_class_maps_through_its_http_status(client: TestClient,
                                                             engine: StubEngine) -> None:
    async def fail(prompt: Any, params: Any = None) -> RequestOutput:
        raise EngineError("the device fell over")

    engine.generate = fail  # type: ignore[method-assign]
    resp = await client.post(C, json={"prompt": "hi"})
    assert resp.status == EngineError.http_status
    assert "device fell over" in assert_error_shape(await resp.json())["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_the_engine_refuses_is_a_400_not_a_stream(
        client: TestClient, engine: StubEngine, stream: bool) -> None:
    engine.refuse = "the prompt has 9 tokens but the KV cache holds only 8"
    resp = await client.post(C, json={"prompt": "hi", "stream": stream})
    assert resp.status == 400
    assert "KV cache" in assert_error_shape(await resp.json())["message"]


async def test_completion_response_shape_and_usage(client: TestClient,
                                                   engine: StubEngine) -> None:
    resp = await client.post(C, json={"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                      "top_k": 5, "min_p": 0.1, "seed": 3, "stop": "zz",
                                      "ignore_eos": True, "model": "stub-model", "n": 1,
                                      "priority": -2})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "stub-model"
    assert body["choices"] == [{"index": 0, "text": "abcd", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.params[0] == SamplingParams(max_tokens=4, temperature=0, top_k=5, min_p=0.1,
                                              seed=3, stop="zz", ignore_eos=True, priority=-2)


async def test_the_tenant_is_the_x_tenant_header_else_the_user_field(
        client: TestClient, engine: StubEngine) -> None:
    await client.post(C, json={"prompt": "hi", "user": "alice"})
    await client.post(CHAT, json={"messages": OK_CHAT, "user": "alice"},
                      headers={"X-Tenant": "team-b"})
    await client.post("/generate", json={"prompt": "hi", "sampling_params": {"tenant": "c"}})
    await client.post(C, json={"prompt": "hi"})
    assert [p.tenant for p in engine.params] == ["alice", "team-b", "c", ""]
    resp = await client.post(C, json={"prompt": "hi"}, headers={"X-Tenant": "t" * 257})
    assert resp.status == 400
    assert assert_error_shape(await resp.json())["param"] == "X-Tenant"
    assert len(engine.params) == 4


async def test_a_single_prompt_in_a_list_is_accepted(client: TestClient,
                                                     engine: StubEngine) -> None:
    for prompt in (["hey"], [[104, 105]], [104, 105]):
        resp = await client.post(C, json={"prompt": prompt, "max_tokens": 1})
        assert resp.status == 200
    assert engine.prompts == [[104, 101, 121], [104, 105], [104, 105]]


async def test_chat_response_shape_and_default_length_clamped_to_the_context(
        client: TestClient, engine: StubEngine) -> None:
    resp = await client.post(CHAT, json={"messages": OK_CHAT})
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"],
                                 "refusal": None}
    prompt_len = len("<user>hi<assistant>")
    assert engine.params[0].max_tokens == ServerOptions().default_max_tokens
    assert body["usage"] == {"prompt_tokens": prompt_len,
                             "completion_tokens": CONTEXT - prompt_len, "total_tokens": CONTEXT,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice["finish_reason"] == "length"


async def test_default_max_tokens_and_its_cap_are_the_servers(engine: StubEngine) -> None:
    options = ServerOptions(default_max_tokens=5, max_tokens_limit=20)
    async with TestClient(TestServer(create_app(engine, options=options))) as client:
        body = await (await client.post(CHAT, json={"messages": OK_CHAT})).json()
        assert body["usage"]["completion_tokens"] == 5
        resp = await client.post(CHAT, json={"messages": OK_CHAT, "max_tokens": 21})
        assert resp.status == 400
        error = assert_error_shape(await resp.json())
        assert error["param"] == "max_tokens" and "20" in error["message"]
        resp = await client.post(C, json={"prompt": "hi", "max_tokens": 20})
        assert resp.status == 200


async def test_max_completion_tokens_wins_over_max_tokens(client: TestClient,
                                                          engine: StubEngine) -> None:
    await client.post(CHAT, json={"messages": OK_CHAT, "max_tokens": 9,
                                  "max_completion_tokens": 2})
    assert engine.params[0].max_tokens == 2


def minimal_body(path: str) -> dict[str, Any]:
    return {"prompt": "hi"} if path == C else {"messages": OK_CHAT}


# Values of tool_choice that are none OpenAI defines, or that ask for a call of a tool the
# body does not offer.
TOOL_CHOICES_REFUSED = ["required", {"type": "function", "function": {"name": "get_weather"}},
                        {"type": "none"}, "None", "AUTO", "", True, 0, [], {}]


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES_REFUSED)
async def test_tool_choice_without_its_tool_is_a_400_naming_it(
        client: TestClient, engine: StubEngine, tool_choice: Any) -> None:
    # Alone, beside an empty tool list, and on a stream: refused before anything runs.
    for extra in ({}, {"tools": []}, {"stream": True}):
        resp = await client.post(CHAT, json={**minimal_body(CHAT), **extra,
                                             "tool_choice": tool_choice})
        assert resp.status == 400
        assert resp.content_type == "application/json"
        error = assert_error_shape(await resp.json())
        assert error["param"] == "tool_choice"
        assert error["type"] == "invalid_request_error"
        assert "tool_choice" in error["message"]
    assert not engine.prompts, "a refused request never reaches the engine"


async def test_tools_without_a_tool_call_parser_are_a_400_naming_the_flag(
        client: TestClient, engine: StubEngine) -> None:
    tool = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (None, "auto", "required"):
        resp = await client.post(CHAT, json={**minimal_body(CHAT), "tools": [tool],
                                             "tool_choice": choice})
        assert resp.status == 400
        error = assert_error_shape(await resp.json())
        assert error["param"] == "tools" and "--tool-call-parser" in error["message"]
    assert not engine.prompts


@pytest.mark.parametrize("path", [C, CHAT])
async def test_tool_choice_unset_none_or_auto_is_plain_generation(
        client: TestClient, engine: StubEngine, path: str) -> None:
    defaults: list[dict[str, Any]] = [{}, {"tool_choice": None}, {"tool_choice": "none"},
                                      {"tool_choice": "auto"},
                                      {"tools": [], "tool_choice": "auto"}]
    texts = []
    for extra in defaults:
        resp = await client.post(path, json={**minimal_body(path), **extra, "max_tokens": 3})
        assert resp.status == 200
        [choice] = (await resp.json())["choices"]
        texts.append(choice.get("text", choice.get("message", {}).get("content")))
    assert texts == ["abc"] * len(defaults)
    assert engine.params == [engine.params[0]] * len(defaults)
    assert engine.prompts == [engine.prompts[0]] * len(defaults)


async def test_completion_stream_is_sse_ending_in_done(client: TestClient) -> None:
    resp = await client.post(C, json={"prompt": "hello", "max_tokens": 3, "stream": True})
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


async def test_chat_stream_starts_with_the_role_and_ends_with_usage(client: TestClient) -> None:
    resp = await client.post(CHAT, json={"messages": OK_CHAT, "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True}})
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    *chunks, last = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
    assert last["choices"] == []
    prompt_len = len("<user>hi<assistant>")
    assert last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3,
                             "total_tokens": prompt_len + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_native_generate_with_text_and_ids(client: TestClient) -> None:
    resp = await client.post(GEN, json={"prompt": "hey", "sampling_params": {"max_tokens": 2}})
    assert await resp.json() == {"text": "ab", "token_ids": [97, 98], "finish_reason": "length",
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                           "total_tokens": 5,
                                           "prompt_tokens_details": {"cached_tokens": 0}}}
    resp = await client.post(GEN, json={"input_ids": [1, 2], "stream": True,
                                        "sampling_params": {"max_tokens": 2}})
    assert resp.content_type == "application/x-ndjson"
    lines = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert [line["token_ids"] for line in lines] == [[97], [98]]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"]["total_tokens"] == 4


async def test_api_key_guards_v1_generate_and_the_cache_routes_not_health_or_metrics(
        engine: StubEngine) -> None:
    async with TestClient(TestServer(create_app(engine, api_key="sk-good"))) as client:
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}):
            for method, path in (("POST", C), ("POST", GEN), ("GET", "/v1/models"),
                                 ("POST", "/flush_cache"), ("GET", "/health_generate")):
                resp = await client.request(method, path, json={"prompt": "hi"},
                                            headers=headers)
                assert resp.status == 401
                assert assert_error_shape(await resp.json())["code"] == "invalid_api_key"
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
        resp = await client.post(C, json={"prompt": "hi"},
                                 headers={"Authorization": "Bearer sk-good"})
        assert resp.status == 200


async def test_models_lists_the_served_name(engine: StubEngine) -> None:
    app = create_app(engine, served_model_name="alias")
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["alias"]
        assert body["data"][0]["max_model_len"] == CONTEXT
        assert (await client.get("/v1/models/alias")).status == 200
        assert (await client.get("/v1/models/stub-model")).status == 404
        assert (await client.post(C, json={"prompt": "hi", "model": "alias"})).status == 200
        assert (await client.post(C, json={"prompt": "hi", "model": "stub-model"})).status == 404


async def test_health(client: TestClient) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}


async def test_metrics_exposes_outcomes_tokens_latencies_and_engine_state(
        client: TestClient) -> None:
    await client.post(C, json={"prompt": "hello", "max_tokens": 3})
    await client.post(C, json={"prompt": "hi", "n": 17})
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    for line in ('asyncinfer_requests_total{outcome="length"} 1.0',
                 'asyncinfer_requests_total{outcome="rejected"} 1.0',
                 "asyncinfer_prompt_tokens_total 5.0",
                 "asyncinfer_generation_tokens_total 3.0",
                 "asyncinfer_time_to_first_token_seconds_count 1.0",
                 "asyncinfer_time_per_output_token_seconds_count 1.0",
                 "asyncinfer_e2e_request_latency_seconds_count 1.0",
                 "asyncinfer_requests_waiting 1.0", "asyncinfer_requests_running 2.0",
                 "asyncinfer_kv_pages_used 3.0", "asyncinfer_kv_pages_total 40.0",
                 'asyncinfer_batches_total{phase="prefill"} 5.0',
                 'asyncinfer_batches_total{phase="decode"} 6.0',
                 'asyncinfer_batches_total{phase="mixed"} 4.0',
                 "asyncinfer_prefix_cache_queries_total 7.0",
                 "asyncinfer_prefix_cache_hits_total 2.0",
                 "asyncinfer_prefix_cache_query_tokens_total 90.0",
                 "asyncinfer_prefix_cache_hit_tokens_total 32.0",
                 "asyncinfer_engine_rounds_total 12.0",
                 "asyncinfer_engine_round_host_seconds_total 0.25",
                 "asyncinfer_engine_round_wait_seconds_total 0.75",
                 "asyncinfer_engine_device_busy_seconds_total 0.5"):
        assert line in text


async def test_metrics_are_also_under_vllms_names_with_the_model_name(
        client: TestClient) -> None:
    """What gateways scrape from servers they know as vLLM: the same values as ours,
    labelled with the served model's name, read with Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from asyncinfer.server.metrics import VLLM_NAMES

    await client.post(C, json={"prompt": "hello", "max_tokens": 3})
    text = await (await client.get("/metrics")).text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    families = {f.name for f in text_string_to_metric_families(text)}
    assert set(VLLM_NAMES) <= families
    model = (("model_name", "stub-model"),)

    def ours(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return samples[(f"asyncinfer_{name}", labels)]

    def theirs(name: str, extra: tuple[tuple[str, str], ...] = ()) -> float:
        return samples[(f"vllm:{name}", tuple(sorted(model + extra)))]

    assert theirs("num_requests_running") == ours("requests_running") == 2
    assert theirs("num_requests_waiting") == ours("requests_waiting") == 1
    assert theirs("kv_cache_usage_perc") == ours("kv_pages_used") / ours("kv_pages_total")
    assert theirs("gpu_cache_usage_perc") == theirs("kv_cache_usage_perc")
    assert theirs("cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "40"))) == 1
    assert theirs("prefix_cache_queries_total") == ours("prefix_cache_query_tokens_total")
    assert theirs("prefix_cache_hits_total") == ours("prefix_cache_hit_tokens_total")
    assert theirs("prompt_tokens_total") == ours("prompt_tokens_total") == 5
    assert theirs("generation_tokens_total") == ours("generation_tokens_total") == 3
    assert theirs("request_success_total", (("finished_reason", "length"),)) == ours(
        "requests_total", (("outcome", "length"),)) == 1
    assert theirs("request_success_total", (("finished_reason", "stop"),)) == 0
    assert samples[("vllm:lora_requests_info", (("max_lora", "0"), ("running_lora_adapters", ""),
                                                ("waiting_lora_adapters", "")))] > 0
    assert theirs("time_to_first_token_seconds_count") == 1
    assert theirs("e2e_request_latency_seconds_count") == 1


class NoCancelServer(TestServer):
    """aiohttp's default outside tests: a disconnect does not cancel the handler."""

    async def _make_runner(self, **kwargs: Any) -> Any:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("server_class", [TestServer, NoCancelServer])
@pytest.mark.parametrize("path", [C, GEN])
async def test_disconnect_mid_stream_aborts_the_request(server_class: type[TestServer],
                                                        path: str) -> None:
    engine = StubEngine(token_delay=0.02)
    app = create_app(engine)
    async with TestClient(server_class(app)) as client:
        resp = await client.post(path, json={"prompt": "hi", "max_tokens": 50, "stream": True})
        assert resp.status == 200
        await resp.content.readline()  # the first token arrived
        resp.close()
        await wait_for(lambda: engine.aborted == [0])
        await wait_for(lambda: 'outcome="cancelled"} 1.0' in app[METRICS].render().decode())


async def test_disconnect_while_waiting_for_a_whole_response_aborts_it() -> None:
    engine = StubEngine(token_delay=0.05)
    async with TestClient(TestServer(create_app(engine))) as client:
        request = asyncio.ensure_future(client.post(C, json={"prompt": "hi", "max_tokens": 50}))
        await asyncio.wait_for(engine.started.wait(), 5)
        request.cancel()
        await wait_for(lambda: engine.aborted == [0])


async def test_official_openai_client(engine: StubEngine) -> None:
    openai = pytest.importorskip("openai")
    server = TestServer(create_app(engine, api_key="sk-test"), host="127.0.0.1")
    async with server:
        api = openai.AsyncOpenAI(api_key="sk-test", base_url=str(server.make_url("/v1")),
                                 max_retries=0)
        done = await api.completions.create(model="stub-model", prompt="hello", max_tokens=4,
                                            temperature=0)
        assert done.choices[0].text == "abcd" and done.usage.total_tokens == 9
        stream = await api.chat.completions.create(
            model="stub-model", messages=OK_CHAT, max_tokens=3, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abc"
        assert chunks[-1].usage.completion_tokens == 3
        assert [m.id for m in (await api.models.list()).data] == ["stub-model"]
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await api.completions.create(model="stub-model", prompt="hi", temperature=-1)
        bad_key = openai.AsyncOpenAI(api_key="sk-wrong", base_url=str(server.make_url("/v1")),
                                     max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad_key.models.list()
        await api.close()
        await bad_key.close()


def test_serve_flags_become_engine_options() -> None:
    import argparse

    from asyncinfer.options import engine_options
    from asyncinfer.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--policy", "skip_ahead", "--policy-opt", "aging=0.5",
                              "--port", "9000", "--page-size", "8", "--no-chunked-prefill",
                              "--cache-type", "naive", "--no-overlap"])
    assert (args.policy, args.policy_options, args.port, args.overlap) == (
        "skip_ahead", ["aging=0.5"], 9000, False)
    # Only the flags given become options: the engine's defaults apply to the rest.
    assert engine_options(args) == {"page_size": 8, "cache_type": "naive",
                                    "chunked_prefill": False, "policy": "skip_ahead",
                                    "policy_options": {"aging": 0.5}, "overlap": False}
    gpu = parser.parse_args(["serve", "--device", "cuda", "--attention-backend", "flashinfer",
                             "--gpu-memory-utilization", "0.5", "--no-cuda-graph",
                             "--cuda-graph-max-bs", "32", "--no-torch-compile"])
    assert engine_options(gpu) == {"device": "cuda", "attention_backend": "flashinfer",
                                   "gpu_memory_utilization": 0.5, "cuda_graph": False,
                                   "cuda_graph_max_bs": 32, "torch_compile": False}
    assert engine_options(parser.parse_args(["serve", "--host", "0.0.0.0"])) == {}


# ---- the real engine behind the app (tests/conftest.py: engine_under_test) --------------------


def real_engine(**options: Any) -> Any:
    from asyncinfer.api import AsyncEngine

    model, target = engine_under_test()
    defaults: dict[str, Any] = {**target, "max_running_requests": 4,
                                "max_seq_len": 128, "cache_type": "naive", "kv_cache_gb": 0.25}
    return AsyncEngine(model, **{**defaults, **options})


async def test_real_engine_streamed_and_whole_completions_agree(served_model: Any) -> None:
    async with real_engine() as engine, TestClient(TestServer(create_app(engine))) as client:
        request = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        whole = await (await client.post(C, json=request)).json()
        resp = await client.post(C, json={**request, "stream": True,
                                          "stream_options": {"include_usage": True}})
        events = sse_events(await resp.text())
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == (
            whole["choices"][0]["text"])
        assert chunks[-1]["usage"] == whole["usage"]
        assert whole["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(request["prompt"]))
        if engine_under_test()[0] is None:  # the embedded SmolLM2 knows this one
            assert "Paris" in whole["choices"][0]["text"]


async def test_real_engine_refuses_a_prompt_longer_than_the_context(served_model: Any) -> None:
    async with real_engine() as engine, TestClient(TestServer(create_app(engine))) as client:
        for stream in (False, True):
            resp = await client.post(C, json={"prompt": "word " * 200, "stream": stream})
            assert resp.status == 400
            message = assert_error_shape(await resp.json())["message"]
            assert "128" in message and str(len(engine.tokenizer.encode("word " * 200))) in (
                message)
        resp = await client.post(CHAT, json={"messages": OK_CHAT, "max_tokens": 4})
        assert resp.status == 200


async def test_real_engine_frees_a_request_whose_client_went_away(served_model: Any) -> None:
    async with real_engine() as engine:
        app = create_app(engine)
        async with TestClient(NoCancelServer(app)) as client:
            resp = await client.post(C, json={"prompt": "Count: 1, 2,", "max_tokens": 100,
                                              "stream": True, "ignore_eos": True})
            await resp.content.readline()
            resp.close()
            # Freed: no slot and (once the batch in flight lands) no page.
            await wait_for(lambda: (engine.stats().running, engine.stats().kv_pages_used) == (
                0, 0), timeout=30)
            metrics = (await (await client.get("/metrics")).text())
            assert 'asyncinfer_requests_total{outcome="cancelled"} 1.0' in metrics
            assert "\nasyncinfer_requests_running 0.0" in metrics
            assert "\nasyncinfer_kv_pages_used 0.0" in metrics
