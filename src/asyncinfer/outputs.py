"""What a request gives back, and the channels that carry it from the engine to its reader.

``RequestOutput``, ``StreamDelta``, ``RequestMetrics`` and ``EngineStats`` are the public
results (re-exported by ``asyncinfer.api``). A request's events reach its reader through a
channel with ``put_nowait(event)``: a :class:`Collector` when only the end matters, a
:class:`TokenChannel` when the reader streams. :func:`stream_deltas` yields a request's text
deltas, with stop strings; :func:`complete` returns its output. The in-process engine and
the front that talks to an engine core in another process share them, so both stream and
finish requests the same way.

Torch-free: the HTTP front imports this without the model's machinery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from attrs import field, frozen

from asyncinfer.core import ErrorKind, Event, FinishReason
from asyncinfer.params import SamplingParams
from asyncinfer.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@frozen
class RequestMetrics:
    """Wall-clock times of one request (seconds, ``time.perf_counter``)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float


@frozen
class RequestOutput:
    """The result of one request.

    With ``finish_reason == "error"``, ``error`` says what happened and ``error_kind`` whose
    fault it is: "invalid", a request that can never run (its prompt does not fit the
    context, ...); "engine", a request the engine failed (its batch failed with it alone, or
    the engine shut down); "unavailable", the engine went away (its process died).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None = None
    cached_tokens: int = 0          # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None = None
    error_kind: ErrorKind | None = None


@frozen
class StreamDelta:
    """What one request produced since the last delta; the last one carries the output.

    A reader that falls behind gets everything produced meanwhile in one delta (several
    tokens), never a backlog of one delta per token."""

    text: str
    token_ids: list[int] = field(factory=list)
    finish_reason: FinishReason | None = None
    output: RequestOutput | None = None


@frozen
class EngineStats:
    """A snapshot for metrics and tests.

    The prefix-cache counts run from the start: one query per admitted request, a hit when
    it found at least one token cached, and the prompt tokens queried and found (all 0
    without a prefix cache). So do the engine loop's rounds and the seconds they spent on
    the host (scheduling, launching, processing, delivering) and awaiting the device, and
    the seconds the device was busy with batches (CUDA only; 0 elsewhere).
    """

    waiting: int
    running: int
    kv_pages_used: int
    kv_pages_total: int
    batches_prefill: int
    batches_decode: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    rounds: int = 0
    round_host_seconds: float = 0.0
    round_wait_seconds: float = 0.0
    device_busy_seconds: float = 0.0


class Channel(Protocol):
    """Where the engine puts one request's events, in order; the last one is finished."""

    def put_nowait(self, event: Event) -> None: ...


class Collector:
    """A channel read once, at the end: it gathers a request's tokens as they come and wakes
    its reader only when the request finishes (per-token wake-ups of hundreds of readers are
    what limits a large batch otherwise)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first_token_time: float | None = None
        self.done: asyncio.Future[Event] = asyncio.get_running_loop().create_future()

    def put_nowait(self, event: Event) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
            self.first_token_time = self.first_token_time or time.perf_counter()
        if event.finished and not self.done.done():
            self.done.set_result(event)


class TokenChannel:
    """A channel read in batches: :meth:`take` returns every token that arrived since the
    last read (and the last event, once it came), waking the reader at most once per batch
    of events however many tokens it carries."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self.last: Event | None = None
        self.first_token_time: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, event: Event) -> None:
        if self.last is not None:
            return
        if event.token is not None:
            self._tokens.append(event.token)
            self.first_token_time = self.first_token_time or time.perf_counter()
        if event.finished:
            self.last = event
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> tuple[list[int], Event | None]:
        """The tokens since the last call (waiting for at least one, or the end) and the
        last event if the request has finished."""
        while not self._tokens and self.last is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        tokens, self._tokens = self._tokens, []
        return tokens, self.last


async def stream_deltas(uid: int, prompt: Prompt, ids: list[int], params: SamplingParams,
                        tokenizer: Tokenizer | None, submit: Callable[[TokenChannel], None],
                        abort: Callable[[], None]) -> AsyncIterator[StreamDelta]:
    """The text deltas of request ``uid``; the last carries its output.

    The request is handed to the engine (``submit(channel)``) when the first delta is
    awaited, not before, so an iterator that is never read holds nothing. A stop string
    that matches calls ``abort`` (the engine may stop it), and so does a reader that stops
    listening before the end."""
    arrival = time.perf_counter()
    channel = TokenChannel()
    submit(channel)
    detok = tokenizer.detokenizer(params, ids) if tokenizer is not None else None
    tokens: list[int] = []
    done = False
    try:
        while not done:
            new, last = await channel.take()
            reason = last.finish_reason if last is not None else None
            text = ""
            if new:
                tokens += new
                if detok is not None:
                    text = detok.push(new)
                    if detok.stopped and reason is None:  # a stop string matched
                        abort()
                        reason = "stop"
            if reason is None:
                if text or new:
                    yield StreamDelta(text, new)
                continue
            done = True
            full = ""
            if detok is not None:
                text += detok.finish()
                full = detok.text
                reason = "stop" if detok.stopped else reason
            error, kind, cached = ((last.error, last.error_kind, last.prefix_len)
                                   if last is not None else (None, None, 0))
            output = RequestOutput(
                uid, prompt if isinstance(prompt, str) else None, ids, full, tokens, reason,
                error, cached,
                RequestMetrics(arrival, channel.first_token_time, time.perf_counter()), kind)
            yield StreamDelta(text, new, reason, output)
    finally:
        if not done:  # cancelled, or the consumer stopped listening
            abort()


async def complete(uid: int, prompt: Prompt, ids: list[int], params: SamplingParams,
                   tokenizer: Tokenizer | None, submit: Callable[[Channel], None],
                   abort: Callable[[], None]) -> RequestOutput:
    """Run request ``uid`` to the end and return its output. Without stop strings to watch
    nothing needs the tokens before the end, so the reader is woken once (a Collector)
    instead of once per token; with them, the stream is read. Cancelling the caller calls
    ``abort``."""
    if params.stop:
        output = None
        async for delta in stream_deltas(uid, prompt, ids, params, tokenizer, submit, abort):
            output = delta.output
        assert output is not None
        return output
    arrival = time.perf_counter()
    collector = Collector()
    submit(collector)
    try:
        last = await collector.done
    except asyncio.CancelledError:
        abort()
        raise
    assert last.finish_reason is not None
    text = ""
    if tokenizer is not None:
        detok = tokenizer.detokenizer(params, ids)
        detok.push(collector.tokens)
        detok.finish()
        text = detok.text
    return RequestOutput(
        uid, prompt if isinstance(prompt, str) else None, ids, text, collector.tokens,
        last.finish_reason, last.error, last.prefix_len,
        RequestMetrics(arrival, collector.first_token_time, time.perf_counter()),
        last.error_kind)
