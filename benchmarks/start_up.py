"""A CPU engine's start-up against its first bursts: how long ``LLM()`` takes to be ready
and how long the first prefills of a burst take after it, with the warm-up on and off,
for one or two checkouts of asyncinfer.

Each run is a fresh process importing one checkout's ``src``: it times ``LLM()`` on the
embedded model, then ``--prefills`` bursts of 16 new prompts of 256 tokens, one output
token each (new prompts, so the prefix cache holds none of them), each with its minor page
faults, under the heap settings the command line gives the processes that compute
(``threads.MALLOC_TUNABLES``, which keep the heap a warm-up grows). The sides alternate
their order run by run.

    python -m benchmarks.start_up --side base:../base:on --side new:.:on --side off:.:off \\
        --runs 2 --json docs/benchmarks/cpu-start-up.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from asyncinfer.threads import MALLOC_TUNABLES
from benchmarks.util import checkout_commit, machine, run_fresh, write_report

RUN = r"""
import json, random, resource, sys, time
start = time.perf_counter()
from asyncinfer.api.llm import LLM
from asyncinfer.params import SamplingParams
imported = time.perf_counter()
llm = LLM(warm_up=sys.argv[1] == "on")
ready = time.perf_counter()
rng = random.Random(0)
def prefill():
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(16)]
    faults, begin = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return {"wall_s": round(time.perf_counter() - begin, 4),
            "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}
bursts = [prefill() for _ in range(int(sys.argv[2]))]
print(json.dumps({"import_s": round(imported - start, 3), "start_s": round(ready - imported, 3),
                  "bursts": bursts}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.start_up",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True,
                        help="NAME:CHECKOUT:on|off, the warm-up on or off (repeatable)")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes per side")
    parser.add_argument("--prefills", type=int, default=3, help="timed bursts per run")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    sides: dict[str, tuple[Path, str]] = {}
    for spec in args.side:
        name, checkout, warm = spec.rsplit(":", 2)
        if warm not in ("on", "off"):
            parser.error(f"--side {spec!r}: the warm-up is on or off")
        sides[name] = (Path(checkout).resolve(), warm)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(args.runs):
        for name in order if i % 2 == 0 else order[::-1]:
            checkout, warm = sides[name]
            run = run_fresh(RUN, [warm, str(args.prefills)],
                            {"PYTHONPATH": str(checkout / "src"),
                             "GLIBC_TUNABLES": MALLOC_TUNABLES}, checkout)
            runs[name].append(run)
            print(f"{name}: start {run['start_s']:.2f} s, bursts "
                  + ", ".join(f"{b['wall_s']:.3f} s ({b['faults']} faults)"
                              for b in run["bursts"]), flush=True)
    summary = {name: {
        "start_s": statistics.median(r["start_s"] for r in per),
        "first_burst_s": statistics.median(r["bursts"][0]["wall_s"] for r in per),
        "later_bursts_s": statistics.median(b["wall_s"] for r in per for b in r["bursts"][1:])
        if args.prefills > 1 else None,
        "first_burst_faults": statistics.median(r["bursts"][0]["faults"] for r in per)}
        for name, per in runs.items()}
    for name, line in summary.items():
        print(name, line)
    write_report(args.json, {
        "benchmark": "start_up", "command": " ".join(["python -m benchmarks.start_up",
                                                       *(argv or sys.argv[1:])]),
        "sides": {name: {"checkout": str(checkout), "commit": checkout_commit(checkout),
                         "warm_up": warm} for name, (checkout, warm) in sides.items()},
        "machine": machine(), "tunables": MALLOC_TUNABLES,
        "workload": "LLM() on the embedded model, then bursts of 16 new prompts of 256 "
                    "tokens, 1 output token each",
        "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
