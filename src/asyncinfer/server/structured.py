"""The request fields that constrain an output, as OpenAI and vLLM spell them, turned into
SamplingParams' ``structured`` (kind, text) and the field a client used (errors name it):

- ``response_format``: ``{"type": "json_schema", "json_schema": {"schema": …}}``,
  ``{"type": "json_object"}``, ``{"type": "text"}`` (no constraint);
- ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``;
- the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``."""

from __future__ import annotations

import json
from typing import Any

from asyncinfer.params import MAX_GRAMMAR_CHARS
from asyncinfer.server.errors import APIError, bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _text(value: Any, field_name: str, kind: str) -> str:
    """A schema or choice list as JSON text; a regex or grammar as itself."""
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise bad_request(f"{field_name} must be a non-empty string", field_name)
        text = value
    elif kind == "choice":
        if not (isinstance(value, list) and value
                and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"{field_name} must be a non-empty list of non-empty strings",
                              field_name)
        text = json.dumps(value)
    else:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{field_name} is not JSON: {exc}", field_name) from exc
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{field_name} must be a JSON schema (an object)", field_name)
        text = json.dumps(value)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{field_name} may be at most {MAX_GRAMMAR_CHARS} characters, got "
                          f"{len(text)}", field_name)
    return text


def _response_format(value: dict[str, Any]) -> tuple[str, str] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format")
        return ("json", _text(spec["schema"], "response_format.json_schema.schema", "json"))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got "
                      f"{kind!r:.40}", "response_format")


def constraint(body: Any) -> tuple[tuple[str, str], str] | None:
    """``((kind, text), field)`` of the one constraint ``body`` sets, None if it sets none;
    two of them, or one malformed: a 400 naming the field."""
    found: list[tuple[tuple[str, str] | None, str]] = []
    if body.response_format is not None:
        found.append((_response_format(body.response_format), "response_format"))
    if body.structured_outputs is not None:
        given = {k: v for k, v in body.structured_outputs.items() if v is not None}
        if len(given) != 1 or next(iter(given)) not in STRUCTURED_OUTPUTS:
            raise bad_request(f"structured_outputs must set exactly one of "
                              f"{', '.join(STRUCTURED_OUTPUTS)}", "structured_outputs")
        [(kind, value)] = given.items()
        name = f"structured_outputs.{kind}"
        text = "" if kind == "json_object" else _text(value, name, kind)
        found.append(((kind, text), name))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append(((kind, _text(value, name, kind)), name))
    wanted = [(spec, name) for spec, name in found if spec is not None]
    if len(wanted) > 1:
        names = " and ".join(name for _, name in wanted)
        raise APIError(400, f"{names} both constrain the output: set one",
                       param=wanted[1][1])
    if not wanted:
        return None
    spec, name = wanted[0]
    assert spec is not None
    return spec, name
