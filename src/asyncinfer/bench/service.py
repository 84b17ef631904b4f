"""The weighted service each tenant of `asyncinfer bench serve` got over time, and the largest
gap between two tenants' service while both were backlogged (docs/workloads.md)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import field, frozen

from asyncinfer.bench.client import RequestResult

Interval = tuple[float, float]


def _by_time(events: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return sorted(events)


@frozen
class TenantTrace:
    """One tenant's (time, weighted service) ``events``, sorted, and the intervals in which a
    request of its waited for its first token (``backlog``)."""

    events: list[tuple[float, float]] = field(converter=_by_time)
    backlog: Sequence[Interval] = ()


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering ``intervals`` (touching ones joined)."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where two sets of disjoint, sorted intervals overlap (for more than an instant)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def cumulative(events: Sequence[tuple[float, float]], times: Sequence[float]) -> list[float]:
    """Service received up to and including each of ``times`` (sorted)."""
    out, total, k = [], 0.0, 0
    for t in times:
        while k < len(events) and events[k][0] <= t:
            total += events[k][1]
            k += 1
        out.append(total)
    return out


def largest_gap(a: TenantTrace, b: TenantTrace) -> dict[str, Any]:
    """The largest ``|ΔW_a - ΔW_b|`` of cumulative service over ``(t1, t2]`` inside one interval
    where both were backlogged: ``gap``, ``from_s``, ``to_s``, ``ahead`` ("a" or "b"), and
    ``backlogged_s`` (see docs/workloads.md)."""
    together = intersect(union(a.backlog), union(b.backlog))
    steps = sorted([(t, w) for t, w in a.events] + [(t, -w) for t, w in b.events])
    times = [t for t, _ in steps]
    level = list(itertools.accumulate((d for _, d in steps), initial=0.0))  # D after k steps
    best: dict[str, Any] = {"gap": 0.0, "from_s": None, "to_s": None, "ahead": None}
    for start, end in together:
        first = bisect.bisect_right(times, start)  # steps up to start are in D(start)
        last = bisect.bisect_right(times, end)
        points = [(start, level[first])] + [(times[k], level[k + 1])
                                            for k in range(first, last)]
        high = max(points, key=lambda p: p[1])
        low = min(points, key=lambda p: p[1])
        if high[1] - low[1] > best["gap"]:
            t1, t2 = sorted((high[0], low[0]))
            rising = high[0] > low[0]  # D went up: a got more than b over (t1, t2]
            best = {"gap": high[1] - low[1], "from_s": t1, "to_s": t2,
                    "ahead": "a" if rising else "b"}
    best["backlogged_s"] = sum(end - start for start, end in together)
    return best


def service_report(traces: Mapping[str, TenantTrace], bucket: float) -> dict[str, Any]:
    """Each tenant's cumulative service every ``bucket`` seconds, its total, and each pair's
    ``largest_gap``; ``max_gap`` is the largest pair's."""
    last = max((t for trace in traces.values() for t, _ in trace.events), default=0.0)
    times = [i * bucket for i in range(math.floor(last / bucket) + 2)]
    pairs = []
    for x, y in itertools.combinations(sorted(traces), 2):
        gap = largest_gap(traces[x], traces[y])
        ahead = {"a": x, "b": y}.get(gap.pop("ahead"))
        pairs.append({"tenants": [x, y], **gap, "ahead": ahead})
    return {"bucket_s": bucket, "times_s": times,
            "cumulative": {name: cumulative(traces[name].events, times)
                           for name in sorted(traces)},
            "total": {name: sum(w for _, w in traces[name].events) for name in sorted(traces)},
            "pairs": pairs,
            "max_gap": max(pairs, key=lambda p: p["gap"], default=None)}


def service_traces(results: list[RequestResult], w_in: float = 1.0,
                   w_out: float = 2.0) -> dict[str, TenantTrace]:
    """Per tenant, the service its requests got as the client saw it: ``w_in`` per prompt
    token at the first token, ``w_out`` per output token as its chunk arrives (a completed
    request's tokens spread evenly over its chunks, else one a chunk); backlogged from each
    request's sending until its first token, or until the client gave up on it."""
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
