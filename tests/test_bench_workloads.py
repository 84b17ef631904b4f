"""The workloads of `asyncinfer bench serve`: length distributions, gamma and per-tenant
arrivals, label mixes, long prompts, the spec parser, the service each tenant got and the
largest gap between two tenants' service while both were backlogged; and the scenario
drivers' helpers and plots."""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.bench.client import RequestResult
from asyncinfer.bench.plan import (
    TOKEN_IDS,
    arrival_schedule,
    label_requests,
    make_requests,
    plan_long,
    shift_ids,
)
from asyncinfer.bench.service import (
    TenantTrace,
    cumulative,
    intersect,
    largest_gap,
    service_report,
    service_traces,
    union,
)
from asyncinfer.bench.traffic import (
    CHAT_INPUT,
    CHAT_OUTPUT,
    LogNormal,
    Uniform,
    chat,
    draw_labels,
    parse_mix,
    tenant_arrivals,
    tenant_name,
)
from asyncinfer.bench.workloads import LongChat, PrefixShare


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def draws(dist: LogNormal | Uniform, n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


# --- Lengths ----------------------------------------------------------------------------------

def test_lognormal_draws_are_reproducible_from_their_seed() -> None:
    assert draws(CHAT_INPUT, 500, seed=3) == draws(CHAT_INPUT, 500, seed=3)
    assert draws(CHAT_INPUT, 500, seed=3) != draws(CHAT_INPUT, 500, seed=4)


def test_lognormal_draws_are_clipped_to_their_bounds() -> None:
    wide = LogNormal(100.0, 2.0, 10, 200)
    values = draws(wide, 5000)
    assert min(values) == 10 and max(values) == 200  # both bounds are reached, none passed
    assert all(isinstance(v, int) for v in values)
    assert sum(v == 200 for v in values) / len(values) == pytest.approx(
        1 - 0.5 * (1 + math.erf((math.log(200) - wide.mu) / (2.0 * math.sqrt(2)))), abs=0.02)


def test_lognormal_mu_puts_the_mean_where_asked() -> None:
    unclipped = LogNormal(338.0, 0.8)
    assert unclipped.mu == pytest.approx(math.log(338) - 0.32)
    values = draws(unclipped, 50_000)
    assert statistics.fmean(values) == pytest.approx(338, rel=0.03)
    assert statistics.median(values) == pytest.approx(math.exp(unclipped.mu), rel=0.03)


def test_chat_lengths_draw_what_docs_workloads_states() -> None:
    # docs/workloads.md's table: clipped to 4..2048 and 4..1024, means 160 and 321 after
    # clipping (ShareGPT's 161 and 338), medians 98 and 245, 3.8% of outputs at 1024.
    inputs, outputs = chat()
    prompt_lens, output_lens = draws(inputs, 50_000), draws(outputs, 50_000)
    assert min(prompt_lens) >= 4 and max(prompt_lens) <= 2048
    assert min(output_lens) >= 4 and max(output_lens) == 1024
    assert statistics.fmean(prompt_lens) == pytest.approx(160, rel=0.03)
    assert statistics.fmean(output_lens) == pytest.approx(321, rel=0.03)
    assert statistics.median(prompt_lens) == pytest.approx(98, rel=0.05)
    assert statistics.median(output_lens) == pytest.approx(245, rel=0.05)
    assert 0.03 < output_lens.count(1024) / len(output_lens) < 0.045
    # The mean the report states as mean_after_clipping is the draws'.
    assert outputs.describe()["mean_after_clipping"] == pytest.approx(
        statistics.fmean(output_lens), rel=0.03)


def test_the_mean_after_clipping_matches_the_draws() -> None:
    narrow = LogNormal(50.0, 1.5, 20, 80)
    assert narrow.expected() == pytest.approx(statistics.fmean(draws(narrow, 50_000)), rel=0.01)
    assert Uniform(4, 10).expected() == 7


def test_chat_means_can_be_overridden() -> None:
    inp, out = chat(input_mean=40, output_mean=8)
    small, default = draws(inp, 50_000), draws(CHAT_INPUT, 50_000)
    assert statistics.fmean(small) == pytest.approx(40, rel=0.03)
    # The spread stays: the median sits at the same share of the mean.
    assert statistics.median(small) / 40 == pytest.approx(statistics.median(default) / 161,
                                                          rel=0.05)
    assert min(draws(out, 5000)) == 4  # the clip bounds stay too
    assert chat() == (CHAT_INPUT, CHAT_OUTPUT)


def test_lognormal_refuses_a_mean_or_sigma_not_above_zero() -> None:
    with pytest.raises(ValueError, match="mean must be > 0"):
        LogNormal(0.0, 1.0)
    with pytest.raises(ValueError, match="sigma must be > 0"):
        LogNormal(10.0, 0.0)


def test_requests_draw_their_lengths_from_a_distribution() -> None:
    specs = make_requests(300, CHAT_INPUT, Uniform(2, 5), seed=2)
    assert all(4 <= len(s.prompt) <= 2048 and 2 <= s.output_len <= 5 for s in specs)
    assert len({len(s.prompt) for s in specs}) > 100
    # A range is a uniform distribution: the same requests either way.
    assert make_requests(50, (4, 64), (1, 32), seed=5) == make_requests(
        50, Uniform(4, 64), Uniform(1, 32), seed=5)


# --- Arrivals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_have_mean_one_over_the_rate(burstiness: float) -> None:
    schedule = arrival_schedule(20_000, 5.0, seed=1, burstiness=burstiness)
    between = gaps(schedule)
    assert schedule[0] == 0.0 and schedule == sorted(schedule)
    assert statistics.fmean(between) == pytest.approx(1 / 5.0, rel=0.05)
    # The shape sets how irregular the gaps are: coefficient of variation 1/sqrt(B).
    cv = statistics.pstdev(between) / statistics.fmean(between)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert schedule == arrival_schedule(20_000, 5.0, seed=1, burstiness=burstiness)
    assert schedule != arrival_schedule(20_000, 5.0, seed=2, burstiness=burstiness)


def test_gamma_of_shape_1_is_the_poisson_schedule() -> None:
    assert arrival_schedule(100, 3.0, seed=4, burstiness=1.0) == arrival_schedule(100, 3.0, 4)
    assert arrival_schedule(3, math.inf, seed=4, burstiness=0.5) == [0.0, 0.0, 0.0]


def test_tenant_processes_merge_in_time_order_at_their_own_rates() -> None:
    arrivals = tenant_arrivals({"A": 40.0, "B": 10.0}, 20_000, seed=3)
    times = [t for t, _ in arrivals]
    assert times[0] == 0.0 and times == sorted(times)
    counts = Counter(name for _, name in arrivals)
    assert counts["A"] / 20_000 == pytest.approx(0.8, abs=0.01)
    for name, rate in (("A", 40.0), ("B", 10.0)):
        own = [t for t, n in arrivals if n == name]
        assert statistics.fmean(gaps(own)) == pytest.approx(1 / rate, rel=0.05)
    assert arrivals == tenant_arrivals({"A": 40.0, "B": 10.0}, 20_000, seed=3)


def test_a_tenant_keeps_its_arrivals_whoever_else_sends() -> None:
    def gaps_of(name: str, arrivals: list[tuple[float, str]]) -> list[float]:
        return gaps([t for t, n in arrivals if n == name])

    alone = tenant_arrivals({"B": 10.0}, 50, seed=1)
    crowded = tenant_arrivals({"A": 40.0, "B": 10.0}, 300, seed=1)
    assert gaps_of("B", crowded)[:20] == pytest.approx(gaps_of("B", alone)[:20])


def test_labels_are_drawn_with_their_shares_from_their_own_stream() -> None:
    labels = draw_labels({"A": 0.8, "B": 0.2}, 10_000, "tenants-0")
    assert Counter(labels)["A"] / 10_000 == pytest.approx(0.8, abs=0.015)
    assert labels == draw_labels({"A": 0.8, "B": 0.2}, 10_000, "tenants-0")
    assert labels != draw_labels({"A": 0.8, "B": 0.2}, 10_000, "tenants-1")
    # Shares need not add up to 1.
    assert draw_labels({"A": 4, "B": 1}, 100, "x") == draw_labels({"A": 0.8, "B": 0.2}, 100, "x")
    priorities = draw_labels({0: 0.1, 1: 0.9}, 1000, "priorities-0")
    assert set(priorities) == {0, 1} and 60 < priorities.count(0) < 140


def test_labels_change_only_the_tenant_and_priority() -> None:
    specs = make_requests(6, (4, 8), (1, 4), seed=0)
    labelled = label_requests(specs, ["A", "B"] * 3, [1, 0, 1, 0, 1, 0])
    assert [(s.prompt, s.output_len) for s in labelled] == [(s.prompt, s.output_len)
                                                            for s in specs]
    assert [(s.tenant, s.priority) for s in labelled][:2] == [("A", 1), ("B", 0)]
    assert label_requests(specs) == specs


def test_long_prompts_are_a_seeded_share_made_k_times_longer() -> None:
    specs = make_requests(200, (10, 20), (1, 4), seed=1)
    planned = plan_long(specs, 0.05, 30, seed=1, max_len=500)
    long = [i for i, s in enumerate(planned) if s.long]
    assert len(long) == 10
    for i, (before, after) in enumerate(zip(specs, planned)):
        if i in long:
            assert len(after.prompt) == min(30 * len(before.prompt), 500)
            assert after.prompt[:len(before.prompt)] == before.prompt
            assert after.output_len == before.output_len
        else:
            assert after == before
    assert planned == plan_long(specs, 0.05, 30, seed=1, max_len=500)
    assert long != [i for i, s in enumerate(plan_long(specs, 0.05, 30, seed=2)) if s.long]
    unclipped = plan_long(specs, 0.05, 30, seed=1)
    assert all(len(u.prompt) == 30 * len(s.prompt) for u, s in zip(unclipped, specs) if u.long)
    # A cap below a prompt's own length leaves it as it was, never shorter.
    assert all(len(a.prompt) == len(b.prompt)
               for a, b in zip(plan_long(specs, 0.5, 3, seed=1, max_len=5), specs))


# --- Specs ------------------------------------------------------------------------------------

def test_long_chat_mixes_a_seeded_share_of_long_prompts_among_chats() -> None:
    specs = LongChat().requests(40, seed=1)
    assert specs == LongChat().requests(40, seed=1)
    assert specs != LongChat().requests(40, seed=2)
    long = [s for s in specs if s.long]
    short = [s for s in specs if not s.long]
    assert len(long) == 10  # round(0.25 * 40), exactly
    assert all(1024 <= len(s.prompt) <= 2048 and 16 <= s.output_len <= 64 for s in long)
    assert all(32 <= len(s.prompt) <= 128 and 64 <= s.output_len <= 192 for s in short)
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for s in specs for t in s.prompt)
    # Not bunched: the long ones are spread over the run.
    positions = [i for i, s in enumerate(specs) if s.long]
    assert positions[0] < 20 <= positions[-1]
    assert sum(s.long for s in LongChat(long_fraction=0.5).requests(8, seed=0)) == 4


