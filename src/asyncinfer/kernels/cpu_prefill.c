/* Prefill attention on Intel's AMX tile units, for bfloat16 queries and a bfloat16 paged
 * pool (the torch attention backend's prefill and mixed batches, on a CPU that has them).
 *
 * Each request's new tokens attend causally over its whole prefix, read where it lies in
 * the pool through its slots. torch's flash kernel for these sizes (prompts of tens to
 * hundreds of tokens, head size 64) ran at 100-250 GFLOP/s on two cores; the tile unit
 * multiplies bf16 at several TFLOP/s.
 *
 * A task is one query head and 16 of a request's new positions (one "query block"). Its
 * scores come transposed, a tile of 16 keys by the block's 16 positions: S^T = K Q^T, with
 * K's rows read straight from the pool (16 consecutive slots at the pool's row stride; a
 * block of slots that is not gets copied first) and Q^T packed once per task with its
 * dims' pairs interleaved. Transposed scores put the positions in the vector lanes, so the
 * softmax's maximum and sum over keys are lane-wise, with no horizontal reductions.
 *
 * Two passes over the keys: the first finds each position's maximum score and the sum of
 * the exponentials (online, rescaling the sum as the maximum grows); the second computes
 * the probabilities p = exp(s - max) once more, rounds them to bf16 (as torch's flash
 * kernel rounds them for bf16 inputs), packs 32 keys' worth with the keys' pairs
 * interleaved, and multiplies V^T by them into four float32 accumulator tiles that hold
 * the output O^T [dims][positions] over all the keys. V^T is transposed once per request
 * and KV head into scratch, before the tasks (every query block reads it). The output is
 * O^T / sum, rounded once to bf16. Scores and sums are float32; exp is cpu_common.h's.
 *
 * A sliding window (``window`` > 0: position p sees keys p - window + 1 .. p) masks the
 * keys before it and starts both passes at the 64-key block that holds the block's first
 * visible key, so a long prefix behind the window is neither scored nor transposed.
 *
 * Head sizes that are a multiple of 32 up to 128 (the accumulators hold 64 dims: a head of
 * 128 takes the second pass twice). Built where the compiler targets AMX and AVX512-BF16;
 * elsewhere prefill_attention_bf16 does nothing and the caller keeps torch's SDPA.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define QB 16  /* query positions a task */
#define KB 16  /* keys a score tile */
#define PB 32  /* keys a product with V */

/* The tiles (amx_configure), in the second pass: 0-3 the O^T accumulators (16 dims each),
 * 4 and 5 V^T, 6 and 7 P^T; the first pass's are said where it runs. */

INLINE __m512 pf_exp(__m512 x) {
    float v[16], r[16];
    _mm512_storeu_ps(v, x);
#pragma omp simd
    for (int i = 0; i < 16; i++) r[i] = exp_clamped(v[i] < -87.0f ? -87.0f : v[i]);
    return _mm512_loadu_ps(r);
}

/* K rows kb .. kb + 15 of this task's KV head, as a tile operand: where they lie in the
 * pool (16 consecutive slots from a multiple of 16: pages of 16 or a multiple), else
 * copied into kbuf [16][dim] (rows past the prefix, zeros). *bytes: the row stride. */
INLINE const bf16 *pf_keys(const bf16 *k, const int64_t *slots, int64_t stride,
                           int64_t pool_slots, int64_t dim, int64_t kb, int64_t end,
                           bf16 *kbuf, int64_t *bytes) {
    const int64_t n = end - kb < KB ? end - kb : KB, first = slots[kb];
    if (first % KB == 0 && first + KB <= pool_slots && slots[kb + n - 1] == first + n - 1) {
        *bytes = stride * 2;
        return k + first * stride;
    }
    for (int64_t j = 0; j < KB; j++) {
        if (j < n)
            memcpy(kbuf + j * dim, k + slots[kb + j] * stride, sizeof(bf16) * (size_t)dim);
        else
            memset(kbuf + j * dim, 0, sizeof(bf16) * (size_t)dim);
    }
    *bytes = dim * 2;
    return kbuf;
}

/* Scores of key row ``key`` scaled, with keys a position may not see at -inf: position
 * lane i (pos0 + i) sees keys up to pos0 + i (with a window, from pos0 + i - window + 1);
 * lanes past the block (i >= nq) see key ``first``, the first one scored. */
