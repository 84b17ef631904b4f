"""The chat request's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``),
checked as the other fields are, and what they make of the request: the tools handed to the
chat template (or, for a template that renders none, written into the chat in the parser's
format), the parser of the output, and for ``required`` or a named function a grammar
(an xgrammar structural tag) that admits only calls to the tools, valid by construction.
See docs/architecture.md, "Tool calling"."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from attrs import frozen
from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from asyncinfer.params import MAX_GRAMMAR_CHARS
from asyncinfer.server.errors import bad_request
from asyncinfer.server.fields import Strict as _Strict
from asyncinfer.server.tool_parsers import ToolParser, parser

MAX_TOOLS = 128     # as OpenAI allows
_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
_CHOICES = ("none", "auto", "required")
# A function that declares no parameters takes none (OpenAI's reading of a missing schema).
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(_Strict):
    """A tool's function: its name, what it does, and its parameters' JSON schema."""

    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolFields(_Strict):
    """The tool fields of ``ChatCompletionRequest`` (a base of it)."""

    # Left out of the OpenAPI document, as the constraint fields: whether a body with tools
    # is served depends on --tool-call-parser, and their schemas on compiling.
    tools: SkipJsonSchema[Annotated[list[Tool] | None, Field(max_length=MAX_TOOLS)]] = None
    tool_choice: SkipJsonSchema[Any] = None
    parallel_tool_calls: SkipJsonSchema[bool | None] = None

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if value is None or value in _CHOICES:
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (isinstance(value, dict) and value.get("type") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)):
            return {"type": "function", "function": {"name": function["name"]}}
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": …}}')

    @model_validator(mode="after")
    def _tools_named(self) -> ToolFields:
        names = [tool.function.name for tool in self.tools or ()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise bad_request(f"tools: the function {twice!r} is listed twice", "tools")
        choice = self.tool_choice
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise bad_request(f"tool_choice names the function {choice['function']['name']!r}, "
                              f"which is not in tools", "tool_choice")
        if choice == "required" and not names:
            raise bad_request('tool_choice "required" needs at least one tool in tools',
                              "tool_choice")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto with tools, else none)."""
        if isinstance(self.tool_choice, dict):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as the chat template takes them (OpenAI's shape, unset keys left out)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]


@frozen
class ToolPlan:
    """What a chat request's tools make of it."""

    tools: list[dict[str, Any]]                 # for the template ([]: none)
    parser: ToolParser | None                   # None: the output is not parsed
    structured: tuple[str, str] | None = None   # the grammar of required or named


def plan(req: ToolFields, parser_name: str | None, *, reasoning: str | None = None
         ) -> ToolPlan:
    """The plan of ``req`` under ``--tool-call-parser parser_name``; ``reasoning``: the
    reasoning parser, whose block may come before forced calls."""
    mode, tools = req.tool_mode, req.tool_list()
    if mode == "none" or not tools:
        return ToolPlan(tools, None)
    if parser_name is None:
        raise bad_request(f"tool_choice {mode!r} needs a tool-call parser: this server was "
                          f"started without --tool-call-parser", "tools")
    offered = [t for t in tools if mode != "named"
               or t["function"]["name"] == req.tool_choice["function"]["name"]]
    single = mode == "named" or req.parallel_tool_calls is False
    read = parser(parser_name, frozenset(t["function"]["name"] for t in offered),
                  single=single)
    if mode == "auto":
        return ToolPlan(tools, read)
    grammar = json.dumps({"type": "structural_tag", "format": _calls_format(
        parser_name, offered, single, reasoning)})
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"tools: the grammar of their calls would take {len(grammar)} "
                          f"characters, more than {MAX_GRAMMAR_CHARS}", "tools")
    return ToolPlan(tools, read, ("structural_tag", grammar))


def _calls_format(parser_name: str, tools: list[dict[str, Any]], single: bool,
                  reasoning: str | None) -> dict[str, Any]:
    """One call or more (one if ``single``) to ``tools``, nothing else; a reasoning block
    first where the reasoning parser expects one."""
    if parser_name == "hermes":
        begin, end, separator = '<tool_call>\n{"name": "%s", "arguments": ', "}\n</tool_call>", "\n"
    else:
        begin, end, separator = '{"name": "%s", "parameters": ', "}", "; "
    tags = [{"type": "tag", "begin": begin % t["function"]["name"], "end": end,
             "content": {"type": "json_schema", "max_whitespace_cnt": 1,
                         "json_schema": t["function"].get("parameters") or _NO_PARAMETERS}}
            for t in tools]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": separator,
             "at_least_one": True, "stop_after_first": single}
    if reasoning is None:
        return calls
    think: dict[str, Any] = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "" if reasoning == "deepseek_r1" else "<think>",
         "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "const_string", "value": "\n\n"}]}
    if reasoning != "deepseek_r1":  # qwen3: the block is the model's to open
        think = {"type": "optional", "content": think}
    return {"type": "sequence", "elements": [think, calls]}


# ---- a template that renders no tools: the chat written in the parser's format ----------

def written(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
            parser_name: str | None) -> list[dict[str, Any]]:
    """``messages`` with the tools, the assistant's calls and the tools' results written as
    text in the format of ``parser_name``, for a chat template that renders none of them;
    without a parser, the calls and results as JSON text."""
    out = []
    hermes = parser_name != "llama3_json"
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if message.get("tool_calls"):
            calls = [_call_text(c["function"], hermes) for c in message["tool_calls"]]
            written_calls = ("\n" if hermes else "; ").join(calls)
            content = f"{content}\n{written_calls}" if content else written_calls
        elif role == "tool":
            role, content = "user", (f"<tool_response>\n{content}\n</tool_response>" if hermes
                                     else f"The tool's result: {content}")
        out.append({"role": role, "content": content})
    if tools and parser_name is not None:
        listing = _listing(tools, hermes)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _call_text(function: dict[str, Any], hermes: bool) -> str:
    arguments = function.get("arguments")
    call = {"name": function["name"], "arguments" if hermes else "parameters": arguments}
    text = json.dumps(call, ensure_ascii=False)
    return f"<tool_call>\n{text}\n</tool_call>" if hermes else text


def _listing(tools: list[dict[str, Any]], hermes: bool) -> str:
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if hermes:
        return ("# Tools\n\nYou may call one or more of these functions, described in JSON "
                f"within <tools></tools>:\n<tools>\n{specs}\n</tools>\n\nTo call one, write "
                "its name and arguments as a JSON object within <tool_call></tool_call> "
                'tags:\n<tool_call>\n{"name": <function name>, "arguments": <arguments '
                "object>}\n</tool_call>")
    return ("You may call these functions, described in JSON:\n" + specs + "\n\nTo call "
            'one, answer with only a JSON object {"name": <function name>, "parameters": '
            '<arguments object>}; separate several calls with "; ".')

