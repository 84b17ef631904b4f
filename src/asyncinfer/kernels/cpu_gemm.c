/* bfloat16 matrix products on Intel's AMX tile units: y = x W^T (+ b), float32 sums rounded
 * once to bfloat16, as torch's bf16 linear does.
 *
 * W [n, k] is packed once (pack_bf16) into the tiles the unit multiplies by: for each
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
 * amx_linear_ready() returns 0 and the functions do nothing. The rest of this file
 * multiplies by the same packed weights on AVX-512 CPUs without AMX (wide_linear_bf16, and
 * dot_linear_bf16 on AVX512-BF16).
 */
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* packed [n / 16][k / 32][16][32]: the tile of (block, step) row r holds, for each of its 16
 * columns c, the pair W[16 block + c][32 step + 2 r + {0, 1}]. */
void pack_bf16(const bf16 *w, int64_t n, int64_t k, bf16 *packed) {
    const int64_t steps = k / 32;
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t s = 0; s < steps; s++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 16; c++)
                    for (int64_t p = 0; p < 2; p++)
                        packed[(((b * steps + s) * 16 + r) * 16 + c) * 2 + p] =
                            w[(16 * b + c) * k + 32 * s + 2 * r + p];
}

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

/* Rows [0, rows) of a 16 x 16 float tile in sums, plus the bias, rounded to nearest even
 * into y (row stride ys). */
INLINE void write_tile(const float *sums, const bf16 *bias, int64_t rows, bf16 *y,
                       int64_t ys) {
    const __m512 b = bias ? widen16_bf16(bias) : _mm512_setzero_ps();
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

void amx_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    (void)x, (void)xs, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)y;
    (void)threads;
}

#endif

/* The same product for AVX-512 CPUs without AMX: the packed bf16 weights widened to float32
 * in registers, multiplied by float32 FMAs. A row of a packed tile is one vector: 16
 * columns' pair of k; shifted left it is the pair's first element, masked its second, each
 * 16 floats. Where the CPU has AVX512-BF16, vdpbf16ps would take the vector as is, but on
 * some such CPUs it issues at a fraction of the FMAs' rate (docs/benchmarks.md), so the
 * widening pays there; dot_linear_bf16, below, is for the others. x is widened to float32
 * once per call.
 *
 * A step of the micro-kernel multiplies DP_ROWS rows of x by DP_BLOCKS blocks of 16 columns
 * (24 vectors of sums, 6 of weights and x's two: all 32 registers). A task is a panel of
 * DP_BLOCKS blocks by a chunk of up to DP_CHUNK rows: the chunk's rows go by the panel
 * DP_ROWS at a time, so the panel's weights come from memory once and then from L2, and
 * consecutive tasks share the chunk. Widening the panel once into float32 instead was
 * slower: the float32 panel then streams from L2 at twice the bytes. */
#if defined(__AVX512F__)
#include <immintrin.h>

#define DP_ROWS 8
#define DP_BLOCKS 3
#define DP_CHUNK 96

int wide_linear_built(void) { return 1; }

/* 16 floats rounded to nearest even, a NaN to a quiet NaN: to_bf16, 16 lanes at a time. */
INLINE void store_bf16x16(bf16 *out, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((void *)out, _mm512_cvtepi32_epi16(r));
}

/* rows (<= DP_ROWS) of float x (row stride k) by blocks (<= DP_BLOCKS) blocks of packed
 * weights from w (block stride 16 k): y's rows, columns 16 blocks from y. Constant rows and
 * blocks unroll the loops, so the sums stay in registers. */
INLINE void wide_kernel(const int rows, const int blocks, const float *x, const bf16 *w,
                        int64_t k, const bf16 *bias, bf16 *y, int64_t ys) {
    __m512 acc[DP_ROWS][DP_BLOCKS];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++)
#pragma GCC unroll 8
        for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t bs = 16 * k;
    for (int64_t p = 0; p < k / 2; p++) {
        __m512 even[DP_BLOCKS], odd[DP_BLOCKS];
#pragma GCC unroll 8
        for (int j = 0; j < blocks; j++) {
            const __m512i v = _mm512_load_si512((const void *)(w + j * bs + 32 * p));
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            const __m512 x0 = _mm512_set1_ps(x[i * k + 2 * p]);
            const __m512 x1 = _mm512_set1_ps(x[i * k + 2 * p + 1]);
#pragma GCC unroll 8
            for (int j = 0; j < blocks; j++)
                acc[i][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[i][j]));
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < blocks; j++) {
        const __m512 b = bias ? widen16_bf16(bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) store_bf16x16(y + i * ys + 16 * j, _mm512_add_ps(acc[i][j], b));
    }
}

