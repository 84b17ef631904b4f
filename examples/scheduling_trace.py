"""Continuous batching, a line per round: prefill 5, decode 4, 3, 3, 2, 1; checked vs HF.

    python examples/scheduling_trace.py
"""

from __future__ import annotations

from typing import Any

import torch

from asyncinfer import LLM, SamplingParams
from asyncinfer.core import Batch

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "1 + 1 =", "Once upon a time,"]
MAX_TOKENS = [6, 2, 5, 1, 4]


def run_trace(verbose: bool = True) -> tuple[list[tuple[str, int, int]], list[bool]]:
    """(phase, batch size, tokens) per round, and whether each output equals transformers'."""
    llm = LLM(None, dtype="float32", cache_type="naive", max_running_requests=8)
    rounds: list[tuple[str, int, int]] = []
    launch = llm.runner.launch

    def traced(batch: Batch) -> Any:
        rounds.append((batch.phase, batch.size, batch.num_tokens))
        if verbose:
            spans = ", ".join(f"row{r}:{e - s}" for r, s, e in
                              zip(batch.rows, batch.starts, batch.ends))
            print(f"  {batch.phase:<7} bs={batch.size}  tokens={batch.num_tokens:<3} [{spans}]")
        return launch(batch)

    llm.runner.launch = traced  # type: ignore[method-assign]
    if verbose:
        print("scheduling trace:")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    same = []
    for out, n in zip(outputs, MAX_TOKENS):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
        same.append(out.token_ids == ref)
        if verbose:
            print(f"{out.prompt!r:<30} -> {out.text!r:<34} equals transformers: {same[-1]}")
    return rounds, same


if __name__ == "__main__":
    run_trace()
