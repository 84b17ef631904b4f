"""Decode throughput of our CPU path beside transformers' `generate`, in one process and run.

Both run the same weights and dtype on the same prompts of random ids; EOS is ignored so
every request produces exactly ``--new-tokens`` tokens. Reported: output tokens per second,
median over ``--repeats`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.util import git_commit, write_report


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(model: str | None, batch_sizes: list[int], prompt_len: int, new_tokens: int,
        repeats: int, **options: Any) -> dict[str, object]:
    """Tokens/s of ours and of transformers for each batch size; ``options`` are the
    engine's (by default: a slot per request of the largest batch, a 0.5 GiB KV cache, no
    prefix cache, since every prompt is new)."""
    from transformers import AutoModelForCausalLM

    from asyncinfer.api import LLM
    from asyncinfer.models.source import resolve_model
    from asyncinfer.params import SamplingParams

    model_dir = resolve_model(model)
    options = {"max_running_requests": max(batch_sizes), "kv_cache_gb": 0.5,
               "cache_type": "naive", **options}
    llm = LLM(str(model_dir), **options)
    device, dtype = llm.config.device, llm.config.dtype
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=llm.config.torch_dtype).eval()
    hf = hf.to(device)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    for bs in batch_sizes:
        prompts = [[rng.randrange(100, 10000) for _ in range(prompt_len)] for _ in range(bs)]
        ids = torch.tensor(prompts, device=device)

        def ours(prompts: list[list[int]] = prompts) -> object:
            return llm.generate(prompts, params, use_tqdm=False)

        def theirs(ids: torch.Tensor = ids) -> object:
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens)

        ours_s, hf_s = _median_seconds(ours, repeats), _median_seconds(theirs, repeats)
        tokens = bs * new_tokens
        rows.append({"batch_size": bs, "tokens": tokens,
                     "asyncinfer_tokens_per_s": round(tokens / ours_s, 1),
                     "transformers_tokens_per_s": round(tokens / hf_s, 1),
                     "ratio": round(hf_s / ours_s, 2)})
        print(f"batch {bs:>3}: asyncinfer {tokens / ours_s:8.1f} tok/s   "
              f"transformers generate {tokens / hf_s:8.1f} tok/s   ratio {hf_s / ours_s:.2f}x",
              flush=True)
    return {
        "benchmark": "decode", "model": model_dir.name, "device": device, "dtype": dtype,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "commit": git_commit(), "results": rows,
    }


def main(args: argparse.Namespace) -> int:
    """``python -m benchmarks.decode``."""
    from asyncinfer.options import engine_options

    options = engine_options(args)
    result = run(options.pop("model", None), [int(b) for b in args.batch_sizes.split(",")],
                 args.prompt_len, args.new_tokens, args.repeats, **options)
    write_report(args.json, result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's command line; the engine options come from EngineConfig."""
    from asyncinfer.options import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode",
        description="Single-request and batched decode tokens/s, ours and "
                    "transformers'.")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results to this file")
    add_engine_arguments(parser, title="engine options", defaults_here={
        "max_running_requests": "the largest batch size", "kv_cache_gb": "0.5",
        "cache_type": "naive"})
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(build_parser().parse_args()))
