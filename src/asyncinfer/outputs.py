"""What a request gives back, the channels that carry its events, and :class:`Front`,
the one request entry every front (in-process, offline, over ZeroMQ) shares. Torch-free."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Generic, Protocol, TypeVar

from attrs import evolve, field, frozen

from asyncinfer.core import ErrorKind, Event, FinishReason, TokenLogprob
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams, choice_seed
from asyncinfer.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@frozen
class RequestMetrics:
    """Wall-clock times of one request (seconds, ``time.perf_counter``)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float


@frozen
class CompletionOutput:
    """One returned choice of a request: ``index`` is its place among the ``n`` returned."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@frozen
class RequestOutput:
    """The result of one request; with finish_reason "error", ``error`` says what and
    ``error_kind`` whose fault (see ``core.ErrorKind``). ``logprobs``: one per output token
    when ``params.logprobs`` is set; ``prompt_logprobs``: one per prompt token (the first
    None) when ``params.prompt_logprobs`` is set (see ``core.TokenLogprob``). ``outputs``
    holds every returned choice (``n`` of them); ``text``, ``token_ids``, ``finish_reason``
    and ``logprobs`` are choice 0's, and ``cached_tokens`` counts the prompt once, as choice
    0 found it."""

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
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    outputs: list[CompletionOutput] = field()

    @outputs.default
    def _one_choice(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                 self.logprobs, _cumulative(self.logprobs))]


@frozen
class StreamDelta:
    """What one request produced since the last delta; the last one carries the output.
    ``logprobs`` align with ``token_ids`` (when asked for); ``prompt_logprobs`` come once,
    in the delta of the first token (or the last, for a request that samples none)."""

    text: str
    token_ids: list[int] = field(factory=list)
    finish_reason: FinishReason | None = None
    output: RequestOutput | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0      # which choice it belongs to (``n`` > 1)


@frozen
class CacheFlush:
    """What a prefix-cache flush did: pages it gave back, and cached pages it left because
    running requests hold them."""

    freed_pages: int
    held_pages: int


@frozen
class EngineStats:
    """The engine's counters, all since its start (device seconds: CUDA only)."""

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
    batches_mixed: int = 0
    kv_event_batches: int = 0            # KV-cache event batches published
    kv_event_batches_dropped: int = 0    # turned away by the publisher's full queue


class Channel(Protocol):
    """Where the engine puts one request's events, in order; the last one is finished."""

    def put_nowait(self, event: Event) -> None: ...


class Collector:
    """A channel read once: it gathers the tokens and wakes its reader only at the end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.first_token_time: float | None = None
        self.done: asyncio.Future[Event] = asyncio.get_running_loop().create_future()

    def put_nowait(self, event: Event) -> None:
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = list(event.prompt_logprobs)
        if event.token is not None:
            self.tokens.append(event.token)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
            self.first_token_time = self.first_token_time or time.perf_counter()
        if event.finished and not self.done.done():
            self.done.set_result(event)


class TokenChannel:
    """A channel read in batches: :meth:`take` returns the tokens since the last read."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self.last: Event | None = None
        self.first_token_time: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, event: Event) -> None:
        if self.last is not None:
            return
        if event.prompt_logprobs is not None:
            self._prompt_logprobs = list(event.prompt_logprobs)
        if event.token is not None:
            self._tokens.append(event.token)
            if event.logprob is not None:
                self._logprobs.append(event.logprob)
            self.first_token_time = self.first_token_time or time.perf_counter()
        if event.finished:
            self.last = event
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> tuple[list[int], Event | None]:
        """The tokens since the last call (awaiting one, or the end), and the last event."""
        while not self._tokens and self.last is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        tokens, self._tokens = self._tokens, []
        return tokens, self.last

    def take_logprobs(self) -> tuple[list[TokenLogprob], list[TokenLogprob | None] | None]:
        """The logprobs of the tokens :meth:`take` just returned (called right after it),
        and the prompt's if they came meanwhile."""
        logprobs, self._logprobs = self._logprobs, []
        prompt, self._prompt_logprobs = self._prompt_logprobs, None
        return logprobs, prompt


