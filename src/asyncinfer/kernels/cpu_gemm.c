/* bfloat16 matrix products on Intel's AMX tile units: y = x W^T (+ b), float32 sums rounded
 * once to bfloat16, as torch's bf16 linear does.
 *
 * W [n, k] is packed once (amx_pack_bf16) into the tiles the unit multiplies by: for each
 * block of 32 output columns and each 32 of k, two 1 KiB tiles (16 columns each) with k's
 * pairs interleaved, the "VNNI" layout; a block's tiles follow each other, so a product
 * reads the weights front to back in one stream. A task is 32 columns by up to 128 rows of
 * x: per 32 rows, four accumulator tiles (2 x 2 of 16 x 16 floats) take two tiles of x and
 * the block's two weight tiles at each step of k. Decode-sized products (tens of rows) are
 * limited by the weights' read, which oneDNN's AMX kernels did at about a third of the
 * memory's rate for these shapes; prefill-sized ones reuse each block of W from the cache
 * for up to 128 rows.
 *
 * Built where the compiler targets AMX (-march of a CPU that has it); elsewhere
 * amx_linear_ready() returns 0 and the functions do nothing.
 */
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

typedef uint16_t bf16;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MB 128 /* rows of x per task */

/* Ask the kernel for the tile state (once per process; torch's oneDNN may have already). */
int amx_linear_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Eight tiles of 16 rows by 64 bytes: 0-3 accumulators, 4-5 x, 6-7 W. */
INLINE void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* packed [n / 32][k / 32][2][16][32]: tile t of (block, step) row r holds, for its 16
 * columns c, the pair W[32 block + 16 t + c][32 step + 2 r + {0, 1}]. */
void amx_pack_bf16(const bf16 *w, int64_t n, int64_t k, bf16 *packed) {
    const int64_t steps = k / 32;
    for (int64_t b = 0; b < n / 32; b++)
        for (int64_t s = 0; s < steps; s++)
            for (int64_t t = 0; t < 2; t++)
                for (int64_t r = 0; r < 16; r++)
                    for (int64_t c = 0; c < 16; c++)
                        for (int64_t p = 0; p < 2; p++)
                            packed[((((b * steps + s) * 2 + t) * 16 + r) * 16 + c) * 2 + p] =
                                w[(32 * b + 16 * t + c) * k + 32 * s + 2 * r + p];
}

/* Rows [0, rows) of the 32 x 32 float block in sums (four 16 x 16 tiles: rows 0-15 cols
 * 0-15, rows 0-15 cols 16-31, rows 16-31 cols 0-15, rows 16-31 cols 16-31), plus the bias,
 * rounded to nearest even into y (row stride ys). */
INLINE void write_block(const float *sums, const bf16 *bias, int64_t rows, bf16 *y,
                        int64_t ys) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + 16))), 16));
    }
    for (int64_t i = 0; i < rows; i++) {
        const float *lo = sums + ((i >= 16) * 2 * 256) + (i % 16) * 16;
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(lo), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(lo + 256), b1);
        const __m512bh packed = _mm512_cvtne2ps_pbh(v1, v0);
        _mm512_storeu_si512((void *)(y + i * ys), (__m512i)packed);
    }
}

/* Ask for the weights AHEAD bytes past this step's two tiles (2 KiB) to be brought in. */
#define AHEAD 8192
INLINE void fetch_ahead(const bf16 *w) {
    const char *at = (const char *)w + AHEAD;
    for (int i = 0; i < 2048; i += 64) _mm_prefetch(at + i, _MM_HINT_T0);
}

/* x [m, k] (row stride xs), packed W of [n, k], bias [n] or NULL: y [m, n] (contiguous).
 * n a multiple of 32, k of 32. */
void amx_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    const int64_t steps = k / 32, blocks = n / 32, row_blocks = (m + MB - 1) / MB;
    /* Tiles read 16 rows: the last rows of x, where fewer than 32, are copied beside zeros. */
    const int64_t full = m / 32 * 32;
    bf16 *pad = NULL;
    if (full < m) {
        pad = aligned_alloc(64, sizeof(bf16) * (size_t)(32 * k));
        for (int64_t i = 0; i < 32; i++) {
            if (full + i < m)
                memcpy(pad + i * k, x + (full + i) * xs, sizeof(bf16) * (size_t)k);
            else
                memset(pad + i * k, 0, sizeof(bf16) * (size_t)k);
        }
    }
#pragma omp parallel num_threads(threads)
    {
        configure();
        float *sums = aligned_alloc(64, sizeof(float) * 4 * 256);
#pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            for (int64_t b = 0; b < blocks; b++) {
                const bf16 *wb = packed + b * steps * 1024;
                const int64_t end = (rb + 1) * MB < m ? (rb + 1) * MB : m;
                for (int64_t m0 = rb * MB; m0 < end; m0 += 32) {
                    const int64_t rows = end - m0 < 32 ? end - m0 : 32;
                    const bf16 *a = rows < 32 ? pad : x + m0 * xs;
                    const int64_t as = rows < 32 ? k : xs;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    /* Four chains of accumulation: the unit's latency hides behind the
                     * others even where rows 16-31 are padding. */
                    for (int64_t s = 0; s < steps; s++) {
                        fetch_ahead(wb + s * 1024);
                        _tile_loadd(4, a + s * 32, as * 2);
                        _tile_loadd(5, a + 16 * as + s * 32, as * 2);
                        _tile_loadd(6, wb + s * 1024, 64);
                        _tile_loadd(7, wb + s * 1024 + 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, sums, 64);
                    _tile_stored(1, sums + 256, 64);
                    _tile_stored(2, sums + 512, 64);
                    _tile_stored(3, sums + 768, 64);
                    write_block(sums, bias ? bias + 32 * b : NULL, rows, y + m0 * n + 32 * b,
                                n);
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
