"""Structured output on the embedded SmolLM2: JSON schemas, regexes, choices and grammars
hold at temperature 1 over several seeds, constrained rows leave the others' tokens alone,
and bad constraints are refused naming their field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.test_server_process import NAME

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

_NAME = {"type": "string", "maxLength": 12}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 999}

# Twenty schemas, from a bare type to nesting, bounded arrays, enums, anyOf and patterns.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "string", "maxLength": 16},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "array", "items": _SMALL, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {"type": "object", "properties": {"name": _NAME, "age": _SMALL},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME,
                                               "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                      "size": {"enum": [1, 2, 3]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
     "required": ["id"]},
    {"type": "object", "properties": {"value": {"anyOf": [_SMALL, _NAME]}},
     "required": ["value"]},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": _SMALL, "y": _SMALL}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"a": _SMALL, "b": _NAME}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                                "items": {"type": "object",
                                                          "properties": {"n": _SMALL},
                                                          "required": ["n"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"kind": {"const": "user"}, "name": _NAME},
     "required": ["kind", "name"]},
    {"type": "object", "properties": {"maybe": {"anyOf": [{"type": "null"}, _SMALL]}},
     "required": ["maybe"]},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^20[0-9]{2}-[01][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"outer": {"type": "object", "properties": {
        "inner": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["inner"]}}, "required": ["outer"]},
    {"type": "object", "properties": {"name": _NAME, "email": {
        "type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}, "admin": {
        "type": "boolean"}}, "required": ["name", "email", "admin"],
     "additionalProperties": False},
]
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> Iterator[LLM]:
    engine = LLM(str(smollm2_dir), dtype="float32", max_running_requests=32)
    yield engine
    engine.close()


def test_twenty_schemas_hold_at_temperature_one(llm: LLM) -> None:
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                             structured={"json": schema}) for schema, seed in cases]
    outputs = llm.generate(["Answer in JSON."] * len(cases), params, use_tqdm=False)
    for (schema, seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (schema, seed, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_grammar_hold(llm: LLM) -> None:
    grammar = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    specs = [("regex", r"[A-Z][a-z]{2,6} [0-9]{2}", re.compile(r"[A-Z][a-z]{2,6} [0-9]{2}")),
             ("choice", json.dumps(["yes", "no", "maybe"]), re.compile("yes|no|maybe")),
             ("grammar", grammar, re.compile(r"The answer is [0-9]{2}\."))]
    cases = [(spec, seed) for spec in specs for seed in SEEDS]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                             structured=(kind, text)) for (kind, text, _), seed in cases]
    outputs = llm.generate(["Say something."] * len(cases), params, use_tqdm=False)
    for ((kind, _, pattern), _seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop" and pattern.fullmatch(out.text), (kind, out.text)


def test_a_length_cut_says_length(llm: LLM) -> None:
    [out] = llm.generate(["List numbers."], SamplingParams(
        max_tokens=3, temperature=0.0, structured={"json": {"type": "array", "items": _SMALL,
                                                            "minItems": 50}}), use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(llm: LLM) -> None:
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3,"]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=7,
                                 structured={"json": SCHEMAS[6]})
    mixed = llm.generate([p for p in prompts for _ in range(2)],
                         [q for _ in prompts for q in (plain, constrained)], use_tqdm=False)
    assert [o.token_ids for o in mixed[::2]] == alone
    for out in mixed[1::2]:
        jsonschema.validate(json.loads(out.text), SCHEMAS[6])


def test_a_grammar_that_does_not_compile_fails_its_request_only(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, structured=("regex", "([a-z"))
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["x", "y"], [bad, good], use_tqdm=False)
    assert (outs[0].finish_reason, outs[0].error_kind) == ("error", "invalid")
    assert outs[0].error is not None and "does not compile" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def test_two_ranks_give_one_ranks_constrained_tokens(tiny_chat_llama_dir: Path) -> None:
    """Every rank masks its own copy of the logits with its own matchers: the ranks agree on
    every batch (checked each round) and give one rank's tokens."""
    prompts = ["Answer in JSON.", "Say something."]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=spec)
              for s in SEEDS for spec in ({"json": SCHEMAS[6]}, ("regex", "[a-z]{2,9}!"))]
    options = {"dtype": "float32", "max_seq_len": 256, "num_pages": 256, "page_size": 4}
    one = LLM(str(tiny_chat_llama_dir), **options)
    alone = [o.token_ids for o in one.generate(prompts * 3, params, use_tqdm=False)]
    one.close()
    two = LLM(str(tiny_chat_llama_dir), tensor_parallel_size=2, tp_guard_interval=1, **options)
    both = two.generate(prompts * 3, params, use_tqdm=False)
    two.close()
    assert [o.token_ids for o in both] == alone
    assert all(o.finish_reason in ("stop", "length") for o in both)


# Through a real server and the openai client.

@pytest.fixture(scope="module")
def server(plain_server: str) -> str:
    return plain_server


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def test_openai_parse_with_a_pydantic_model(client: Any) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**7)

    for seed in SEEDS:
        completion = client.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "Name a city as JSON."}],
            response_format=City, temperature=1.0, seed=seed, max_tokens=80)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vllm_fields_in_completions(client: Any, stream: bool) -> None:
    bodies = [({"structured_outputs": {"choice": ["alpha", "beta"]}}, re.compile("alpha|beta")),
              ({"guided_regex": "[0-9]{3}"}, re.compile("[0-9]{3}")),
              ({"response_format": {"type": "json_object"}}, None)]
    for extra, pattern in bodies:
        kwargs = {"model": NAME, "prompt": "Answer:", "max_tokens": 60, "temperature": 1.0,
                  "seed": 3, "extra_body": extra}
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        if pattern is None:
            assert isinstance(json.loads(text), dict)
        else:
            assert pattern.fullmatch(text), (extra, text)


def _post(server: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import requests

    response = requests.post(f"{server}/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **body}, timeout=120)
    return response.status_code, response.json()


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= " + '"a" ' * 300_000}},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}},
     "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
], ids=["bad-schema", "bad-type", "bad-regex", "1MB-grammar", "bad-grammar", "no-choices",
        "two-constraints"])
def test_bad_constraints_are_400s_naming_the_field(server: str, body: dict[str, Any],
                                                   field: str) -> None:
    status, answer = _post(server, body)
    assert status == 400, answer
    assert field in answer["error"]["message"] or answer["error"].get("param") == field
    status, _ = _post(server, {})
    assert status == 200
