"""Decode attention kernels over a paged cache on one GPU, bf16 and FP8 pages: flashinfer's
decode wrapper (its tensor-core and its CUDA-core kernel) and flashinfer's XQA kernel
(TensorRT-LLM's decode kernel), one layer of a batch at one context length, each timed
with CUDA events, with the rate it reads the cache at and its largest difference from the
bf16 tensor-core output.

    python -m benchmarks.decode_kernels --batch 256 --context 850 --json OUT.json

The shape defaults to Qwen3-0.6B's attention (16 query heads, 8 KV heads, head size 128).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.util import git_commit, machine, write_report


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls, after three to warm up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(batch: int, context: int, heads: int, kv_heads: int, dim: int, page: int,
        reps: int) -> dict[str, Any]:
    import flashinfer

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_seq = -(-context // page)
    num_pages = batch * pages_per_seq
    # Each request's pages scattered over the pool, as a running engine leaves them.
    order = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    block_tables = order.view(batch, pages_per_seq).contiguous()
    indptr = torch.arange(0, num_pages + 1, pages_per_seq, dtype=torch.int32, device=device)
    last = torch.full((batch,), context - (pages_per_seq - 1) * page, dtype=torch.int32,
                      device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, generator=gen, device=device).bfloat16()
    k16 = torch.randn(num_pages, page, kv_heads, dim, generator=gen, device=device).bfloat16()
    v16 = torch.randn(num_pages, page, kv_heads, dim, generator=gen, device=device).bfloat16()
    k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    scale = dim ** -0.5
    results: list[dict[str, Any]] = []
    reference = None

    def record(name: str, kv_dtype: torch.dtype, fn: Callable[[], torch.Tensor]) -> None:
        nonlocal reference
        try:
            out = fn()
            ms = _time(fn, reps)
        except Exception as exc:  # a kernel this build or GPU lacks: recorded, not fatal
            results.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(results[-1], file=sys.stderr, flush=True)
            return
        item = torch.empty((), dtype=kv_dtype).element_size()
        read = 2 * batch * context * kv_heads * dim * item
        if reference is None:
            reference = out.float()
        results.append({"kernel": name, "kv_dtype": str(kv_dtype).removeprefix("torch."),
                        "ms": round(ms, 4), "kv_bytes": read,
                        "kv_read_tb_s": round(read / ms / 1e9, 3),
                        "max_abs_diff_from_first": round(float((out.float() - reference)
                                                                .abs().max()), 4)})
        print(results[-1], file=sys.stderr, flush=True)

    for tensor_cores in (True, False):
        for kv_dtype, pages in ((torch.bfloat16, (k16, v16)), (torch.float8_e4m3fn, (k8, v8))):
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores)
            wrapper.plan(indptr, order, last, heads, kv_heads, dim, page,
                         q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=scale)
            record(f"flashinfer decode, {'tensor' if tensor_cores else 'CUDA'} cores",
                   kv_dtype, functools.partial(wrapper.run, q, pages))
    from flashinfer.decode import xqa_batch_decode_with_kv_cache as xqa
    for kv_dtype, pages in ((torch.bfloat16, (k16, v16)), (torch.float8_e4m3fn, (k8, v8))):
        xqa_workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
        record("flashinfer xqa", kv_dtype,
               functools.partial(xqa, q, pages, xqa_workspace, block_tables, seq_lens,
                                 context, bmm1_scale=scale, bmm2_scale=1.0))
    return {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads,
            "head_dim": dim, "page_size": page, "reps": reps, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--context", type=int, default=850)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shapes = [run(b, args.context, args.heads, args.kv_heads, args.head_dim, args.page_size,
                  args.reps) for b in args.batch]
    import flashinfer

    write_report(args.json, {
        "benchmark": "decode_kernels", "command": "python -m benchmarks.decode_kernels "
        + " ".join(sys.argv[1:] if argv is None else argv), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "flashinfer": getattr(flashinfer, "__version__", "unknown"), "shapes": shapes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
