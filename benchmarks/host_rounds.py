"""The host's share of a scheduling round, with no model (``-m benchmarks.host_rounds``).

A null engine stands in for the runner: it builds what the CUDA runner builds on the host
for each batch (the host inputs, the paged layout, the sampler's row keys) and returns a
fixed token. Everything else is the real scheduler and policy. On the GPU workload (256
requests, page 16, 16,384 prefill tokens a round) this is the part of each round that no
GPU can make faster, so it bounds the rounds where the kernels are short (prefill launches
aside): the small-batch tail of the H200 benchmark. ``--profile`` lists where it goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncinfer.attention.flashinfer_backend import paged_layout
from asyncinfer.bench.throughput import offline_workload
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.engine.runner import host_inputs
from asyncinfer.engine.sampler import Sampler
from asyncinfer.params import SamplingParams
from asyncinfer.policies.registry import load_policy
from asyncinfer.scheduler.scheduler import Scheduler


class NullEngine:
    """The scheduler's Engine protocol with the runner's host work and no model."""

    def __init__(self, max_rows: int, page_size: int, num_pages: int,
                 context_len: int = 2048) -> None:
        self.num_pages, self.page_size, self.max_rows = num_pages, page_size, max_rows
        self.context_len = context_len
        self.width = -(-context_len // page_size) * page_size + 1
        self.page_table = torch.zeros(max_rows, self.width, dtype=torch.int64)
        self.token_pool = torch.zeros(max_rows + 1, self.width, dtype=torch.int64)
        self.sampler = Sampler(0)

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        pass

    def forward(self, batch: Batch) -> ForwardOutput:
        host_inputs(batch, self.width, self.max_rows)
        paged_layout(self.page_table, batch.rows, batch.ends, self.page_size)
        self.sampler._row_keys(batch.params, batch.steps, torch.device("cpu"))
        return ForwardOutput(torch.full((batch.size,), 5, dtype=torch.int64),
                             torch.empty(0))


def measure(prompts: list[list[int]], max_tokens: list[int], policy: str = "prefill_first",
            max_rows: int = 256, page_size: int = 16, extend_tokens: int = 16384,
            profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """Run the requests to the end through the scheduler and the null engine; seconds,
    rounds and rows decoded."""
    pages = sum(-(-(len(p) + m) // page_size) for p, m in zip(prompts, max_tokens))
    engine = NullEngine(max_rows, page_size, pages + 1)
    config = EngineConfig(max_running_requests=max_rows, max_extend_tokens=extend_tokens,
                          page_size=page_size)
    scheduler = Scheduler(engine, load_policy(policy), config)
    for uid, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
        scheduler.add_request(uid, prompt, SamplingParams(max_tokens=limit, temperature=0.6,
                                                          ignore_eos=True))
    rounds = decode_rows = tokens = 0
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    while scheduler.has_work:
        scheduled = scheduler.schedule()
        if scheduled is None:
            scheduler.flush()
        else:
            out = engine.forward(scheduled.batch)
            scheduler.process(scheduled, out.next_tokens.tolist())
            rounds += 1
            decode_rows += scheduled.batch.size if scheduled.phase == "decode" else 0
        tokens += sum(e.token is not None for e in scheduler.take_events())
    if profile is not None:
        profile.disable()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rounds": rounds, "ms_per_round": 1e3 * seconds / rounds,
            "decode_rows": decode_rows, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="prefill_first")
    parser.add_argument("--profile", action="store_true", help="list where the time goes")
    args = parser.parse_args(argv)
    prompts, max_tokens = offline_workload("gpu")
    profile = cProfile.Profile() if args.profile else None
    result = measure(prompts, max_tokens, args.policy, profile=profile)
    print(f"{result['rounds']} rounds in {result['seconds']:.2f} s: "
          f"{result['ms_per_round']:.3f} ms a round ({result['decode_rows']} decode rows, "
          f"{result['tokens']} tokens)")
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