def test_prefix_share_spreads_requests_evenly_over_a_few_system_prompts() -> None:
    workload = PrefixShare(groups=3, prefix_len=50)
    specs = workload.requests(30, seed=0)
    assert specs == workload.requests(30, seed=0)
    prefixes = workload.prefixes(seed=0)
    assert len(set(prefixes)) == 3 and all(len(p) == 50 for p in prefixes)
    groups = workload.group_of(30, seed=0)
    assert Counter(groups) == {0: 10, 1: 10, 2: 10}
    assert groups != [i % 3 for i in range(30)]  # a seeded order, not in turn
    for spec, group in zip(specs, groups):
        assert spec.prompt[:50] == prefixes[group]
        assert 16 <= len(spec.prompt) - 50 <= 64 and 32 <= spec.output_len <= 96
    assert len({s.prompt[50:] for s in specs}) == 30  # each its own question
    assert workload.requests(30, seed=1)[0].prompt[:50] not in prefixes


def test_shifted_ids_keep_lengths_and_shared_prefixes_but_no_prompt() -> None:
    specs = PrefixShare(groups=2, prefix_len=20).requests(6, seed=0)
    shifted = shift_ids(specs, 7919)
    assert [len(s.prompt) for s in shifted] == [len(s.prompt) for s in specs]
    assert [s.output_len for s in shifted] == [s.output_len for s in specs]
    assert len({s.prompt[:20] for s in shifted}) == 2  # still two shared system prompts
    assert all(a.prompt[0] != b.prompt[0] for a, b in zip(specs, shifted))
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for s in shifted for t in s.prompt)
    assert shift_ids(specs, 0) == specs
    assert shift_ids(specs, TOKEN_IDS[1] - TOKEN_IDS[0]) == specs