INLINE __m512 pf_row(const float *s, int64_t key, int64_t pos0, int64_t nq, float scale,
                     int64_t window, int64_t first) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sees = _mm512_add_epi32(_mm512_set1_epi32((int)(pos0 - key)), lane);
    __mmask16 ok = _mm512_cmpge_epi32_mask(sees, _mm512_setzero_si512());
    if (window > 0) ok &= _mm512_cmplt_epi32_mask(sees, _mm512_set1_epi32((int)window));
    const __mmask16 real = (__mmask16)((1u << nq) - 1u);
    ok = (ok & real) | (key == first ? (__mmask16)~real : 0);
    return _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok, _mm512_loadu_ps(s),
                              _mm512_set1_ps(scale));
}

/* The first key a block from position ``pos0`` scores: 0, or with a window the start of
 * the 64-key block (four score tiles) that holds pos0's first visible key. */
INLINE int64_t pf_first(int64_t pos0, int64_t window) {
    const int64_t lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    return lo / (4 * KB) * (4 * KB);
}

/* Interleave two rows of 16 probabilities (keys 2r, 2r + 1) into one VNNI row of bf16. */
INLINE void pf_pair(__m512 even, __m512 odd, bf16 *row) {
    const __m512i order = _mm512_setr_epi32(
        0 | 16 << 16, 1 | 17 << 16, 2 | 18 << 16, 3 | 19 << 16, 4 | 20 << 16, 5 | 21 << 16,
        6 | 22 << 16, 7 | 23 << 16, 8 | 24 << 16, 9 | 25 << 16, 10 | 26 << 16, 11 | 27 << 16,
        12 | 28 << 16, 13 | 29 << 16, 14 | 30 << 16, 15 | 31 << 16);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even low, odd high */
    _mm512_storeu_si512((void *)row, _mm512_permutexvar_epi16(order, both));
}

/* O^T (tiles 0-3) += V^T (dtiles tiles of 16 dims, rows from vb, stride vs bytes) times
 * the bf16 P^T at ptb, loaded into tile P. */
#define PV_TILES(P)                                                                         \
    do {                                                                                    \
        _tile_loadd(P, ptb, 64);                                                            \
        _tile_loadd(4, vb, vs);                                                             \
        _tile_dpbf16ps(0, 4, P);                                                            \
        if (dtiles > 1) {                                                                   \
            _tile_loadd(5, vb + 16 * padded, vs);                                           \
            _tile_dpbf16ps(1, 5, P);                                                        \
        }                                                                                   \
        if (dtiles > 2) {                                                                   \
            _tile_loadd(4, vb + 32 * padded, vs);                                           \
            _tile_dpbf16ps(2, 4, P);                                                        \
        }                                                                                   \
        if (dtiles > 3) {                                                                   \
            _tile_loadd(5, vb + 48 * padded, vs);                                           \
            _tile_dpbf16ps(3, 5, P);                                                        \
        }                                                                                   \
    } while (0)

/* q [tokens, heads, dim] (row stride ``q_stride`` elements), out the same, contiguous;
 * pools [slots, kv_heads, dim]; for each of ``requests`` requests: its slots of positions
 * 0 .. starts + news at slots + slot_at[r], its new tokens at rows q_at[r] .. q_at[r] +
 * news[r] of q; ``window`` > 0: the sliding window. */
