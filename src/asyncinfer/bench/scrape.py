"""What `asyncinfer bench serve` reads of the servers: the replicas behind a router, their
counters before and after the load, and the gauges polled until the server drains."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from typing import Any

from asyncinfer.bench.client import auth_headers

REPLICA_COUNTERS = ("requests", "generation_tokens", "prefix_cache_query_tokens",
                    "prefix_cache_hit_tokens")
GAUGES = ("requests_running", "requests_waiting", "kv_pages_used")
_COUNTER_LINE = re.compile(r"^asyncinfer_(\w+?)(?:_total)?(?:\{[^}]*\})?\s+(\S+)")
_GAUGE_LINE = re.compile(r"^asyncinfer_(\w+?)(?:\{[^}]*\})?\s+(\S+)")


def replica_urls(base: str, api_key: str | None = None) -> list[str]:
    """The servers behind ``base``: the replicas a router at ``base`` lists on /workers
    (sglang-router's), else ``base`` itself."""
    request = urllib.request.Request(f"{base}/workers", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            workers = json.loads(response.read()).get("workers")
    except (OSError, ValueError, AttributeError):
        return [base]
    urls = [w["url"].rstrip("/") for w in workers or [] if isinstance(w, dict) and "url" in w]
    return urls or [base]


def replica_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each readable server's ``REPLICA_COUNTERS`` from its /metrics, summed over labels."""
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
    """Per server, what the run added to its counters, and its prefix-cache hit rate."""
    rows = []
    for url, end in after.items():
        start = before.get(url, dict.fromkeys(REPLICA_COUNTERS, 0.0))
        delta = {k: int(end[k] - start[k]) for k in REPLICA_COUNTERS}
        queried = delta["prefix_cache_query_tokens"]
        rows.append({"url": url, **delta, "prefix_cache_hit_rate":
                     round(delta["prefix_cache_hit_tokens"] / queried, 4) if queried else None})
    return rows


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
    """Poll ``{base}/metrics`` until nothing runs or waits (up to ``timeout`` s), then until
    ``kv_pages_used`` is 0 (up to ``settle`` s more: pages still used then leaked). Returns
    ``drained``, ``clean`` (drained, no page used), the last gauges, ``waited_s``, ``error``."""
    import aiohttp

    start = time.perf_counter()
    deadline, idle_since = start + timeout, None
    gauges: dict[str, int] = {}
    report: dict[str, Any] = {"drained": False, "clean": False, "error": None}
    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
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
