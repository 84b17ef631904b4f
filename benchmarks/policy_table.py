"""A paired comparison of scheduling policies on one workload: one `asyncinfer serve` per
policy, started in turn in alternated order (A B C, then C B A, ...), each loaded by the same
`asyncinfer bench serve` run; one record with every run and a table of the policies'
medians (``python -m benchmarks.policy_table``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.serve_sweep import (
    add_server_flags,
    add_workload_flags,
    policy_flags,
    run_rate,
    server_model,
    serving,
    split_argv,
    workload_flags,
)
from benchmarks.util import git_commit, machine, write_report

# The --help epilog: how to run it.
USAGE = """\
Long prompts among streaming chats on two CPU cores (embedded SmolLM2-135M), three policies
in one round; stall_free's token budget set so that a round stays short:

    python -m benchmarks.policy_table --out OUT \\
        --policies prefill_first,decode_first,stall_free --workload long-chat \\
        --long-fraction 0.5 --rate 0.5 --num-requests 48 \\
        --policy-opt stall_free:token_budget=256 -- --dtype bfloat16

Each run is `asyncinfer bench serve --rate R` (or ``--rate-search LO:HI`` with
``--slo-tbt-p99-ms X``: each policy's capacity under the SLO) with the workload flags given,
after ``--warmup`` requests that are not counted. A policy whose server does not come up
(not installed?) is recorded with its error and left out of the table.
"""

# `asyncinfer bench serve` flags passed through as given, besides serve_sweep's.
EXTRA_FLAGS = ("long_input_range", "long_output_range", "prefix_groups", "prefix_len",
               "slo_tbt_p99_ms", "slo_ttft_p99_ms", "max_probes")

# The table's columns: (name, a run's value from its report).
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("tbt_p50_ms", lambda r: r["tbt_ms"]["p50"]),
    ("tbt_p99_ms", lambda r: r["tbt_ms"]["p99"]),
    ("tbt_per_request_p99_p50_ms", lambda r: r["tbt_ms"]["per_request_p99"]["p50"]),
    ("short_tbt_p99_ms",
     lambda r: r["groups"].get("class", {}).get("short", {}).get("tbt_ms", {}).get("p99")),
    ("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"]),
    ("ttft_p99_ms", lambda r: r["ttft_ms"]["p99"]),
    ("output_tok_s", lambda r: r["output_throughput"]),
    ("request_throughput", lambda r: r["request_throughput"]),
    ("capacity_req_s", lambda r: (r.get("rate_search") or {}).get("capacity")),
)


def run_order(policies: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: as given, then reversed, in turn (so drift of the machine over
    the run falls on every policy alike)."""
    return [policies if r % 2 == 0 else policies[::-1] for r in range(rounds)]


def policy_table(policies: list[str], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy with a run that completed, the median over its runs of each column (None
    where no run has it), and the number of runs."""
    rows = []
    for policy in policies:
        reports = [run["result"] for run in runs
                   if run["policy"] == policy and "result" in run]
        if not reports:
            continue
        row: dict[str, Any] = {"policy": policy, "runs": len(reports)}
        for name, value in COLUMNS:
            values = [v for r in reports if (v := value(r)) is not None]
            row[name] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as markdown: TBT, TTFT, throughput and (with a search) capacity."""
    search = any(row["capacity_req_s"] is not None for row in rows)
    heads = ["policy", "TBT p50 / p99 (ms)", "a request's TBT p99, median (ms)",
             "short requests' TBT p99 (ms)", "TTFT p50 / p99 (ms)", "output tok/s",
             "req/s"] + (["capacity (req/s)"] * search)

    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = [r["policy"], f"{num(r['tbt_p50_ms'])} / {num(r['tbt_p99_ms'])}",
                 num(r["tbt_per_request_p99_p50_ms"]), num(r["short_tbt_p99_ms"]),
                 f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p99_ms'])}",
                 num(r["output_tok_s"]), num(r["request_throughput"], 3)]
        cells += [num(r["capacity_req_s"], 3)] * search
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_flags(args: argparse.Namespace) -> list[str]:
    """The load flags of each measured run: the rate (or the search) and ``EXTRA_FLAGS``."""
    flags = (["--rate", args.rate] if args.rate is not None
             else ["--rate-search", args.rate_search])
    for flag in EXTRA_FLAGS:
        if (value := getattr(args, flag)) is not None:
            flags += ["--" + flag.replace("_", "-"), str(value)]
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser, port=18690)
    parser.add_argument("--policies", default="prefill_first,decode_first,stall_free",
                        help="comma-separated, any registered policy")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each policy, the order reversed every other round")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", help="requests/s, Poisson")
    load.add_argument("--rate-search", metavar="LO:HI",
                      help="each run a capacity search under --slo-tbt-p99-ms")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2,
                        help="requests sent to each new server first, not counted "
                             "(1024-token prompts, 8 tokens out)")
    parser.add_argument("--workload", default="long-chat")
    add_workload_flags(parser, skip=("workload",))
    for flag in EXTRA_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), default=None,
                            help="passed to `asyncinfer bench serve`")
    return parser


def main() -> int:
    argv, engine_flags = split_argv(sys.argv[1:])
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, engine_flags = server_model(args, engine_flags)
    policies = args.policies.split(",")
    order = run_order(policies, args.rounds)
    record: dict[str, Any] = {
        "benchmark": "policy-table", "commit": git_commit(), "machine": machine(),
        "model": f"{args.shape} (dummy weights)" if args.shape else "embedded",
        "engine_flags": engine_flags, "policy_opt": args.policy_opt, "order": order,
        "bench_flags": [*bench_flags(args), *workload_flags(args),
                        "--num-requests", str(args.num_requests)],
        "command": "python -m benchmarks.policy_table " + " ".join(sys.argv[1:]),
        "runs": [], "table": []}
    warm = argparse.Namespace(num_requests=args.warmup)
    for round_, policies_now in enumerate(order):
        for policy in policies_now:
            port = args.port + policies.index(policy)
            url = f"http://127.0.0.1:{port}"
            name = f"{policy}-round{round_}"
            run: dict[str, Any] = {"round": round_, "policy": policy}
            try:
                with serving(model, policy, port,
                             [*engine_flags, *policy_flags(policy, args.policy_opt)],
                             args.api_workers, out / f"server-{name}.log"):
                    if args.warmup:
                        run_rate(url, policy, "inf", warm, out, None, name=f"warmup-{name}",
                                 load=["--rate", "inf", "--input-len", "1024",
                                       "--output-len", "8"])
                    run["result"] = run_rate(url, policy, "", args, out, None, name=name,
                                             load=bench_flags(args))
            except SystemExit as exc:  # the server did not come up
                run["error"] = str(exc)
            except subprocess.CalledProcessError as exc:  # the load: nothing completed
                run["error"] = f"the load failed (exit status {exc.returncode}); see {name}.json"
            record["runs"].append(run)
            record["table"] = policy_table(policies, record["runs"])
            write_report(str(out / "policy-table.json"), record)
            brief = {k: v for k, v in run.items() if k != "result"}
            if "result" in run:
                brief.update({k: value(run["result"]) for k, value in COLUMNS})
            print(json.dumps(brief), flush=True)
    print(markdown(record["table"]))
    return 0 if record["table"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