void prefill_attention_bf16(const bf16 *q, int64_t q_stride, const bf16 *k_pool,
                            const bf16 *v_pool, int64_t pool_slots, const int64_t *slots,
                            const int64_t *slot_at, const int64_t *q_at, const int64_t *starts,
                            const int64_t *news, int64_t requests, int64_t heads,
                            int64_t kv_heads, int64_t dim, float scale, int64_t window,
                            bf16 *out, int threads) {
    const int64_t group = heads / kv_heads, stride = kv_heads * dim;
    /* V^T of each request and KV head: [dim][keys padded to PB], zeros past the prefix. */
    int64_t *vt_at = malloc(sizeof(int64_t) * (size_t)(requests + 1));
    int64_t *blocks_at = malloc(sizeof(int64_t) * (size_t)(requests + 1));
    int64_t longest = 0; /* keys of the longest prefix, padded to four score tiles */
    vt_at[0] = blocks_at[0] = 0;
    for (int64_t r = 0; r < requests; r++) {
        const int64_t end = starts[r] + news[r], padded = (end + PB - 1) / PB * PB;
        const int64_t tiles = (end + 4 * KB - 1) / (4 * KB) * (4 * KB);
        vt_at[r + 1] = vt_at[r] + kv_heads * dim * padded;
        blocks_at[r + 1] = blocks_at[r] + (news[r] + QB - 1) / QB;
        longest = tiles > longest ? tiles : longest;
    }
    bf16 *vt = aligned_alloc(64, sizeof(bf16) * (size_t)(vt_at[requests] + 32));
    const int64_t tasks = blocks_at[requests] * heads;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < requests; r++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t end = starts[r] + news[r], padded = (end + PB - 1) / PB * PB;
                bf16 *dst = vt + vt_at[r] + g * dim * padded;
                const int64_t *sl = slots + slot_at[r];
                for (int64_t j = pf_first(starts[r], window); j < end; j++) {
                    const bf16 *row = v_pool + sl[j] * stride + g * dim;
                    for (int64_t d = 0; d < dim; d++) dst[d * padded + j] = row[d];
                }
                for (int64_t d = 0; d < dim; d++)
                    memset(dst + d * padded + end, 0, sizeof(bf16) * (size_t)(padded - end));
            }
        amx_configure();
        bf16 *qt = aligned_alloc(64, sizeof(bf16) * (size_t)(dim / 32 * 512));
        bf16 *kbuf = aligned_alloc(64, sizeof(bf16) * (size_t)(4 * KB * dim));
        bf16 *pt = aligned_alloc(64, sizeof(bf16) * 2 * 512);
        float *sc = aligned_alloc(64, sizeof(float) * (size_t)(longest * QB));
        float *ot = aligned_alloc(64, sizeof(float) * 4 * 256);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            /* Which request and query block: the requests' blocks are numbered in turn. */
            const int64_t block = t / heads, h = t % heads, g = h / group;
            int64_t r = 0;
            while (blocks_at[r + 1] <= block) r++;
            const int64_t q0 = (block - blocks_at[r]) * QB;
            const int64_t nq = news[r] - q0 < QB ? news[r] - q0 : QB;
            const int64_t pos0 = starts[r] + q0, end = pos0 + nq;
            const int64_t padded = (starts[r] + news[r] + PB - 1) / PB * PB;
            const bf16 *vr = vt + vt_at[r] + g * dim * padded;
            /* Q^T: for each 32 dims, [16 pairs of dims][16 positions][2], copied as 32-bit
             * pairs (positions past the block: zeros). */
            uint32_t *qt32 = (uint32_t *)qt;
            for (int64_t i = 0; i < QB; i++) {
                const uint32_t *row =
                    (const uint32_t *)(q + (q_at[r] + q0 + i) * q_stride + h * dim);
                for (int64_t u = 0; u < dim / 2; u++)
                    qt32[(u / 16) * 256 + (u % 16) * 16 + i] = i < nq ? row[u] : 0;
            }
            const bf16 *kh = k_pool + g * dim;
            const int64_t first = pf_first(pos0, window);
            const int64_t *sl = slots + slot_at[r];
            /* Pass 1: the scores, scaled and masked, into sc [keys][16]; each position's
             * maximum. Four key blocks at a time in tiles 0-3 (free until pass 2), the keys
             * in 4 and 5 in turn, the query's 32-dim chunks in 6 and 7 (a head of 96 or
             * 128 reloads them). */
            __m512 top = _mm512_set1_ps(-INFINITY);
            const int64_t chunks = dim / 32;
            if (chunks <= 2) {
                _tile_loadd(6, qt, 64);
                if (chunks == 2) _tile_loadd(7, qt + 512, 64);
            }
            for (int64_t kb0 = first; kb0 < end; kb0 += 4 * KB) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    if (chunks > 2) {
                        _tile_loadd(6, qt + c * 512, 64);
                    }
#define PF_BLOCK(T, A)                                                                       \
    if (kb0 + (T) * KB < end) {                                                              \
        int64_t bytes;                                                                       \
        const bf16 *base = pf_keys(kh, sl, stride, pool_slots, dim, kb0 + (T) * KB, end,     \
                                   kbuf + (T) * KB * dim, &bytes);                           \
        _tile_loadd(A, base + 32 * c, bytes);                                                \
        if (chunks > 2 || c == 0)                                                            \
            _tile_dpbf16ps(T, A, 6);                                                         \
        else                                                                                 \
            _tile_dpbf16ps(T, A, 7);                                                         \
    }
                    PF_BLOCK(0, 4)
                    PF_BLOCK(1, 5)
                    PF_BLOCK(2, 4)
                    PF_BLOCK(3, 5)
