"""The offline workloads: the CPU one, and nano-vllm's bench (random.seed(0) draws)."""

from __future__ import annotations

import random


def cpu_offline() -> tuple[list[list[int]], list[int]]:
    """64 prompts of 32..512 random ids, then 64 max_tokens of 32..256 (9,896 in all)."""
    return _draw(64, (32, 512), (32, 256))


def gpu_offline() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench: 256 prompts of 100..1024 ids, then max_tokens of 100..1024."""
    return _draw(256, (100, 1024), (100, 1024))


def _draw(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int]
          ) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)  # the same draws as nano-vllm's random.seed(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*prompt_len))]
               for _ in range(n)]
    max_tokens = [rng.randint(*output_len) for _ in range(n)]
    return prompts, max_tokens