@frozen
class _Request:
    uid: int
    prompt: Prompt
    ids: list[int]
    params: SamplingParams

    def output(self, text: str, tokens: list[int], last: Event | None, reason: FinishReason,
               arrival: float, first_token: float | None,
               logprobs: list[TokenLogprob] | None = None,
               prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        error, kind, cached = ((last.error, last.error_kind, last.prefix_len)
                               if last is not None else (None, None, 0))
        return RequestOutput(
            self.uid, self.prompt if isinstance(self.prompt, str) else None, self.ids, text,
            tokens, reason, error, cached,
            RequestMetrics(arrival, first_token, time.perf_counter()), kind,
            logprobs if self.params.logprobs is not None else None,
            prompt_logprobs if self.params.prompt_logprobs is not None else None)


class Front(ABC):
    """Where requests enter: ``generate`` and ``stream``, written once over a subclass's
    ``new_uid``, ``submit`` and ``abort``. Cancelling a reader aborts its request.

    Invariant: ``new_uid`` never returns a uid open in the engine behind this front."""

    tokenizer: Tokenizer | None

    @abstractmethod
    def new_uid(self) -> int: ...

    @abstractmethod
    def submit(self, uid: int, prompt_ids: list[int], params: SamplingParams,
               channel: Channel) -> None:
        """Queue a request; its events go to ``channel``, the last one finished."""

    @abstractmethod
    def abort(self, uid: int) -> None:
        """Stop a submitted request; its channel gets no more events."""

    def check_open(self) -> None:
        """Raise if this front takes no requests now (default: errors arrive as events)."""
        return

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text needs the tokenizer)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; this front has none")
        return self.tokenizer.encode(prompt)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None
                       ) -> RequestOutput:
        """Run one request to the end (woken once, unless stop strings or ``n`` > 1 choices
        need the stream)."""
        request = self._open(prompt, params)
        if request.params.stop or request.params.choices > 1:
            output = None
            async for delta in self._streamed(request):
                output = delta.output
            assert output is not None
            return output
        arrival = time.perf_counter()
        collector = Collector()
        self.submit(request.uid, request.ids, request.params, collector)
        try:
            last = await collector.done
        except asyncio.CancelledError:
            self.abort(request.uid)
            raise
        assert last.finish_reason is not None
        text = ""
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(request.params, request.ids)
            detok.push(_text_ids(collector.tokens, last, request.params))
            detok.finish()
            text = detok.text
        return request.output(text, collector.tokens, last, last.finish_reason, arrival,
                              collector.first_token_time, collector.logprobs,
                              collector.prompt_logprobs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None
               ) -> AsyncIterator[StreamDelta]:
        """Text deltas of one request as they come; the last carries the output. A reader
        that falls behind gets what came meanwhile in one delta. With ``n`` > 1 each delta
        names its choice (``index``); each choice's last delta has its finish reason, and
        the last of all the whole output."""
        request = self._open(prompt, params)
        if request.params.choices > request.params.n:
            raise InvalidRequestError(
                f"best_of ({request.params.best_of}) above n ({request.params.n}) cannot be "
                "streamed: the best choices are known only at the end", param="best_of")
        return self._streamed(request)

    def _streamed(self, request: _Request) -> AsyncIterator[StreamDelta]:
        return self._choices(request) if request.params.choices > 1 else self._deltas(request)

    def _open(self, prompt: Prompt, params: SamplingParams | None) -> _Request:
        self.check_open()
        params = params or SamplingParams()
        return _Request(self.new_uid(), prompt, self.encode(prompt), params)

    async def _deltas(self, request: _Request) -> AsyncIterator[StreamDelta]:
        """Submitted at the first await; a stop string or an early exit aborts it."""
        arrival = time.perf_counter()
        channel = TokenChannel()
        self.submit(request.uid, request.ids, request.params, channel)
        tokenizer = self.tokenizer
        detok = (tokenizer.detokenizer(request.params, request.ids)
                 if tokenizer is not None else None)
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob | None] | None = None
        asks = request.params.logprobs is not None
        done = False
        try:
            while not done:
                new, last = await channel.take()
                new_logprobs, prompt = channel.take_logprobs()
                logprobs += new_logprobs
                prompt_logprobs = prompt if prompt is not None else prompt_logprobs
                reason = last.finish_reason if last is not None else None
                text = ""
                if new:
                    tokens += new
                    if detok is not None:
                        text = detok.push(_text_ids(new, last, request.params))
                        if detok.stopped and reason is None:  # a stop string matched
                            self.abort(request.uid)
                            reason = "stop"
                if reason is None:
                    if text or new or prompt is not None:
                        yield StreamDelta(text, new, logprobs=new_logprobs if asks else None,
                                          prompt_logprobs=prompt)
                    continue
                done = True
                full = ""
                if detok is not None:
                    text += detok.finish()
                    full = detok.text
                    reason = "stop" if detok.stopped else reason
                yield StreamDelta(text, new, reason, request.output(
                    full, tokens, last, reason, arrival, channel.first_token_time, logprobs,
                    prompt_logprobs), new_logprobs if asks else None, prompt)
        finally:
            if not done:  # cancelled, or the consumer stopped listening
                self.abort(request.uid)

    async def _choices(self, request: _Request) -> AsyncIterator[StreamDelta]:
        """The choices of an ``n`` > 1 request: choice 0 alone until its prompt is prefilled
        (its first token), then the others, which find the prompt's pages in the prefix cache
        (see docs/architecture.md, 'Choices sharing the prompt'). Choice i samples with
        ``choice_seed(seed, i)``. Closing the iterator aborts every choice."""
        params = request.params
        count = params.choices
        merged: Merged[StreamDelta] = Merged()
        # Ranking best_of by cumulative logprob needs every sampled token's logprob.
        ranks = count > params.n and params.logprobs is None
        leader = params.replace(logprobs=0) if ranks else params

        def start(index: int) -> None:
            child = _Request(request.uid, request.prompt, request.ids, leader) if index == 0 \
                else _Request(self.new_uid(), request.prompt, request.ids, leader.replace(
                    n=1, best_of=None, prompt_logprobs=None,
                    seed=choice_seed(params.seed, index)))
            merged.add(self._deltas(child))

        finals: list[RequestOutput | None] = [None] * count
        try:
            start(0)
            while True:
                index, item = await merged.next()
                output = item.output
                if len(merged) == 1:  # choice 0's first delta: its prompt is in the cache
                    if (output is not None and not output.token_ids
                            and output.finish_reason in ("error", "abort")):  # refused
                        yield item
                        return
                    for i in range(1, count):
                        start(i)
                if output is None:
                    yield evolve(item, index=index)
                    continue
                finals[index] = output
                if output.finish_reason == "error":  # one choice failed: the request did
                    yield evolve(item, index=index, output=evolve(
                        output, request_id=request.uid, outputs=[_choice(0, output)]))
                    return
                done = all(f is not None for f in finals)
                whole = _combine(request, [f for f in finals if f is not None]) if done else None
                yield evolve(item, index=index, output=whole)
                if done:
                    return
        finally:
            await merged.close()


