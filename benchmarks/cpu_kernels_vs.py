"""The CPU kernels of this tree against those of another commit, in one process on the same
inputs, the two libraries' calls alternated: a decode step's matrix products (every layer
of SmolLM2-135M's shapes with its own weights, then the tied LM head), its attention (16
requests at 288 positions, every layer with its own pages, so that K and V come from
memory) and the batch-invariant prefill's attention (16 prompts of 256 tokens, each token
its own query). Each figure is the median of ``--reps`` calls; the record keeps every call
and whether the two libraries' outputs are equal bit for bit.

    python -m benchmarks.cpu_kernels_vs --vs fdd9db6 --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncinfer.kernels import cpu as native
from benchmarks.util import git_commit, machine, write_report

# SmolLM2-135M: products (out, in) of a layer, the head, and the attention's sizes.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS, HEADS, KV_HEADS, DIM, PAGE = 30, 9, 3, 64, 16


def build(sources: dict[str, str], where: Path, name: str) -> native.NativeKernels:
    """The kernels compiled from these texts (file name -> source), as load() builds them."""
    folder = where / name
    folder.mkdir()
    for file, text in sources.items():
        (folder / file).write_text(text)
    library = folder / "kernels.so"
    c_files = [str(folder / p.name) for p in native.SOURCES]
    subprocess.run(["cc", *native.FLAGS, "-march=native", *c_files, "-o", str(library), "-lm"],
                   check=True, capture_output=True, text=True)
    return native.NativeKernels(library, "native")


def sources_at(revision: str | None) -> dict[str, str]:
    """The kernels' C sources of the working tree (None) or of a commit."""
    files = [*native.SOURCES, *native.HEADERS]
    if revision is None:
        return {p.name: p.read_text() for p in files}
    root = Path(__file__).resolve().parent.parent
    return {p.name: subprocess.run(
        ["git", "show", f"{revision}:{p.relative_to(root).as_posix()}"], cwd=root,
        check=True, capture_output=True, text=True).stdout for p in files}


def products(sides: dict[str, native.NativeKernels], rows: int
             ) -> Callable[[native.NativeKernels], list[torch.Tensor]]:
    """Every layer's four products, then the head; each side multiplies by weights it
    packed itself."""
    gen = torch.Generator().manual_seed(rows)
    shapes = [*SHAPES * LAYERS, HEAD]
    plain = [(torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16() for n, k in shapes]
    packed = {id(k): [k.pack(w) for w in plain] for k in sides.values()}
    inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
    return lambda kernels: [kernels.linear(inputs[k], p, n) for (n, k), p in
                            zip(shapes, packed[id(kernels)], strict=True)]


def attention(batch: int, context: int, prefill: bool, dtype: torch.dtype = torch.bfloat16
              ) -> Callable[[native.NativeKernels], list[torch.Tensor]]:
    """Decode (one query per request at ``context``) or prefill (every position a query)."""
    gen = torch.Generator().manual_seed(context)
    width = (context + PAGE) // PAGE * PAGE
    pages = torch.randperm(batch * width // PAGE, generator=gen).view(batch, -1)
    table = (pages[:, :, None] * PAGE + torch.arange(PAGE)).view(batch, -1).contiguous()
    pools = [(torch.randn(batch * width, KV_HEADS, DIM, generator=gen).to(dtype),
              torch.randn(batch * width, KV_HEADS, DIM, generator=gen).to(dtype))
             for _ in range(1 if prefill else LAYERS)]
    if prefill:
        rows = torch.arange(batch).repeat_interleave(context)
        lens = torch.arange(1, context + 1).repeat(batch)
    else:
        rows, lens = torch.arange(batch), torch.full((batch,), context)
    q = torch.randn(rows.shape[0], HEADS, DIM, generator=gen).bfloat16()
    return lambda k: [k.decode_attention(q, kp, vp, table, rows, lens, DIM ** -0.5, context)
                      for kp, vp in pools]


def compare(sides: dict[str, native.NativeKernels],
            work: Callable[[native.NativeKernels], list[torch.Tensor]], reps: int
            ) -> dict[str, Any]:
    outputs = {name: work(k) for name, k in sides.items()}  # also the warm-up
    first = next(iter(outputs.values()))
    same = all(torch.equal(a, b) for out in outputs.values() for a, b in zip(out, first))
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            work(sides[name])
            times[name].append((time.perf_counter() - start) * 1e3)
    return {"median_ms": {n: statistics.median(t) for n, t in times.items()},
            "same_bits": same, "runs_ms": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs", required=True, help="the commit whose kernels to run beside")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=16, help="the decode step's batch")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the pool's (float32: a CPU without bf16 units' engine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kv_dtype = getattr(torch, args.kv_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"this": build(sources_at(None), Path(tmp), "this"),
                 args.vs: build(sources_at(args.vs), Path(tmp), "base")}
        if sides["this"].fixed_products is None:
            print("no native matrix products on this CPU", file=sys.stderr)
            return 1
        work = {"decode products": products(sides, args.rows),
                "decode attention": attention(args.rows, 288, False, kv_dtype),
                "prefill attention": attention(args.rows, 256, True, kv_dtype)}
        results = {name: compare(sides, fn, args.reps) for name, fn in work.items()}
    for name, result in results.items():
        print(f"{name}: " + ", ".join(f"{side} {ms:.2f} ms" for side, ms in
                                      result["median_ms"].items())
              + f"; same bits: {result['same_bits']}")
    write_report(args.json, {
        "benchmark": "cpu_kernels_vs", "command": "python -m benchmarks.cpu_kernels_vs "
        + " ".join(sys.argv[1:] if argv is None else argv), "commit": git_commit(),
        "vs": subprocess.run(["git", "rev-parse", "--short", args.vs], check=True,
                             capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "threads": torch.get_num_threads(), "rows": args.rows, "layers": LAYERS,
        "kv_dtype": args.kv_dtype,
        "products": sides["this"].products, "dot": sides["this"].dot, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