#undef PF_BLOCK
                }
                float *s4 = sc + kb0 * QB;
                _tile_stored(0, s4, 64);
                _tile_stored(1, s4 + 256, 64);
                _tile_stored(2, s4 + 512, 64);
                _tile_stored(3, s4 + 768, 64);
                const int64_t n = end - kb0 < 4 * KB ? end - kb0 : 4 * KB;
                for (int64_t j = 0; j < n; j++) {
                    const __m512 x = pf_row(s4 + j * QB, kb0 + j, pos0, nq, scale, window,
                                            first);
                    _mm512_storeu_ps(s4 + j * QB, x);
                    top = _mm512_max_ps(top, x);
                }
            }
            /* Pass 2, for each 64 dims: p = exp(s - max), summed in float32, rounded to
             * bf16 and packed 32 keys at a time as P^T with the keys' pairs interleaved;
             * O^T += V^T P^T in tiles 0-3 (P^T in 6 and 7, V^T in 4 and 5, in turn). */
            __m512 sum = _mm512_setzero_ps();
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                const int64_t dtiles = (dim - d0 < 64 ? dim - d0 : 64) / 16;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kp = first; kp < end; kp += PB) {
                    bf16 *ptb = pt + ((kp / PB) % 2) * 512;
                    for (int64_t i = 0; i < PB / 2; i++) {
                        __m512 e[2];
                        for (int64_t u = 0; u < 2; u++) {
                            const int64_t key = kp + 2 * i + u;
                            e[u] = _mm512_setzero_ps();
                            if (key < end) {
                                const __m512 x = _mm512_loadu_ps(sc + key * QB);
                                const __mmask16 live =
                                    _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                                e[u] = _mm512_maskz_mov_ps(live, pf_exp(_mm512_sub_ps(x, top)));
                                if (d0 == 0) sum = _mm512_add_ps(sum, e[u]);
                            }
                        }
                        pf_pair(e[0], e[1], ptb + i * 32);
                    }
                    const bf16 *vb = vr + d0 * padded + kp;
                    const int64_t vs = padded * 2;
                    /* The tile numbers must be constants: P^T alternates between 6 and 7. */
                    if ((kp / PB) % 2 == 0) {
                        PV_TILES(6);
                    } else {
                        PV_TILES(7);
                    }
                }
                _tile_stored(0, ot, 64);
                _tile_stored(1, ot + 256, 64);
                _tile_stored(2, ot + 512, 64);
                _tile_stored(3, ot + 768, 64);
                float sums[16];
                _mm512_storeu_ps(sums, sum);
                for (int64_t i = 0; i < nq; i++) {
                    bf16 *o = out + (q_at[r] + q0 + i) * heads * dim + h * dim + d0;
                    const float inv = 1.0f / sums[i];
                    for (int64_t d = 0; d < dtiles * 16; d++) o[d] = to_bf16(ot[d * 16 + i] * inv);
                }
            }
        }
        free(qt);
        free(kbuf);
        free(pt);
        free(sc);
        free(ot);
        _tile_release();
    }
    free(vt);
    free(vt_at);
    free(blocks_at);
}

int prefill_attention_built(void) { return 1; }

#else

void prefill_attention_bf16(const bf16 *q, int64_t q_stride, const bf16 *k_pool,
                            const bf16 *v_pool, int64_t pool_slots, const int64_t *slots,
                            const int64_t *slot_at, const int64_t *q_at, const int64_t *starts,
                            const int64_t *news, int64_t requests, int64_t heads,
                            int64_t kv_heads, int64_t dim, float scale, int64_t window,
                            bf16 *out, int threads) {
    (void)window, (void)q, (void)q_stride, (void)k_pool, (void)v_pool, (void)pool_slots, (void)slots;
    (void)slot_at, (void)q_at, (void)starts, (void)news, (void)requests, (void)heads;
    (void)kv_heads, (void)dim, (void)scale, (void)out, (void)threads;
}

int prefill_attention_built(void) { return 0; }

#endif