#define WIDE_CASE(r, b)                                                                     \
    case (r) * 8 + (b):                                                                     \
        wide_kernel(r, b, x, w, k, bias, y, ys);                                            \
        break;
#define WIDE_ROWS_CASES(r) WIDE_CASE(r, 1) WIDE_CASE(r, 2) WIDE_CASE(r, 3)

static void wide_step(int rows, int blocks, const float *x, const bf16 *w, int64_t k,
                      const bf16 *bias, bf16 *y, int64_t ys) {
    switch (rows * 8 + blocks) {
        WIDE_ROWS_CASES(1)
        WIDE_ROWS_CASES(2)
        WIDE_ROWS_CASES(3)
        WIDE_ROWS_CASES(4)
        WIDE_ROWS_CASES(5)
        WIDE_ROWS_CASES(6)
        WIDE_ROWS_CASES(7)
        WIDE_ROWS_CASES(8)
    default:
        break;
    }
}

/* As amx_linear_bf16: x [m, k] (row stride xs), packed W of [n, k], bias [n] or NULL: y [m,
 * n] (contiguous); n a multiple of 16, k of 32. Returns 0, or -1 (y unwritten) where the
 * float32 copy of x could not be allocated. */
int wide_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    const int64_t blocks = n / 16, panels = (blocks + DP_BLOCKS - 1) / DP_BLOCKS;
    const int64_t chunks = (m + DP_CHUNK - 1) / DP_CHUNK;
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < k; c += 16)
                _mm512_store_ps(xf + r * k + c, widen16_bf16(x + r * xs + c));
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t p = 0; p < panels; p++) {
                const int64_t b0 = p * DP_BLOCKS;
                const int nb = (int)(blocks - b0 < DP_BLOCKS ? blocks - b0 : DP_BLOCKS);
                const int64_t end = (c + 1) * DP_CHUNK < m ? (c + 1) * DP_CHUNK : m;
                for (int64_t r = c * DP_CHUNK; r < end; r += DP_ROWS) {
                    const int rows = (int)(end - r < DP_ROWS ? end - r : DP_ROWS);
                    wide_step(rows, nb, xf + r * k, packed + b0 * 16 * k, k,
                              bias ? bias + 16 * b0 : NULL, y + r * n + 16 * b0, n);
                }
            }
        }
    }
    free(xf);
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The same product on AVX2 with FMA, for an AVX2 CPU's float32 products and the
 * batch-invariant mode (torch's float32 GEMM copies the weight on every call, which at
 * decode sizes costs more than the product): a block of 16 columns is two 8-float
 * vectors, and a step multiplies up to AV_ROWS rows of x by one block (twelve vectors of
 * sums, two of weights, x's one and the mask: the sixteen registers; six rows rather than
 * four give each widened weight half as many multiply-adds again, about 7% faster on a
 * Zen 1 EPYC at 16 and at 4,096 rows). Each output is summed along k in the same order, pair by pair,
 * whatever the number of rows: the property the mode needs. */
#define AV_ROWS 6
#define AV_CHUNK 96

int wide_linear_built(void) { return 2; }

/* 8 floats rounded to nearest even, a NaN to a quiet NaN, as to_bf16. */
INLINE void store_bf16x8(bf16 *out, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    int32_t lanes[8];
    _mm256_storeu_si256((void *)lanes, r);
    for (int j = 0; j < 8; j++) out[j] = (bf16)lanes[j];
}

INLINE void avx2_kernel(const int rows, const float *x, const bf16 *w, int64_t k,
                        const bf16 *bias, bf16 *y, int64_t ys) {
    __m256 acc[AV_ROWS][2];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 6
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        const __m256i *wp = (const __m256i *)(w + 32 * p);
        /* The even k of the pair, then the odd: each x value broadcast once for both
         * halves of the block, the weights widened from memory as they are needed. */
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wp), 16));
        const __m256 e1 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_loadu_si256(wp + 1), 16));
#pragma GCC unroll 6
        for (int i = 0; i < rows; i++) {
            const __m256 x0 = _mm256_set1_ps(x[i * k + 2 * p]);
            acc[i][0] = _mm256_fmadd_ps(x0, e0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(x0, e1, acc[i][1]);
        }
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp), high));
        const __m256 o1 = _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_loadu_si256(wp + 1), high));
