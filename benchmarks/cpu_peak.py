"""What this CPU can do at most, the floor the CPU figures are read against: the rate of the
multiply-adds the products issue (AVX512-BF16 ``vdpbf16ps``, where the CPU has it, and
float32 FMAs, on AVX-512 registers or AVX2's), and the rate at which the cores read memory,
each on one thread and on every core (``python -m benchmarks.cpu_peak``).

    python -m benchmarks.cpu_peak --json docs/benchmarks/cpu-peak-zen4.json

A small C program is compiled here with ``-march=native``: twelve independent chains of
the instruction over registers (more than its latency times its issue rate, so the units
stay full; the chains start apart, so the compiler cannot fold them into one), and a read
of a 512 MiB buffer in vector loads. Each figure is the best of ``--reps``
timings; the record keeps them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.util import git_commit, machine, write_report

PROGRAM = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHAINS(OP) \
    OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

/* The widest vectors this CPU has: AVX-512's 16 floats, or AVX2's 8. */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define LOAD _mm512_load_ps
#define ZERO _mm512_setzero_ps
static float reduce(vec v) { return _mm512_reduce_add_ps(v); }
#else
#define LANES 8
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define LOAD _mm256_load_ps
#define ZERO _mm256_setzero_ps
static float reduce(vec v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}
#endif

static double flops(int dot, long iters) {
    double sink = 0;
    double start = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
    {
#define INIT(i) vec a##i = SET1((float)(i));
        CHAINS(INIT)
        const vec xf = SET1(1.0001f), yf = SET1(0.9999f);
#if defined(__AVX512BF16__)
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f803f80);
#endif
        for (long n = 0; n < iters; n++) {
            if (dot) {
#if defined(__AVX512BF16__)
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, xb, xb);
                CHAINS(DOT)
#endif
            } else {
#define FMA(i) a##i = FMADD(xf, a##i, yf);
                CHAINS(FMA)
            }
        }
#define SUM(i) sink += reduce(a##i);
        CHAINS(SUM)
    }
    double seconds = omp_get_wtime() - start;
    if (sink == 1.0) puts("");  /* keeps the chains */
    /* Per instruction: LANES lanes, one multiply-add (2 flops) or two (4 flops) a lane. */
    return (double)iters * 12 * LANES * (dot ? 4 : 2) * omp_get_max_threads() / seconds / 1e9;
}

static double bandwidth(const char *buffer, size_t bytes) {
    float sink = 0;
    double start = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
    {
        vec s0 = ZERO(), s1 = s0, s2 = s0, s3 = s0;
        const size_t step = LANES * 4;  /* bytes of a vector */
#pragma omp for schedule(static)
        for (size_t i = 0; i < bytes; i += 4 * step) {
            s0 = ADD(s0, LOAD((const float *)(buffer + i)));
            s1 = ADD(s1, LOAD((const float *)(buffer + i + step)));
            s2 = ADD(s2, LOAD((const float *)(buffer + i + 2 * step)));
            s3 = ADD(s3, LOAD((const float *)(buffer + i + 3 * step)));
        }
        sink += reduce(ADD(ADD(s0, s1), ADD(s2, s3)));
    }
    double seconds = omp_get_wtime() - start;
    if (sink == 1.0f) puts("");
    return bytes / seconds / 1e9;
}

int main(int argc, char **argv) {
    int reps = atoi(argv[1]);
    size_t bytes = (size_t)512 << 20;
    char *buffer = aligned_alloc(64, bytes);
    memset(buffer, 0, bytes);
#if defined(__AVX512BF16__)
    int has_dot = 1;
#else
    int has_dot = 0;
#endif
    printf("{\"dot_built\": %d, \"runs\": [", has_dot);
    for (int r = 0; r < reps; r++) {
        printf("%s{\"fma_gflops\": %.1f, ", r ? ", " : "", flops(0, 20000000));
        printf("\"dot_gflops\": %.1f, ", has_dot ? flops(1, 20000000) : 0.0);
        printf("\"read_gb_s\": %.1f}", bandwidth(buffer, bytes));
    }
    puts("]}");
    free(buffer);
    return 0;
}
"""


def measure(binary: Path, threads: int, reps: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread"}
    out = subprocess.run([str(binary), str(reps)], env=env, capture_output=True, text=True,
                         check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    runs = result["runs"]
    best = {key: max(run[key] for run in runs) for key in runs[0]}
    return {"threads": threads, "best": best, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    compiler = os.environ.get("CC") or "cc"
    command = [compiler, "-O2", "-march=native", "-fopenmp"]
    with tempfile.TemporaryDirectory() as scratch:
        source, binary = Path(scratch) / "peak.c", Path(scratch) / "peak"
        source.write_text(PROGRAM)
        subprocess.run([*command, str(source), "-o", str(binary)], check=True)
        results = [measure(binary, threads, args.reps) for threads in sorted({1, cores})]
    for result in results:
        best = result["best"]
        print(f"{result['threads']} thread(s): float32 FMA {best['fma_gflops']:.0f} GFLOP/s, "
              f"vdpbf16ps {best['dot_gflops']:.0f} GFLOP/s, read {best['read_gb_s']:.1f} GB/s")
    write_report(args.json, {
        "benchmark": "cpu_peak", "command": ["python", "-m", "benchmarks.cpu_peak",
                                             "--reps", str(args.reps)],
        "compile": command, "commit": git_commit(), "machine": machine(),
        "results": results})


if __name__ == "__main__":
    main()
