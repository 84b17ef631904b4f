"""Latency statistics of streamed requests: percentiles, and the time between tokens (TBT,
Sarathi-Serve's metric): the gaps between consecutive text chunks of each stream.

A chunk that carries several tokens counts as one gap, the time before it (as vLLM's
benchmark counts ITL): that is the stall the reader saw; spreading it over the chunk's tokens
(as SGLang's does) would hide it. ``tokens_per_chunk`` says how often chunks held more.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of sorted ``ordered``, as numpy's default."""
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, P50, P99 and max in ms of ``seconds`` (all None when empty)."""
    if not seconds:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    ms = sorted(s * 1000 for s in seconds)
    return {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99),
            "max": ms[-1]}


def tbt_gaps(arrivals: Sequence[float]) -> list[float]:
    """The gaps between consecutive text-chunk ``arrivals`` (seconds, in order) of one stream:
    one fewer than the chunks; the first chunk's wait is TTFT, not a gap."""
    return [b - a for a, b in itertools.pairwise(arrivals)]


def tbt_stats(per_request: Sequence[Sequence[float]], tokens: int = 0,
              chunks: int = 0) -> dict[str, Any]:
    """TBT in ms: mean, P50, P99 and max of every gap of every request pooled (Sarathi-Serve's
    P99 TBT), the ``gaps`` counted, and ``per_request_p99``: the same statistics over each
    request's own P99 gap (requests with a gap); ``tokens_per_chunk``: ``tokens / chunks``
    (None without chunks)."""
    pooled = [gap for gaps in per_request for gap in gaps]
    own = [percentile(sorted(gaps), 99) for gaps in per_request if gaps]
    return {**stats_ms(pooled), "gaps": len(pooled), "per_request_p99": stats_ms(own),
            "tokens_per_chunk": tokens / chunks if chunks else None}
