"""The progress meter of ``LLM.generate``: output tokens counted as they are delivered.
See docs/architecture.md, "The token meter"."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncinfer.core import Event
from asyncinfer.outputs import Channel, Front
from asyncinfer.params import SamplingParams


class TokenMeter:
    """The output tokens of one ``LLM.generate`` call, shown on its bar as ``out=N tok,
    R tok/s`` at most once per ``bar.mininterval``; a token costs one addition."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.tokens = 0
        self.start = self.shown = time.perf_counter()
        self.interval = float(bar.mininterval)
        self.checking = False
        self._loop = asyncio.get_running_loop()

    @staticmethod
    def label(tokens: int, elapsed: float) -> str:
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return f"out={tokens} tok, {rate:.1f} tok/s"

    def count(self) -> None:
        """One token delivered; the first of a round schedules one look at the clock."""
        self.tokens += 1
        if not self.checking:
            self.checking = True
            self._loop.call_soon(self._check)

    def _check(self) -> None:
        self.checking = False
        now = time.perf_counter()
        if now - self.shown >= self.interval:
            self.shown = now
            self.bar.set_postfix_str(self.label(self.tokens, now - self.start))

    def relabel(self) -> None:
        """Bring the label up to date without printing (the bar prints when it is due)."""
        self.bar.set_postfix_str(
            self.label(self.tokens, time.perf_counter() - self.start), refresh=False)

    def finish(self, tokens: int) -> None:
        """The final label, from the outputs' own counts."""
        self.tokens = tokens
        self.relabel()


class MeteredChannel:
    """A request's channel that counts its tokens on ``meter`` and passes every event on."""

    __slots__ = ("channel", "meter")

    def __init__(self, channel: Channel, meter: TokenMeter) -> None:
        self.channel = channel
        self.meter = meter

    def put_nowait(self, event: Event) -> None:
        if event.token is not None:
            self.meter.count()
        self.channel.put_nowait(event)


class MeteredFront(Front):
    """``front``'s requests, their tokens counted on ``meter`` on the way to their reader."""

    def __init__(self, front: Front, meter: TokenMeter) -> None:
        self.front, self.meter = front, meter
        self.tokenizer = front.tokenizer

    def new_uid(self) -> int:
        return self.front.new_uid()

    def check_open(self) -> None:
        self.front.check_open()

    def submit(self, uid: int, prompt_ids: list[int], params: SamplingParams,
               channel: Channel) -> None:
        self.front.submit(uid, prompt_ids, params, MeteredChannel(channel, self.meter))

    def abort(self, uid: int) -> None:
        self.front.abort(uid)
