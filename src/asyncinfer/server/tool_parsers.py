"""Tool-call parsers (``--tool-call-parser``): the calls a chat output makes, in the format
its model family writes them, taken out of the text as OpenAI's ``tool_calls``; whole or
delta by delta, with the same result however the text was cut.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": …, "arguments": {…}}\\n
  </tool_call>`` blocks, anywhere in the text; the text around them is the content.
- ``llama3_json`` (Llama 3.1 to 3.3): an output that is JSON, ``{"name": …, "parameters":
  {…}}``, several separated by ``;``; any other output is content.

A block that is not a call to one of the request's tools (bad JSON, an unknown name) stays
in the content, as the model wrote it. See docs/architecture.md, "Tool calling".
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from attrs import define, field, frozen

from asyncinfer.server.reasoning import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")


@frozen
class ToolCall:
    """One call: the function's name, its arguments as JSON text, and the call's id."""

    name: str
    arguments: str
    id: str = field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """The call as ``message.tool_calls[]``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@frozen
class Parsed:
    """One output as content (None: only calls, no text) and the calls it makes."""

    content: str | None
    calls: tuple[ToolCall, ...]


@frozen
class ToolParser:
    """How one request's output is read: the format, the names of the tools it offers, and
    whether it takes one call at most (``parallel_tool_calls: false`` keeps the first)."""

    name: str
    tools: frozenset[str]
    single: bool = False

    def parse(self, text: str) -> Parsed:
        """The whole output's content and calls."""
        stream = self.stream()
        content, calls = stream.push(text)
        more, last = stream.finish()
        content += more
        calls = calls + last
        return Parsed(content if content or not calls else None, tuple(calls))

    def stream(self) -> ToolStream:
        """A splitter for one streamed output."""
        return ToolStream(self)

    def call(self, text: str) -> ToolCall | None:
        """The call one block's JSON makes, or None if it is not a call to an offered tool."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if value["name"] not in self.tools or not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parser(name: str, tools: frozenset[str], *, single: bool = False) -> ToolParser:
    """The parser called ``name`` (one of :data:`PARSERS`) for a request offering ``tools``."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return ToolParser(name, tools, single)


@define
class ToolStream:
    """One output's text deltas as (content delta, new calls). Text that may begin a call
    is held back until it is known; so is trailing whitespace, which is dropped at the end
    of an output that made calls (the space between calls is not content)."""

    parser: ToolParser
    calls: list[ToolCall] = field(factory=list)
    _state: str = field(default="start", init=False)   # start, text, call or json
    _held: str = field(default="", init=False)
    _space: str = field(default="", init=False)

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls that ``text`` (the next delta) completes."""
        return self._feed(text, final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Whatever was held back, at the end of the output."""
        return self._feed("", final=True)

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        before = len(self.calls)
        held, self._held = self._held + text, ""
        if self.parser.name == "hermes":
            content = self._hermes(held, final)
        else:
            content = self._llama(held, final)
        return self._spaced(content, final), self.calls[before:]

    def _add(self, call: ToolCall | None) -> bool:
        if call is None:
            return False
        if not (self.parser.single and self.calls):
            self.calls.append(call)
        return True

    def _hermes(self, held: str, final: bool) -> str:
        content = ""
        while True:
            if self._state != "call":
                start = held.find(OPEN)
                if start < 0:
                    keep = 0 if final else partial_tag(held, OPEN)
                    self._held = held[len(held) - keep:]
                    return content + held[:len(held) - keep]
                content, held, self._state = content + held[:start], held[start + len(OPEN):], (
                    "call")
            end = held.find(CLOSE)
            if end < 0:
                if final:  # a block the output never closed: a call if it is whole
                    if not self._add(self.parser.call(held)):
                        content += OPEN + held
                    return content
                self._held = held
                return content
            block, held, self._state = held[:end], held[end + len(CLOSE):], "text"
            if not self._add(self.parser.call(block)):
                content += OPEN + block + CLOSE

    def _llama(self, held: str, final: bool) -> str:
        if self._state == "start":
            head = held.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._state = "json"
            elif not final and (not head or PYTHON_TAG.startswith(head)):
                self._held = held
                return ""
            else:
                self._state = "text"
        if self._state == "text":
            return held
        if not final:
            self._held = held
            return ""
        calls = _json_calls(held.lstrip().removeprefix(PYTHON_TAG), self.parser)
        if calls is None:
            return held
        for call in calls:
            self._add(call)
        return ""

    def _spaced(self, content: str, final: bool) -> str:
        """``content`` less its trailing whitespace, which waits for more text."""
        content = self._space + content
        kept = content.rstrip()
        self._space = content[len(kept):]
        if final:
            if not self.calls:
                kept += self._space
            self._space = ""
        return kept


def _json_calls(text: str, parser: ToolParser) -> list[ToolCall] | None:
    """The calls of ``;``-separated JSON objects, or None if ``text`` is anything else."""
    decoder, calls, at = json.JSONDecoder(), list[ToolCall](), 0
    while True:
        while at < len(text) and (text[at].isspace() or (text[at] == ";" and calls)):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = parser.call(json.dumps(value))
        if call is None:
            return None
        calls.append(call)
        at = end