#pragma GCC unroll 6
        for (int i = 0; i < rows; i++) {
            const __m256 x1 = _mm256_set1_ps(x[i * k + 2 * p + 1]);
            acc[i][0] = _mm256_fmadd_ps(x1, o0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(x1, o1, acc[i][1]);
        }
    }
    for (int h = 0; h < 2; h++) {
        __m256 b = _mm256_setzero_ps();
        if (bias) {
            float widened[8];
            for (int j = 0; j < 8; j++) widened[j] = from_bf16(bias[8 * h + j]);
            b = _mm256_loadu_ps(widened);
        }
        for (int i = 0; i < rows; i++) store_bf16x8(y + i * ys + 8 * h, _mm256_add_ps(acc[i][h], b));
    }
}

static void avx2_step(int rows, const float *x, const bf16 *w, int64_t k, const bf16 *bias,
                      bf16 *y, int64_t ys) {
    switch (rows) {
    case 1: avx2_kernel(1, x, w, k, bias, y, ys); break;
    case 2: avx2_kernel(2, x, w, k, bias, y, ys); break;
    case 3: avx2_kernel(3, x, w, k, bias, y, ys); break;
    case 4: avx2_kernel(4, x, w, k, bias, y, ys); break;
    case 5: avx2_kernel(5, x, w, k, bias, y, ys); break;
    case 6: avx2_kernel(6, x, w, k, bias, y, ys); break;
    default: break;
    }
}

/* As wide_linear_bf16 on AVX-512. */
int wide_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    const int64_t blocks = n / 16, chunks = (m + AV_CHUNK - 1) / AV_CHUNK;
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < k; c++) xf[r * k + c] = from_bf16(x[r * xs + c]);
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t end = (c + 1) * AV_CHUNK < m ? (c + 1) * AV_CHUNK : m;
                for (int64_t r = c * AV_CHUNK; r < end; r += AV_ROWS) {
                    const int rows = (int)(end - r < AV_ROWS ? end - r : AV_ROWS);
                    avx2_step(rows, xf + r * k, packed + b * 16 * k, k,
                              bias ? bias + 16 * b : NULL, y + r * n + 16 * b, n);
                }
            }
        }
    }
    free(xf);
    return 0;
}

#else

int wide_linear_built(void) { return 0; }

int wide_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                     int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    (void)x, (void)xs, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)y;
    (void)threads;
    return -1;
}

#endif

/* The same product where the CPU's AVX512-BF16 dot product issues at the FMAs' rate (AMD's
 * Zen 4): vdpbf16ps multiplies a packed row as it is by a broadcast pair of x's bf16 values
 * and adds both products to the float32 sums, so an instruction does two of the FMA
 * kernel's multiply-adds, and neither W nor x is widened (no float32 copy of x). Each pair's
 * two products enter its sum together, so results can differ from the FMA kernel's by a
 * rounding step; like it, an output's order of sums does not depend on the row count.
 * Subnormal inputs count as zero (the instruction's own rule). */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DOT_ROWS 8
#define DOT_BLOCKS 3
/* A decode-sized product (more than DOT_ROWS rows, up to DOT_SLICED) goes over k in
 * slices of DOT_SLICE pairs, every row group in turn on each slice, and asks for the
 * weights 2 KiB (a slice) ahead: the read of the next slice overlaps the row groups'
 * arithmetic on this one. Over whole panels, the first group's pass waits on memory and
 * the later ones' run from L2 with the memory idle. 16 rows by a 30-layer model's weights
 * streamed from memory: 4-5% less time (12 or more groups, as a prefill's, gain nothing). */
#define DOT_SLICED 32
#define DOT_SLICE 32
#define DOT_AHEAD 2048

int dot_linear_built(void) { return 1; }

/* rows (<= DOT_ROWS) of x by blocks (<= DOT_BLOCKS) blocks of packed weights, over k's
 * pairs [p0, p1): the sums start at zero where p0 is 0 and from sums (rows x blocks
 * vectors) elsewhere; they end in y (plus the bias, rounded) where p1 is k / 2 and back in
 * sums elsewhere. Only the vectors' trips through memory differ from one pass over all of
 * k, so the results do not. With fetch, each step asks for the weights DOT_AHEAD bytes on
 * in each block's stream. */
