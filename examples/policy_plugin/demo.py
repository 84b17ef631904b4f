"""Admission order of five requests, one slot, under the example policy and prefill_first.

    pip install --no-build-isolation examples/policy_plugin   # after asyncinfer: README.md
    python examples/policy_plugin/demo.py --model PATH --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from asyncinfer import LLM, SamplingParams
from asyncinfer.options import add_engine_arguments, engine_options

PROMPTS = ["Write a story about a dragon.", "Say hi.", "List the planets.",
           "Name a colour.", "Explain photosynthesis."]
MAX_TOKENS = [12, 2, 8, 1, 5]


def admission_order(policy: str, **options: Any) -> list[int]:
    """Indices of PROMPTS in the order their first token came, under ``policy``."""
    llm = LLM(policy=policy, **{**options, "max_running_requests": 1})
    try:
        assert llm.policy.name == policy
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in MAX_TOKENS]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [len(out.token_ids) for out in outputs] == MAX_TOKENS
    finally:
        llm.close()
    first = [out.metrics.first_token_time if out.metrics else None for out in outputs]
    return sorted(range(len(PROMPTS)), key=lambda i: first[i] or float("inf"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, exclude=("policy", "policy_options", "max_running_requests"),
                         title="engine options (--model among them)")
    options = engine_options(parser.parse_args(argv))
    for policy in ("prefill_first", "shortest_output_first"):
        order = admission_order(policy, **options)
        print(f"{policy:<22} admitted (max_tokens): {[MAX_TOKENS[i] for i in order]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
