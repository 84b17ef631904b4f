"""`asyncinfer bench serve`: its flags, and the run they ask for (plan, load, scrape, report)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncinfer.bench import argtypes
from asyncinfer.bench.client import RequestResult, run_load
from asyncinfer.bench.plan import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    TOKEN_IDS,
    RequestSpec,
    arrival_schedule,
    label_requests,
    make_requests,
    plan_hangups,
    plan_long,
    shift_ids,
)
from asyncinfer.bench.report import format_report, group_summaries, request_row, summarize
from asyncinfer.bench.scrape import check_drained, replica_counters, replica_report, replica_urls
from asyncinfer.bench.search import Slo, bisect_rates
from asyncinfer.bench.service import service_report, service_traces
from asyncinfer.bench.traffic import (
    WORKLOADS,
    LengthDist,
    Uniform,
    chat,
    draw_labels,
    tenant_arrivals,
    tenant_name,
)
from asyncinfer.bench.workload_file import read_workload_file
from asyncinfer.bench.workloads import (
    NAMED_WORKLOADS,
    check_workload_flags,
    workload_from_flags,
)
from asyncinfer.errors import AsyncInferError

DEFAULT_LONG_FACTOR = 30.0  # of --long-fraction
DEFAULT_MAX_PROBES = 6  # of --rate-search
DEFAULT_NUM_REQUESTS = 64
PROBE_SHIFT = 7919  # a probe's prompt ids move by this times its index (prime to their range)

# The --help text.
DESCRIPTION = """\
`asyncinfer bench serve`: load a running OpenAI-compatible server and measure its latency.

Requests of random token ids (EOS ignored, so each yields exactly its output length) arrive
as a seeded Poisson or gamma (bursty) process (``--rate``, ``--arrival``), one per tenant
(``--tenant-rates``), or from closed-loop workers (``--concurrency``). Lengths are uniform or
follow a named workload (``--workload chat``: lognormal, fitted to ShareGPT's published
means; ``long-chat``: long prompts among streaming chats; ``prefix-share``: a few long system
prompts shared by many requests); a share of the prompts can be made much longer
(``--long-fraction``). Requests carry a tenant (``--tenants``: the OpenAI ``user`` field and
an ``X-Tenant`` header) and a ``priority`` (``--priorities``) drawn per request. TTFT, TPOT,
the time between tokens (TBT: the gaps between streamed chunks, pooled and per request) and
end-to-end latency are measured client-side, for the whole run and per tenant, priority and
long or short prompt; with tenants, each one's weighted service over time too (see
docs/workloads.md).

``--slo-tbt-p99-ms`` (and ``--slo-ttft-p99-ms``) judge a run; with ``--rate-search LO:HI``
the same requests are sent at rates chosen by bisection to find the highest that meets them
(docs/benchmarks.md, "Time between tokens, capacity under a TBT SLO, ...").