def test_mix_specs_parse_names_and_numbers() -> None:
    assert parse_mix("A:0.8,B:0.2", tenant_name, "share") == {"A": 0.8, "B": 0.2}
    assert parse_mix(" gold : 40 , free:10", tenant_name, "rate") == {"gold": 40, "free": 10}
    assert parse_mix("0:0.1,1:0.9", int, "share") == {0: 0.1, 1: 0.9}
    assert parse_mix("-1:1", int, "share") == {-1: 1.0}


@pytest.mark.parametrize(("text", "message"), [
    ("A:x", "expected NAME:SHARE,... with each share a finite number > 0, got 'x' in 'A:x'"),
    ("A", "expected NAME:SHARE,... got 'A' (no ':' in 'A')"),
    (":0.5", "got ':0.5' (bad NAME '')"),
    ("A:0", "finite number > 0, got '0' in 'A:0'"),
    ("A:-1", "finite number > 0, got '-1'"),
    ("A:inf", "finite number > 0, got 'inf'"),
    ("A:nan", "finite number > 0, got 'nan'"),
    ("A:1,A:2", "got 'A' twice in 'A:1,A:2'"),
    ("A:1,", "(no ':' in '')"),
])
def test_bad_mix_specs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_mix(text, tenant_name, "share")
    assert message in str(error.value)


