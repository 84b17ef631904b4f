"""Capacity under a latency SLO: the highest request rate whose run meets a P99 TBT (and
optionally P99 TTFT) target, found by bisection over rates, each probe a run of the same
requests at that rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import frozen


@frozen
class Slo:
    """Targets on a run's pooled P99 TBT and P99 TTFT in ms (None: no target)."""

    tbt_p99_ms: float | None = None
    ttft_p99_ms: float | None = None

    def misses(self, summary: dict[str, Any]) -> list[str]:
        """Why a run's ``summarize`` dict misses the SLO; empty when it meets it. A run with
        a failed request, or none completed, misses it whatever its latencies."""
        why = []
        if not summary["completed"]:
            why.append("no request completed")
        if summary["failed"]:
            why.append(f"{summary['failed']} failed")
        for name, key, target in (("TBT", "tbt_ms", self.tbt_p99_ms),
                                  ("TTFT", "ttft_ms", self.ttft_p99_ms)):
            value = summary[key]["p99"]
            if target is not None and value is not None and value > target:
                why.append(f"{name} p99 {value:.1f} ms > {target:g} ms")
        return why

    def describe(self) -> dict[str, Any]:
        return {"tbt_p99_ms": self.tbt_p99_ms, "ttft_p99_ms": self.ttft_p99_ms}


def bisect_rates(meets: Callable[[float], bool], lo: float, hi: float,
                 max_probes: int) -> dict[str, Any]:
    """The highest rate in ``lo..hi`` that ``meets``, assumed monotone (met below a threshold,
    missed above), in at most ``max_probes`` (>= 2) calls: ``lo``, then ``hi``, then the
    midpoint of the bracket. ``capacity``: the highest rate met (None: not even ``lo``);
    ``missed``: the lowest rate missed (None: not even ``hi``); ``probes``: (rate, met) in
    the order run."""
    assert 0 < lo < hi and max_probes >= 2
    probes: list[tuple[float, bool]] = []

    def probe(rate: float) -> bool:
        met = meets(rate)
        probes.append((rate, met))
        return met

    if not probe(lo):
        return {"capacity": None, "missed": lo, "probes": probes}
    if probe(hi):
        return {"capacity": hi, "missed": None, "probes": probes}
    good, bad = lo, hi
    while len(probes) < max_probes:
        mid = (good + bad) / 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return {"capacity": good, "missed": bad, "probes": probes}


def search_lines(search: dict[str, Any]) -> list[str]:
    """The printed lines of a rate search: one a probe, then the capacity found."""
    slo = " and ".join(f"{name} p99 <= {search['slo'][key]:g} ms" for name, key in
                       (("TBT", "tbt_p99_ms"), ("TTFT", "ttft_p99_ms"))
                       if search["slo"][key] is not None)
    lines = [f"{'probe':<12}{'req/s':>8}{'TBT p99':>10}{'TTFT p99':>10}{'tok/s':>9}  verdict"]
    for p in search["probes"]:
        tbt, ttft = p["summary"]["tbt_ms"]["p99"], p["summary"]["ttft_ms"]["p99"]
        verdict = "meets" if p["meets_slo"] else "misses: " + "; ".join(p["misses"])
        lines.append(f"{'':<12}{p['rate']:>8.3g}"
                     + "".join(f"{'-' if v is None else f'{v:.1f}':>10}" for v in (tbt, ttft))
                     + f"{p['summary']['output_throughput']:>9.1f}  {verdict}")
    capacity = search["capacity"]
    lo, hi = search["range"]
    found = (f"below {lo:g} req/s (missed at the lowest rate)" if capacity is None else
             f"at least {hi:g} req/s (met at the highest rate)" if search["missed"] is None
             else f"{capacity:.3g} req/s (missed at {search['missed']:.3g})")
    lines.append(f"{'capacity':<12}{found} under {slo}")
    return lines
