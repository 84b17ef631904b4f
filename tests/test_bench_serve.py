"""`asyncinfer bench serve` against a fake OpenAI-compatible server on loopback: counts,
latency statistics, the seeded arrival schedule, goodput, failures that never crash it, the
hostile load: clients hanging up mid-stream, then the server's gauges polled until it
drains; and the workloads: tenants and priorities reaching the server, reports per group,
each tenant's service, and the flags that are refused."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import re
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asyncinfer.bench.client import RequestResult
from asyncinfer.bench.latency import tbt_gaps, tbt_stats
from asyncinfer.bench.plan import arrival_schedule, make_requests, plan_hangups, plan_long
from asyncinfer.bench.report import summarize
from asyncinfer.bench.scrape import check_drained, parse_gauges
from asyncinfer.bench.search import Slo, bisect_rates
from asyncinfer.bench.serve import add_parser, main, plan_run
from asyncinfer.bench.traffic import chat, draw_labels, tenant_arrivals
from asyncinfer.bench.workload_file import read_workload_file, write_workload_file
from asyncinfer.errors import AsyncInferError

FAST = 0.002  # seconds before each chunk of a normal request
SLOW = 0.3  # well past the SLOs of the goodput test, even on a loaded machine


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


Gauges = tuple[int, int, int]  # requests_running, requests_waiting, kv_pages_used


class FakeServer:
    """Streams ``max_tokens`` tokens of text, ``tokens_per_chunk`` a chunk, after an empty
    first chunk (as a chat role chunk), then a usage chunk and [DONE]; ``plan(k)`` picks how
    the k-th request (from 0) behaves: ok, 500, slow_ttft, slow_tpot, disconnect,
    error_frame or hang.

    Records each request's body and X-Tenant header, the prompts of streams finished to
    [DONE], and, for streams the client broke off, the prompt and how many text chunks had
    been written. Requests for a tenant in ``slow_for`` are slow to their first token.
    ``/metrics`` serves ``gauges`` one scrape after another, the last one over and over, or
    waits for all ``barrier`` requests to have arrived when that is set.
    """

    def __init__(self, plan: Callable[[int], str] = lambda k: "ok", usage: bool = True,
                 delay: float = FAST, gauges: list[Gauges] | None = None,
                 barrier: int = 0, slow_for: tuple[str, ...] = (),
                 tokens_per_chunk: int = 1) -> None:
        self.plan, self.usage, self.delay, self.slow_for = plan, usage, delay, slow_for
        self.tokens_per_chunk = tokens_per_chunk
        self.counter = itertools.count()
        self.bodies: list[dict[str, Any]] = []
        self.tenant_headers: list[str | None] = []
        self.finished: list[tuple[int, ...]] = []
        self.aborted: list[tuple[tuple[int, ...], int]] = []
        self.gauges, self.scrapes = gauges or [(0, 0, 0)], 0
        self.barrier, self.in_flight, self.most_in_flight = barrier, 0, 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        running, waiting, pages = self.gauges[min(self.scrapes, len(self.gauges) - 1)]
        self.scrapes += 1
        lines = []
        for name, value in (("requests_waiting", waiting), ("requests_running", running),
                            ("kv_pages_used", pages), ("kv_pages_total", 64)):
            lines += [f"# HELP asyncinfer_{name} {name}", f"# TYPE asyncinfer_{name} gauge",
                      f"asyncinfer_{name} {float(value)}"]
        lines.append('asyncinfer_requests_total{outcome="cancelled"} 3.0')
        return web.Response(text="\n".join(lines) + "\n")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        kind = self.plan(next(self.counter))
        body = await request.json()
        self.bodies.append(body)
        self.tenant_headers.append(request.headers.get("X-Tenant"))
        if body.get("user") in self.slow_for:
            kind = "slow_ttft"
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        written = [0]
        try:
            if self.barrier:
                while len(self.bodies) < self.barrier:
                    await asyncio.sleep(0.01)
            return await self.stream(request, kind, body, written)
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted.append((tuple(body["prompt"]), written[0]))
            raise
        finally:
            self.in_flight -= 1

    async def stream(self, request: web.Request, kind: str, body: dict[str, Any],
                     written: list[int]) -> web.StreamResponse:
        if kind == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse({"choices": [{"text": ""}], "usage": None}))
        if kind == "hang":
            await asyncio.sleep(5)
        n = body["max_tokens"]
        for i in range(n):
            slow = (kind == "slow_ttft" and i == 0) or (kind == "slow_tpot" and i > 0)
            await asyncio.sleep(SLOW if slow else self.delay)
            if kind == "disconnect" and i == 1:
                assert request.transport is not None
                request.transport.close()
                return response
            if (i + 1) % self.tokens_per_chunk and i < n - 1:
                continue  # this token's text goes out with the next ones
            finish = "length" if i == n - 1 else None
            await response.write(_sse({"choices": [{"text": f"t{i} ", "finish_reason": finish}],
                                       "usage": None}))
            written[0] += 1
        if kind == "error_frame":
            await response.write(_sse({"error": {"message": "engine failed"}}))
        if self.usage:
            await response.write(_sse({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": n}}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.finished.append(tuple(body["prompt"]))
        return response


@contextmanager
def serving(server: FakeServer) -> Iterator[str]:
    """Run the fake on 127.0.0.1, an ephemeral port, in a thread with its own event loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app(), shutdown_timeout=0.5, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def bench(server: FakeServer, tmp_path: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """Run ``main`` against the fake; its exit status and its JSON report."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    out = tmp_path / "report.json"
    with serving(server) as url:
        args = parser.parse_args(["serve", "--url", url, "--json", str(out), *options])
        status = main(args)
    return status, json.loads(out.read_text())


def test_every_request_completes_with_its_exact_lengths(tmp_path: Path) -> None:
    server = FakeServer()
    status, report = bench(server, tmp_path, "--concurrency", "3", "--num-requests", "7",
                           "--input-len", "16", "--output-len", "5")
    assert status == 0
    assert (report["completed"], report["failed"]) == (7, 0)
    assert report["total_input_tokens"] == 7 * 16
    assert report["total_output_tokens"] == 7 * 5
    assert report["params"]["model"] == "fake-model"  # asked of /v1/models
    for body in server.bodies:
        assert body["model"] == "fake-model"
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])
        assert body["max_tokens"] == 5 and body["ignore_eos"] and body["stream"]
        assert body["stream_options"] == {"include_usage": True}


def test_latencies_are_positive_and_ordered(tmp_path: Path) -> None:
    _, report = bench(FakeServer(), tmp_path, "--concurrency", "4", "--num-requests", "8",
                      "--output-len", "6")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[name]
        assert 0 < stats["p50"] <= stats["p99"] <= stats["max"], name
        assert 0 < stats["mean"] <= stats["max"], name
    for row in report["requests"]:
        assert 0 < row["ttft_ms"] < row["e2e_ms"]
        assert row["tpot_ms"] == pytest.approx((row["e2e_ms"] - row["ttft_ms"]) / 5)


def test_tbt_gaps_and_their_percentiles_from_known_chunk_times() -> None:
    first = tbt_gaps([0.1, 0.2, 0.25, 1.25, 1.3])  # one stall of 1 s
    second = tbt_gaps([0.0, 0.02, 0.04])
    assert first == pytest.approx([0.1, 0.05, 1.0, 0.05])
    assert second == pytest.approx([0.02, 0.02]) and tbt_gaps([0.3]) == []
    stats = tbt_stats([first, second, []], tokens=12, chunks=8)
    # Pooled, in ms: 20 20 50 50 100 1000 (numpy's linear interpolation).
    assert stats["gaps"] == 6
    assert stats["p50"] == pytest.approx(50) and stats["max"] == pytest.approx(1000)
    assert stats["p99"] == pytest.approx(100 + 0.95 * 900)
    assert stats["mean"] == pytest.approx(1240 / 6)
    # Each request's own P99: 100 + 0.97 * 900 = 973, and 20; the third has no gap.
    own = stats["per_request_p99"]
    assert own["max"] == pytest.approx(973) and own["mean"] == pytest.approx((973 + 20) / 2)
    assert own["p99"] == pytest.approx(20 + 0.99 * 953)
    assert stats["tokens_per_chunk"] == 1.5
    assert tbt_stats([])["p99"] is None and tbt_stats([])["tokens_per_chunk"] is None


@pytest.mark.parametrize("per_chunk", [1, 2])
def test_tbt_counts_a_gap_per_chunk_and_the_tokens_chunks_held(
        tmp_path: Path, per_chunk: int, capsys: pytest.CaptureFixture[str]) -> None:
    status, report = bench(FakeServer(tokens_per_chunk=per_chunk), tmp_path, "--concurrency",
                           "3", "--num-requests", "4", "--output-len", "6")
    assert status == 0
    chunks = 6 // per_chunk
    tbt = report["tbt_ms"]
    assert tbt["gaps"] == 4 * (chunks - 1) and tbt["tokens_per_chunk"] == per_chunk
    assert 0 < tbt["p50"] <= tbt["p99"] <= tbt["max"]
    assert 0 < tbt["per_request_p99"]["p50"] <= tbt["max"]
    for row in report["requests"]:
        assert row["chunks"] == chunks and row["output_tokens"] == 6
        assert 0 < row["tbt_p50_ms"] <= row["tbt_p99_ms"] <= row["tbt_max_ms"]
    out = capsys.readouterr().out
    assert any(line.startswith("TBT p99/req ") for line in out.splitlines())
    assert ("chunks held 2.00 tokens" in out) == (per_chunk == 2)


def test_bisection_finds_the_threshold_of_a_monotone_probe() -> None:
    asked: list[float] = []

    def below(threshold: float) -> Callable[[float], bool]:
        def meets(rate: float) -> bool:
            asked.append(rate)
            return rate <= threshold
        return meets

    found = bisect_rates(below(3.7), 1.0, 10.0, max_probes=8)
    assert [rate for rate, _ in found["probes"]] == asked and len(asked) == 8
    assert asked[:4] == [1.0, 10.0, 5.5, 3.25]  # lo, hi, then midpoints
    assert found["capacity"] <= 3.7 < found["missed"]
    assert found["missed"] - found["capacity"] == pytest.approx(9 / 2**6)
    assert all(met == (rate <= 3.7) for rate, met in found["probes"])
    asked.clear()
    assert bisect_rates(below(0.5), 1.0, 10.0, 8) == {
        "capacity": None, "missed": 1.0, "probes": [(1.0, False)]}
    asked.clear()
    assert bisect_rates(below(99), 1.0, 10.0, 8)["capacity"] == 10.0 and len(asked) == 2


def test_a_run_misses_the_slo_on_a_slow_tail_or_any_failure() -> None:
    def summary(tbt: float, ttft: float, failed: int = 0) -> dict[str, Any]:
        return {"completed": 5, "failed": failed, "tbt_ms": {"p99": tbt},
                "ttft_ms": {"p99": ttft}}

    slo = Slo(tbt_p99_ms=100, ttft_p99_ms=500)
    assert slo.misses(summary(100, 500)) == []
    assert slo.misses(summary(101, 900)) == ["TBT p99 101.0 ms > 100 ms",
                                             "TTFT p99 900.0 ms > 500 ms"]
    assert slo.misses(summary(10, 10, failed=1)) == ["1 failed"]
    assert Slo(tbt_p99_ms=100).misses(summary(10, 1e9)) == []
    assert "no request completed" in slo.misses({**summary(10, 10), "completed": 0})


def test_a_rate_search_records_every_probe(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    options = ("--rate-search", "40:160", "--num-requests", "4", "--output-len", "3")
    server = FakeServer()
    status, report = bench(server, tmp_path, *options, "--slo-tbt-p99-ms", "1e9")
    assert status == 0
    # The second probe sends the same lengths, none of the first probe's prompts.
    first, second = server.bodies[:4], server.bodies[4:]
    assert sorted(len(b["prompt"]) for b in first) == sorted(len(b["prompt"]) for b in second)
    assert not {tuple(b["prompt"]) for b in first} & {tuple(b["prompt"]) for b in second}
    search = report["rate_search"]
    assert [p["rate"] for p in search["probes"]] == [40, 160]  # met at both ends
    assert (search["capacity"], search["missed"], search["range"]) == (160, None, [40, 160])
    for probe in search["probes"]:
        assert probe["meets_slo"] and probe["misses"] == []
        assert len(probe["requests"]) == 4 and probe["summary"]["tbt_ms"]["gaps"] == 8
    assert report["params"]["load"] == "rate_search" and report["params"]["rate"] == 160
    assert report["completed"] == 4 and report["slo"]["meets"]
    assert "capacity    at least 160 req/s" in capsys.readouterr().out
    # An SLO no run can meet: the lowest rate misses it, and the search stops there.
    status, report = bench(FakeServer(), tmp_path, *options, "--slo-tbt-p99-ms", "1e-9",
                           "--max-probes", "3")
    assert status == 0  # missing an SLO is a finding
    search = report["rate_search"]
    assert [p["rate"] for p in search["probes"]] == [40] and search["capacity"] is None
    assert search["probes"][0]["misses"][0].startswith("TBT p99 ")
    assert not report["slo"]["meets"] and "below 40 req/s" in capsys.readouterr().out


def test_an_slo_without_a_search_is_judged_on_the_run(tmp_path: Path) -> None:
    _, report = bench(FakeServer(), tmp_path, "--rate", "50", "--num-requests", "3",
                      "--output-len", "3", "--slo-ttft-p99-ms", "1e9")
    assert report["slo"] == {"tbt_p99_ms": None, "ttft_p99_ms": 1e9, "meets": True,
                             "misses": []}
    assert report["rate_search"] is None
    _, report = bench(FakeServer(), tmp_path, "--rate", "50", "--num-requests", "3")
    assert report["slo"] is None


def test_output_tokens_are_counted_from_chunks_without_usage(tmp_path: Path) -> None:
    _, report = bench(FakeServer(usage=False), tmp_path, "--concurrency", "2",
                      "--num-requests", "4", "--output-len", "3")
    assert [row["output_tokens"] for row in report["requests"]] == [3, 3, 3, 3]


def test_length_ranges_draw_within_bounds(tmp_path: Path) -> None:
    server = FakeServer()
    bench(server, tmp_path, "--concurrency", "4", "--num-requests", "12",
          "--input-len-range", "4,9", "--output-len-range", "2,4")
    assert {len(b["prompt"]) for b in server.bodies} <= set(range(4, 10))
    assert {b["max_tokens"] for b in server.bodies} <= {2, 3, 4}


def test_arrival_schedule_is_reproducible_from_its_seed() -> None:
    schedule = arrival_schedule(1000, 4.0, seed=7)
    assert schedule == arrival_schedule(1000, 4.0, seed=7)
    assert schedule != arrival_schedule(1000, 4.0, seed=8)
    assert schedule[0] == 0.0 and schedule == sorted(schedule)
    assert schedule[-1] / 999 == pytest.approx(1 / 4.0, rel=0.1)  # mean gap of a 4/s process


def test_the_workload_is_reproducible_from_its_seed() -> None:
    draw = make_requests(20, (4, 64), (1, 32), seed=5)
    assert draw == make_requests(20, (4, 64), (1, 32), seed=5)
    assert draw != make_requests(20, (4, 64), (1, 32), seed=6)
    assert all(4 <= len(r.prompt) <= 64 and 1 <= r.output_len <= 32 for r in draw)


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_schedule(5, float("inf"), seed=0) == [0.0] * 5


def never_early(report: dict[str, Any], schedule: list[float]) -> bool:
    """Each request was sent no earlier than its time (a loaded machine may only send late)."""
    return all(row["sent_s"] >= at - 1e-3 for row, at in zip(report["requests"], schedule))


def test_open_loop_sends_on_the_schedule(tmp_path: Path) -> None:
    # The server answers none until all 6 have arrived: an open loop must send each on its
    # time without waiting for the earlier ones' answers.
    server = FakeServer(barrier=6)
    status, report = bench(server, tmp_path, "--rate", "40", "--seed", "3",
                           "--num-requests", "6", "--output-len", "2", "--timeout", "60")
    assert status == 0 and report["params"]["load"] == "poisson"
    assert report["completed"] == 6 and server.most_in_flight == 6
    assert never_early(report, arrival_schedule(6, 40.0, seed=3))


def test_goodput_of_a_run_leaves_out_the_slow_requests(tmp_path: Path) -> None:
    plan = ("slow_ttft", "slow_tpot", "ok")
    status, report = bench(FakeServer(lambda k: plan[k % 3]), tmp_path, "--concurrency", "6",
                           "--num-requests", "6", "--output-len", "3",
                           "--slo-ttft-ms", "150", "--slo-tpot-ms", "150")
    assert status == 0 and report["completed"] == 6
    # The 4 slow ones (300 ms sleeps) can never meet the SLOs; whether the 2 others do
    # depends on the machine, so goodput is checked against the rows, not a fixed count.
    good = [r["ttft_ms"] <= 150 and r["tpot_ms"] <= 150 for r in report["requests"]]
    assert sum(r["ttft_ms"] > 290 or r["tpot_ms"] > 290 for r in report["requests"]) >= 4
    assert report["good_requests"] == sum(good) <= 2
    assert report["goodput"] == pytest.approx(sum(good) / report["duration_s"])


def test_goodput_counts_requests_within_both_slos() -> None:
    def done(ttft: float, tpot: float) -> RequestResult:
        return RequestResult(4, 3, ttft=ttft, e2e=ttft + 2 * tpot, itl=[tpot, tpot],
                             output_tokens=3)

    results = [done(0.3, 0.01), done(0.01, 0.3), done(0.01, 0.01), done(0.1, 0.1),
               RequestResult(4, 3, error="HTTP 500")]
    report = summarize(results, duration=2.0, slo_ttft_ms=150, slo_tpot_ms=150)
    assert (report["completed"], report["good_requests"], report["goodput"]) == (4, 2, 1.0)
    assert summarize(results, 2.0, slo_ttft_ms=150)["good_requests"] == 3
    assert summarize(results, 2.0, slo_tpot_ms=150)["good_requests"] == 3


def test_goodput_is_absent_without_an_slo(tmp_path: Path) -> None:
    _, report = bench(FakeServer(), tmp_path, "--num-requests", "2", "--output-len", "2")
    assert report["goodput"] is None and report["good_requests"] is None


def test_http_errors_are_counted_as_failures(tmp_path: Path) -> None:
    status, report = bench(FakeServer(lambda k: "500" if k % 3 == 0 else "ok"), tmp_path,
                           "--concurrency", "3", "--num-requests", "9", "--output-len", "2")
    assert status == 0
    assert (report["completed"], report["failed"]) == (6, 3)
    assert report["errors"] == {"HTTP 500": 3}
    assert report["total_output_tokens"] == 6 * 2


def test_the_servers_error_message_is_logged_once_per_status(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncinfer.bench.client"):
        bench(FakeServer(lambda k: "500"), tmp_path, "--concurrency", "2", "--num-requests", "4")
    [record] = caplog.records
    assert "HTTP 500" in record.getMessage() and "boom" in record.getMessage()


def test_broken_streams_and_timeouts_are_counted_as_failures(tmp_path: Path) -> None:
    plan = ("disconnect", "error_frame", "hang", "ok")
    status, report = bench(FakeServer(lambda k: plan[k]), tmp_path, "--concurrency", "4",
                           "--num-requests", "4", "--output-len", "3", "--timeout", "1")
    assert status == 0
    assert (report["completed"], report["failed"]) == (1, 3)
    assert "error in stream: engine failed" in report["errors"]
    assert "timeout after 1 s" in report["errors"]


def test_a_run_where_nothing_completes_exits_1(tmp_path: Path) -> None:
    status, report = bench(FakeServer(lambda k: "500"), tmp_path, "--num-requests", "3")
    assert status == 1 and report["failed"] == 3
    assert report["ttft_ms"]["p50"] is None


def test_an_unreachable_server_is_an_error_naming_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", f"http://127.0.0.1:{port}", "--timeout", "5"])
    with pytest.raises(AsyncInferError, match=f"127.0.0.1:{port}/v1/models"):
        main(args)


def test_plot_rate_sweep_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot_rate_sweep

    def report(policy: str, rate: float, scale: float) -> dict[str, Any]:
        stats = {"p50": 10 * rate * scale, "p99": 30 * rate * scale}
        return {"params": {"policy": policy, "rate": rate, "load": "poisson"},
                "ttft_ms": stats, "tpot_ms": {k: v / 10 for k, v in stats.items()}}

    results = [report(p, r, s) for p, s in (("prefill_first", 1.0), ("decode_first", 1.5))
               for r in (1.0, 2.0, 4.0)]
    results.append({"params": {"policy": "x", "rate": None, "load": "burst"}})
    path = plot_rate_sweep(results, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hangups_are_a_seeded_choice_of_the_given_share() -> None:
    specs = make_requests(1000, (4, 8), (1, 40), seed=3)
    planned = plan_hangups(specs, 0.3, seed=3)
    hangups = [s.hangup_after for s in planned if s.hangup_after is not None]
    assert len(hangups) == 300
    assert [(s.prompt, s.output_len) for s in planned] == [(s.prompt, s.output_len)
                                                           for s in specs]
    assert all(s.hangup_after is None or 1 <= s.hangup_after <= max(1, s.output_len // 2)
               for s in planned)
    assert len(set(hangups)) > 10  # K is drawn, not fixed
    assert planned == plan_hangups(specs, 0.3, seed=3)
    assert planned != plan_hangups(specs, 0.3, seed=4)
    assert plan_hangups(specs, 0.0, seed=3) == specs
    assert sum(s.hangup_after is not None for s in plan_hangups(specs[:7], 0.5, seed=0)) == 4


def test_hung_up_requests_break_off_mid_stream_and_are_no_failures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Slow chunks, so the server is still streaming when it notices the client has gone.
    server = FakeServer(delay=0.01)
    status, report = bench(server, tmp_path, "--concurrency", "20", "--num-requests", "20",
                           "--input-len", "8", "--output-len", "12",
                           "--hangup-fraction", "0.3", "--seed", "4")
    planned = plan_hangups(make_requests(20, (8, 8), (12, 12), seed=4), 0.3, seed=4)
    hang = {s.prompt: s.hangup_after for s in planned if s.hangup_after is not None}
    assert status == 0
    assert (report["hung_up"], report["kept"]) == (6, 14)
    assert (report["completed"], report["failed"], report["errors"]) == (14, 0, {})
    # The server saw exactly those clients go away, each after their K-th chunk, before its
    # last; every other stream it finished.
    assert {prompt for prompt, _ in server.aborted} == set(hang)
    for prompt, written in server.aborted:
        assert hang[prompt] <= written < 12
    assert sorted(server.finished) == sorted(s.prompt for s in planned if s.hangup_after is None)
    rows = report["requests"]
    assert [row["hung_up"] for row in rows] == [s.hangup_after is not None for s in planned]
    kept_e2e = [row["e2e_ms"] for row in rows if not row["hung_up"]]
    assert all(row["e2e_ms"] is None and row["error"] is None for row in rows if row["hung_up"])
    assert report["e2e_ms"]["max"] == pytest.approx(max(kept_e2e))
    assert report["total_output_tokens"] == 14 * 12
    # A hang-up storm checks the server drained, unless told not to.
    assert report["params"]["check_drained"] and report["drain"]["clean"]
    out = capsys.readouterr().out
    assert "6 hung up mid-stream, 14 kept: 14 completed, 0 failed" in out


def test_hung_up_requests_stay_out_of_latencies_and_failures() -> None:
    def result(ttft: float, e2e: float | None, error: str | None = None,
               hung_up: bool = False) -> RequestResult:
        return RequestResult(4, 3, ttft=ttft, e2e=e2e, itl=[0.01, 0.01], output_tokens=3,
                             error=error, hung_up=hung_up)

    results = [result(0.1, 0.2), result(0.2, 0.4), result(9.0, None, hung_up=True),
               result(0.3, None, error="stream ended before [DONE]"),
               result(8.0, None, hung_up=True)]
    report = summarize(results, duration=2.0)
    assert (report["hung_up"], report["kept"]) == (2, 3)
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["errors"] == {"stream ended before [DONE]": 1}
    assert report["ttft_ms"]["max"] == pytest.approx(200.0)
    assert report["total_output_tokens"] == 6 and report["request_throughput"] == 1.0


def test_the_drain_check_polls_the_gauges_until_nothing_runs_or_waits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(gauges=[(5, 3, 40), (2, 0, 12), (0, 1, 3), (0, 0, 0), (9, 9, 9)])
    status, report = bench(server, tmp_path, "--num-requests", "2", "--output-len", "2",
                           "--check-drained")
    assert status == 0 and server.scrapes == 4
    drain = report["drain"]
    assert drain["drained"] and drain["clean"] and drain["error"] is None
    assert (drain["requests_running"], drain["requests_waiting"], drain["kv_pages_used"]) == (
        0, 0, 0)
    assert "drained after" in capsys.readouterr().out


def test_a_server_that_does_not_drain_fails_the_check(tmp_path: Path) -> None:
    server = FakeServer(gauges=[(3, 2, 8), (1, 0, 4)])
    status, report = bench(server, tmp_path, "--num-requests", "2", "--output-len", "2",
                           "--check-drained", "--drain-timeout", "0.3")
    assert status == 1 and server.scrapes > 2
    drain = report["drain"]
    assert not drain["drained"] and not drain["clean"] and drain["waited_s"] >= 0.3
    assert (drain["requests_running"], drain["requests_waiting"], drain["kv_pages_used"]) == (
        1, 0, 4)


def test_pages_used_with_nothing_running_are_a_leak(tmp_path: Path) -> None:
    server = FakeServer(gauges=[(0, 0, 5)])
    status, report = bench(server, tmp_path, "--num-requests", "2", "--output-len", "2",
                           "--check-drained", "--drain-timeout", "0.3")
    drain = report["drain"]
    assert status == 1 and drain["drained"] and not drain["clean"]
    assert drain["kv_pages_used"] == 5


def test_the_drain_check_runs_only_when_asked_or_after_hangups(tmp_path: Path) -> None:
    server = FakeServer()
    # /metrics is read once before and once after the load (the server's counters); the
    # drain check would poll it beyond that.
    _, report = bench(server, tmp_path, "--num-requests", "2", "--output-len", "2")
    assert report["drain"] is None and server.scrapes == 2
    _, report = bench(server, tmp_path, "--num-requests", "2", "--output-len", "4",
                      "--hangup-fraction", "0.5", "--no-check-drained")
    assert report["drain"] is None and server.scrapes == 4 and report["hung_up"] == 1


def test_a_server_without_the_gauges_fails_the_drain_check() -> None:
    with serving(FakeServer()) as url:
        drain = asyncio.run(check_drained(f"{url}/elsewhere", timeout=1))
    assert not drain["drained"] and not drain["clean"]
    assert "could not read" in drain["error"] and "404" in drain["error"]


def test_gauges_are_read_from_prometheus_text() -> None:
    text = ("# HELP asyncinfer_requests_running Requests holding a slot\n"
            "# TYPE asyncinfer_requests_running gauge\n"
            "asyncinfer_requests_running 2.0\n"
            "asyncinfer_requests_waiting 0.0\n"
            "asyncinfer_kv_pages_used 17.0\n"
            "asyncinfer_kv_pages_total 64.0\n"
            'asyncinfer_requests_total{outcome="cancelled"} 3.0\n')
    assert parse_gauges(text) == {"requests_running": 2, "requests_waiting": 0,
                                  "kv_pages_used": 17}


def test_a_burst_has_every_stream_open_at_once(tmp_path: Path) -> None:
    # Each request waits until all have arrived: a connection pool capping the client below
    # the burst's size would leave the rest queued and the run would time out.
    n = 300
    server = FakeServer(barrier=n)
    status, report = bench(server, tmp_path, "--concurrency", str(n), "--num-requests", str(n),
                           "--input-len", "4", "--output-len", "2", "--timeout", "20")
    assert status == 0 and report["completed"] == n
    assert server.most_in_flight == n


@pytest.mark.parametrize("fraction", ["1", "-0.1", "1.5"])
def test_the_hangup_fraction_is_below_1(fraction: str) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--hangup-fraction", fraction])


# --- Workloads --------------------------------------------------------------------------------

def parse(*options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *options])


def test_tenants_and_priorities_reach_the_server(tmp_path: Path) -> None:
    server = FakeServer()
    status, report = bench(server, tmp_path, "--concurrency", "5", "--num-requests", "30",
                           "--input-len", "8", "--output-len", "2", "--seed", "2",
                           "--tenants", "A:0.7,B:0.3", "--priorities", "0:0.5,7:0.5")
    assert status == 0
    prompts = [s.prompt for s in make_requests(30, (8, 8), (2, 2), seed=2)]
    tenants = draw_labels({"A": 0.7, "B": 0.3}, 30, "tenants-2")
    priorities = draw_labels({0: 0.5, 7: 0.5}, 30, "priorities-2")
    assert set(tenants) == {"A", "B"} and set(priorities) == {0, 7}
    expected = {p: (t, q) for p, t, q in zip(prompts, tenants, priorities)}
    assert len(server.bodies) == 30
    for body, header in zip(server.bodies, server.tenant_headers):
        tenant, priority = expected[tuple(body["prompt"])]
        assert (body["user"], header, body["priority"]) == (tenant, tenant, priority)
    rows = report["requests"]
    assert [(r["tenant"], r["priority"], r["long"]) for r in rows] == [
        (t, q, False) for t, q in zip(tenants, priorities)]
    assert report["params"]["tenants"] == {"A": 0.7, "B": 0.3}
    assert report["params"]["priorities"] == {"0": 0.5, "7": 0.5}


def test_without_tenants_or_priorities_nothing_extra_is_sent(tmp_path: Path) -> None:
    server = FakeServer()
    _, report = bench(server, tmp_path, "--num-requests", "3", "--output-len", "2")
    assert all("user" not in b and "priority" not in b for b in server.bodies)
    assert server.tenant_headers == [None, None, None]
    assert report["groups"] == {} and report["service"] is None
    assert report["params"]["workload"] == "uniform"
    assert report["params"]["input_dist"] == {"dist": "uniform", "lo": 128, "hi": 128}


def test_a_tenant_mix_leaves_prompts_and_times_as_they_were(tmp_path: Path) -> None:
    runs = []
    for mix in ([], ["--tenants", "A:1,B:1", "--priorities", "0:1,1:1"]):
        server = FakeServer()
        _, report = bench(server, tmp_path, "--rate", "50", "--num-requests", "8",
                          "--input-len-range", "4,30", "--output-len", "2", "--seed", "1",
                          *mix)
        runs.append((server, report))
    (plain, plain_report), (mixed, mixed_report) = runs
    assert sorted(b["prompt"] for b in plain.bodies) == sorted(b["prompt"] for b in mixed.bodies)
    assert [r["prompt_len"] for r in plain_report["requests"]] == [
        r["prompt_len"] for r in mixed_report["requests"]]
    assert {b["user"] for b in mixed.bodies} == {"A", "B"}
    flags = ["--rate", "50", "--num-requests", "8", "--input-len-range", "4,30", "--seed", "1"]
    plain_plan = plan_run(parse(*flags))
    mixed_plan = plan_run(parse(*flags, "--tenants", "A:1,B:1", "--priorities", "0:1,1:1"))
    assert [s.prompt for s in plain_plan[0]] == [s.prompt for s in mixed_plan[0]]
    assert plain_plan[1] == mixed_plan[1] == arrival_schedule(8, 50.0, seed=1)
    assert never_early(plain_report, plain_plan[1]) and never_early(mixed_report, plain_plan[1])


def test_reports_per_tenant_and_priority(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # B's requests are slow to their first token: its goodput under a TTFT SLO is 0.
    server = FakeServer(slow_for=("B",))
    status, report = bench(server, tmp_path, "--concurrency", "8", "--num-requests", "16",
                           "--input-len", "4", "--output-len", "3", "--tenants", "A:1,B:1",
                           "--priorities", "2:1,10:1", "--slo-ttft-ms", "150")
    assert status == 0
    tenants = Counter(draw_labels({"A": 1, "B": 1}, 16, "tenants-0"))
    priorities = Counter(draw_labels({2: 1, 10: 1}, 16, "priorities-0"))
    groups = report["groups"]
    assert set(groups) == {"tenant", "priority"}  # no long prompts: no class groups
    assert {name: g["completed"] for name, g in groups["tenant"].items()} == tenants
    assert list(groups["priority"]) == ["2", "10"]  # in numeric order
    assert {int(p): g["completed"] for p, g in groups["priority"].items()} == priorities
    a, b = groups["tenant"]["A"], groups["tenant"]["B"]
    # B's first tokens come after a 300 ms sleep; A's meet the SLO as fast as the machine is.
    a_good = sum(r["ttft_ms"] <= 150 for r in report["requests"] if r["tenant"] == "A")
    assert (a["good_requests"], b["good_requests"]) == (a_good, 0)
    assert b["ttft_ms"]["p50"] > 250
    assert a["goodput"] == pytest.approx(a_good / report["duration_s"])
    assert a["total_output_tokens"] == 3 * tenants["A"]
    out = capsys.readouterr().out
    for label in ("tenant A", "tenant B", "priority 2", "priority 10"):
        [line] = [line for line in out.splitlines() if line.startswith(label + " ")]
        assert line.split()[len(label.split())] == str(groups[label.split()[0]][
            label.split()[1]]["completed"])


def test_the_service_of_each_tenant_counts_its_tokens(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    status, report = bench(FakeServer(), tmp_path, "--num-requests", "12", "--output-len",
                           "3", "--input-len-range", "4,20", "--tenant-rates", "A:300,B:100",
                           "--service-w-in", "0.5", "--service-w-out", "3",
                           "--service-bucket-s", "0.01")
    assert status == 0
    arrivals = tenant_arrivals({"A": 300.0, "B": 100.0}, 12, seed=0)
    rows = report["requests"]
    assert [r["tenant"] for r in rows] == [name for _, name in arrivals]
    p = report["params"]
    assert (p["load"], p["rate"], p["tenant_rates"]) == ("poisson", 400.0,
                                                         {"A": 300.0, "B": 100.0})
    service = report["service"]
    assert (service["w_in"], service["w_out"], service["bucket_s"]) == (0.5, 3.0, 0.01)
    for name in ("A", "B"):
        mine = [r for r in rows if r["tenant"] == name]
        total = sum(0.5 * r["prompt_len"] + 3 * r["output_tokens"] for r in mine)
        assert service["total"][name] == pytest.approx(total)
        curve = service["cumulative"][name]
        assert curve == sorted(curve) and curve[-1] == pytest.approx(total)
    times = service["times_s"]
    assert times[:3] == pytest.approx([0, 0.01, 0.02])
    assert times[-1] >= max(r["sent_s"] + r["e2e_ms"] / 1000 for r in rows) - 0.01
    assert service["max_gap"]["tenants"] == ["A", "B"] and service["max_gap"]["gap"] >= 0
    assert "service     A " in capsys.readouterr().out


def test_sends_follow_the_gamma_schedule(tmp_path: Path) -> None:
    status, report = bench(FakeServer(), tmp_path, "--rate", "40", "--arrival", "gamma",
                           "--burstiness", "0.5", "--seed", "3", "--num-requests", "6",
                           "--output-len", "2")
    assert status == 0
    p = report["params"]
    assert (p["load"], p["arrival"], p["burstiness"], p["rate"]) == ("gamma", "gamma", 0.5, 40)
    expected = arrival_schedule(6, 40.0, seed=3, burstiness=0.5)
    assert expected != arrival_schedule(6, 40.0, seed=3)
    schedule = plan_run(parse("--rate", "40", "--arrival", "gamma", "--burstiness", "0.5",
                              "--seed", "3", "--num-requests", "6"))[1]
    assert schedule == expected and never_early(report, expected)


def test_long_prompts_are_sent_and_reported_apart(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer()
    status, report = bench(server, tmp_path, "--concurrency", "4", "--num-requests", "8",
                           "--input-len", "8", "--output-len", "2", "--long-fraction", "0.25",
                           "--long-factor", "30", "--max-input-len", "100")
    assert status == 0
    planned = plan_long(make_requests(8, (8, 8), (2, 2), seed=0), 0.25, 30, seed=0,
                        max_len=100)
    assert sorted(len(b["prompt"]) for b in server.bodies) == [8] * 6 + [100] * 2
    assert [r["long"] for r in report["requests"]] == [s.long for s in planned]
    classes = report["groups"]["class"]
    assert (classes["long"]["completed"], classes["short"]["completed"]) == (2, 6)
    assert (classes["long"]["total_input_tokens"], classes["short"]["total_input_tokens"]) == (
        200, 48)
    p = report["params"]
    assert (p["long_fraction"], p["long_factor"], p["max_input_len"]) == (0.25, 30, 100)
    out = capsys.readouterr().out
    assert any(line.startswith("long ") for line in out.splitlines())
    assert any(line.startswith("short ") for line in out.splitlines())


def test_the_chat_workload_draws_lognormal_lengths(tmp_path: Path) -> None:
    server = FakeServer(delay=0)
    status, report = bench(server, tmp_path, "--concurrency", "16", "--num-requests", "48",
                           "--workload", "chat", "--input-mean", "60", "--output-mean", "6")
    assert status == 0
    inputs, outputs = chat(60, 6)
    expected = make_requests(48, inputs, outputs, seed=0)
    assert sorted(len(b["prompt"]) for b in server.bodies) == sorted(
        len(s.prompt) for s in expected)
    assert sorted(b["max_tokens"] for b in server.bodies) == sorted(
        s.output_len for s in expected)
    assert len({len(s.prompt) for s in expected}) > 20
    p = report["params"]
    assert p["workload"] == "chat" and p["input_len"] == [4, 2048]
    assert p["input_dist"] == {"dist": "lognormal", "mean": 60.0, "sigma": 1.0, "lo": 4,
                               "hi": 2048, "mean_after_clipping": 60.0}


@pytest.mark.parametrize(("options", "message"), [
    (["--tenants", "A:x"], "argument --tenants: expected NAME:SHARE,... with each share a "
                           "finite number > 0, got 'x' in 'A:x'"),
    (["--tenants", "A"], "argument --tenants: expected NAME:SHARE,... got 'A' (no ':' in "
                         "'A')"),
    (["--tenant-rates", "A:10,B:inf"], "argument --tenant-rates: expected NAME:RATE,... with "
                                       "each rate a finite number > 0, got 'inf'"),
    (["--priorities", "low:0.5"], "argument --priorities: expected PRIORITY:SHARE,... got "
                                  "'low:0.5' (bad PRIORITY 'low')"),
    (["--priorities", "0:0"], "argument --priorities: expected PRIORITY:SHARE"),
    (["--long-fraction", "1.5"], "argument --long-fraction: expected a fraction"),
    (["--long-factor", "0.5"], "argument --long-factor: expected a number >= 1"),
    (["--burstiness", "0"], "argument --burstiness: expected a gamma shape > 0"),
    (["--workload", "trace"], "argument --workload: invalid choice: 'trace'"),
    (["--rate", "4", "--tenant-rates", "A:1"], "not allowed with argument --rate"),
    (["--rate-search", "5:2"], "argument --rate-search: expected LO:HI requests/s with 0 < LO"),
    (["--rate-search", "1:inf"], "argument --rate-search: expected LO:HI"),
    (["--rate", "4", "--rate-search", "1:2"], "not allowed with argument --rate"),
    (["--max-probes", "1"], "argument --max-probes: expected an integer >= 2"),
])
def test_bad_workload_flags_are_argparse_errors(options: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(*options)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_long_chat_workload_reaches_the_server_and_is_reported_by_class(
        tmp_path: Path) -> None:
    server = FakeServer(delay=0)
    status, report = bench(server, tmp_path, "--concurrency", "4", "--num-requests", "8",
                           "--workload", "long-chat", "--long-input-range", "40,50",
                           "--input-len-range", "4,8", "--output-len-range", "3,4",
                           "--long-output-range", "1,2", "--seed", "5")
    assert status == 0
    lengths = sorted(len(b["prompt"]) for b in server.bodies)
    assert all(4 <= n <= 8 for n in lengths[:6]) and all(40 <= n <= 50 for n in lengths[6:])
    classes = report["groups"]["class"]
    assert (classes["long"]["completed"], classes["short"]["completed"]) == (2, 6)
    assert classes["short"]["tbt_ms"]["gaps"] > 0
    p = report["params"]
    assert p["workload_spec"]["long_input"] == {"dist": "uniform", "lo": 40, "hi": 50}
    assert p["long_fraction"] == 0.25 and p["input_len"][1] <= 50


def test_the_prefix_share_workload_sends_its_shared_prefixes(tmp_path: Path) -> None:
    server = FakeServer(delay=0)
    status, report = bench(server, tmp_path, "--concurrency", "3", "--num-requests", "6",
                           "--workload", "prefix-share", "--prefix-groups", "2",
                           "--prefix-len", "20", "--output-len-range", "2,2")
    assert status == 0 and report["completed"] == 6
    shared = Counter(tuple(b["prompt"][:20]) for b in server.bodies)
    assert sorted(shared.values()) == [3, 3]  # two system prompts, three requests each
    assert report["params"]["prefix_groups"] == 2 and report["params"]["prefix_len"] == 20


@pytest.mark.parametrize(("options", "message"), [
    (["--input-mean", "40"], "--input-mean set the means of --workload chat"),
    (["--workload", "long-chat", "--prefix-groups", "2"], "does not read --prefix-groups"),
    (["--workload", "prefix-share", "--long-fraction", "0.1"], "does not read --long-fract"),
    (["--long-input-range", "5,9"], "--workload uniform does not read --long-input-range"),
    (["--workload", "prefix-share", "--prefix-groups", "0"], "--prefix-groups of 1 or more"),
    (["--rate-search", "1:2"], "give --slo-tbt-p99-ms and/or --slo-ttft-p99-ms"),
    (["--max-probes", "3", "--slo-tbt-p99-ms", "9"], "add --rate-search LO:HI"),
    (["--workload", "chat", "--input-len", "9"], "drop --input-len"),
    (["--tenants", "A:1", "--tenant-rates", "A:1"], "not both"),
    (["--arrival", "gamma", "--rate", "3"], "--arrival gamma needs --burstiness"),
    (["--burstiness", "0.5", "--rate", "3"], "add --arrival gamma"),
    (["--arrival", "gamma", "--burstiness", "2", "--concurrency", "2"], "not --concurrency"),
])
def test_flags_that_do_not_go_together_are_refused(options: list[str], message: str) -> None:
    # Refused before any request: the URL is never reached.
    with pytest.raises(AsyncInferError, match=message):
        main(parse("--url", "http://127.0.0.1:9", *options))


def test_a_workload_file_sends_its_requests_whole_and_in_order(tmp_path: Path) -> None:
    """Prompts, lengths and sampling as written; what a file leaves out is not sent."""
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"requests": [
        {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.6, "top_p": 0.9, "seed": 11},
        {"prompt": [8], "max_tokens": 2},
        {"prompt": [9, 10], "max_tokens": 1, "temperature": 1.5}]}))
    server = FakeServer(delay=0)
    status, report = bench(server, tmp_path, "--concurrency", "1", "--workload-file", str(path))
    assert status == 0 and report["completed"] == 3
    sent = [(b["prompt"], b["max_tokens"], b["temperature"], b.get("top_p"), b.get("seed"))
            for b in server.bodies]
    assert sent == [([5, 6, 7], 3, 0.6, 0.9, 11), ([8], 2, 0.0, None, None),
                    ([9, 10], 1, 1.5, None, None)]
    assert all(b["ignore_eos"] for b in server.bodies)
    assert [r["output_tokens"] for r in report["requests"]] == [3, 2, 1]
    p = report["params"]
    assert p["num_requests"] == 3 and p["workload_file"] == str(path)
    assert (p["input_tokens"], p["output_tokens_planned"]) == (6, 6)
    assert p["temperatures"] == [0.0, 0.6, 1.5]


def test_a_written_workload_file_reads_back_as_the_same_requests(tmp_path: Path) -> None:
    prompts, lengths = [[1, 2], [3, 4, 5]], [7, 9]
    specs = read_workload_file(write_workload_file(tmp_path / "w.json", prompts, lengths,
                                                   temperature=0.6))
    assert [(list(s.prompt), s.output_len, s.temperature, s.top_p, s.seed) for s in specs] == [
        ([1, 2], 7, 0.6, 1.0, None), ([3, 4, 5], 9, 0.6, 1.0, None)]


@pytest.mark.parametrize(("requests", "message"), [
    ([], "holds no request"),
    ([{"prompt": [], "max_tokens": 2}], "request 0: prompt must be a non-empty list"),
    ([{"prompt": [1], "max_tokens": 2}, {"prompt": ["a"], "max_tokens": 2}],
     "request 1: prompt must be a non-empty list of token ids"),
    ([{"prompt": [-1], "max_tokens": 2}], "request 0: prompt must be"),
    ([{"prompt": [1], "max_tokens": 0}],
     "request 0: max_tokens must be an integer in [1, 2147483647], got 0"),
    ([{"prompt": [1], "max_tokens": True}], "max_tokens must be an integer in"),
    ([{"prompt": [1], "max_tokens": 2**31}], "max_tokens must be an integer in"),
    ([{"prompt": [1], "max_tokens": None}], "max_tokens must be an integer in"),
    ([{"prompt": [1]}], "request 0: max_tokens is missing"),
    ([{"prompt": [1], "max_tokens": 2, "temperature": -1}], "temperature must be a finite"),
    ([{"prompt": [1], "max_tokens": 2, "temperature": float("nan")}],
     "temperature must be a finite"),
    ([{"prompt": [1], "max_tokens": 2, "temperature": 10**400}],
     "temperature must be a finite number"),
    ([{"prompt": [1], "max_tokens": 2, "top_p": 0}], "top_p must be a finite number in (0"),
    ([{"prompt": [1], "max_tokens": 2, "seed": 1.5}], "seed must be an integer in"),
    ([{"prompt": [1], "max_tokens": 2, "seed": 2**64}], "seed must be an integer in"),
    ([{"prompt": [2**31], "max_tokens": 2}], "prompt must be a non-empty list"),
    ([{"prompt": [1], "max_tokens": 2, "stop": ["x"]}], "unknown field(s) stop"),
    (["text"], "request 0: expected an object, got str"),
])
def test_a_malformed_workload_file_is_refused_naming_the_request(
        tmp_path: Path, requests: list[Any], message: str) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": requests}))
    with pytest.raises(AsyncInferError) as info:
        read_workload_file(path)
    assert message in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("{", "is not JSON"), ('{"prompts": []}', 'must hold {"requests": [...]}'),
    ("[1, 2]", 'must hold {"requests": [...]}'),
    ('{"requests": [{"prompt": [1], "max_tokens": 1}], "sampling": {}}', "and nothing else")])
def test_a_workload_file_that_is_not_one_is_refused(tmp_path: Path, text: str,
                                                    message: str) -> None:
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(AsyncInferError, match=re.escape(message)):
        read_workload_file(path)
    with pytest.raises(AsyncInferError, match="cannot read the workload file"):
        read_workload_file(tmp_path / "missing.json")


@pytest.mark.parametrize("flags", [["--num-requests", "5"], ["--input-len", "8"],
                                   ["--workload", "chat"], ["--prefix-groups", "2"],
                                   ["--output-len-range", "2,4"],
                                   ["--rate-search", "1:2", "--slo-tbt-p99-ms", "50"],
                                   ["--prompt-format", "text"]])
def test_a_workload_file_refuses_the_flags_that_would_plan_requests(
        tmp_path: Path, flags: list[str]) -> None:
    path = write_workload_file(tmp_path / "w.json", [[1]], [1])
    named = " ".join(flags[:2]) if flags[0] == "--prompt-format" else flags[0]
    with pytest.raises(AsyncInferError, match=f"--workload-file holds the requests whole.*"
                                              f"drop {re.escape(named)}"):
        main(parse("--workload-file", str(path), *flags))


def test_a_workload_file_is_not_sent_through_a_router_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a router prompts go as text, which would turn the file's ids into other
    prompts: refused, naming the URL."""
    path = write_workload_file(tmp_path / "w.json", [[1, 2]], [1])
    monkeypatch.setattr("asyncinfer.bench.serve.replica_urls",
                        lambda base, api_key: [f"{base}/a", f"{base}/b"])
    with pytest.raises(AsyncInferError, match=r"routes to replicas.*point --url at one server"):
        main(parse("--url", "http://127.0.0.1:9", "--workload-file", str(path)))
