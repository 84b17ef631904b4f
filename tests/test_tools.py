"""Tool calling: the parsers alone (whole and cut anywhere), the request fields' refusals,
and a served SmolLM2 driven by the openai SDK and LangChain: forced calls valid by
construction, streamed as OpenAI streams them, and a tool round-trip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.server.tool_parsers import ToolParser, parser
from tests.test_server_process import NAME, served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                            "maxLength": 12}},
                   "required": ["zone"]}}}
HERMES = parser("hermes", frozenset({"get_weather", "get_time"}))
LLAMA = parser("llama3_json", frozenset({"get_weather", "get_time"}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _streamed(tools: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = tools.stream()
    content, calls = "", []
    for piece in pieces:
        text, made = stream.push(piece)
        content, calls = content + text, calls + made
    text, made = stream.finish()
    return content + text, [(c.name, c.arguments) for c in calls + made]


# ---- the parsers alone --------------------------------------------------------------------

@pytest.mark.parametrize(("tools", "text", "content", "calls"), [
    (HERMES, CALL, None, [("get_weather", '{"city": "Paris"}')]),
    (HERMES, "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), "Let me look.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    # Not a call to an offered tool, or not JSON: the text stays content.
    (HERMES, CALL.replace("get_weather", "rm_rf"), CALL.replace("get_weather", "rm_rf"), []),
    (HERMES, "<tool_call>\n{oops\n</tool_call>", "<tool_call>\n{oops\n</tool_call>", []),
    # A block the output did not close is a call if its JSON is whole.
    (HERMES, CALL.removesuffix("\n</tool_call>"), None, [("get_weather", '{"city": "Paris"}')]),
    (LLAMA, '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
     [("get_time", '{"zone": "UTC"}')]),
    (LLAMA, '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
            '"parameters": {"city": "Rome"}}', None,
     [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Rome"}')]),
    (LLAMA, '{"answer": 4}', '{"answer": 4}', []),
    (LLAMA, "It is 4.", "It is 4.", []),
])
def test_parser_splits_content_from_calls(tools: ToolParser, text: str, content: str | None,
                                          calls: list[tuple[str, str]]) -> None:
    parsed = tools.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    single = parser("hermes", frozenset({"get_weather"}), single=True)
    parsed = single.parse(CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert [json.loads(c.arguments)["city"] for c in parsed.calls] == ["Paris"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([
    (HERMES, "Sure.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n"),
    (HERMES, "text with < and <tool and </tool_call> " + CALL),
    (LLAMA, ' {"name": "get_time", "parameters": {"zone": "UTC"}}'),
    (LLAMA, "plain words {not a call}"),
]), st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_cut_anywhere_gives_the_whole_result(case: tuple[ToolParser, str],
                                                      cuts: list[int]) -> None:
    tools, text = case
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    whole = tools.parse(text)
    content, calls = _streamed(tools, pieces)
    assert (content or None if whole.calls else content) == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.calls]


# ---- through a served SmolLM2 and the openai SDK ------------------------------------------


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[str]:
    with served(served_model, "--tool-call-parser", "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def _valid(call: Any) -> dict[str, Any]:
    jsonschema = pytest.importorskip("jsonschema")
    arguments = json.loads(call.function.arguments)
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(arguments, schema["function"]["parameters"])
    return arguments


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_calls_are_valid_by_construction(client: Any, choice: Any) -> None:
    for seed in (1, 2, 3):
        reply = client.chat.completions.create(
            model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
            temperature=1.0, seed=seed, max_tokens=120)
        [one] = reply.choices
        assert one.finish_reason == "tool_calls"
        assert one.message.tool_calls, one.message
        for call in one.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _valid(call)
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
        if isinstance(choice, dict):
            assert len(one.message.tool_calls) == 1


@pytest.mark.slow
def test_streamed_calls_add_up_to_the_whole_reply(client: Any) -> None:
    asked = dict(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                 temperature=0.0, max_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**asked).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish, first_chunks = None, []
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or ():
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                if part.id is not None:
                    first_chunks.append(part)
                    entry["name"] = part.function.name
                entry["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.arguments for c in first_chunks] == [""]   # id and name first
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.slow
def test_a_tool_round_trip_answers_from_the_result(client: Any) -> None:
    first = client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.0,
        max_tokens=120, parallel_tool_calls=False).choices[0].message
    [call] = first.tool_calls
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER],
                                            temperature=0.0, max_tokens=24)
    [one] = answer.choices
    assert one.finish_reason in ("stop", "length") and one.message.content
    # The call and its result reached the prompt: the prompt grew by both.
    alone = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                           max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server: str, extra: dict[str, Any],
                                                    param: str) -> None:
    import urllib.error
    import urllib.request

    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 4, **extra}
    request = urllib.request.Request(f"{server}/v1/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    # The engine compiles the grammar: its refusal names the field in the message.
    assert error["param"] == param or error["message"].startswith(param), error
    with urllib.request.urlopen(f"{server}/health", timeout=10) as health:
        assert health.status == 200


@pytest.mark.slow
def test_langchain_binds_tools_and_structures_output(server: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    chat = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused",
                                       model=NAME, temperature=0, max_tokens=120)
    ask = "What is the weather in Paris? Use the tool."
    called = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(ask)
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city", "unit"}

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)

    person = chat.with_structured_output(Person).invoke("Make up a person.")
    assert isinstance(person, Person)
