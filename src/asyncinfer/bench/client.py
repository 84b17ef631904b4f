"""The HTTP side of `asyncinfer bench serve`: one streamed completion read chunk by chunk,
sent on an open-loop schedule or from closed-loop workers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attrs import define, field, frozen

from asyncinfer.bench.latency import tbt_gaps
from asyncinfer.bench.plan import RequestSpec
from asyncinfer.errors import AsyncInferError

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)


@define
class RequestResult:
    """What the client saw of one request; ``sent`` from the run's start, the rest from
    ``sent``, all in seconds."""

    prompt_len: int
    output_len: int
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(factory=list)  # the gaps between text chunks (see latency)
    output_tokens: int = 0
    error: str | None = None
    hung_up: bool = False  # the client closed the connection mid-stream, as planned
    tenant: str | None = None
    priority: int | None = None
    long: bool = False
    elapsed: float | None = None  # until the client stopped reading, whatever the outcome

    @property
    def ok(self) -> bool:
        """Streamed to [DONE] with some text and no error (never true of a hang-up)."""
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a failure or a one-token output."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def chunks(self) -> int:
        """Text chunks read: the first (TTFT), then one per gap."""
        return 0 if self.ttft is None else 1 + len(self.itl)


class RequestFailed(Exception):
    """A request the server refused or broke off: a label to count by, and what it said."""

    def __init__(self, label: str, detail: str = "") -> None:
        super().__init__(label)
        self.label, self.detail = label, detail


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                  headers: dict[str, str], result: RequestResult,
                  hangup_after: int | None = None) -> None:
    arrivals: list[float] = []  # each text chunk's, from sending
    try:
        await _read(session, url, payload, headers, result, arrivals, hangup_after)
    finally:  # a timeout or a failure mid-stream keeps the chunks read until then
        result.ttft = arrivals[0] if arrivals else None
        result.itl = tbt_gaps(arrivals)


async def _read(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                headers: dict[str, str], result: RequestResult, arrivals: list[float],
                hangup_after: int | None) -> None:
    sent = time.perf_counter()
    usage_tokens = None
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status != 200:
            raise RequestFailed(f"HTTP {response.status}", (await response.text())[:500])
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other SSE fields
            now = time.perf_counter()
            data = line[5:].strip()
            if data == b"[DONE]":
                result.e2e = now - sent
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(f"error in stream: {chunk['error'].get('message')}")
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                usage_tokens = int(usage["completion_tokens"])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(now - sent)
                if len(arrivals) == hangup_after:
                    # Close the socket itself, not release it to the pool: the server must see
                    # the client go away with its stream unfinished.
                    response.close()
                    result.hung_up = True
                    return
    if result.e2e is None:
        raise RequestFailed("stream ended before [DONE]")
    if not arrivals:
        raise RequestFailed("no text in the stream")
    result.output_tokens = usage_tokens if usage_tokens is not None else len(arrivals)


@frozen
class _Client:
    session: aiohttp.ClientSession
    url: str
    model: str
    headers: dict[str, str]
    timeout: float
    start: float
    on_done: Callable[[], object]
    text: bool = False
    reported: set[str] = field(factory=set)

    async def send(self, spec: RequestSpec) -> RequestResult:
        """One streamed completion; every failure is recorded, none is raised."""
        prompt: str | list[int] = as_text(spec.prompt) if self.text else list(spec.prompt)
        payload: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": spec.output_len,
            "temperature": spec.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
        if spec.top_p != 1.0:
            payload["top_p"] = spec.top_p
        if spec.seed is not None:
            payload["seed"] = spec.seed
        headers = self.headers
        if spec.tenant is not None:
            payload["user"] = spec.tenant
            headers = {**headers, "X-Tenant": spec.tenant}
        if spec.priority is not None:
            payload["priority"] = spec.priority
        began = time.perf_counter()
        result = RequestResult(len(spec.prompt), spec.output_len, sent=began - self.start,
                               tenant=spec.tenant, priority=spec.priority, long=spec.long)
        try:
            await asyncio.wait_for(_stream(self.session, self.url, payload, headers,
                                           result, spec.hangup_after), self.timeout)
        except asyncio.TimeoutError:
            result.error = f"timeout after {self.timeout:g} s"
        except RequestFailed as exc:
            result.error = exc.label
            if exc.detail and exc.label not in self.reported:
                self.reported.add(exc.label)  # the first of each kind: the rest say the same
                logger.warning("%s: %s", exc.label, exc.detail)
        except Exception as exc:  # a disconnect or a garbled stream is a data point, not a crash
            result.error = type(exc).__name__
        result.elapsed = time.perf_counter() - began
        self.on_done()
        return result


async def _open_loop(client: _Client, specs: list[RequestSpec],
                     schedule: list[float]) -> list[RequestResult]:
    tasks = []
    for spec, at in zip(specs, schedule):
        delay = client.start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.send(spec)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client: _Client, specs: list[RequestSpec],
                       concurrency: int) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(specs)
    queue = iter(enumerate(specs))  # shared by the workers: each takes the next unsent request

    async def worker() -> None:
        for i, spec in queue:
            results[i] = await client.send(spec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


async def _first_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str],
                       timeout: float) -> str:
    async def ask() -> str:
        async with session.get(f"{base}/v1/models", headers=headers) as response:
            response.raise_for_status()
            return str((await response.json(content_type=None))["data"][0]["id"])

    try:
        return await asyncio.wait_for(ask(), timeout)
    except Exception as exc:
        raise AsyncInferError(
            f"could not ask {base}/v1/models for a model name ({type(exc).__name__}: {exc}); "
            f"is the server running there? Pass --url, or --model to skip the lookup") from exc


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _raise_open_files_limit(needed: int) -> None:
    """Lift the soft open-files limit toward the hard one, so the OS does not cap concurrency."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning("open files are limited to %d (hard limit), fewer than the %d connections "
                       "this load may open", target, needed)