INLINE void dot_kernel(const int rows, const int blocks, const bf16 *x, int64_t xs,
                       const bf16 *w, int64_t k, int64_t p0, int64_t p1, __m512 *sums,
                       const int fetch, const bf16 *bias, bf16 *y, int64_t ys) {
    __m512 acc[DOT_ROWS][DOT_BLOCKS];
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++)
#pragma GCC unroll 8
        for (int j = 0; j < blocks; j++)
            acc[i][j] = p0 ? sums[i * DOT_BLOCKS + j] : _mm512_setzero_ps();
    const int64_t bs = 16 * k;
    for (int64_t p = p0; p < p1; p++) {
        __m512bh wv[DOT_BLOCKS];
#pragma GCC unroll 8
        for (int j = 0; j < blocks; j++)
            wv[j] = (__m512bh)_mm512_load_si512((const void *)(w + j * bs + 32 * p));
        if (fetch)
#pragma GCC unroll 8
            for (int j = 0; j < blocks; j++)
                _mm_prefetch((const char *)(w + j * bs + 32 * p) + DOT_AHEAD, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, x + i * xs + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
            for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (p1 < k / 2) {
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++)
#pragma GCC unroll 8
            for (int j = 0; j < blocks; j++) sums[i * DOT_BLOCKS + j] = acc[i][j];
        return;
    }
#pragma GCC unroll 8
    for (int j = 0; j < blocks; j++) {
        const __m512 b = bias ? widen16_bf16(bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) store_bf16x16(y + i * ys + 16 * j, _mm512_add_ps(acc[i][j], b));
    }
}

#define DOT_CASE(r, b)                                                                      \
    case (r) * 8 + (b):                                                                     \
        dot_kernel(r, b, x, xs, w, k, p0, p1, sums, fetch, bias, y, ys);                    \
        break;
#define DOT_ROWS_CASES(r) DOT_CASE(r, 1) DOT_CASE(r, 2) DOT_CASE(r, 3)

static void dot_step(int rows, int blocks, const bf16 *x, int64_t xs, const bf16 *w,
                     int64_t k, int64_t p0, int64_t p1, __m512 *sums, int fetch,
                     const bf16 *bias, bf16 *y, int64_t ys) {
    switch (rows * 8 + blocks) {
        DOT_ROWS_CASES(1)
        DOT_ROWS_CASES(2)
        DOT_ROWS_CASES(3)
        DOT_ROWS_CASES(4)
        DOT_ROWS_CASES(5)
        DOT_ROWS_CASES(6)
        DOT_ROWS_CASES(7)
        DOT_ROWS_CASES(8)
    default:
        break;
    }
}

/* As wide_linear_bf16, tasks and all; returns 0. */
int dot_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                    int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    const int64_t blocks = n / 16, panels = (blocks + DOT_BLOCKS - 1) / DOT_BLOCKS;
    const int sliced = m > DOT_ROWS && m <= DOT_SLICED;
    const int64_t chunk = sliced ? m : DP_CHUNK, chunks = (m + chunk - 1) / chunk;
    const int64_t slice = sliced ? DOT_SLICE : k / 2;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t p = 0; p < panels; p++) {
            __m512 sums[DOT_SLICED / DOT_ROWS][DOT_ROWS * DOT_BLOCKS];
            const int64_t b0 = p * DOT_BLOCKS;
            const int nb = (int)(blocks - b0 < DOT_BLOCKS ? blocks - b0 : DOT_BLOCKS);
            const int64_t end = (c + 1) * chunk < m ? (c + 1) * chunk : m;
            for (int64_t p0 = 0; p0 < k / 2; p0 += slice) {
                const int64_t p1 = p0 + slice < k / 2 ? p0 + slice : k / 2;
                for (int64_t r = c * chunk; r < end; r += DOT_ROWS) {
                    const int rows = (int)(end - r < DOT_ROWS ? end - r : DOT_ROWS);
                    dot_step(rows, nb, x + r * xs, xs, packed + b0 * 16 * k, k, p0, p1,
                             sliced ? sums[(r - c * chunk) / DOT_ROWS] : NULL, sliced,
                             bias ? bias + 16 * b0 : NULL, y + r * n + 16 * b0, n);
                }
            }
        }
    }
    return 0;
}

#else

int dot_linear_built(void) { return 0; }

int dot_linear_bf16(const bf16 *x, int64_t xs, const bf16 *packed, const bf16 *bias,
                    int64_t m, int64_t n, int64_t k, bf16 *y, int threads) {
    (void)x, (void)xs, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)y;
    (void)threads;
    return -1;
}

#endif
