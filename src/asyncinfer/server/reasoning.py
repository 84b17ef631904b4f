"""Reasoning parsers (``--reasoning-parser``): a chat output's ``<think>…</think>`` block
split off as ``reasoning_content``, the rest as ``content``, whole or delta by delta.

Pure text work, no tokenizer: the tags are matched in the detokenized text, so a tag the
tokenizer spells in several tokens, or that arrives split across deltas, is found alike.
See docs/architecture.md, "Reasoning parsers".
"""

from __future__ import annotations

from attrs import define, field, frozen

OPEN, CLOSE = "<think>", "</think>"

# Each parser: whether the output starts inside the block (the chat template opened it).
_STARTS_INSIDE = {"deepseek_r1": True, "qwen3": False}
PARSERS = tuple(sorted(_STARTS_INSIDE))


@frozen
class Split:
    """One text as reasoning (None: it has no reasoning block) and content."""

    reasoning: str | None
    content: str


@frozen
class ReasoningParser:
    """How a model marks its reasoning.

    ``starts_inside`` (deepseek_r1): the template opened ``<think>``, so everything before
    ``</think>`` is reasoning; an output that opens the block itself is taken too. Otherwise
    (qwen3) only an output that begins with ``<think>`` (after whitespace) has a block. A
    block never closed is reasoning to the end (a stream cannot take back what it sent as
    reasoning). ``thinking=False`` (the request's ``enable_thinking: false``): no block at
    all, everything is content. The text is kept as generated, whitespace included.
    """

    name: str
    starts_inside: bool
    thinking: bool = True

    def split(self, text: str) -> Split:
        """The whole output's reasoning and content."""
        if not self.thinking:
            return Split(None, text)
        head = text.lstrip()
        if head.startswith(OPEN):
            body = head[len(OPEN):]
        elif self.starts_inside:
            body = text
        else:
            return Split(None, text)
        reasoning, _, content = body.partition(CLOSE)
        return Split(reasoning, content)

    def stream(self) -> ReasoningStream:
        """A splitter for one streamed output."""
        return ReasoningStream(self)


def parser(name: str, *, thinking: bool = True) -> ReasoningParser:
    """The parser called ``name`` (one of :data:`PARSERS`)."""
    if name not in _STARTS_INSIDE:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return ReasoningParser(name, _STARTS_INSIDE[name], thinking)


@define
class ReasoningStream:
    """One output's text deltas as (reasoning, content) deltas; together they make what
    :meth:`ReasoningParser.split` makes of the whole text, however it was cut. Text that
    may be the start of a tag is held back until the next push or :meth:`finish`."""

    parser: ReasoningParser
    _state: str = field(default="start", init=False)  # start, reasoning or content
    _held: str = field(default="", init=False)

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` (the next delta) makes safe to send."""
        return self._feed(text, final=False)

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the output."""
        return self._feed("", final=True)

    def _feed(self, text: str, final: bool) -> tuple[str, str]:
        held, self._held = self._held + text, ""
        if self._state == "start":
            if not self.parser.thinking:
                self._state = "content"
            else:
                head = held.lstrip()
                if head.startswith(OPEN):
                    held, self._state = head[len(OPEN):], "reasoning"
                elif OPEN.startswith(head) and not final:  # may still become <think>
                    self._held = held
                    return "", ""
                else:
                    self._state = "reasoning" if self.parser.starts_inside else "content"
        reasoning = ""
        if self._state == "reasoning":
            before, tag, after = held.partition(CLOSE)
            if not tag:
                keep = 0 if final else partial_tag(held, CLOSE)
                self._held = held[len(held) - keep:]
                return held[:len(held) - keep], ""
            reasoning, held, self._state = before, after, "content"
        return reasoning, held


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
