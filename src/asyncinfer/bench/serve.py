"""`asyncinfer bench serve`: load a running OpenAI-compatible server and measure its latency.

Requests of random token ids (EOS ignored, so each yields exactly its output length) arrive
as a seeded Poisson or gamma (bursty) process (``--rate``, ``--arrival``), one per tenant
(``--tenant-rates``), or from closed-loop workers (``--concurrency``). Lengths are uniform or
follow a named workload (``--workload chat``: lognormal, fitted to ShareGPT's published
means); a share of the prompts can be made much longer (``--long-fraction``). Requests carry
a tenant (``--tenants``: the OpenAI ``user`` field and an ``X-Tenant`` header) and a
``priority`` (``--priorities``) drawn per request. TTFT, ITL, TPOT and end-to-end latency are
measured client-side from the streamed chunks, for the whole run and per tenant, priority and
long or short prompt; with tenants, each one's weighted service over time too (see
docs/workloads.md).

A hostile load (``--hangup-fraction``) has a seeded share of the requests close their
connection mid-stream; afterwards the server's ``/metrics`` gauges tell whether it let go of
everything those requests held (``--check-drained``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import random
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import define, evolve, field, frozen

from asyncinfer.bench.workloads import (
    WORKLOADS,
    LengthDist,
    TenantTrace,
    Uniform,
    arrival_times,
    chat,
    draw_labels,
    parse_mix,
    service_report,
    tenant_arrivals,
    tenant_name,
)
from asyncinfer.errors import AsyncInferError

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

TOKEN_IDS = (100, 10000)  # as in `bench decode`: clear of special ids, inside real vocabularies
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 128, 64  # of --workload uniform


@frozen
class RequestSpec:
    """One request of the workload: its prompt ids, how many tokens it must produce, after
    how many streamed text chunks the client hangs up (None: it reads to the end), whom it is
    for and its priority (None: not sent), and whether its prompt was made long."""

    prompt: tuple[int, ...]
    output_len: int
    hangup_after: int | None = None
    tenant: str | None = None
    priority: int | None = None
    long: bool = False


@define
class RequestResult:
    """What the client saw of one request; ``sent`` from the run's start, the rest from
    ``sent``, all in seconds."""

    prompt_len: int
    output_len: int
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(factory=list)
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


class _RequestFailed(Exception):
    """A request the server refused or broke off: a label to count failures by, and what the
    server said."""

    def __init__(self, label: str, detail: str = "") -> None:
        super().__init__(label)
        self.label, self.detail = label, detail


def arrival_schedule(num_requests: int, rate: float, seed: int,
                     burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gaps of mean ``1/rate``
    drawn from ``random.Random(seed)``, exponential (Poisson arrivals) or, for a
    ``burstiness`` other than 1, gamma of that shape; all at 0 for an infinite rate."""
    return arrival_times(num_requests, rate, random.Random(seed), burstiness)


def make_requests(num_requests: int, input_len: tuple[int, int] | LengthDist,
                  output_len: tuple[int, int] | LengthDist, seed: int, prefix_groups: int = 0,
                  prefix_len: int = 0) -> list[RequestSpec]:
    """Prompts of random ids with lengths drawn from ``input_len`` and ``output_len``: a
    distribution, or an inclusive range drawn uniformly. With ``prefix_groups``, request i's
    prompt starts with shared prefix ``i % prefix_groups`` (``prefix_len`` random ids each)
    before its own ids: what a prefix cache, and a router that sends a prompt where its
    prefix is cached, can serve from cache."""
    inputs = Uniform(*input_len) if isinstance(input_len, tuple) else input_len
    outputs = Uniform(*output_len) if isinstance(output_len, tuple) else output_len
    rng = random.Random(f"prompts-{seed}")  # not the schedule's stream: same prompts at any rate
    prefixes = [tuple(rng.randrange(*TOKEN_IDS) for _ in range(prefix_len))
                for _ in range(prefix_groups)]
    specs = []
    for i in range(num_requests):
        prompt = tuple(rng.randrange(*TOKEN_IDS) for _ in range(inputs.sample(rng)))
        shared = prefixes[i % prefix_groups] if prefixes else ()
        specs.append(RequestSpec(shared + prompt, outputs.sample(rng)))
    return specs