A hostile load (``--hangup-fraction``) has a seeded share of the requests close their
connection mid-stream; afterwards the server's ``/metrics`` gauges tell whether it let go of
everything those requests held (``--check-drained``).
"""


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_tbt_p99_ms, args.slo_ttft_p99_ms)


def _check_workload_file(args: argparse.Namespace) -> None:
    """``--workload-file`` holds the requests whole: refuse the flags that would plan them."""
    planning = [flag for flag, value in (
        ("--num-requests", args.num_requests), ("--input-mean", args.input_mean),
        ("--output-mean", args.output_mean), ("--input-len", args.input_len),
        ("--output-len", args.output_len), ("--input-len-range", args.input_len_range),
        ("--output-len-range", args.output_len_range), ("--prefix-groups", args.prefix_groups),
        ("--prefix-len", args.prefix_len), ("--long-fraction", args.long_fraction),
        ("--long-factor", args.long_factor), ("--long-input-range", args.long_input_range),
        ("--long-output-range", args.long_output_range),
        ("--max-input-len", args.max_input_len)) if value is not None]
    if args.workload != "uniform":
        planning.insert(0, "--workload")
    if args.rate_search:  # its probes shift the prompts' ids
        planning.append("--rate-search")
    if args.prompt_format == "text":
        planning.append("--prompt-format text")
    if planning:
        raise AsyncInferError(f"--workload-file holds the requests whole (prompts, lengths, "
                              f"sampling): drop {' and '.join(planning)}")


def _check_options(args: argparse.Namespace) -> None:
    """Refuse flags that would be silently ignored together (AsyncInferError)."""
    if args.workload_file is not None:
        _check_workload_file(args)
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
    check_workload_flags(args)
    if args.tenants and args.tenant_rates:
        raise AsyncInferError("give --tenants (shares of one arrival process) or "
                              "--tenant-rates (a process per tenant), not both")
    if args.arrival == "gamma" and args.burstiness is None:
        raise AsyncInferError("--arrival gamma needs --burstiness B (below 1: burstier than "
                              "Poisson; 1: Poisson)")
    if args.arrival != "gamma" and args.burstiness is not None:
        raise AsyncInferError("--burstiness shapes gamma arrivals: add --arrival gamma")
    if args.rate_search and slo_of(args) == Slo():
        raise AsyncInferError("--rate-search finds the highest rate meeting an SLO: give "
                              "--slo-tbt-p99-ms and/or --slo-ttft-p99-ms")
    if args.max_probes is not None and not args.rate_search:
        raise AsyncInferError("--max-probes bounds --rate-search: add --rate-search LO:HI")
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


def plan_run(args: argparse.Namespace
             ) -> tuple[list[RequestSpec], list[float] | None, list[str] | None, float]:
    """The requests the flags ask for, their send times (None: a closed loop), their tenants
    (None: untenanted) and the total rate."""
    count = DEFAULT_NUM_REQUESTS if args.num_requests is None else args.num_requests
    if args.workload_file is not None:
        specs = read_workload_file(args.workload_file)
    elif args.workload in NAMED_WORKLOADS:
        specs = workload_from_flags(args).requests(count, args.seed)
    else:
        input_dist, output_dist = workload_lengths(args)
        specs = make_requests(count, input_dist, output_dist, args.seed,
                              args.prefix_groups or 0, args.prefix_len or 0)
        if args.long_fraction:
            specs = plan_long(specs, args.long_fraction, _long_factor(args), args.seed,
                              args.max_input_len)
    if args.hangup_fraction:
        specs = plan_hangups(specs, args.hangup_fraction, args.seed)
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
    return label_requests(specs, tenants, priorities), schedule, tenants, rate


def _long_factor(args: argparse.Namespace) -> float:
    return DEFAULT_LONG_FACTOR if args.long_factor is None else args.long_factor


def _length_params(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    """The report's record of the lengths: the distributions, or the named workload's, or
    the workload file's."""
    if args.workload_file is not None:
        prompts, outputs = [len(s.prompt) for s in specs], [s.output_len for s in specs]
        return {"input_len": [min(prompts), max(prompts)],
                "output_len": [min(outputs), max(outputs)], "input_dist": None,
                "output_dist": None, "workload_spec": None, "long_fraction": 0.0,
                "long_factor": None, "prefix_groups": 0, "prefix_len": 0,
                "workload_file": str(args.workload_file),
                "input_tokens": sum(prompts), "output_tokens_planned": sum(outputs),
                "temperatures": sorted({s.temperature for s in specs})}
    if args.workload in NAMED_WORKLOADS:
        workload = workload_from_flags(args)
        prompts, outputs = [len(s.prompt) for s in specs], [s.output_len for s in specs]
        return {"input_len": [min(prompts), max(prompts)] if specs else None,
                "output_len": [min(outputs), max(outputs)] if specs else None,
                "input_dist": None, "output_dist": None, "workload_spec": workload.describe(),
                "long_fraction": getattr(workload, "long_fraction", None), "long_factor": None,
                "prefix_groups": getattr(workload, "groups", None),
                "prefix_len": getattr(workload, "prefix_len", None)}
    input_dist, output_dist = workload_lengths(args)
    long = bool(args.long_fraction)
    return {"input_len": [input_dist.lo, input_dist.hi],
            "output_len": [output_dist.lo, output_dist.hi],
            "input_dist": input_dist.describe(), "output_dist": output_dist.describe(),
            "workload_spec": None, "long_fraction": args.long_fraction or 0.0,
            "long_factor": _long_factor(args) if long else None,
            "prefix_groups": args.prefix_groups or 0, "prefix_len": args.prefix_len or 0}


Run = Callable[[list[RequestSpec], list[float] | None, str],
               tuple[list[RequestResult], float]]


