"""The OpenAPI 3.1 document of the routes, from the request models and the served limits."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from asyncinfer.server.protocol import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Limits,
)

_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}


def openapi_document(limits: Limits, model: str | None = None) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes, from the models above, the served limits and the served
    model's name."""
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    routes: dict[str, type[BaseModel]] = {
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
        "/generate": GenerateRequest}
    paths: dict[str, Any] = {}
    for path, request in routes.items():
        schema = request.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas[name] = _served(sub, limits, model)
        schemas[request.__name__] = _served(schema, limits, model)
        paths[path] = {"post": {
            "summary": (request.__doc__ or "").split("\n")[0],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request.__name__}"}}}},
            "responses": {
                "200": {"description": "the result, or a stream of chunks when stream is true"},
                **{str(s): {"description": d, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}}
                   for s, d in _ERROR_STATUSES.items()}}}}
    for path, summary in (("/v1/models", "the served model"), ("/health", "liveness"),
                          ("/metrics", "Prometheus metrics")):
        paths[path] = {"get": {"summary": summary, "responses": {
            "200": {"description": summary}, "503": {"description": "draining or down"}}}}
    return {"openapi": "3.1.0", "info": {"title": "asyncinfer", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}


_ERROR_STATUSES = {400: "a request the client can fix", 401: "a missing or wrong API key",
                   404: "an unknown model", 408: "the body was not sent in time",
                   413: "the body is too large", 500: "the engine failed the request",
                   503: "the server is full or shutting down"}


def _served(schema: dict[str, Any], limits: Limits, model: str | None) -> dict[str, Any]:
    """A model's schema with the served model's bounds filled in, so that what the schema
    allows is what the server accepts (token ids below the vocabulary, the served name)."""
    props = schema.get("properties", {})
    for name, bound in (("top_k", limits.vocab_size), ("max_tokens", limits.max_tokens_limit),
                        ("max_completion_tokens", limits.max_tokens_limit)):
        if name in props:
            for option in props[name].get("anyOf", [props[name]]):
                if option.get("type") == "integer":
                    option["maximum"] = bound
    for name in ("prompt", "input_ids"):
        if name in props:
            _bound_prompt(props[name], limits)
    for option in props.get("stop_token_ids", {}).get("anyOf", []):
        if option.get("type") == "array":
            option["items"]["maximum"] = limits.vocab_size - 1
    if "messages" in props and "top_logprobs" in props:  # chat: only with logprobs true
        schema["dependencies"] = {"top_logprobs": {
            "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
    for name, allowed in UNSUPPORTED.items():
        if name in props:
            props[name] = {"enum": list(allowed), "description": "not supported: unset or "
                                                                  "its default"}
    if "model" in props and model is not None:
        props["model"] = {"anyOf": [{"const": model}, {"type": "null"}]}
    return schema


def _bound_prompt(schema: dict[str, Any], limits: Limits) -> None:
    if schema.get("type") == "string":
        schema["maxLength"] = limits.max_prompt_chars
    if schema.get("type") == "integer":
        schema["maximum"] = limits.vocab_size - 1
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "integer":
        schema["maxItems"] = limits.context_len - 1
    for sub in [*schema.get("anyOf", []), schema.get("items", {})]:
        if isinstance(sub, dict) and sub:
            _bound_prompt(sub, limits)
