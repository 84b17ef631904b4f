"""The offline workloads: the CPU one, and nano-vllm's bench (``asyncinfer bench offline``'s,
random.seed(0) draws)."""

from __future__ import annotations

from asyncinfer.bench.offline import workload


def cpu_offline() -> tuple[list[list[int]], list[int]]:
    """64 prompts of 32..512 random ids, then 64 max_tokens of 32..256 (9,896 in all)."""
    return workload("cpu")


def gpu_offline() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench: 256 prompts of 100..1024 ids, then max_tokens of 100..1024."""
    return workload("gpu")