def plan_long(specs: list[RequestSpec], fraction: float, factor: float, seed: int,
              max_len: int | None = None) -> list[RequestSpec]:
    """``specs`` with ``round(fraction * len(specs))`` of them, drawn from ``seed``, given
    prompts ``factor`` times as long (at most ``max_len``, never shorter than they were):
    their ids, then fresh random ids. A few long prefills among short requests show whether
    a policy lets them hold up everyone behind (head-of-line blocking)."""
    rng = random.Random(f"long-{seed}")  # its own stream: same prompts and arrival times
    chosen = sorted(rng.sample(range(len(specs)), round(fraction * len(specs))))
    out = list(specs)
    for i in chosen:
        prompt = specs[i].prompt
        target = round(factor * len(prompt))
        if max_len is not None:
            target = min(target, max_len)
        extra = tuple(rng.randrange(*TOKEN_IDS) for _ in range(target - len(prompt)))
        out[i] = evolve(specs[i], prompt=prompt + extra, long=True)
    return out


def label_requests(specs: list[RequestSpec], tenants: list[str] | None = None,
                   priorities: list[int] | None = None) -> list[RequestSpec]:
    """``specs`` with request i's tenant ``tenants[i]`` and priority ``priorities[i]``
    (either left as it was where None)."""
    return [evolve(spec, tenant=spec.tenant if tenants is None else tenants[i],
                   priority=spec.priority if priorities is None else priorities[i])
            for i, spec in enumerate(specs)]


