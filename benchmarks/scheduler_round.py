"""Host time of one scheduler round, ``schedule()`` plus ``process()``, against the depth of
the waiting queue (``python -m benchmarks.scheduler_round``).

256 requests decode in 256 rows (they do not finish while measured) and 0, 100, 1,000 or
10,000 more wait for a row, so every round shows the policy a full engine and a queue it
cannot admit from: what grows with the depth is the scheduler's and the policy's own cost.
A runner with no model stands in for the engine and is not timed. Each (policy, depth) runs
on its own scheduler, ``--repeats`` times; the depths take turns round by round, and the
record has every round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.params import SamplingParams
from asyncinfer.policies.registry import available_policies, load_policy
from asyncinfer.scheduler.scheduler import Scheduler
from benchmarks.util import git_commit, machine, write_report

DEPTHS = (0, 100, 1_000, 10_000)
POLICIES = ("prefill_first", "decode_first", "stall_free", "skip_ahead", "priority", "lpm",
            "vtc", "shortest_prompt_first")


class NullRunner:
    """The BatchRunner protocol with no model: tables on the host, a fixed next token."""

    def __init__(self, max_rows: int, page_size: int, num_pages: int, context_len: int) -> None:
        self.max_rows, self.page_size, self.num_pages = max_rows, page_size, num_pages
        self.context_len = context_len
        width = -(-context_len // page_size) * page_size + 1
        self.page_table = torch.zeros(max_rows, width, dtype=torch.int64)
        self.token_pool = torch.zeros(max_rows, width, dtype=torch.int64)

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        pass

    def forward(self, batch: Batch) -> ForwardOutput:
        return ForwardOutput(torch.full((batch.size,), 5, dtype=torch.int64), torch.empty(0))


def prompt(uid: int, length: int) -> list[int]:
    """A prompt of its own after a prefix shared by a quarter of the requests."""
    shared = [3] * (length // 2) if uid % 4 == 0 else []
    return (shared + [7 + (uid * 31 + i) % 4000 for i in range(length)])[:length]


def setup(policy: str, depth: int, rows: int, prompt_len: int) -> Scheduler:
    """A scheduler with ``rows`` requests decoding and ``depth`` more waiting."""
    page_size, context = 16, 4096
    pages = rows * (context // page_size) + 1
    runner = NullRunner(rows, page_size, pages, context)
    config = EngineConfig(max_running_requests=rows, max_extend_tokens=16384,
                          page_size=page_size, cache_type="radix", chunked_prefill=True)
    sched = Scheduler(runner, load_policy(policy), config)
    long = SamplingParams(max_tokens=context - prompt_len, ignore_eos=True)
    for uid in range(rows):
        sched.add_request(uid, prompt(uid, prompt_len), long)
    while len(sched.running) < rows:
        sched.step()
    for uid in range(rows, rows + depth):
        sched.add_request(uid, prompt(uid, prompt_len), SamplingParams(
            max_tokens=16, priority=uid % 3, tenant=f"t{uid % 8}"))
    return sched


def one_round(sched: Scheduler) -> float:
    """Microseconds of one ``schedule()`` and ``process()``."""
    start = time.perf_counter_ns()
    scheduled = sched.schedule()
    assert scheduled is not None
    sched.process(scheduled, [5] * scheduled.batch.size)
    return (time.perf_counter_ns() - start) / 1000


def measure(policy: str, depths: list[int], rows: int, rounds: int, warmup: int,
            prompt_len: int) -> dict[int, list[float]]:
    """Microseconds of each measured round at each depth. The depths take turns round by
    round, so a load that comes and goes on the machine falls on all of them alike."""
    scheds = {depth: setup(policy, depth, rows, prompt_len) for depth in depths}
    gc.collect()
    gc.freeze()  # as the engine does: the long-lived heap is not traversed per collection
    times: dict[int, list[float]] = {depth: [] for depth in depths}
    for i in range(warmup + rounds):
        turn = depths[i % len(depths):] + depths[: i % len(depths)]
        for depth in turn:
            elapsed = one_round(scheds[depth])
            if i >= warmup:
                times[depth].append(elapsed)
    gc.unfreeze()
    for depth, sched in scheds.items():
        assert len(sched.running) == rows and len(sched.waiting) == depth, "the setting moved"
    return times


def _without_json(args: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip or arg.startswith("--json"):
            skip = arg == "--json"
            continue
        kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler_round",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=None,
                        help="default: every installed one of " + ", ".join(POLICIES))
    parser.add_argument("--depths", nargs="+", type=int, default=list(DEPTHS))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    installed = available_policies()
    policies = args.policies or [p for p in POLICIES if p in installed]
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for policy in policies:
            measured = measure(policy, args.depths, args.rows, args.rounds, args.warmup,
                               args.prompt_len)
            for depth, times in measured.items():
                run = {"policy": policy, "depth": depth, "repeat": repeat,
                       "median_us": round(statistics.median(times), 2),
                       "mean_us": round(statistics.fmean(times), 2),
                       "round_us": [round(t, 2) for t in times]}
                print(json.dumps({k: v for k, v in run.items() if k != "round_us"}),
                      file=sys.stderr, flush=True)
                runs.append(run)
    summary: dict[str, dict[str, float]] = {}
    for policy in policies:
        summary[policy] = {str(d): statistics.median(
            r["median_us"] for r in runs if r["policy"] == policy and r["depth"] == d)
            for d in args.depths}
    base, deepest = str(min(args.depths)), str(max(args.depths))
    record = {
        "benchmark": "scheduler round",
        # Where the record was written is no part of the command that measured it.
        "command": "python -m benchmarks.scheduler_round " + " ".join(_without_json(
            argv if argv is not None else sys.argv[1:])),
        "commit": git_commit(), "machine": {**machine(), "python": platform.python_version(),
                                             "load_average": list(os.getloadavg())},
        "setting": {"rows": args.rows, "rounds": args.rounds, "warmup": args.warmup,
                    "repeats": args.repeats, "prompt_len": args.prompt_len,
                    "page_size": 16, "cache_type": "radix"},
        "median_round_us": summary,
        f"ratio_{deepest}_over_{base}": {p: round(s[deepest] / s[base], 3)
                                         for p, s in summary.items()},
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1))
    write_report(args.json, record)


if __name__ == "__main__":
    main()
