"""The chat request's fields that drive its template: ``chat_template_kwargs`` (variables
for the template, such as Qwen3's ``enable_thinking``), ``add_generation_prompt`` and
``continue_final_message``, checked as the other fields are (a 400 naming the field)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from asyncinfer.server.errors import bad_request
from asyncinfer.tokenizer import TEMPLATE_NAMES

# The names a template variable may have, in the schema (the check takes any identifier).
_NAME = {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$", "not": {"enum": sorted(TEMPLATE_NAMES)}}
_TemplateKwargs = Annotated[
    dict[str, Any] | None,
    WithJsonSchema({"anyOf": [{"type": "object", "propertyNames": _NAME}, {"type": "null"}]}),
    Field(description="variables for the chat template, such as Qwen3's enable_thinking")]
MAX_DEPTH = 32  # of lists and mappings in the template variables (the top one included)
# Fields the request sets itself, not through template variables.
_OWN_FIELDS = ("messages", "tools", "documents", "add_generation_prompt",
               "continue_final_message")
# continue_final_message needs add_generation_prompt false (which it implies when unset).
_SCHEMA: dict[str, Any] = {
    "if": {"required": ["continue_final_message"],
           "properties": {"continue_final_message": {"const": True}}},
    "then": {"not": {"required": ["add_generation_prompt"],
                     "properties": {"add_generation_prompt": {"const": True}}}}}


class ChatTemplateFields(BaseModel):
    """The template fields of ``ChatCompletionRequest`` (a base of it, beside its messages)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_SCHEMA)
    if TYPE_CHECKING:  # the request's own field
        messages: list[Any]

    chat_template_kwargs: _TemplateKwargs = None
    add_generation_prompt: Annotated[bool | None, Field(
        description="open the assistant's turn after the messages (default true)")] = None
    continue_final_message: Annotated[bool | None, Field(
        description="continue the last message, the assistant's, instead of opening a "
                    "turn")] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if _depth(value) > MAX_DEPTH:
            raise bad_request(f"chat_template_kwargs: values nest deeper than {MAX_DEPTH} "
                              "levels", "chat_template_kwargs")
        for name in value or {}:
            if not name.isidentifier():
                raise bad_request(f"chat_template_kwargs: {name!r} is not a name a template "
                                  "can read", "chat_template_kwargs")
            if name in TEMPLATE_NAMES:
                own = f" (use the request's field {name})" if name in _OWN_FIELDS else ""
                raise bad_request(f"chat_template_kwargs: {name!r} is set by the server, "
                                  f"not by template variables{own}", "chat_template_kwargs")
        return value

    @model_validator(mode="after")
    def _continues(self) -> ChatTemplateFields:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true: the last message is continued, no new turn opened",
                              "continue_final_message")
        role = self.messages[-1].role
        if role != "assistant":
            raise bad_request(f"continue_final_message continues the assistant's last "
                              f"message, but the last message is the {role!r}'s",
                              "continue_final_message")
        return self

    def template_options(self) -> dict[str, Any]:
        """How the chat is rendered besides its messages (the keywords of the encoder's
        ``chat``); ``continue_final_message`` implies no generation prompt."""
        generation_prompt = self.add_generation_prompt
        if generation_prompt is None:
            generation_prompt = not self.continue_final_message
        return {"add_generation_prompt": generation_prompt,
                "continue_final_message": bool(self.continue_final_message),
                "template_kwargs": self.chat_template_kwargs or {}}

    @property
    def thinking(self) -> bool:
        """False when the request turned reasoning off (``enable_thinking: false``)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    def template_chars(self) -> int:
        """The characters of the template variables' strings (they join the prompt)."""
        return _characters(self.chat_template_kwargs)


def _depth(value: Any) -> int:
    """How deep lists and mappings nest in ``value`` (without recursion: any depth)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                 else item))
    return deepest


def _characters(value: Any) -> int:
    """The characters of the strings in ``value`` (nested lists and mappings, keys too)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_characters(k) + _characters(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_characters(v) for v in value)
    return 0
