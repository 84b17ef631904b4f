"""Where one decode step's time goes on CUDA: attention, matrix products, sampling, other
kernels, and the gaps between kernels, for a steady batch at a fixed context length."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.params import SamplingParams

_ATTENTION = ("kvcache", "flashinfer", "mergestate", "attention")
_MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_")


def kernel_class(name: str) -> str:
    """attention, matmul or other, from a kernel's name."""
    lower = name.lower()
    if any(k in lower for k in _ATTENTION):
        return "attention"
    if any(k in lower for k in _MATMUL):
        return "matmul"
    return "other"


def steady_decode_batch(runner: ModelRunner, batch_size: int, context: int,
                        params: SamplingParams) -> Batch:
    """``batch_size`` rows of ``context`` tokens each, on disjoint pages, decoding one token."""
    page = runner.page_size
    span = -(-(context + 1) // page) * page
    assert batch_size * span // page <= runner.num_pages, "KV pool too small for the profile"
    for row in range(batch_size):
        runner.page_table[row, :span] = torch.arange(row * span, (row + 1) * span)
    runner.token_pool[:batch_size, : context + 1].random_(0, 10000)
    return Batch(rows=list(range(batch_size)), starts=[context - 1] * batch_size,
                 ends=[context] * batch_size, params=[params] * batch_size,
                 steps=[0] * batch_size)


def _step_ms(runner: ModelRunner, batch: Batch, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.launch(batch)()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def _sampling_ms(runner: ModelRunner, batch: Batch, steps: int = 20) -> float:
    logits = torch.randn(batch.size, runner.model_config.vocab_size, device=runner.device,
                         dtype=runner.logits_dtype)
    runner.sampler.sample(logits, batch.params, batch.steps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.sampler.sample(logits, batch.params, batch.steps)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def profile_decode_step(runner: ModelRunner, batch_size: int, context: int,
                        steps: int = 10, top_kernels: int = 15) -> dict[str, Any]:
    """Times one decode step (graph replay when captured) and splits its kernel time; lists
    the ``top_kernels`` kernels that take the most of it."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.6, ignore_eos=True)
    batch = steady_decode_batch(runner, batch_size, context, params)
    for _ in range(3):
        runner.launch(batch)()
    step_ms = _step_ms(runner, batch, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step_ms(runner, batch, steps)
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        totals[kernel_class(e.name)] += e.time_range.elapsed_us() / 1000
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    busy_ms = _union_ms([(e.time_range.start, e.time_range.end) for e in kernels])
    sampling = _sampling_ms(runner, batch)
    per_step = {k: round(v / steps, 3) for k, v in totals.items()}
    # Sampling kernels are named like any elementwise kernel: time them apart, take them out
    # of "other".
    per_step["sampling"] = round(sampling, 3)
    per_step["other"] = round(max(0.0, per_step["other"] - sampling), 3)
    busy = busy_ms / steps
    return {"batch_size": batch_size, "context": context, "step_ms": round(step_ms, 3),
            "kernel_ms": per_step, "kernels_busy_ms": round(busy, 3),
            "gaps_ms": round(max(0.0, step_ms - busy), 3),
            "kernels_seen": len(kernels) // steps,
            "top_kernels": [{"name": name[:100], "class": kernel_class(name),
                             "us_per_step": round(us / steps, 1), "per_step": n // steps}
                            for name, (us, n) in top],
            "graph": getattr(runner, "graphs", None) is not None}


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    return sum(hi - lo for lo, hi in _merged(intervals)) / 1000


GAP_BOUNDS_US = (2, 5, 20, 100, 1000)


def idle_gaps(intervals: list[tuple[int, int]], windows: int = 10,
              longest: int = 20) -> dict[str, Any]:
    """Where the GPU sat idle between kernels (µs intervals): seconds and counts of gaps by
    length (short ones are launch latency inside a graph, long ones a host that came late),
    the idle seconds in each tenth of the run (to tell a slow start from a slow tail), and
    the ``longest`` gaps as [ms from the first kernel, ms idle]."""
    merged = _merged(intervals)
    if len(merged) < 2:
        return {}
    edges = (0, *GAP_BOUNDS_US, float("inf"))
    names = [f"{lo}-{hi}us" for lo, hi in itertools.pairwise(edges)]
    seconds = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0)
    start, span = merged[0][0], merged[-1][1] - merged[0][0]
    by_window = [0.0] * windows
    gaps: list[tuple[float, float]] = []
    for (_, prev_end), (lo, _) in itertools.pairwise(merged):
        gap = lo - prev_end
        gaps.append((gap, prev_end - start))
        name = next(n for n, hi in zip(names, edges[1:], strict=True) if gap <= hi)
        seconds[name] += gap / 1e6
        counts[name] += 1
        by_window[min(windows - 1, int((prev_end - start) * windows // span))] += gap / 1e6
    return {"idle_s_by_gap": {n: round(v, 6) for n, v in seconds.items()},
            "gaps_by_length": counts,
            "idle_s_by_tenth_of_run": [round(v, 6) for v in by_window],
            "longest_gaps_ms": [[round(at / 1000, 2), round(gap / 1000, 3)]
                                for gap, at in sorted(gaps, reverse=True)[:longest]]}


def kernel_busy(prof: Any) -> dict[str, Any]:
    """Seconds some kernel ran (the union of kernel intervals), time by kernel class, and
    the idle gaps between kernels (``idle_gaps``)."""
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for e in kernels:
        totals[kernel_class(e.name)] += e.time_range.elapsed_us() / 1e6
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = _union_ms(intervals) / 1000
    return {"busy_s": round(busy, 3), "kernels": len(kernels),
            **{f"{k}_s": round(v, 3) for k, v in totals.items()}, **idle_gaps(intervals)}
