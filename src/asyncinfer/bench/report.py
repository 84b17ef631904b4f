"""The report of an `asyncinfer bench serve` run: counts, throughputs, goodput and latency
percentiles, overall and per group, as a JSON-ready dict and as a table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncinfer.bench.client import RequestResult
from asyncinfer.bench.latency import percentile, stats_ms, tbt_stats
from asyncinfer.bench.search import search_lines


def _meets_slo(r: RequestResult, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    tpot = r.tpot
    return (r.ttft is not None and (ttft_ms is None or r.ttft * 1000 <= ttft_ms)
            and (tpot_ms is None or tpot is None or tpot * 1000 <= tpot_ms))


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Counts, throughputs, goodput (None without an SLO) and latencies in ms. Hung-up requests
    count in ``hung_up`` only; the ``kept`` rest are ``completed`` or ``failed``."""
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
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "tbt_ms": tbt_stats([r.itl for r in done], output_tokens,
                            sum(r.chunks for r in done)),
        "e2e_ms": stats_ms([r.e2e for r in done if r.e2e is not None]),
    }


def group_summaries(results: list[RequestResult], duration: float,
                    slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict[str, dict[str, Any]]:
    """``summarize`` per ``tenant``, ``priority`` and ``class`` (long or short prompt), each kind
    only when the run used it; throughputs over the whole run's ``duration``."""
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


def request_row(r: RequestResult) -> dict[str, Any]:
    def ms(s: float | None) -> float | None:
        return None if s is None else s * 1000

    gaps = sorted(r.itl)
    return {"sent_s": r.sent, "prompt_len": r.prompt_len, "output_len": r.output_len,
            "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot),
            "chunks": r.chunks, "tbt_p50_ms": ms(percentile(gaps, 50)) if gaps else None,
            "tbt_p99_ms": ms(percentile(gaps, 99)) if gaps else None,
            "tbt_max_ms": ms(gaps[-1]) if gaps else None,
            "e2e_ms": ms(r.e2e) if r.ok else None, "error": r.error,
            "hung_up": r.hung_up, "tenant": r.tenant, "priority": r.priority, "long": r.long}


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of a report."""
    p = report["params"]
    load = ("all at once" if p["load"] == "burst" else
            f"{p['concurrency']} closed-loop workers" if p["load"] == "closed_loop" else
            f"gamma arrivals (burstiness {p['burstiness']:g}) at {p['rate']:g} req/s"
            if p["load"] == "gamma" else
            f"Poisson arrivals; below, the {_shown_probe(report)} probe's run at "
            f"{p['rate']:g} req/s" if p["load"] == "rate_search" else
            f"Poisson arrivals at {p['rate']:g} req/s")
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
    tbt = report["tbt_ms"]
    rows = [("TTFT", report["ttft_ms"]), ("TPOT", report["tpot_ms"]),
            ("TBT", tbt), ("TBT p99/req", tbt["per_request_p99"]), ("E2E", report["e2e_ms"])]
    for name, stats in rows:
        cells = ["-" if stats[k] is None else f"{stats[k]:.1f}"
                 for k in ("mean", "p50", "p99", "max")]
        lines.append(f"{name:<12}" + "".join(f"{c:>10}" for c in cells))
    if (per_chunk := tbt["tokens_per_chunk"]) is not None and per_chunk > 1.05:
        lines.append(f"{'':<12}(chunks held {per_chunk:.2f} tokens on average: a TBT gap "
                     f"is a chunk's)")
    lines += _group_lines(report.get("groups") or {})
    if (verdict := report.get("slo")) is not None:
        lines.append(f"{'SLO':<12}" + ("met" if verdict["meets"] else
                                       "missed: " + "; ".join(verdict["misses"])))
    if (search := report.get("rate_search")) is not None:
        lines += search_lines(search)
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


def _shown_probe(report: dict[str, Any]) -> str:
    return "lowest" if report["rate_search"]["capacity"] is None else "capacity"


def _group_lines(groups: dict[str, dict[str, Any]]) -> list[str]:
    """A header, then a line per group: counts, TTFT, TPOT, TBT, E2E p50 and p99, goodput."""
    if not groups:
        return []

    def cell(value: float | None, width: int, digits: int = 1) -> str:
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    stats = ("ttft_ms", "tpot_ms", "tbt_ms", "e2e_ms")
    lines = [f"{'group (ms)':<16}{'done':>6}{'failed':>7}"
             + "".join(f"{name + ' p50':>10}{'p99':>9}" for name in ("TTFT", "TPOT", "TBT",
                                                                      "E2E"))
             + f"{'goodput':>9}"]
    for kind, members in groups.items():
        for name, s in members.items():
            label = name if kind == "class" else f"{kind} {name}"
            row = f"{label[:15]:<16}{s['completed']:>6}{s['failed']:>7}"
            for stat in stats:
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