T = TypeVar("T")


class Merged(Generic[T]):
    """The items of several async iterators as they come, each with its iterator's place
    (in the order added); :meth:`close` closes them all (a request's stream: aborted)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[int, T | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, iterator: AsyncIterator[T]) -> None:
        self._tasks.append(asyncio.ensure_future(self._pump(len(self._tasks), iterator)))

    async def _pump(self, index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                self._queue.put_nowait((index, item))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def next(self) -> tuple[int, T]:
        """The next item and its iterator's place; an iterator's exception is raised."""
        index, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return index, item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _cumulative(logprobs: list[TokenLogprob] | None) -> float | None:
    return None if logprobs is None else sum(t.logprob for t in logprobs)


def _choice(index: int, output: RequestOutput, keep_logprobs: bool = True
            ) -> CompletionOutput:
    first = output.outputs[0]
    return CompletionOutput(index, output.text, output.token_ids, output.finish_reason,
                            first.logprobs if keep_logprobs else None,
                            first.cumulative_logprob)


def _combine(request: _Request, finals: list[RequestOutput]) -> RequestOutput:
    """One output of a request's choices: the ``n`` returned (of ``best_of``: those with
    the highest cumulative logprob), choice 0's fields on top, timed from choice 0's
    arrival to the last finish."""
    n, asked = request.params.n, request.params.logprobs is not None
    ranked = finals
    if len(finals) > n:  # best_of: the most likely n, most likely first (a stable sort)
        ranked = sorted(finals, key=lambda o: -(o.outputs[0].cumulative_logprob or 0.0))[:n]
    leader, top = finals[0], ranked[0]
    times = [o.metrics for o in finals if o.metrics is not None]
    metrics = leader.metrics
    if metrics is not None:
        metrics = RequestMetrics(metrics.arrival_time, metrics.first_token_time,
                                 max(m.finish_time for m in times))
    return evolve(top, request_id=request.uid, cached_tokens=leader.cached_tokens,
                  metrics=metrics, logprobs=top.logprobs if asked else None,
                  prompt_logprobs=leader.prompt_logprobs,
                  outputs=[_choice(j, o, asked) for j, o in enumerate(ranked)])


def _text_ids(tokens: list[int], last: Event | None, params: SamplingParams) -> list[int]:
    """The ids whose text is shown: a stop token id that ended the request is not (it stays
    in ``token_ids``), as EOS is skipped as a special token."""
    if (last is not None and last.finish_reason == "stop" and tokens
            and tokens[-1] in params.stop_token_ids):
        return tokens[:-1]
    return tokens