def test_priorities_must_be_integers() -> None:
    with pytest.raises(ValueError) as error:
        parse_mix("high:1", int, "share", "PRIORITY")
    assert str(error.value) == "expected PRIORITY:SHARE,... got 'high:1' (bad PRIORITY 'high')"


# --- Service ----------------------------------------------------------------------------------

def test_intervals_join_and_meet() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2.5), (3, 4)], [(1, 3.5)]) == [(1, 2.5), (3, 3.5)]
    assert intersect([(0, 1)], [(1, 2)]) == []  # touching is not overlapping
    assert cumulative([(1, 5), (2, 1)], [0, 1, 1.5, 2, 9]) == [0, 5, 5, 6, 6]


# A: 10 every second from t=1, waiting throughout 0..5; B: 5 at 1.5 and 30 at 2.5, waiting
# 1..3. Both wait in 1..3, where D = W_A - W_B is 10 (at 1), 5 (1.5), 15 (2), -15 (2.5),
# -5 (3): the largest gap is 15 - (-15) = 30, B's 30 over (2, 2.5] while A got nothing.
HAND_MADE = {"A": TenantTrace([(3, 10), (1, 10), (2, 10), (4, 10)], [(0, 5)]),
             "B": TenantTrace([(1.5, 5), (2.5, 30)], [(1, 2), (1.5, 3)])}


def test_the_largest_backlogged_gap_of_a_hand_made_example() -> None:
    gap = largest_gap(HAND_MADE["A"], HAND_MADE["B"])
    assert gap == {"gap": 30.0, "from_s": 2, "to_s": 2.5, "ahead": "b", "backlogged_s": 2}
    assert largest_gap(HAND_MADE["B"], HAND_MADE["A"])["ahead"] == "a"
    # Had B stopped waiting at 2.4, its 30 at 2.5 would fall outside: D is 10, 5, 15 there.
    early = TenantTrace(HAND_MADE["B"].events, [(1, 2.4)])
    assert largest_gap(HAND_MADE["A"], early) == {
        "gap": 10.0, "from_s": 1.5, "to_s": 2, "ahead": "a", "backlogged_s": pytest.approx(1.4)}


def test_the_service_report_of_a_hand_made_example() -> None:
    report = service_report(HAND_MADE, bucket=1.0)
    assert report["times_s"] == [0, 1, 2, 3, 4, 5]
    assert report["cumulative"] == {"A": [0, 10, 20, 30, 40, 40], "B": [0, 0, 5, 35, 35, 35]}
    assert report["total"] == {"A": 40, "B": 35}
    assert report["max_gap"] == {"tenants": ["A", "B"], "gap": 30.0, "from_s": 2,
                                 "to_s": 2.5, "backlogged_s": 2, "ahead": "B"}
    assert report["pairs"] == [report["max_gap"]]


def test_the_largest_gap_is_the_largest_pairs() -> None:
    traces = {**HAND_MADE, "C": TenantTrace([(2, 100)], [(1.8, 2.2)])}
    report = service_report(traces, bucket=2.0)
    assert [p["tenants"] for p in report["pairs"]] == [["A", "B"], ["A", "C"], ["B", "C"]]
    assert [p["gap"] for p in report["pairs"]] == [30, 100, 100]
    assert report["max_gap"]["tenants"] == ["A", "C"] and report["max_gap"]["ahead"] == "C"
    assert report["times_s"] == [0, 2, 4, 6]


def test_tenants_never_backlogged_together_have_no_gap() -> None:
    traces = {"A": TenantTrace([(1, 10)], [(0, 1)]), "B": TenantTrace([(3, 10)], [(2, 3)])}
    gap = service_report(traces, bucket=1.0)["max_gap"]
    assert (gap["gap"], gap["from_s"], gap["to_s"], gap["backlogged_s"]) == (0, None, None, 0)