def plan_hangups(specs: list[RequestSpec], fraction: float, seed: int) -> list[RequestSpec]:
    """``specs`` with ``round(fraction * len(specs))`` of them, drawn from ``seed``, marked to
    hang up after K streamed text chunks, K uniform in ``1..max(1, output_len // 2)``: the
    request is running and holds KV pages by then, and usually has tokens left to produce."""
    rng = random.Random(f"hangups-{seed}")  # its own stream: same prompts and arrival times
    chosen = sorted(rng.sample(range(len(specs)), round(fraction * len(specs))))
    out = list(specs)
    for i in chosen:
        out[i] = evolve(specs[i], hangup_after=rng.randint(1, max(1, specs[i].output_len // 2)))
    return out


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                  headers: dict[str, str], result: RequestResult,
                  hangup_after: int | None = None) -> None:
    sent = time.perf_counter()
    last, chunks, usage_tokens = sent, 0, None
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status != 200:
            raise _RequestFailed(f"HTTP {response.status}", (await response.text())[:500])
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
                raise _RequestFailed(f"error in stream: {chunk['error'].get('message')}")
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                usage_tokens = int(usage["completion_tokens"])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                if result.ttft is None:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
                if chunks == hangup_after:
                    # Close the socket itself, not release it to the pool: the server must see
                    # the client go away with its stream unfinished.
                    response.close()
                    result.hung_up = True
                    return
    if result.e2e is None:
        raise _RequestFailed("stream ended before [DONE]")
    if result.ttft is None:
        raise _RequestFailed("no text in the stream")
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks


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
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
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
        except _RequestFailed as exc:
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


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _raise_open_files_limit(needed: int) -> None:
    """Lift the soft limit on open files toward the hard one when ``needed`` sockets would pass
    it (1024 is a common default): the OS, not the client, would otherwise cap concurrency."""
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
    headers = _auth(api_key)
    # No pool limit (0): every request in flight has its own connection, however many (a
    # burst of a thousand streams included). A pool would queue requests inside the client,
    # and that wait would be counted as the server's TTFT.
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


# Words standing in for token ids where a prompt must be text (a router that reads prompts
# as text, for its cache-aware routing): common words, about one token each in most
# vocabularies.
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


REPLICA_COUNTERS = ("requests", "generation_tokens", "prefix_cache_query_tokens",
                    "prefix_cache_hit_tokens")


def replica_urls(base: str, api_key: str | None = None) -> list[str]:
    """The servers behind ``base``: the replicas a router at ``base`` lists on /workers
    (sglang-router's), else ``base`` itself."""
    request = urllib.request.Request(f"{base}/workers", headers=_auth(api_key))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            workers = json.loads(response.read()).get("workers")
    except (OSError, ValueError, AttributeError):
        return [base]
    urls = [w["url"].rstrip("/") for w in workers or [] if isinstance(w, dict) and "url" in w]
    return urls or [base]


def replica_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each server's counters of ``REPLICA_COUNTERS`` from its /metrics (summed over their
    labels); a server that cannot be read is left out."""
    found: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                text = response.read().decode()
        except OSError:
            continue
        counters = dict.fromkeys(REPLICA_COUNTERS, 0.0)
        for line in text.splitlines():
            match = _COUNTER_LINE.match(line)
            if match and match[1] in counters:
                counters[match[1]] += float(match[2])
        found[url] = counters
    return found


def replica_report(before: dict[str, dict[str, float]],
                   after: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per server, what the run added: requests, generated tokens, and prompt tokens looked
    up in and served from its prefix cache (with the hit rate)."""
    rows = []
    for url, end in after.items():
        start = before.get(url, dict.fromkeys(REPLICA_COUNTERS, 0.0))
        delta = {k: int(end[k] - start[k]) for k in REPLICA_COUNTERS}
        queried = delta["prefix_cache_query_tokens"]
        rows.append({"url": url, **delta, "prefix_cache_hit_rate":
                     round(delta["prefix_cache_hit_tokens"] / queried, 4) if queried else None})
    return rows


GAUGES = ("requests_running", "requests_waiting", "kv_pages_used")
_COUNTER_LINE = re.compile(r"^asyncinfer_(\w+?)(?:_total)?(?:\{[^}]*\})?\s+(\S+)")
_GAUGE_LINE = re.compile(r"^asyncinfer_(\w+?)(?:\{[^}]*\})?\s+(\S+)")


def parse_gauges(text: str) -> dict[str, int]:
    """The engine gauges of ``GAUGES`` found in a Prometheus text exposition."""
    found = {}
    for line in text.splitlines():
        match = _GAUGE_LINE.match(line)
        if match and match[1] in GAUGES:
            found[match[1]] = int(float(match[2]))
    return found


async def check_drained(base: str, *, api_key: str | None = None, timeout: float = 30.0,
                        interval: float = 0.1, settle: float = 1.0) -> dict[str, Any]:
    """Poll ``{base}/metrics`` until no request runs or waits, up to ``timeout`` seconds.

    Once nothing runs or waits, polling goes on until ``kv_pages_used`` (which leaves out the
    prefix cache's pages) is 0 too, for at most ``settle`` seconds, in case a page is freed
    a round after its request: pages used after that were leaked. Returns ``drained`` (nothing
    running or waiting at the end), ``clean`` (drained, no page used), the last gauges read,
    the seconds waited, and ``error`` when ``/metrics`` could not be read or lacked a gauge.
    """
    import aiohttp

    start = time.perf_counter()
    deadline, idle_since = start + timeout, None
    gauges: dict[str, int] = {}
    report: dict[str, Any] = {"drained": False, "clean": False, "error": None}
    async with aiohttp.ClientSession(headers=_auth(api_key)) as session:
        while True:
            try:
                async with session.get(f"{base}/metrics",
                                       timeout=aiohttp.ClientTimeout(total=10)) as response:
                    response.raise_for_status()
                    gauges = parse_gauges(await response.text())
            except Exception as exc:
                report["error"] = f"could not read {base}/metrics ({type(exc).__name__}: {exc})"
                break
            if missing := [g for g in GAUGES if g not in gauges]:
                report["error"] = (f"{base}/metrics has no "
                                   + ", ".join(f"asyncinfer_{g}" for g in missing))
                break
            now = time.perf_counter()
            if gauges["requests_running"] or gauges["requests_waiting"]:
                idle_since = None
            else:
                idle_since = now if idle_since is None else idle_since
                if gauges["kv_pages_used"] == 0 or now - idle_since >= settle:
                    break
            if now >= deadline:
                break
            await asyncio.sleep(min(interval, deadline - now))
    report["drained"] = report["error"] is None and idle_since is not None
    report["clean"] = report["drained"] and gauges["kv_pages_used"] == 0
    report.update({g: gauges.get(g) for g in GAUGES})
    report["waited_s"] = time.perf_counter() - start
    return report


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy's default."""
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats_ms(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    ms = sorted(s * 1000 for s in seconds)
    return {"mean": sum(ms) / len(ms), "p50": _percentile(ms, 50), "p99": _percentile(ms, 99),
            "max": ms[-1]}


def _meets_slo(r: RequestResult, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    tpot = r.tpot
    return (r.ttft is not None and (ttft_ms is None or r.ttft * 1000 <= ttft_ms)
            and (tpot_ms is None or tpot is None or tpot * 1000 <= tpot_ms))


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Counts, throughputs, goodput (None without an SLO) and latency statistics in ms.

    Requests the client hung up on are counted in ``hung_up`` and nowhere else: the rest,
    ``kept``, are ``completed`` or ``failed`` (``errors`` by label)."""
    kept = [r for r in results if not r.hung_up]
    done = [r for r in kept if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(_meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done) if has_slo else None
    return {
        "hung_up": len(results) - len(kept), "kept": len(kept),
        "completed": len(done), "failed": len(kept) - len(done),
        "errors": dict(Counter(r.error for r in kept if r.error is not None)),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "good_requests": good,
        "goodput": None if good is None else good / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in done if r.e2e is not None]),
    }


def group_summaries(results: list[RequestResult], duration: float,
                    slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict[str, dict[str, Any]]:
    """``summarize`` of each group of requests, by ``tenant``, by ``priority`` and by
    ``class`` (``long`` or ``short`` prompt), each kind only when the run used it; the
    throughputs are over the whole run's ``duration``."""
    kinds: dict[str, Callable[[RequestResult], str | None]] = {
        "tenant": lambda r: r.tenant,
        "priority": lambda r: None if r.priority is None else str(r.priority),
        "class": lambda r: "long" if r.long else "short",
    }
    in_use = {"tenant": any(r.tenant is not None for r in results),
              "priority": any(r.priority is not None for r in results),
              "class": any(r.long for r in results)}
    groups: dict[str, dict[str, Any]] = {}
    for kind, key in kinds.items():
        if not in_use[kind]:
            continue
        members: dict[str, list[RequestResult]] = {}
        for r in results:
            if (name := key(r)) is not None:
                members.setdefault(name, []).append(r)
        order = sorted(members, key=lambda n: (int(n), n) if kind == "priority" else (0, n))
        groups[kind] = {name: summarize(members[name], duration, slo_ttft_ms, slo_tpot_ms)
                        for name in order}
    return groups


def service_traces(results: list[RequestResult], w_in: float = 1.0,
                   w_out: float = 2.0) -> dict[str, TenantTrace]:
    """Per tenant, the weighted service its requests received, as the client saw it: a
    request's ``w_in`` x prompt tokens when its first token arrives, ``w_out`` per output
    token when the chunk holding it arrives (a completed request's reported tokens spread
    evenly over its chunks; one token a chunk otherwise); and the intervals in which one of
    its requests waited for its first token (backlogged), from its sending until then, or
    until the client stopped for one that never got it."""
    events: dict[str, list[tuple[float, float]]] = {}
    backlog: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r.tenant is None:
            continue
        events.setdefault(r.tenant, [])
        waited = r.ttft if r.ttft is not None else r.elapsed
        if waited is not None:
            backlog.setdefault(r.tenant, []).append((r.sent, r.sent + waited))
        if r.ttft is None:
            continue
        chunks = 1 + len(r.itl)
        per_chunk = r.output_tokens / chunks if r.ok and r.output_tokens else 1.0
        first = r.sent + r.ttft
        events[r.tenant].append((first, w_in * r.prompt_len))
        for at in itertools.accumulate(r.itl, initial=first):
            events[r.tenant].append((at, w_out * per_chunk))
    return {name: TenantTrace(events[name], backlog.get(name, [])) for name in events}


def _request_row(r: RequestResult) -> dict[str, Any]:
    def ms(s: float | None) -> float | None:
        return None if s is None else s * 1000

    return {"sent_s": r.sent, "prompt_len": r.prompt_len, "output_len": r.output_len,
            "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot),
            "e2e_ms": ms(r.e2e) if r.ok else None, "error": r.error,
            "hung_up": r.hung_up, "tenant": r.tenant, "priority": r.priority, "long": r.long}


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of a report."""
    p = report["params"]
    load = ("all at once" if p["load"] == "burst" else
            f"{p['concurrency']} closed-loop workers" if p["load"] == "closed_loop" else
            f"gamma arrivals (burstiness {p['burstiness']:g}) at {p['rate']:g} req/s"
            if p["load"] == "gamma" else f"Poisson arrivals at {p['rate']:g} req/s")
    if p.get("tenant_rates"):
        load += " (" + ", ".join(f"{name} {rate:g}" for name, rate in
                                 p["tenant_rates"].items()) + ")"
    counts = f"{report['completed']} completed, {report['failed']} failed"
    if p.get("hangup_fraction"):
        counts = f"{report['hung_up']} hung up mid-stream, {report['kept']} kept: {counts}"
    lines = [
        f"{p['model']} at {p['url']}: {p['num_requests']} requests, {load}",
        f"{'requests':<12}{counts} in {report['duration_s']:.2f} s",
        f"{'throughput':<12}{report['request_throughput']:.2f} req/s, "
        f"{report['output_throughput']:.1f} output tok/s",
    ]
    if report["goodput"] is not None:
        slo = " and ".join(f"{name} <= {p[key]:g} ms" for name, key in
                           (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms")) if p[key] is not None)
        lines.append(f"{'goodput':<12}{report['goodput']:.2f} req/s "
                     f"({report['good_requests']} requests with {slo})")
    lines += [f"{'failed':<12}{count} x {error}" for error, count in report["errors"].items()]
    lines.append(f"{'(ms)':<12}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p99", "max")))
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = ["-" if v is None else f"{v:.1f}" for v in report[f"{name}_ms"].values()]
        lines.append(f"{name.upper():<12}" + "".join(f"{c:>10}" for c in cells))
    lines += _group_lines(report.get("groups") or {})
    if (service := report.get("service")) is not None:
        lines += _service_lines(service)
    if (drain := report.get("drain")) is not None:
        lines.append(f"{'drain':<12}{_drain_line(drain)}")
    replicas = report.get("replicas") or []
    if len(replicas) > 1 or any(r["prefix_cache_query_tokens"] for r in replicas):
        lines.append(f"{'replica':<28}{'requests':>10}{'gen tok':>10}{'cached':>10}"
                     f"{'of prompt':>11}{'hit rate':>10}")
        for r in replicas:
            rate = "-" if r["prefix_cache_hit_rate"] is None else (
                f"{r['prefix_cache_hit_rate']:.1%}")
            lines.append(f"{r['url'][-28:]:<28}{r['requests']:>10}{r['generation_tokens']:>10}"
                         f"{r['prefix_cache_hit_tokens']:>10}"
                         f"{r['prefix_cache_query_tokens']:>11}{rate:>10}")
    return "\n".join(lines)


def _group_lines(groups: dict[str, dict[str, Any]]) -> list[str]:
    """A header, then one line per group: counts, TTFT, TPOT and E2E p50 and p99 (ms),
    goodput (req/s)."""
    if not groups:
        return []

    def cell(value: float | None, width: int, digits: int = 1) -> str:
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    lines = [f"{'group (ms)':<16}{'done':>6}{'failed':>7}"
             + "".join(f"{name + ' p50':>10}{'p99':>9}" for name in ("TTFT", "TPOT", "E2E"))
             + f"{'goodput':>9}"]
    for kind, members in groups.items():
        for name, s in members.items():
            label = name if kind == "class" else f"{kind} {name}"
            row = f"{label[:15]:<16}{s['completed']:>6}{s['failed']:>7}"
            for stat in ("ttft_ms", "tpot_ms", "e2e_ms"):
                row += cell(s[stat]["p50"], 10) + cell(s[stat]["p99"], 9)
            lines.append(row + cell(s["goodput"], 9, 2))
    return lines


def _service_lines(service: dict[str, Any]) -> list[str]:
    totals = ", ".join(f"{name} {total:.0f}" for name, total in service["total"].items())
    lines = [f"{'service':<12}{totals} (weights: input {service['w_in']:g}, "
             f"output {service['w_out']:g} a token)"]
    gap = service["max_gap"]
    if gap is not None and gap["from_s"] is not None:
        behind = next(t for t in gap["tenants"] if t != gap["ahead"])
        lines.append(f"{'max gap':<12}{gap['gap']:.0f} ({gap['ahead']} ahead of {behind} "
                     f"over {gap['from_s']:.2f}..{gap['to_s']:.2f} s; both backlogged "
                     f"{gap['backlogged_s']:.2f} s in all)")
    elif gap is not None:
        lines.append(f"{'max gap':<12}no interval with two tenants backlogged together")
    return lines


def _drain_line(drain: dict[str, Any]) -> str:
    if drain["error"] is not None:
        return f"check FAILED: {drain['error']}"
    gauges = (f"{drain['requests_running']} running, {drain['requests_waiting']} waiting, "
              f"{drain['kv_pages_used']} KV pages used (prefix cache aside)")
    if not drain["drained"]:
        return f"NOT drained after {drain['waited_s']:.1f} s: {gauges}"
    verdict = "drained" if drain["clean"] else "drained but KV pages LEAKED"
    return f"{verdict} after {drain['waited_s']:.1f} s: {gauges}"


def _check_options(args: argparse.Namespace) -> None:
    """Refuse flags that would be silently ignored together (AsyncInferError)."""
    chat_only = [flag for flag, value in (("--input-mean", args.input_mean),
                                          ("--output-mean", args.output_mean)) if value]
    if args.workload != "chat" and chat_only:
        raise AsyncInferError(f"{' and '.join(chat_only)} set the means of --workload chat; "
                              f"use --input-len/--input-len-range with --workload uniform")
    fixed = [flag for flag, value in (("--input-len", args.input_len),
                                      ("--output-len", args.output_len),
                                      ("--input-len-range", args.input_len_range),
                                      ("--output-len-range", args.output_len_range)) if value]
    if args.workload == "chat" and fixed:
        raise AsyncInferError(f"--workload chat draws its own lengths: drop "
                              f"{' and '.join(fixed)}, or set --input-mean/--output-mean")
    if args.tenants and args.tenant_rates:
        raise AsyncInferError("give --tenants (shares of one arrival process) or "
                              "--tenant-rates (a process per tenant), not both")
    if args.arrival == "gamma" and args.burstiness is None:
        raise AsyncInferError("--arrival gamma needs --burstiness B (below 1: burstier than "
                              "Poisson; 1: Poisson)")
    if args.arrival != "gamma" and args.burstiness is not None:
        raise AsyncInferError("--burstiness shapes gamma arrivals: add --arrival gamma")
    if args.arrival == "gamma" and args.concurrency:
        raise AsyncInferError("--arrival gamma times an open loop: use --rate or "
                              "--tenant-rates, not --concurrency")


def workload_lengths(args: argparse.Namespace) -> tuple[LengthDist, LengthDist]:
    """The prompt and output length distributions the flags ask for."""
    if args.workload == "chat":
        return chat(args.input_mean, args.output_mean)
    input_len = args.input_len or DEFAULT_INPUT_LEN
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    return (Uniform(*(args.input_len_range or (input_len, input_len))),
            Uniform(*(args.output_len_range or (output_len, output_len))))


def main(args: argparse.Namespace) -> int:
    """`asyncinfer bench serve`: run the load, check the server drained (see ``--check-drained``),
    print the table, write ``--json``; exit status 1 when no kept request completed, or when
    the drain check failed, timed out or found KV pages still used."""
    from tqdm import tqdm

    _check_options(args)
    input_dist, output_dist = workload_lengths(args)
    specs = make_requests(args.num_requests, input_dist, output_dist, args.seed,
                          args.prefix_groups, args.prefix_len)
    if args.long_fraction:
        specs = plan_long(specs, args.long_fraction, args.long_factor, args.seed,
                          args.max_input_len)
    if args.hangup_fraction:
        specs = plan_hangups(specs, args.hangup_fraction, args.seed)
    check = args.check_drained if args.check_drained is not None else args.hangup_fraction > 0
    burstiness = args.burstiness or 1.0
    tenants = None
    if args.tenant_rates:
        arrivals = tenant_arrivals(args.tenant_rates, len(specs), args.seed, burstiness)
        schedule: list[float] | None = [t for t, _ in arrivals]
        tenants = [name for _, name in arrivals]
        rate = sum(args.tenant_rates.values())
    else:
        rate = math.inf if args.rate is None and args.concurrency is None else args.rate
        schedule = (None if args.concurrency else
                    arrival_schedule(len(specs), rate, args.seed, burstiness))
        if args.tenants:
            tenants = draw_labels(args.tenants, len(specs), f"tenants-{args.seed}")
    priorities = (draw_labels(args.priorities, len(specs), f"priorities-{args.seed}")
                  if args.priorities else None)
    specs = label_requests(specs, tenants, priorities)
    base = args.url.rstrip("/")
    replicas = replica_urls(base, args.api_key)
    counted = replica_counters(replicas)
    # A router reads prompts as text (and refuses ids): words stand in for the ids then.
    text = args.prompt_format == "text" or (args.prompt_format is None and replicas != [base])
    with tqdm(total=len(specs), desc="requests", disable=None) as progress:
        model, results, duration = asyncio.run(run_load(
            base, args.model, specs, schedule=schedule, concurrency=args.concurrency,
            api_key=args.api_key, timeout=args.timeout, on_done=progress.update, text=text))
    per_replica = replica_report(counted, replica_counters(replicas))
    drain = None
    if check:
        drain = asyncio.run(check_drained(base, api_key=args.api_key,
                                          timeout=args.drain_timeout))
    load = ("closed_loop" if args.concurrency else "burst" if math.isinf(rate) else
            "gamma" if args.arrival == "gamma" else "poisson")
    params = {"url": base, "model": model, "policy": args.policy, "load": load,
              "rate": rate if load in ("poisson", "gamma") else None,
              "concurrency": args.concurrency, "num_requests": args.num_requests,
              "workload": args.workload, "input_len": [input_dist.lo, input_dist.hi],
              "output_len": [output_dist.lo, output_dist.hi],
              "input_dist": input_dist.describe(), "output_dist": output_dist.describe(),
              "arrival": args.arrival, "burstiness": args.burstiness,
              "tenants": args.tenants, "tenant_rates": args.tenant_rates,
              "priorities": (None if args.priorities is None else
                             {str(k): v for k, v in args.priorities.items()}),
              "long_fraction": args.long_fraction,
              "long_factor": args.long_factor if args.long_fraction else None,
              "max_input_len": args.max_input_len if args.long_fraction else None,
              "prefix_groups": args.prefix_groups,
              "prefix_len": args.prefix_len, "prompt_format": "text" if text else "ids",
              "seed": args.seed, "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, "timeout_s": args.timeout,
              "hangup_fraction": args.hangup_fraction, "check_drained": check,
              "drain_timeout_s": args.drain_timeout if check else None}
    service = None
    if tenants is not None:
        service = {"w_in": args.service_w_in, "w_out": args.service_w_out,
                   **service_report(service_traces(results, args.service_w_in,
                                                   args.service_w_out),
                                    args.service_bucket_s)}
    report = {"benchmark": "serve", "params": params,
              **summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms),
              "groups": group_summaries(results, duration, args.slo_ttft_ms,
                                        args.slo_tpot_ms),
              "service": service, "drain": drain, "replicas": per_replica,
              "requests": [_request_row(r) for r in results]}
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["completed"] and (drain is None or drain["clean"]) else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _above_zero(what: str) -> Callable[[str], float]:
    """An argparse type: a number > 0 (``inf`` included), ``what`` naming it in the error."""

    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {text}")
        return value

    return parse


_rate = _above_zero("requests/s (or 'inf')")
_seconds = _above_zero("seconds")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction with 0 <= F < 1, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction with 0 <= F <= 1, got {text}")
    return value


def _at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low``."""

    def parse(text: str) -> float:
        value = float(text)
        if not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a number >= {low:g}, got {text}")
        return value

    return parse


def _mix(key: Callable[[str], Any], what: str,
         name: str = "NAME") -> Callable[[str], dict[Any, float]]:
    """An argparse type: ``NAME:VALUE,...`` (see ``parse_mix``)."""

    def parse(text: str) -> dict[Any, float]:
        try:
            return parse_mix(text, key, what, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``asyncinfer bench`` subcommands; returns its parser."""
    parser = bench_subparsers.add_parser(
        "serve", help="load a running OpenAI-compatible server: TTFT, TPOT, ITL, goodput",
        description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None,
                        help="the model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("ASYNCINFER_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $ASYNCINFER_API_KEY)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_rate, default=None,
                      help="requests/s as Poisson arrivals; 'inf' sends all at once (default)")
    load.add_argument("--concurrency", type=_positive_int, default=None,
                      help="closed loop: this many workers, each sending its next request when "
                           "its last one ends; with --num-requests equal to it, a burst of that "
                           "many concurrent streams")
    load.add_argument("--tenant-rates", type=_mix(tenant_name, "rate"), default=None,
                      metavar="A:R,B:R",
                      help="one arrival process per tenant at its own rate (requests/s), "
                           "merged in time order until --num-requests; each request is "
                           "sent for its tenant (see --tenants)")
    parser.add_argument("--num-requests", type=_positive_int, default=64)
    parser.add_argument("--workload", choices=WORKLOADS, default="uniform",
                        help="lengths: uniform (--input-len, --input-len-range ...), or chat: "
                             "lognormal, fitted to ShareGPT's means (prompt 161, output 338 "
                             "tokens; see docs/workloads.md). Default uniform")
    parser.add_argument("--input-mean", type=_above_zero("tokens"), default=None,
                        help="--workload chat: the prompts' mean length before clipping")
    parser.add_argument("--output-mean", type=_above_zero("tokens"), default=None,
                        help="--workload chat: the outputs' mean length before clipping")
    parser.add_argument("--input-len", type=_positive_int, default=None,
                        help=f"prompt tokens (random ids in [{TOKEN_IDS[0]}, {TOKEN_IDS[1]})) "
                             f"(default {DEFAULT_INPUT_LEN})")
    parser.add_argument("--output-len", type=_positive_int, default=None,
                        help=f"output tokens (EOS is ignored) (default {DEFAULT_OUTPUT_LEN})")
    parser.add_argument("--prompt-format", choices=["ids", "text"], default=None,
                        help="send prompts as token ids, or as words (about a token each) "
                             "(default: text through a router, which refuses ids; else ids)")
    parser.add_argument("--prefix-groups", type=int, default=0,
                        help="requests share this many prompt prefixes, in turn (0: none)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="tokens of each shared prefix, before each request's own "
                             "--input-len")
    parser.add_argument("--input-len-range", type=_length_range, default=None, metavar="LO,HI",
                        help="uniform random prompt lengths, replacing --input-len")
    parser.add_argument("--output-len-range", type=_length_range, default=None, metavar="LO,HI",
                        help="uniform random output lengths, replacing --output-len")
    parser.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson",
                        help="inter-arrival times at --rate: exponential (Poisson), or gamma "
                             "of shape --burstiness. Default poisson")
    parser.add_argument("--burstiness", type=_above_zero("a gamma shape"), default=None,
                        metavar="B",
                        help="--arrival gamma's shape, the mean gap staying 1/rate: below 1 "
                             "burstier than Poisson, 1 Poisson, above 1 more regular")
    parser.add_argument("--tenants", type=_mix(tenant_name, "share"), default=None,
                        metavar="A:S,B:S",
                        help="each request's tenant, drawn with these shares; sent as the "
                             "OpenAI 'user' field and an X-Tenant header. Reports per tenant "
                             "and each tenant's service over time")
    parser.add_argument("--priorities", type=_mix(int, "share", "PRIORITY"), default=None,
                        metavar="P:S,...",
                        help="each request's integer 'priority' field (lower runs first with "
                             "the priority policy), drawn with these shares; reports per "
                             "priority")
    parser.add_argument("--long-fraction", type=_share, default=0.0, metavar="F",
                        help="this share of the requests (a seeded choice) get prompts "
                             "--long-factor times as long; reports long and short apart. "
                             "Default 0")
    parser.add_argument("--long-factor", type=_at_least(1), default=30.0, metavar="K",
                        help="how many times longer a long prompt is (default 30)")
    parser.add_argument("--max-input-len", type=_positive_int, default=None,
                        help="the longest a long prompt may be made (keep prompt and output "
                             "within the model's context)")
    parser.add_argument("--service-w-in", type=_at_least(0), default=1.0,
                        help="service: the weight of a prompt token, counted at the "
                             "request's first token (default 1)")
    parser.add_argument("--service-w-out", type=_at_least(0), default=2.0,
                        help="service: the weight of an output token, counted when it "
                             "arrives (default 2)")
    parser.add_argument("--service-bucket-s", type=_seconds, default=1.0,
                        help="service curves are sampled this often, in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="draws the prompts, the lengths, the arrival times, the "
                             "hang-ups, the long prompts, the tenants and the priorities "
                             "(each from a stream of its own)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput counts requests with TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="goodput counts requests with TPOT at most this")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take, from sending to its last chunk")
    parser.add_argument("--hangup-fraction", type=_fraction, default=0.0, metavar="F",
                        help="this share of the requests (a seeded choice) closes its "
                             "connection after K streamed text chunks, K seeded in "
                             "1..max(1, output_len // 2), reading no further; they are counted "
                             "as hung up, outside the latencies and the failures (one whose "
                             "stream ends first just completes). Default 0")
    parser.add_argument("--check-drained", action=argparse.BooleanOptionalAction, default=None,
                        help="after the load, poll the server's /metrics until no request runs "
                             "or waits, and report those gauges and kv_pages_used; exit status "
                             "1 unless it drains with no KV page used (default: on exactly "
                             "when --hangup-fraction > 0)")
    parser.add_argument("--drain-timeout", type=_seconds, default=30.0,
                        help="seconds --check-drained waits for the server to drain")
    parser.add_argument("--policy", default=None,
                        help="the server's scheduling policy, only recorded in the report "
                             "(plot_rate_sweep draws one line per policy)")
    parser.add_argument("--json", default=None, help="write the report to this file")
    parser.set_defaults(func=main)
    return parser
