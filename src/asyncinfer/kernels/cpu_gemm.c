/* bfloat16 matrix products on Intel's AMX tile units: y = x W^T (+ b), float32 sums rounded
 * once to bfloat16, as torch's bf16 linear does.
 *
 * W [n, k] is packed once (amx_pack_bf16) into the tiles the unit multiplies by: for each
 * block of 16 output columns and each 32 of k, one 1 KiB tile with k's pairs interleaved
 * (the "VNNI" layout); a block's tiles follow each other, so a product reads the weights
 * front to back in one stream. A task is a block of 16 columns by up to 64 rows of x: at
 * each step of k, the block's weight tile is loaded once and multiplied by up to four tiles
 * of 16 rows of x into four accumulator tiles. Decode-sized products (tens of rows) are
 * limited by the weights' read: every row takes its share of each tile as it streams by,
 * with the stream prefetched ahead. One row runs at about three quarters of the memory's
 * read rate, forty at about half (the tiles' work does not all hide behind the stream);
 * oneDNN's kernels for these shapes read at about a third to half of it. Above a few
 * hundred rows torch's path is faster (layers.linear switches there). Outputs are rounded
 * by the CPU's bf16 conversion: to nearest even, as torch, but a float32 subnormal
 * becomes zero.
 *
 * Built where the compiler targets AMX (-march of a CPU that has it); elsewhere
 * amx_linear_ready() returns 0 and the functions do nothing.
 */
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MB 64 /* rows of x per task: four tiles */

/* Ask the kernel for the tile state (once per process; torch's oneDNN may have already). */
int amx_linear_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* The tiles (amx_configure): 0-3 accumulators, 4-6 x, 7 W. */

/* packed [n / 16][k / 32][16][32]: the tile of (block, step) row r holds, for each of its 16
 * columns c, the pair W[16 block + c][32 step + 2 r + {0, 1}]. */
void amx_pack_bf16(const bf16 *w, int64_t n, int64_t k, bf16 *packed) {
    const int64_t steps = k / 32;
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t s = 0; s < steps; s++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 16; c++)
                    for (int64_t p = 0; p < 2; p++)
                        packed[(((b * steps + s) * 16 + r) * 16 + c) * 2 + p] =
                            w[(16 * b + c) * k + 32 * s + 2 * r + p];
}

/* Rows [0, rows) of a 16 x 16 float tile in sums, plus the bias, rounded to nearest even
 * into y (row stride ys). */
INLINE void write_tile(const float *sums, const bf16 *bias, int64_t rows, bf16 *y,
                       int64_t ys) {
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
    for (int64_t i = 0; i < rows; i++) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + 16 * i), b));
        _mm256_storeu_si256((void *)(y + i * ys), (__m256i)out);
    }
}

/* Ask for the weights AHEAD bytes past this step's tile (1 KiB) to be brought in. */
#define AHEAD 8192
INLINE void fetch_ahead(const bf16 *w) {
    const char *at = (const char *)w + AHEAD;
    for (int i = 0; i < 1024; i += 64) _mm_prefetch(at + i, _MM_HINT_T0);
}

/* x [m, k] (row stride xs), packed W of [n, k], bias [n] or NULL: y [m, n] (contiguous).
 * n a multiple of 16, k of 32. */
void amx_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    const int64_t steps = k / 32, blocks = n / 16, groups = (m + MB - 1) / MB;
    /* A tile reads 16 rows: the last rows of x, where fewer, are copied beside zeros. */
    const int64_t full = m / 16 * 16;
    bf16 *pad = NULL;
    if (full < m) {
        pad = aligned_alloc(64, sizeof(bf16) * (size_t)(16 * k));
        for (int64_t i = 0; i < 16; i++) {
            if (full + i < m)
                memcpy(pad + i * k, x + (full + i) * xs, sizeof(bf16) * (size_t)k);
            else
                memset(pad + i * k, 0, sizeof(bf16) * (size_t)k);
        }
    }
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
        float *sums = aligned_alloc(64, sizeof(float) * 4 * 256);
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t b = 0; b < blocks; b++) {
                const bf16 *wb = packed + b * steps * 512;
                const int64_t m0 = g * MB, left = m - m0;
                const int tiles = left >= MB ? 4 : (int)((left + 15) / 16);
                const bf16 *a[4] = {pad, pad, pad, pad};
                int64_t as[4] = {k, k, k, k};
                for (int i = 0; i < tiles; i++)
                    if (m0 + 16 * i + 16 <= m) {
                        a[i] = x + (m0 + 16 * i) * xs;
                        as[i] = xs;
                    }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; s++) {
                    fetch_ahead(wb + s * 512);
                    _tile_loadd(7, wb + s * 512, 64);
                    _tile_loadd(4, a[0] + s * 32, as[0] * 2);
                    _tile_dpbf16ps(0, 4, 7);
                    if (tiles > 1) {
                        _tile_loadd(5, a[1] + s * 32, as[1] * 2);
                        _tile_dpbf16ps(1, 5, 7);
                    }
                    if (tiles > 2) {
                        _tile_loadd(6, a[2] + s * 32, as[2] * 2);
                        _tile_dpbf16ps(2, 6, 7);
                    }
                    if (tiles > 3) {
                        _tile_loadd(4, a[3] + s * 32, as[3] * 2);
                        _tile_dpbf16ps(3, 4, 7);
                    }
                }
                _tile_stored(0, sums, 64);
                _tile_stored(1, sums + 256, 64);
                _tile_stored(2, sums + 512, 64);
                _tile_stored(3, sums + 768, 64);
                for (int i = 0; i < tiles; i++) {
                    const int64_t r0 = m0 + 16 * i, rows = m - r0 < 16 ? m - r0 : 16;
                    write_tile(sums + 256 * i, bias ? bias + 16 * b : NULL, rows,
                               y + r0 * n + 16 * b, n);
                }
            }
        }
        free(sums);
        _tile_release();
    }
    free(pad);
}

#else

int amx_linear_ready(void) { return 0; }

void amx_pack_bf16(const bf16 *w, int64_t n, int64_t k, bf16 *packed) {
    (void)w, (void)n, (void)k, (void)packed;
}

void amx_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    (void)x, (void)xs, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)y;
    (void)threads;
}

#endif
