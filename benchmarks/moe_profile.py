"""Where the CPU offline workload's time goes on a mixture-of-experts shape (dummy weights):
each step's wall time split into the grouped expert products, the router, attention, the
dense products (projections and the head), the sampler and the rest, by exclusive timers
around those functions. Writes its own JSON record.

    python -m benchmarks.moe_profile --shape qwen3-moe-tiny --dtype bfloat16 \\
        --json docs/benchmarks/cpu-moe-profile.json
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncinfer.bench.throughput import SHAPES, machine, offline_workload, shape_dir
from benchmarks.util import git_commit, write_report


class ExclusiveTimers:
    """Wall seconds per name, each excluding the timed calls nested in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.seconds[name] += spent - nested
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += spent
        return timed


def instrument(timers: ExclusiveTimers) -> None:
    """Wrap the functions each share is named by (in this process only)."""
    from asyncinfer.attention.torch_backend import TorchBackend
    from asyncinfer.engine.sampler import Sampler
    from asyncinfer.layers import fused_moe
    from asyncinfer.layers.linear import Linear, TiedHead
    from asyncinfer.models.moe import MoEBlock

    fused_moe.grouped_moe = timers.wrap("experts", fused_moe.grouped_moe)
    MoEBlock.route = timers.wrap("router", MoEBlock.route)  # type: ignore[method-assign]
    TorchBackend.forward = timers.wrap("attention", TorchBackend.forward)  # type: ignore[method-assign]
    Linear.forward = timers.wrap("dense products", Linear.forward)  # type: ignore[method-assign]
    TiedHead.forward = timers.wrap("dense products", TiedHead.forward)  # type: ignore[method-assign]
    Sampler.sample = timers.wrap("sampler", Sampler.sample)  # type: ignore[method-assign]


def main(args: argparse.Namespace) -> int:
    from asyncinfer.api import LLM
    from asyncinfer.params import SamplingParams

    prompts, max_tokens = offline_workload("cpu")
    model_dir = shape_dir(args.shape, Path(tempfile.mkdtemp()))
    llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
              max_running_requests=64, max_seq_len=2048)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, untimed
    timers = ExclusiveTimers()
    instrument(timers)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    shares = {name: round(s / wall, 4) for name, s in sorted(timers.seconds.items())}
    shares["rest (scheduling, norms, rope, activations, copies)"] = round(
        1 - sum(timers.seconds.values()) / wall, 4)
    report = {"benchmark": "cpu-moe-profile", "shape": args.shape, "config": SHAPES[args.shape],
              "dtype": args.dtype, "command": " ".join(sys.argv), "commit": git_commit(),
              "machine": machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "requests": len(prompts), "tokens": tokens,
              "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
              "seconds_by_share": {k: round(v, 3) for k, v in timers.seconds.items()},
              "calls": dict(timers.calls), "shares": shares,
              "note": "exclusive wall time around each function; the timers slow the run "
                      "(tokens_per_s here is below the offline benchmark's)"}
    for name, share in shares.items():
        print(f"{name:<55} {100 * share:5.1f}%")
    print(f"{tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s, timed)")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-tiny")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None, help="write the record to this file")
    sys.exit(main(parser.parse_args()))
