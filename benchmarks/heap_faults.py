"""Page faults and system time of a CPU prefill, with glibc's heap as the command line sets
it for the processes that compute (``threads.MALLOC_TUNABLES``) and with glibc's defaults.

Each run is a fresh process on the embedded model: one warm-up, then ``--prefills`` batches
of 16 new prompts of 256 tokens, one output token each (fresh prompts, so the prefix cache
holds none of them), each timed with its minor page faults and user and system CPU seconds
(``getrusage``). The two settings alternate run by run.

    python -m benchmarks.heap_faults --runs 4 --json docs/benchmarks/cpu-heap-faults.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from asyncinfer.threads import MALLOC_TUNABLES
from benchmarks.util import git_commit, machine, run_fresh, write_report

RUN = r"""
import json, os, random, resource, sys, time
from asyncinfer.api.llm import LLM
from asyncinfer.params import SamplingParams
llm = LLM()
rng = random.Random(0)
def prefill():
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(16)]
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": time.perf_counter() - start,
            "faults": after.ru_minflt - before.ru_minflt,
            "system_s": after.ru_stime - before.ru_stime,
            "user_s": after.ru_utime - before.ru_utime}
prefill()
print(json.dumps([prefill() for _ in range(int(sys.argv[1]))]))
"""

SETTINGS = {"kept": MALLOC_TUNABLES, "glibc": ""}  # "": tunables set, to none


def run(setting: str, prefills: int) -> list[dict[str, float]]:
    result: list[dict[str, float]] = run_fresh(RUN, [str(prefills)],
                                               {"GLIBC_TUNABLES": SETTINGS[setting]})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="fresh processes per setting")
    parser.add_argument("--prefills", type=int, default=3, help="timed prefills per run")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in SETTINGS}
    order = list(SETTINGS)
    for i in range(args.runs):
        for name in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run(name, args.prefills))
            last = runs[name][-1]
            print(f"{name:6s} " + "  ".join(f"{p['wall_s']:.3f} s {p['faults']} faults "
                                             f"{p['system_s']:.2f} s sys" for p in last))
    summary: dict[str, Any] = {}
    for name, per_run in runs.items():
        flat = [p for r in per_run for p in r]
        summary[name] = {key: statistics.median(p[key] for p in flat)
                         for key in ("wall_s", "faults", "system_s", "user_s")}
        summary[name].update(faults_range=[min(p["faults"] for p in flat),
                                           max(p["faults"] for p in flat)])
        print(name, summary[name])
    write_report(args.json, {
        "benchmark": "heap_faults", "command": " ".join(sys.argv), "commit": git_commit(),
        "machine": machine(), "tunables": SETTINGS,
        "workload": "16 new prompts of 256 tokens, 1 output token, embedded model",
        "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