async def run_load(base: str, model: str | None, specs: list[RequestSpec], *,
                   schedule: list[float] | None = None, concurrency: int | None = None,
                   api_key: str | None = None, timeout: float = 600.0,
                   on_done: Callable[[], object] = lambda: None, text: bool = False
                   ) -> tuple[str, list[RequestResult], float]:
    """Send ``specs`` on ``schedule`` (open loop) or from ``concurrency`` workers (closed loop),
    their prompts as ids or, with ``text``, as words; returns the model name, each request's
    result in order, and the run's duration."""
    import aiohttp

    assert (schedule is None) != (concurrency is None), "exactly one of schedule, concurrency"
    headers = auth_headers(api_key)
    # No pool limit: a pool would queue requests in the client, counted as the server's TTFT.
    _raise_open_files_limit((concurrency or len(specs)) + 64)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        if model is None:
            model = await _first_model(session, base, headers, timeout)
            logger.info("model from %s/v1/models: %s", base, model)
        client = _Client(session, f"{base}/v1/completions", model, headers, timeout,
                         time.perf_counter(), on_done, text)
        if schedule is not None:
            results = await _open_loop(client, specs, schedule)
        else:
            assert concurrency is not None
            results = await _closed_loop(client, specs, concurrency)
        return model, results, time.perf_counter() - client.start


# Where a prompt must be text (a router reads prompts as text): a word, about a token, an id.
_WORD_LIST = """time year people way day man thing woman life child world school state
family student group country problem hand part place case week company system program
question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute
idea kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death
experience effect class control care field development role effort rate heart drug show
leader light voice wife police mind price report decision son view relationship town road
arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity
star table need court oil situation cost industry figure street image phone data picture
practice piece land product doctor wall patient worker news test movie north love support
technology step baby computer type attention film tree source organization hair window
evidence population stage"""
WORDS = tuple(_WORD_LIST.split())


def as_text(ids: tuple[int, ...]) -> str:
    """A prompt's ids as words (the same ids, the same words)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)