def test_requests_become_service_events_and_backlogs() -> None:
    done = RequestResult(10, 3, sent=0.0, ttft=1.0, e2e=2.0, itl=[0.5, 0.5], output_tokens=3,
                         tenant="A")
    # A completed request whose 4 tokens came in 2 chunks: 2 tokens a chunk.
    coalesced = RequestResult(4, 4, sent=1.0, ttft=0.5, e2e=1.0, itl=[0.5], output_tokens=4,
                              tenant="B")
    hung_up = RequestResult(6, 8, sent=0.5, ttft=1.5, itl=[1.0], hung_up=True, tenant="A")
    refused = RequestResult(7, 2, sent=0.2, error="HTTP 503", elapsed=0.1, tenant="B")
    untenanted = RequestResult(5, 1, sent=0.0, ttft=0.1, e2e=0.2, output_tokens=1)
    traces = service_traces([done, coalesced, hung_up, refused, untenanted], w_in=1, w_out=2)
    assert set(traces) == {"A", "B"}
    assert traces["A"].events == sorted([(1.0, 10), (1.0, 2), (1.5, 2), (2.0, 2),  # done
                                         (2.0, 6), (2.0, 2), (3.0, 2)])  # hung up: a token a chunk
    assert traces["A"].backlog == [(0.0, 1.0), (0.5, 2.0)]
    assert traces["B"].events == [(1.5, 4), (1.5, 4.0), (2.0, 4.0)]  # the refused one: none
    assert traces["B"].backlog == [(1.0, 1.5), (0.2, pytest.approx(0.3))]
    weighted = service_traces([done], w_in=0.5, w_out=3)["A"].events
    assert sum(w for _, w in weighted) == 0.5 * 10 + 3 * 3


# --- The scenario drivers -------------------------------------------------------------------

def test_sweep_flags_pass_through() -> None:
    from benchmarks.serve_sweep import add_workload_flags, policy_flags, workload_flags

    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    args = parser.parse_args(["--workload", "chat", "--tenants", "A:0.8,B:0.2",
                              "--long-fraction", "0.05"])
    assert workload_flags(args) == ["--workload", "chat", "--tenants", "A:0.8,B:0.2",
                                    "--long-fraction", "0.05"]
    assert workload_flags(args, skip=("tenants",)) == ["--workload", "chat",
                                                       "--long-fraction", "0.05"]
    options = ["aging=0.5", "vtc:weights=A:2", "priority:levels=3"]
    assert policy_flags("vtc", options) == ["--policy-opt", "aging=0.5",
                                            "--policy-opt", "weights=A:2"]
    assert policy_flags("prefill_first", options) == ["--policy-opt", "aging=0.5"]


def test_policy_runs_alternate_their_order() -> None:
    from benchmarks.policy_table import run_order

    assert run_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert run_order(["a"], 2) == [["a"], ["a"]]


