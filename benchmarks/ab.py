"""Paired A/B of the CPU offline workload between two checkouts of asyncinfer.

Each run is a fresh process importing one checkout's ``src`` and timing one ``LLM.generate``
over the workload; the pairs alternate their order (A B, B A, ...). The record keeps every
run, both commits, the machine, and a digest of each run's output tokens, so a change that
should leave results alone is shown to: every digest must be the same. ``--new-variant``
(and ``--base-variant``) run a feature on one side: the cost of logprobs, of n=4 against
the same sequences as separate requests, of JSON schemas on half or all of the requests, of
the batch-invariant mode, of KV-cache events, or of an FP8 KV cache (one checkout may be
both sides).

    python -m benchmarks.ab --base ../base --new . --pairs 3 --json ab.json
    python -m benchmarks.ab --base . --new . --new-variant logprobs5 --json cost.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.util import checkout_commit, machine, run_fresh

# What one run executes, in the checkout under test: only the public API, which both sides
# share. The workload is drawn as benchmarks.offline's cpu workload (random.Random(0)).
RUN = r"""
import hashlib, json, os, random, sys, time
from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
model, dtype, variant = sys.argv[1], sys.argv[2], sys.argv[3]
rng = random.Random(0)
prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(32, 512))] for _ in range(64)]
max_tokens = [rng.randint(32, 256) for _ in range(64)]
extra = {}
if variant == "logprobs5":
    extra = {"logprobs": 5}
elif variant in ("n4", "repeat4"):  # a quarter of the prompts, four sequences each
    prompts, max_tokens = prompts[:16], max_tokens[:16]
    if variant == "n4":
        extra = {"n": 4}
    else:
        prompts = [p for p in prompts for _ in range(4)]
        max_tokens = [n for n in max_tokens for _ in range(4)]
# json50, json100: every other request, or every one, under a JSON schema that stays open
# (an array of integers), so each constrained row is masked at every step.
schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}}
constrained = {"json50": set(range(1, 64, 2)), "json100": set(range(64))}.get(variant, set())
options = {"invariant": {"batch_invariant": True},
           # KV-cache events published (hashed, encoded, sent) with no subscriber attached
           "kv_events": {"kv_events": f"ipc:///tmp/asyncinfer-ab-kv-events-{os.getpid()}"},
           "kv_fp8": {"kv_cache_dtype": "fp8_e4m3"}}
llm = LLM(model, skip_tokenizer_init=True, dtype=dtype, max_running_requests=64,
          max_seq_len=2048, **options.get(variant, {}))
try:
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([p[:64] for p in prompts[:4]], warm, use_tqdm=False)
    if constrained:  # the tokenizer's vocabulary for xgrammar, and the schema, compiled once
        llm.generate([prompts[0][:64]], warm.replace(structured={"json": schema}),
                     use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra,
                             **({"structured": {"json": schema}} if i in constrained else {}))
              for i, n in enumerate(max_tokens)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
finally:
    llm.close()
if variant == "n4":
    ids = [list(c.token_ids) for o in outputs for c in o.outputs]
else:
    ids = [list(o.token_ids) for o in outputs]
tokens = sum(map(len, ids))
print(json.dumps({"variant": variant, "tokens": tokens, "seconds": round(seconds, 3),
                  "tokens_per_s": round(tokens / seconds, 1),
                  # the even-numbered requests' tokens: unconstrained in every variant but json100
                  "digest_even": hashlib.sha256(json.dumps(ids[::2]).encode()).hexdigest()[:16],
                  "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}))
"""


# What each side runs: the workload plainly; with logprobs=5; its first 16 prompts with n=4;
# or those 16 prompts each sent four times (the same tokens as n=4, greedy); half or all of
# the requests under a JSON schema; the workload plainly in the batch-invariant mode, or
# with the radix cache's KV-cache events published, or over an e4m3 KV cache.
VARIANTS = ("plain", "logprobs5", "n4", "repeat4", "json50", "json100", "invariant",
            "kv_events", "kv_fp8")


def _run(checkout: Path, model: str, dtype: str, variant: str) -> dict[str, Any]:
    result: dict[str, Any] = run_fresh(RUN, [model, dtype, variant],
                                       {"PYTHONPATH": str(checkout / "src")}, checkout)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--new", type=Path, required=True, help="checkout B (the change)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--base-variant", choices=VARIANTS, default="plain")
    parser.add_argument("--new-variant", choices=VARIANTS, default="plain")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    base, new = args.base.resolve(), args.new.resolve()
    model = args.model
    if model is None:
        from asyncinfer.models.source import embedded_model_dir

        model = str(embedded_model_dir())
    runs = []
    for pair in range(args.pairs):
        order = [("base", base, args.base_variant), ("new", new, args.new_variant)]
        for side, checkout, variant in order if pair % 2 == 0 else order[::-1]:
            run = {"pair": pair, "side": side, **_run(checkout, model, args.dtype, variant)}
            print(json.dumps(run), flush=True)
            runs.append(run)

    def median(side: str) -> float:
        values = sorted(r["tokens_per_s"] for r in runs if r["side"] == side)
        return values[len(values) // 2]

    ratios = sorted(next(r["tokens_per_s"] for r in runs if r["pair"] == p and r["side"] == "new")
                    / next(r["tokens_per_s"] for r in runs if r["pair"] == p
                           and r["side"] == "base") for p in range(args.pairs))
    record = {
        "benchmark": "offline-cpu A/B",
        # The checkouts by commit, not by where they lay on the measuring machine.
        "command": (f"python -m benchmarks.ab --base <checkout of {checkout_commit(base)}> "
                    f"--new <checkout of {checkout_commit(new)}> --dtype {args.dtype} "
                    f"--pairs {args.pairs} --base-variant {args.base_variant} "
                    f"--new-variant {args.new_variant}"),
        "base_commit": checkout_commit(base), "new_commit": checkout_commit(new),
        "machine": machine(), "model": Path(model).name, "dtype": args.dtype,
        "variants": {"base": args.base_variant, "new": args.new_variant},
        "same_tokens": len({r["digest"] for r in runs}) == 1,
        "same_even_tokens": len({r["digest_even"] for r in runs}) == 1,
        "median_tokens_per_s": {"base": median("base"), "new": median("new")},
        "median_pair_ratio_new_over_base": round(ratios[len(ratios) // 2], 3),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
