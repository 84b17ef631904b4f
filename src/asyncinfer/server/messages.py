"""A chat request's messages: text content, and the tool calls of an assistant's turn and
the results of a tool's, as OpenAI's clients send them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema

from asyncinfer.server.errors import bad_request
from asyncinfer.server.fields import Strict as _Strict


class TextPart(_Strict):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


_CONTENT_SCHEMA = WithJsonSchema({"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}}]})


class CalledFunction(_Strict):
    """The function an assistant's call named, with its arguments as JSON text."""

    name: str
    arguments: str


class MessageToolCall(_Strict):
    """One call of an assistant's ``tool_calls``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    """One chat turn; ``developer`` is read as ``system``. An assistant's turn may hold
    ``tool_calls`` (its content then may be null); a tool's turn answers one by
    ``tool_call_id``."""

    # Content is required but for the calls the document leaves out.
    model_config = ConfigDict(strict=True, extra="ignore",
                              json_schema_extra={"required": ["role", "content"]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Before content, which needs it; left out of the OpenAPI document (arguments must be
    # JSON, which a fuzzer's strings are not), with the null content it allows.
    tool_calls: SkipJsonSchema[list[MessageToolCall] | None] = None
    content: Annotated[str | list[TextPart] | None, _CONTENT_SCHEMA,
                       Field(validate_default=True)] = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _text_only(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of text parts (only text parts are "
                             "supported)") from None

    @field_validator("tool_calls")
    @classmethod
    def _assistants(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value and role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant's message, not a {role!r}'s")
        return value

    @field_validator("content")
    @classmethod
    def _given(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not info.data.get("tool_calls"):
            raise ValueError("is required (it may be null only in an assistant's message "
                             "with tool_calls)")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined; none: empty)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def characters(self) -> int:
        """The characters the message brings to the prompt."""
        calls = sum(len(c.function.name) + len(c.function.arguments)
                    for c in self.tool_calls or ())
        return len(self.text()) + calls + len(self.tool_call_id or "")

    def rendered(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it: role and content text, with the calls'
        arguments as objects (templates write them as JSON) and the tool's call id."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": call.id or f"call_{index}_{j}", "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _arguments(call.function.arguments,
                                                      f"messages[{index}].tool_calls[{j}]")}}
                for j, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            out["name"] = self.name
        return out


def _arguments(text: str, where: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object as text, got "
                          f"{text!r:.80}", f"{where}.function.arguments")
    return value