def _search(args: argparse.Namespace, specs: list[RequestSpec], slo: Slo,
            run: Run) -> tuple[list[RequestResult], float, float, dict[str, Any]]:
    """``--rate-search``: each probe the same requests at its rate, recorded whole, their ids
    shifted per probe so that no probe finds an earlier one's prompts in the prefix cache;
    returns the results, duration and rate of the capacity probe (the lowest one when none
    met the SLO), and the search's record."""
    lo, hi = args.rate_search
    runs: dict[float, tuple[list[RequestResult], float]] = {}
    probes: list[dict[str, Any]] = []

    def meets(rate: float) -> bool:
        schedule = arrival_schedule(len(specs), rate, args.seed, args.burstiness or 1.0)
        shifted = shift_ids(specs, PROBE_SHIFT * len(probes))
        results, duration = run(shifted, schedule, f"{rate:.3g} req/s")
        runs[rate] = results, duration
        summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        misses = slo.misses(summary)
        probes.append({"rate": rate, "meets_slo": not misses, "misses": misses,
                       "summary": {**summary, "groups": group_summaries(
                           results, duration, args.slo_ttft_ms, args.slo_tpot_ms)},
                       "requests": [request_row(r) for r in results]})
        return not misses

    found = bisect_rates(meets, lo, hi, args.max_probes or DEFAULT_MAX_PROBES)
    shown = lo if found["capacity"] is None else found["capacity"]
    search = {"range": [lo, hi], "max_probes": args.max_probes or DEFAULT_MAX_PROBES,
              "slo": slo.describe(), "capacity": found["capacity"], "missed": found["missed"],
              "probes": probes}
    return *runs[shown], shown, search