def test_the_policy_table_passes_flags_bench_serve_reads() -> None:
    from benchmarks.policy_table import bench_flags, build_parser
    from benchmarks.serve_sweep import workload_flags

    from asyncinfer.bench.serve import add_parser

    args = build_parser().parse_args(["--out", "x", "--rate", "0.5", "--long-input-range",
                                      "900,1000", "--slo-tbt-p99-ms", "300", "--seed", "3"])
    assert args.policies == "prefill_first,decode_first,stall_free"
    serve = argparse.ArgumentParser()
    add_parser(serve.add_subparsers())
    parsed = serve.parse_args(["serve", *bench_flags(args), *workload_flags(args)])
    assert (parsed.rate, parsed.workload, parsed.long_input_range) == (0.5, "long-chat",
                                                                      (900, 1000))
    assert (parsed.slo_tbt_p99_ms, parsed.seed, parsed.rate_search) == (300, 3, None)
    args = build_parser().parse_args(["--out", "x", "--rate-search", "0.2:1",
                                      "--slo-tbt-p99-ms", "300", "--max-probes", "4"])
    parsed = serve.parse_args(["serve", *bench_flags(args), *workload_flags(args)])
    assert (parsed.rate_search, parsed.max_probes, parsed.rate) == ((0.2, 1.0), 4, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", "x"])  # a rate or a search: one is needed


def _run_report(tbt_p99: float, tok_s: float, capacity: float | None = None) -> dict[str, Any]:
    stats = {"p50": tbt_p99 / 4, "p99": tbt_p99}
    return {"tbt_ms": {**stats, "per_request_p99": {"p50": tbt_p99 / 2}},
            "ttft_ms": {"p50": 10.0, "p99": 20.0}, "output_throughput": tok_s,
            "request_throughput": tok_s / 100,
            "groups": {"class": {"short": {"tbt_ms": {"p99": tbt_p99 - 1}}}},
            "rate_search": None if capacity is None else {"capacity": capacity}}


def test_the_policy_table_takes_each_policys_median_run() -> None:
    from benchmarks.policy_table import markdown, policy_table

    runs = [{"policy": "a", "round": 0, "result": _run_report(400, 90)},
            {"policy": "b", "round": 0, "result": _run_report(100, 95)},
            {"policy": "c", "round": 0, "error": "the server did not come up"},
            {"policy": "b", "round": 1, "result": _run_report(120, 97)},
            {"policy": "a", "round": 1, "result": _run_report(500, 92)}]
    rows = policy_table(["a", "b", "c"], runs)
    assert [(r["policy"], r["runs"]) for r in rows] == [("a", 2), ("b", 2)]
    assert (rows[0]["tbt_p99_ms"], rows[0]["output_tok_s"]) == (450, 91)
    assert (rows[1]["tbt_p99_ms"], rows[1]["short_tbt_p99_ms"]) == (110, 109)
    assert rows[1]["tbt_per_request_p99_p50_ms"] == 55 and rows[1]["capacity_req_s"] is None
    table = markdown(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| a | 112.5 / 450.0 | 225.0 | 449.0 |")
    assert "capacity" not in table[0]
    searched = policy_table(["a"], [{"policy": "a", "result": _run_report(9, 9, 0.75)}])
    assert searched[0]["capacity_req_s"] == 0.75
    assert markdown(searched).splitlines()[2].endswith("| 0.750 |")


def test_the_policy_table_record_names_the_machine(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The record says which CPU its figures came from, as the other benchmarks' do: a
    run with the servers and the load stood in for."""
    import contextlib
    import json
    import os
    import sys

    import benchmarks.policy_table as table

    monkeypatch.setattr(table, "serving", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(table, "run_rate", lambda *a, **k: _run_report(100, 90))
    monkeypatch.setattr(sys, "argv", ["policy_table", "--out", str(tmp_path), "--rate", "1",
                                      "--policies", "a,b", "--warmup", "0"])
    assert table.main() == 0
    record = json.loads((tmp_path / "policy-table.json").read_text())
    assert set(record["machine"]) == {"cpu", "flags", "cores"}
    assert record["machine"]["cores"] == len(os.sched_getaffinity(0))
    assert [row["policy"] for row in record["table"]] == ["a", "b"]


def test_the_scenarios_parse_their_own_flags() -> None:
    from benchmarks.scenarios import build_parser, longest_output

    args = build_parser().parse_args(["head-of-line", "--out", "x", "--rate", "5"])
    assert (args.long_fraction, args.long_factor, args.workload) == ("0.05", "30", "chat")
    assert args.policies == "prefill_first,decode_first,skip_ahead,shortest_prompt_first"
    assert longest_output(args) == 1024
    args = build_parser().parse_args(["noisy-neighbour", "--out", "x", "--rate-b", "2",
                                      "--output-len-range", "8,300", "--workload", "uniform"])
    assert (args.ratio, args.policies, longest_output(args)) == (4.0, "prefill_first,vtc", 300)
    assert not hasattr(args, "long_fraction") and not hasattr(args, "tenant_rates")


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_scenario_plots_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot_head_of_line, plot_noisy_neighbour

    def stats(p50: float | None) -> dict[str, Any]:
        return {"p50": p50, "p99": None if p50 is None else 3 * p50, "max": None}

    rows = [{"policy": "prefill_first", "short_ttft_ms": stats(20), "long_ttft_ms": stats(90)},
            {"policy": "shortest_prompt_first", "short_ttft_ms": stats(10),
             "long_ttft_ms": stats(None)}]
    assert _png(plot_head_of_line(rows, tmp_path / "hol.png"))
    service = service_report(HAND_MADE, bucket=1.0)
    rows = [{"policy": p, "victim": "B", "victim_ttft_ms": stats(v), "service": service}
            for p, v in (("prefill_first", 50.0), ("vtc", 20.0))]
    assert _png(plot_noisy_neighbour(rows, tmp_path / "nn.png"))
