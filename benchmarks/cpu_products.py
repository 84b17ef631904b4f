"""The bf16 matrix products of a decoder layer on a CPU: our AVX-512 kernel as float32 FMAs
over widened weights and as AVX512-BF16 dot products (where the CPU has them), beside
oneDNN's packed bf16 kernel, torch's bf16 ``linear`` and its float32 one, at torch's thread
count; on an AVX2 CPU our AVX2 kernel beside torch's float32 product over a float32 copy.
A call runs the four products of ``--layers`` layers, each with its own weights, so
that, as in a forward, the weights come from memory rather than from a cache the previous
call filled. Each figure is the median of ``--reps`` calls, the sides' order alternated call by
call; the record keeps every call and each side's largest difference from the float32
product.

    python -m benchmarks.cpu_products --rows 1 16 256 4096 --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from asyncinfer.kernels import cpu as native
from benchmarks.util import git_commit, machine, write_report

# SmolLM2-135M's products: (name, out features, in features).
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def _ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _ours(kernels: native.NativeKernels, dot: bool, x: torch.Tensor, packed: torch.Tensor,
          n: int) -> torch.Tensor:
    kernels.dot = dot
    return kernels.linear(x, packed, n)


def run(rows: int, reps: int, kernels: native.NativeKernels, depth: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rows)
    layers = []
    for name, n, k in SHAPES * depth:
        weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        x = torch.randn(rows, k, generator=gen).bfloat16()
        layers.append((name, n, x, weight, kernels.pack(weight),
                       torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                       if kernels.products is not None else None, weight.float()))
    sides: dict[str, Callable[[], Any]] = {}

    def each(product: Callable[..., torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        return lambda: [product(*layer) for layer in layers]

    sides["ours_fma"] = each(lambda _, n, x, w, p, d, f: _ours(kernels, False, x, p, n))
    if kernels.dot_built:
        sides["ours_dot"] = each(lambda _, n, x, w, p, d, f: _ours(kernels, True, x, p, n))
    if kernels.products is not None:  # an AVX2 CPU emulates bf16: only float32 beside ours
        sides["onednn_bf16"] = each(lambda _, n, x, w, p, d, f:
                                    torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], ""))
        sides["torch_bf16"] = each(lambda _, n, x, w, p, d, f: F.linear(x, w))
    # The float32 product as the model runs it where it multiplies over a float32 shadow.
    sides["torch_fp32"] = each(lambda _, n, x, w, p, d, f: F.linear(x.float(), f).to(x.dtype))
    dot = kernels.dot
    try:
        want = [F.linear(x.float(), f) for _, _, x, _, _, _, f in layers]
        error = {name: max(float((got.float() - ref).abs().max()) for got, ref in
                           zip(fn(), want, strict=True)) for name, fn in sides.items()}
        for fn in sides.values():  # warm up (allocations, the thread team)
            fn()
        times: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for rep in range(reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                times[name].append(_ms(sides[name]))
    finally:
        kernels.dot = dot
    flops = 2 * rows * depth * sum(n * k for _, n, k in SHAPES)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "flops": flops, "median_ms": median,
            "gflops": {name: flops / ms / 1e6 for name, ms in median.items()},
            "max_abs_error_vs_fp32": error, "runs_ms": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kernels = native.load()
    if kernels is None or kernels.products not in ("avx512", None) \
            or kernels.fixed_products is None:
        print("our FMA product does not run here (no AVX2 and FMA, or AMX takes over)",
              file=sys.stderr)
        return 1
    results = [run(r, args.reps, kernels, args.layers) for r in args.rows]
    for result in results:
        print(f"{result['rows']:5d} rows: " + ", ".join(
            f"{name} {ms:.3f} ms ({result['gflops'][name]:.0f} GFLOP/s)"
            for name, ms in result["median_ms"].items()))
    write_report(args.json, {
        "benchmark": "cpu_products", "command": "python -m benchmarks.cpu_products "
        + " ".join(sys.argv[1:] if argv is None else argv), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "shapes": SHAPES,
        "layers": args.layers,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "dot_by_default": kernels.dot, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