def main(args: argparse.Namespace) -> int:
    """`asyncinfer bench serve`: run the load (or, with ``--rate-search``, one a probe), check
    the server drained (see ``--check-drained``), print the table, write ``--json``; exit
    status 1 when no kept request completed, or when the drain check failed, timed out or
    found KV pages still used. Missing an SLO is a finding, not a failure."""
    from tqdm import tqdm

    _check_options(args)
    specs, schedule, tenants, rate = plan_run(args)
    check = args.check_drained if args.check_drained is not None else args.hangup_fraction > 0
    base = args.url.rstrip("/")
    replicas = replica_urls(base, args.api_key)
    counted = replica_counters(replicas)
    # A router reads prompts as text (and refuses ids): words stand in for the ids then.
    text = args.prompt_format == "text" or (args.prompt_format is None and replicas != [base])
    if text and args.workload_file is not None:
        raise AsyncInferError(f"{base} routes to replicas, which take prompts as text: the "
                              f"workload file's token ids would be sent as other prompts; "
                              f"point --url at one server")
    model = args.model

    def run(sent: list[RequestSpec], schedule: list[float] | None,
            desc: str) -> tuple[list[RequestResult], float]:
        nonlocal model
        with tqdm(total=len(sent), desc=desc, disable=None) as progress:
            model, results, duration = asyncio.run(run_load(
                base, model, sent, schedule=schedule, concurrency=args.concurrency,
                api_key=args.api_key, timeout=args.timeout, on_done=progress.update,
                text=text))
        return results, duration

    slo = slo_of(args)
    search = None
    if args.rate_search:
        results, duration, rate, search = _search(args, specs, slo, run)
    else:
        results, duration = run(specs, schedule, "requests")
    per_replica = replica_report(counted, replica_counters(replicas))
    drain = None
    if check:
        drain = asyncio.run(check_drained(base, api_key=args.api_key,
                                          timeout=args.drain_timeout))
    load = ("rate_search" if search else "closed_loop" if args.concurrency else
            "burst" if math.isinf(rate) else "gamma" if args.arrival == "gamma" else "poisson")
    params = {"url": base, "model": model, "policy": args.policy, "load": load,
              "rate": rate if load in ("poisson", "gamma", "rate_search") else None,
              "concurrency": args.concurrency, "num_requests": len(specs),
              "workload": args.workload, **_length_params(args, specs),
              "arrival": args.arrival, "burstiness": args.burstiness,
              "tenants": args.tenants, "tenant_rates": args.tenant_rates,
              "priorities": (None if args.priorities is None else
                             {str(k): v for k, v in args.priorities.items()}),
              "max_input_len": args.max_input_len,
              "prompt_format": "text" if text else "ids",
              "seed": args.seed, "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, **slo.describe(),
              "timeout_s": args.timeout,
              "hangup_fraction": args.hangup_fraction, "check_drained": check,
              "drain_timeout_s": args.drain_timeout if check else None}
    service = None
    if tenants is not None:
        service = {"w_in": args.service_w_in, "w_out": args.service_w_out,
                   **service_report(service_traces(results, args.service_w_in,
                                                   args.service_w_out),
                                    args.service_bucket_s)}
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    verdict = None
    if slo != Slo():
        misses = slo.misses(summary)
        verdict = {**slo.describe(), "meets": not misses, "misses": misses}
    report = {"benchmark": "serve", "params": params, **summary,
              "groups": group_summaries(results, duration, args.slo_ttft_ms,
                                        args.slo_tpot_ms),
              "slo": verdict, "rate_search": search,
              "service": service, "drain": drain, "replicas": per_replica,
              "requests": [request_row(r) for r in results]}
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["completed"] and (drain is None or drain["clean"]) else 1


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``asyncinfer bench`` subcommands; returns its parser."""
    parser = bench_subparsers.add_parser(
        "serve", help="load a running OpenAI-compatible server: TTFT, TPOT, TBT, goodput, "
             "capacity under an SLO",
        description=DESCRIPTION)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None,
                        help="the model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("ASYNCINFER_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $ASYNCINFER_API_KEY)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=argtypes.rate, default=None,
                      help="requests/s as Poisson arrivals; 'inf' sends all at once (default)")
    load.add_argument("--concurrency", type=argtypes.positive_int, default=None,
                      help="closed loop: this many workers, each sending its next request when "
                           "its last one ends; with --num-requests equal to it, a burst of that "
                           "many concurrent streams")
    load.add_argument("--tenant-rates", type=argtypes.mix(tenant_name, "rate"), default=None,
                      metavar="A:R,B:R",
                      help="one arrival process per tenant at its own rate (requests/s), "
                           "merged in time order until --num-requests; each request is "
                           "sent for its tenant (see --tenants)")
    load.add_argument("--rate-search", type=argtypes.rate_range, default=None, metavar="LO:HI",
                      help="capacity under the SLO (--slo-tbt-p99-ms, --slo-ttft-p99-ms): "
                           "the highest Poisson rate in LO..HI req/s whose run meets it, by "
                           "bisection (LO, HI, then midpoints), each probe the same requests "
                           "at its rate (their ids shifted, so none is in the prefix cache "
                           "from an earlier probe), recorded whole in the report")
    parser.add_argument("--max-probes", type=argtypes.at_least_int(2), default=None,
                        help=f"--rate-search runs at most this many probes (default "
                             f"{DEFAULT_MAX_PROBES})")
    parser.add_argument("--num-requests", type=argtypes.positive_int, default=None,
                        help=f"requests to send (default: {DEFAULT_NUM_REQUESTS})")
    parser.add_argument("--workload-file", default=None, metavar="FILE",
                        help="send the requests of FILE, written out whole, in its order: "
                             "JSON {\"requests\": [{\"prompt\": [ids], \"max_tokens\": N, "
                             "\"temperature\": T, \"top_p\": P, \"seed\": S}, ...]} "
                             "(temperature 0, top_p 1, no seed where left out; EOS ignored), "
                             "the same requests an offline run can generate. Takes no "
                             "length or workload flag")
    parser.add_argument("--workload", choices=(*WORKLOADS, *NAMED_WORKLOADS),
                        default="uniform",
                        help="lengths: uniform (--input-len, --input-len-range ...), or chat: "
                             "lognormal, fitted to ShareGPT's means (prompt 161, output 338 "
                             "tokens; see docs/workloads.md); long-chat: a --long-fraction "
                             "(0.25) of prompts of --long-input-range (1024,2048) tokens and "
                             "--long-output-range (16,64) outputs among chats of "
                             "--input-len-range (32,128) and --output-len-range (64,192); "
                             "prefix-share: --prefix-groups (4) system prompts of "
                             "--prefix-len (1024) tokens shared evenly, each followed by "
                             "--input-len-range (16,64) tokens, outputs of "
                             "--output-len-range (32,96). Default uniform")
    parser.add_argument("--input-mean", type=argtypes.above_zero("tokens"), default=None,
                        help="--workload chat: the prompts' mean length before clipping")
    parser.add_argument("--output-mean", type=argtypes.above_zero("tokens"), default=None,
                        help="--workload chat: the outputs' mean length before clipping")
    parser.add_argument("--input-len", type=argtypes.positive_int, default=None,
                        help=f"prompt tokens (random ids in [{TOKEN_IDS[0]}, {TOKEN_IDS[1]})) "
                             f"(default {DEFAULT_INPUT_LEN})")
    parser.add_argument("--output-len", type=argtypes.positive_int, default=None,
                        help=f"output tokens (EOS is ignored) (default {DEFAULT_OUTPUT_LEN})")
    parser.add_argument("--prompt-format", choices=["ids", "text"], default=None,
                        help="send prompts as token ids, or as words (about a token each) "
                             "(default: text through a router, which refuses ids; else ids)")
    parser.add_argument("--prefix-groups", type=argtypes.at_least_int(0), default=None,
                        help="requests share this many prompt prefixes, in turn (0: none)")
    parser.add_argument("--prefix-len", type=argtypes.at_least_int(0), default=None,
                        help="tokens of each shared prefix, before each request's own "
                             "--input-len")
    parser.add_argument("--input-len-range", type=argtypes.length_range, default=None,
                        metavar="LO,HI",
                        help="uniform random prompt lengths, replacing --input-len")
    parser.add_argument("--output-len-range", type=argtypes.length_range, default=None,
                        metavar="LO,HI",
                        help="uniform random output lengths, replacing --output-len")
    parser.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson",
                        help="inter-arrival times at --rate: exponential (Poisson), or gamma "
                             "of shape --burstiness. Default poisson")
    parser.add_argument("--burstiness", type=argtypes.above_zero("a gamma shape"), default=None,
                        metavar="B",
                        help="--arrival gamma's shape, the mean gap staying 1/rate: below 1 "
                             "burstier than Poisson, 1 Poisson, above 1 more regular")
    parser.add_argument("--tenants", type=argtypes.mix(tenant_name, "share"), default=None,
                        metavar="A:S,B:S",
                        help="each request's tenant, drawn with these shares; sent as the "
                             "OpenAI 'user' field and an X-Tenant header. Reports per tenant "
                             "and each tenant's service over time")
    parser.add_argument("--priorities", type=argtypes.mix(int, "share", "PRIORITY"), default=None,
                        metavar="P:S,...",
                        help="each request's integer 'priority' field (lower runs first with "
                             "the priority policy), drawn with these shares; reports per "
                             "priority")
    parser.add_argument("--long-fraction", type=argtypes.share, default=None, metavar="F",
                        help="this share of the requests (a seeded choice) get prompts "
                             "--long-factor times as long; reports long and short apart. "
                             "Default 0")
    parser.add_argument("--long-factor", type=argtypes.at_least(1), default=None, metavar="K",
                        help=f"how many times longer a long prompt is (default "
                             f"{DEFAULT_LONG_FACTOR:g})")
    parser.add_argument("--long-input-range", type=argtypes.length_range, default=None,
                        metavar="LO,HI", help="--workload long-chat: its long prompts' lengths")
    parser.add_argument("--long-output-range", type=argtypes.length_range, default=None,
                        metavar="LO,HI", help="--workload long-chat: its long requests' outputs")
    parser.add_argument("--max-input-len", type=argtypes.positive_int, default=None,
                        help="the longest a long prompt may be made (keep prompt and output "
                             "within the model's context)")
    parser.add_argument("--service-w-in", type=argtypes.at_least(0), default=1.0,
                        help="service: the weight of a prompt token, counted at the "
                             "request's first token (default 1)")
    parser.add_argument("--service-w-out", type=argtypes.at_least(0), default=2.0,
                        help="service: the weight of an output token, counted when it "
                             "arrives (default 2)")
    parser.add_argument("--service-bucket-s", type=argtypes.seconds, default=1.0,
                        help="service curves are sampled this often, in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="draws the prompts, the lengths, the arrival times, the "
                             "hang-ups, the long prompts, the tenants and the priorities "
                             "(each from a stream of its own)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput counts requests with TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="goodput counts requests with TPOT at most this")
    parser.add_argument("--slo-tbt-p99-ms", type=argtypes.above_zero("ms"), default=None,
                        help="an SLO on the run's P99 time between tokens (every gap of "
                             "every request pooled): the report says whether it was met; "
                             "--rate-search finds the highest rate meeting it")
    parser.add_argument("--slo-ttft-p99-ms", type=argtypes.above_zero("ms"), default=None,
                        help="an SLO on the run's P99 TTFT, as --slo-tbt-p99-ms (both must "
                             "be met when both are given)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take, from sending to its last chunk")
    parser.add_argument("--hangup-fraction", type=argtypes.fraction, default=0.0, metavar="F",
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
    parser.add_argument("--drain-timeout", type=argtypes.seconds, default=30.0,
                        help="seconds --check-drained waits for the server to drain")
    parser.add_argument("--policy", default=None,
                        help="the server's scheduling policy, only recorded in the report "
                             "(plot_rate_sweep draws one line per policy)")
    parser.add_argument("--json", default=None, help="write the report to this file")
    parser.set_defaults(func=main)
    return parser
