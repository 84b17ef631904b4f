"""The host's time to launch a small prefill round, with prefill CUDA graphs and without.

``python -m benchmarks.prefill_host`` (CUDA; a Qwen3-0.6B-shaped model of dummy weights
unless ``--model`` names one). For each batch it times ``ModelRunner.launch``: the host
building the batch's inputs, planning attention and enqueueing the forward and sampling,
what a scheduling round pays on the host whatever the device does; and the whole round
(``launch`` and its wait). Medians of ``--repeats`` after a warm-up, once with prefill graphs
and once with prefill eager (decode graphs on in both).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncinfer.bench.throughput import SHAPES
from benchmarks.util import git_commit, write_report

# name -> (rows, starts, ends): rows 0 .. n-1 of the page table
BATCHES: dict[str, tuple[list[int], list[int], list[int]]] = {
    "1 prompt of 128": ([0], [0], [128]),
    "1 prompt of 512": ([0], [0], [512]),
    "1 prompt of 2048": ([0], [0], [2048]),
    "4 prompts of 128": ([0, 1, 2, 3], [0] * 4, [128] * 4),
    "256 over 1024 cached": ([0], [1024], [1280]),
    "32 decoding + 1 prompt of 256": (list(range(33)), [600] * 32 + [0], [601] * 32 + [256]),
}


def time_runner(runner: Any, repeats: int) -> dict[str, dict[str, Any]]:
    """Median host (``launch``) and round (``launch`` and wait) milliseconds per batch."""
    from asyncinfer.core import Batch
    from asyncinfer.params import SamplingParams

    span = -(-runner.width // runner.page_size) * runner.page_size
    used = max(len(rows) for rows, _, _ in BATCHES.values())
    assert used * span <= runner.num_pages * runner.page_size, "the KV cache is too small"
    for row in range(used):
        runner.page_table[row] = torch.arange(row * span, row * span + runner.width)
    greedy = SamplingParams(temperature=0.0)
    results = {}
    for name, (rows, starts, ends) in BATCHES.items():
        batch = Batch(rows=rows, starts=starts, ends=ends, params=[greedy] * len(rows),
                      steps=[0] * len(rows))
        graphs = runner.graphs
        graph = None if graphs is None else graphs.pick(batch.phase, batch.size,
                                                        batch.num_tokens)
        host, whole = [], []
        for i in range(repeats + 3):
            runner.synchronize()
            start = time.perf_counter()
            wait = runner.launch(batch)
            launched = time.perf_counter()
            wait()
            if i >= 3:  # warm-up first
                host.append(launched - start)
                whole.append(time.perf_counter() - start)
        results[name] = {"tokens": batch.num_tokens, "requests": batch.size,
                         "graph_tokens": None if graph is None else graph.shape.tokens,
                         "host_ms": 1e3 * statistics.median(host),
                         "round_ms": 1e3 * statistics.median(whole)}
    return results


def main(args: argparse.Namespace) -> int:
    from asyncinfer.bench.throughput import shape_dir
    from asyncinfer.config import EngineConfig
    from asyncinfer.engine.runner import ModelRunner

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    model_dir = (Path(args.model) if args.model
                 else shape_dir(args.shape, Path(tempfile.mkdtemp())))
    report: dict[str, Any] = {"commit": git_commit(), "model": str(args.model or args.shape),
                              "device": torch.cuda.get_device_name(), "runs": {}}
    for label, max_tokens in (("graphs", args.max_prefill_tokens), ("eager", 0)):
        config = EngineConfig(
            model=str(model_dir), device="cuda", load_format="auto" if args.model else "dummy",
            kv_cache_gb=10.0, max_seq_len=2304, max_running_requests=64,
            cuda_graph_max_prefill_tokens=max_tokens)
        start = time.perf_counter()
        runner = ModelRunner(config, model_dir)
        print(f"{label}: runner ready in {time.perf_counter() - start:.1f} s", flush=True)
        report["runs"][label] = time_runner(runner, args.repeats)
        del runner
        gc.collect()  # the runner sits in reference cycles (its graphs call back into it)
        torch.cuda.empty_cache()
    graphs, eager = report["runs"]["graphs"], report["runs"]["eager"]
    print(f"{'batch':<32} {'tokens':>6} {'graph':>6} {'host ms graphs/eager':>22} "
          f"{'round ms graphs/eager':>23}")
    for name, ours in graphs.items():
        theirs = eager[name]
        print(f"{name:<32} {ours['tokens']:>6} {ours['graph_tokens'] or '-':>6} "
              f"{ours['host_ms']:>10.2f} / {theirs['host_ms']:<9.2f} "
              f"{ours['round_ms']:>11.2f} / {theirs['round_ms']:<9.2f}")
    write_report(args.json, report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_host",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b",
                        help="a model of this shape with dummy weights (default)")
    parser.add_argument("--model", default=None, help="a local model directory instead")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048,
                        help="cuda_graph_max_prefill_tokens of the graphs run")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(build_parser().parse_args()))
