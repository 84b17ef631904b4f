"""Two scheduling scenarios against `asyncinfer serve`, one server per policy, each written as
a JSON summary and a PNG (``python -m benchmarks.scenarios SCENARIO``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncinfer.bench.plan import DEFAULT_OUTPUT_LEN
from asyncinfer.bench.traffic import CHAT_OUTPUT
from benchmarks.plot import plot_head_of_line, plot_noisy_neighbour
from benchmarks.serve_sweep import (
    add_server_flags,
    add_workload_flags,
    policy_flags,
    run_rate,
    server_model,
    serving,
    split_argv,
)
from benchmarks.util import git_commit, write_report

# The --help epilog: how to run it.
USAGE = """\
``head-of-line``: a chat workload at ``--rate`` in which one request in 20 has a prompt 30
times longer (``--long-fraction 0.05 --long-factor 30``, at most ``--max-input-len``: by
default the server's context less the longest output): how long the long prefills hold up
the short requests (the short ones' TTFT p99), and how long the long ones wait (their TTFT).

``noisy-neighbour``: tenant A sends at ``--ratio`` (4) times the rate of tenant B, whose rate
``--rate-b`` stays the same, each an arrival process of its own: B's TTFT p50 and p99, both
tenants' weighted service over time, and the largest gap between their service while both
had requests waiting (docs/workloads.md), for prefill_first and vtc by default.

    python -m benchmarks.scenarios head-of-line --out OUT --rate 20 --num-requests 400 \\
        --shape qwen3-0.6b --tokenizer TOK -- --device cuda --dtype bfloat16
    python -m benchmarks.scenarios noisy-neighbour --out OUT --rate-b 5 --num-requests 1000 \\
        --policies prefill_first,vtc --shape qwen3-0.6b --tokenizer TOK -- --device cuda

Each policy's server is started as ``benchmarks.serve_sweep`` starts it, with the engine
flags after ``--`` (and ``--policy-opt [POLICY:]KEY=VALUE`` for the policy); the workload
flags of ``asyncinfer bench serve`` pass through (default ``--workload chat``). A policy whose
server does not come up is recorded with its error and left out of the plot.
"""

AGGRESSOR, VICTIM = "A", "B"


def context_length(url: str) -> int | None:
    """The server's context length, from /server_info (None if it does not say)."""
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as response:
            return int(json.loads(response.read())["context_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def longest_output(args: argparse.Namespace) -> int:
    """The most tokens one request of the workload may produce."""
    if args.output_len_range:
        return int(args.output_len_range.split(",")[1])
    if args.output_len:
        return int(args.output_len)
    return CHAT_OUTPUT.hi if args.workload == "chat" else DEFAULT_OUTPUT_LEN


def _stats(summary: dict[str, Any] | None, key: str) -> dict[str, Any]:
    if summary is None:
        return {"p50": None, "p99": None, "max": None}
    return {q: summary[key][q] for q in ("p50", "p99", "max")}


def _counts(summary: dict[str, Any] | None) -> dict[str, int]:
    if summary is None:
        return {"completed": 0, "failed": 0}
    return {"completed": summary["completed"], "failed": summary["failed"]}


def head_of_line(url: str, policy: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One policy's run: the short and the long requests' TTFT."""
    run = argparse.Namespace(**vars(args))
    if run.max_input_len is None:
        context = context_length(url)
        run.max_input_len = None if context is None else context - longest_output(args)
    result = run_rate(url, policy, str(args.rate), run, out, None,
                      name=f"head-of-line-{policy}")
    classes = result["groups"].get("class", {})
    short, long = classes.get("short"), classes.get("long")
    return {"policy": policy, "short_ttft_ms": _stats(short, "ttft_ms"),
            "long_ttft_ms": _stats(long, "ttft_ms"), "short": _counts(short),
            "long": _counts(long), "max_input_len": run.max_input_len,
            "request_throughput": result["request_throughput"],
            "report": f"head-of-line-{policy}.json"}


def noisy_neighbour(url: str, policy: str, args: argparse.Namespace,
                    out: Path) -> dict[str, Any]:
    """One policy's run: B's TTFT, both tenants' service, the largest backlogged gap."""
    rates = {AGGRESSOR: args.ratio * args.rate_b, VICTIM: args.rate_b}
    spec = ",".join(f"{name}:{rate:g}" for name, rate in rates.items())
    result = run_rate(url, policy, "mix", args, out, None, name=f"noisy-neighbour-{policy}",
                      load=["--tenant-rates", spec])
    tenants = result["groups"].get("tenant", {})
    service = result["service"]
    return {"policy": policy, "rates": rates, "victim": VICTIM,
            "victim_ttft_ms": _stats(tenants.get(VICTIM), "ttft_ms"),
            "aggressor_ttft_ms": _stats(tenants.get(AGGRESSOR), "ttft_ms"),
            "counts": {name: _counts(tenants.get(name)) for name in rates},
            "service": {k: service[k] for k in ("w_in", "w_out", "bucket_s", "times_s",
                                                "cumulative", "total", "max_gap")},
            "max_gap": service["max_gap"], "report": f"noisy-neighbour-{policy}.json"}


SCENARIOS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., Path], str]] = {
    "head-of-line": (head_of_line, plot_head_of_line,
                     "prefill_first,decode_first,skip_ahead,shortest_prompt_first"),
    "noisy-neighbour": (noisy_neighbour, plot_noisy_neighbour, "prefill_first,vtc"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="scenario", required=True)
    for name, (_, _, policies) in SCENARIOS.items():
        each = sub.add_parser(name, help=f"policies {policies} by default")
        add_server_flags(each, port=18660)
        each.add_argument("--policies", default=policies)
        each.add_argument("--num-requests", type=int, default=400)
        each.add_argument("--workload", default="chat")
        if name == "head-of-line":
            each.add_argument("--rate", type=float, required=True, help="requests/s")
            each.add_argument("--long-fraction", default="0.05")
            each.add_argument("--long-factor", default="30")
            add_workload_flags(each, skip=("workload", "long_fraction", "long_factor",
                                           "tenants", "tenant_rates"))
        else:
            each.add_argument("--rate-b", type=float, required=True,
                              help="tenant B's requests/s")
            each.add_argument("--ratio", type=float, default=4.0,
                              help="tenant A's rate over B's (default 4)")
            add_workload_flags(each, skip=("workload", "long_fraction", "long_factor",
                                           "max_input_len", "tenants", "tenant_rates"))
    return parser


def main() -> int:
    argv, engine_flags = split_argv(sys.argv[1:])
    args = build_parser().parse_args(argv)
    run, plot, _ = SCENARIOS[args.scenario]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, engine_flags = server_model(args, engine_flags)
    summary: dict[str, Any] = {
        "benchmark": f"scenario-{args.scenario}", "commit": git_commit(),
        "model": f"{args.shape} (dummy weights)" if args.shape else "embedded",
        "engine_flags": engine_flags, "policy_opt": args.policy_opt,
        "command": "python -m benchmarks.scenarios " + " ".join(sys.argv[1:]),
        "policies": []}
    for i, policy in enumerate(args.policies.split(",")):
        port = args.port + i
        try:
            with serving(model, policy, port, [*engine_flags,
                                               *policy_flags(policy, args.policy_opt)],
                         args.api_workers, out / f"server-{args.scenario}-{policy}.log"):
                row = run(f"http://127.0.0.1:{port}", policy, args, out)
        except SystemExit as exc:  # the server did not come up (a policy not installed?)
            row = {"policy": policy, "error": str(exc)}
        except subprocess.CalledProcessError as exc:  # the load: nothing completed
            row = {"policy": policy, "error": f"the load failed (exit status "
                                              f"{exc.returncode}); see its report"}
        summary["policies"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "service"}), flush=True)
        write_report(str(out / f"{args.scenario}.json"), summary)
    rows = [row for row in summary["policies"] if "error" not in row]
    if rows:
        print(plot(rows, out / f"{args.scenario}.png"))
    return 0 if rows else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
