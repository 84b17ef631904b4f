"""The sampler's token choice on a CPU: the Gumbel race (``argmax(logits / T + noise)``) in
the sampler's eager torch code beside the native kernel's one pass, and the greedy argmax,
for a batch of rows over a vocabulary, at torch's thread count. Each figure is the median
of ``--reps`` calls, the order of the two alternated call by call.

    python -m benchmarks.cpu_sampling --rows 1 16 64 --vocab 49152 --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncinfer.engine import sampler
from asyncinfer.kernels import cpu as native
from benchmarks.util import git_commit, machine, write_report


def _ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(rows: int, vocab: int, reps: int, kernels: native.NativeKernels) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rows)
    logits = 4 * torch.randn(rows, vocab, generator=gen)
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen)
    inv_t = torch.ones(rows)
    sides: dict[str, Callable[[], Any]] = {
        "race_torch": lambda: sampler.race(logits, inv_t, keys),
        "race_native": lambda: kernels.race(logits, inv_t, keys),
        "argmax_native": lambda: kernels.argmax(logits),
    }
    for fn in sides.values():  # warm up (allocations, the thread team)
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            times[name].append(_ms(sides[name]))
    same = bool(torch.equal(sampler.race(logits, inv_t, keys), kernels.race(logits, inv_t, keys)))
    return {"rows": rows, "vocab": vocab, "same_tokens": same,
            "median_ms": {name: statistics.median(t) for name, t in times.items()},
            "runs_ms": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kernels = native.load()
    if kernels is None:
        print("the native kernels do not build here", file=sys.stderr)
        return 1
    shapes = [run(r, args.vocab, args.reps, kernels) for r in args.rows]
    for shape in shapes:
        med = shape["median_ms"]
        print(f"{shape['rows']:4d} rows: race torch {med['race_torch']:7.2f} ms, native "
              f"{med['race_native']:6.2f} ms, argmax {med['argmax_native']:6.2f} ms, "
              f"same tokens: {shape['same_tokens']}")
    write_report(args.json, {
        "benchmark": "cpu_sampling", "command": "python -m benchmarks.cpu_sampling "
        + " ".join(sys.argv[1:] if argv is None else argv), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": shapes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
