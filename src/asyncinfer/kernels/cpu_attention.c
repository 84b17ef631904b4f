/* CPU kernels of the torch attention backend, compiled at first use for this CPU
 * (asyncinfer.attention.native): decode attention that reads K and V where they lie in the
 * paged pool, through the page table, instead of gathering every request's prefix first.
 *
 * One task per (request, KV head): the query heads that share that KV head are scored
 * against each key as it is read (one load of K and V serves the whole group), with a
 * two-pass softmax in float32. Tasks are independent, so a request's output does not
 * depend on what shares its batch. Built with -march of this CPU: AVX2 or AVX-512 code
 * comes from the same source.
 *
 * Head sizes that are a multiple of 16 take the blocked path: keys are widened to float32
 * sixteen at a time into a small buffer (on AVX-512, in registers as each is read: FUSED,
 * with the same results); each head's sixteen dot products are kept as
 * sixteen vectors of partial sums and reduced together by a transpose (fifteen shuffle-add
 * steps for sixteen keys, where one horizontal sum per key costs about as many each). The
 * vectors are GCC's generic 16-float vectors: one AVX-512 register, or two AVX2 ones. The
 * common head sizes (64, 128) get loops of a fixed length, which unroll into straight code.
 * Other head sizes take a plain loop per key.
 *
 * A sliding window (``window`` > 0) attends only the last ``window`` positions: the task
 * starts its slots there, so the keys before it are never read.
 *
 * The batch-invariant mode attends each new token of a prefill chunk as one query of this
 * kernel, at its own position, so that a token's output never depends on how it was
 * batched. Such queries come in runs (one request, consecutive positions); a run of up to
 * sixteen is one task of the blocked path, which widens each key and value block once for
 * the run rather than once per query and still computes every query exactly as a task of
 * its own would (MULTI below says why the bits agree).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (scores minus their maximum). */
INLINE float exp_nonpositive(float x) {
    return exp_clamped(x < -87.0f ? -87.0f : x);
}

INLINE void load_f32(const float *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = src[i];
}

INLINE void load_bf16(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = from_bf16(src[i]);
}

typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

INLINE vf pick(vi mask, vf a, vf b) { /* a where mask is set, else b */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp_nonpositive on sixteen lanes, each lane's arithmetic exp_clamped's (floorf done as a
 * truncation moved down where it rounded up), so a lane gives the scalar's bits. */
INLINE vf exp16_nonpositive(vf x) {
    const vf low = (vf){0} - 87.0f;
    x = pick(x < low, low, x);
    const vf t = x * 1.44269504088896341f + 0.5f;
    vi ti = __builtin_convertvector(t, vi);
    ti += t < __builtin_convertvector(ti, vf);
    const vf k = __builtin_convertvector(ti, vf);
    const vf f = x - k * 0.693359375f + k * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    return p * (vf)((vu)(ti + 127) << 23);
}

INLINE vf load16(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* The softmax of each head's scores [group][len], in place: sixteen lanes at a time (GCC's
 * loop vectorizer leaves these loops scalar), the rest of a row one by one; the sum is the
 * lanes' partial sums added lane by lane, then the rest. Not inlined: one compiled body, so
 * the one-query and the many-query tasks below sum a row in one order. */
__attribute__((noinline)) static void softmax_rows(float *scores, int64_t group, int64_t len) {
    const int64_t whole = len / 16 * 16;
    for (int64_t h = 0; h < group; h++) {
        float *sh = scores + h * len;
        float top = sh[0];
        if (whole) {
            vf m = load16(sh);
            for (int64_t j = 16; j < whole; j += 16) {
                const vf x = load16(sh + j);
                m = pick(x > m, x, m);
            }
            for (int l = 0; l < 16; l++) top = m[l] > top ? m[l] : top;
        }
        for (int64_t j = whole; j < len; j++) top = sh[j] > top ? sh[j] : top;
        vf lanes = {0};
        for (int64_t j = 0; j < whole; j += 16) {
            const vf e = exp16_nonpositive(load16(sh + j) - top);
            memcpy(sh + j, &e, sizeof e);
            lanes += e;
        }
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += lanes[l];
        for (int64_t j = whole; j < len; j++) {
            sh[j] = exp_nonpositive(sh[j] - top);
            sum += sh[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < whole; j += 16) {
            const vf e = load16(sh + j) * inv;
            memcpy(sh + j, &e, sizeof e);
        }
        for (int64_t j = whole; j < len; j++) sh[j] *= inv;
    }
}

/* One (request, KV head) task: scores of ``group`` query heads qs [group][dim] times ``scale``
 * against ``len`` keys at ``slots``, softmax, then the weighted sum of the values into
 * out [group][dim]. ``scores`` holds group * len floats, ``acc`` group * dim. */
#define TASK(NAME, KV_T, LOAD)                                                               \
    INLINE void NAME(const float *qs, const KV_T *k, const KV_T *v, const int64_t *slots,    \
                     int64_t len, int64_t stride, int64_t group, const int64_t dim,          \
                     float scale, float *scores, float *acc, float *out) {                                \
        float row[dim];                                                                      \
        for (int64_t j = 0; j < len; j++) {                                                  \
            LOAD(k + slots[j] * stride, row, dim);                                           \
            for (int64_t h = 0; h < group; h++) {                                            \
                const float *qh = qs + h * dim;                                              \
                float s = 0.0f;                                                              \
                _Pragma("omp simd reduction(+ : s)")                                         \
                for (int64_t d = 0; d < dim; d++) s += qh[d] * row[d];                       \
                scores[h * len + j] = s * scale;                                             \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, group, len);                                                    \
        for (int64_t i = 0; i < group * dim; i++) acc[i] = 0.0f;                             \
        for (int64_t j = 0; j < len; j++) {                                                  \
            LOAD(v + slots[j] * stride, row, dim);                                           \
            for (int64_t h = 0; h < group; h++) {                                            \
                const float p = scores[h * len + j];                                         \
                float *ah = acc + h * dim;                                                   \
                _Pragma("omp simd")                                                          \
                for (int64_t d = 0; d < dim; d++) ah[d] += p * row[d];                       \
            }                                                                                \
        }                                                                                    \
        memcpy(out, acc, sizeof(float) * (size_t)(group * dim));                             \
    }

TASK(task_f32, float, load_f32)
TASK(task_bf16, uint16_t, load_bf16)

/* ---- the blocked path (head size a multiple of 16) ---- */

typedef uint16_t vh __attribute__((vector_size(32)));
#define BLOCK 16

INLINE vf widen_f32(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

INLINE vf widen_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)widen16_bf16(p);
#endif
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* a[i] + a[i + half] pairs of a and b, interleaved by the masks: one transpose step. */
INLINE vf fold(vf a, vf b, vi lo, vi hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

/* The sixteen horizontal sums of p[0..15], as one vector (lane j: the sum of p[j]). */
INLINE vf sum16(vf *p) {
    const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf y[8], z[4], w[2];
    for (int i = 0; i < 8; i++) y[i] = fold(p[2 * i], p[2 * i + 1], lo1, hi1);
    for (int i = 0; i < 4; i++) z[i] = fold(y[2 * i], y[2 * i + 1], lo2, hi2);
    for (int i = 0; i < 2; i++) w[i] = fold(z[2 * i], z[2 * i + 1], lo3, hi3);
    return fold(w[0], w[1], lo4, hi4);
}

/* Rows ``n`` keys (or values) at ``slots`` widened into rows[BLOCK][nc] (zeros past n). */
#define WIDEN(NAME, KV_T, LOADV)                                                             \
    INLINE void NAME(const KV_T *base, const int64_t *slots, int64_t n, int64_t stride,      \
                     const int64_t nc, vf *rows) {                                           \
        for (int64_t j = 0; j < n; j++) {                                                    \
            const KV_T *src = base + slots[j] * stride;                                      \
            for (int64_t c = 0; c < nc; c++) rows[j * nc + c] = LOADV(src + c * 16);         \
        }                                                                                    \
        for (int64_t j = n; j < BLOCK; j++)                                                  \
            for (int64_t c = 0; c < nc; c++) rows[j * nc + c] = (vf){0};                     \
    }

WIDEN(widen_rows_f32, float, widen_f32)
WIDEN(widen_rows_bf16, uint16_t, widen_bf16)

/* Asks for the rows of ``n`` positions at ``slots`` (BLOCK at most, ``bytes`` each) to be
 * brought into the L2 cache. The blocks' rows are scattered by the page table, so the
 * hardware prefetcher does not see them coming: asking for the block after next while
 * this one is computed overlaps the reads with the arithmetic (a third off a 30-layer
 * decode step whose K and V come from memory). Into L2, not L1: a core has few L1 misses
 * in flight, and the prefetches would hold them all (a step's attention took about a
 * tenth longer asking for L1). */
INLINE void fetch_rows(const void *base, const int64_t *slots, int64_t n, int64_t stride,
                       int64_t bytes) {
    n = n < BLOCK ? n : BLOCK;
    for (int64_t j = 0; j < n; j++)
        for (int64_t at = 0; at < bytes; at += 64)
            __builtin_prefetch((const char *)base + slots[j] * stride + at, 0, 2);
}

#define AHEAD (2 * BLOCK) /* positions between a block and the one fetch_rows asks for */

/* One (request, KV head) task, blocked: q [group][nc] already scaled; scores [group][padded
 * len]; rows [BLOCK][nc] and acc [group][nc] scratch; out [group][nc * 16]. */
#define BLOCKED(NAME, KV_T, WIDEN_FN)                                                        \
    INLINE void NAME(const vf *q, const KV_T *k, const KV_T *v, const int64_t *slots,        \
                     int64_t len, int64_t stride, int64_t group, const int64_t nc,           \
                     float *scores, vf *rows, vf *acc, float *out) {                          \
        const int64_t padded = (len + BLOCK - 1) / BLOCK * BLOCK;                            \
        const int64_t row_bytes = stride * (int64_t)sizeof(KV_T);                           \
        const int64_t head_bytes = nc * 16 * (int64_t)sizeof(KV_T);                          \
        fetch_rows(k, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(k, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            WIDEN_FN(k, slots + j0, n, stride, nc, rows);                                    \
            fetch_rows(k, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            for (int64_t h = 0; h < group; h++) {                                            \
                const vf *qh = q + h * nc;                                                   \
                vf part[BLOCK];                                                              \
                for (int64_t j = 0; j < BLOCK; j++) {                                        \
                    vf s = qh[0] * rows[j * nc];                                             \
                    for (int64_t c = 1; c < nc; c++) s += qh[c] * rows[j * nc + c];          \
                    part[j] = s;                                                             \
                }                                                                            \
                const vf sums = sum16(part);                                                 \
                memcpy(scores + h * padded + j0, &sums, sizeof sums);                        \
            }                                                                                \
        }                                                                                    \
        fetch_rows(v, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(v, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t h = 0; h < group; h++) {                                                \
            softmax_rows(scores + h * padded, 1, len);                                       \
            for (int64_t j = len; j < padded; j++) scores[h * padded + j] = 0.0f;            \
        }                                                                                    \
        for (int64_t i = 0; i < group * nc; i++) acc[i] = (vf){0};                           \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            WIDEN_FN(v, slots + j0, n, stride, nc, rows);                                    \
            fetch_rows(v, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            for (int64_t h = 0; h < group; h++) {                                            \
                const float *p = scores + h * padded + j0;                                   \
                vf *ah = acc + h * nc;                                                       \
                for (int64_t j = 0; j < BLOCK; j++)                                          \
                    for (int64_t c = 0; c < nc; c++) ah[c] += p[j] * rows[j * nc + c];       \
            }                                                                                \
        }                                                                                    \
        memcpy(out, acc, sizeof(vf) * (size_t)(group * nc));                                 \
    }

BLOCKED(blocked_f32, float, widen_rows_f32)
BLOCKED(blocked_bf16, uint16_t, widen_rows_bf16)

#if defined(__AVX512F__)
/* BLOCKED's task for AVX-512 builds, with its results bit for bit; part [group][BLOCK]
 * scratch in place of rows. Each key and value is widened in registers as it is read and
 * serves every head of the group there, and the values are asked for while the keys are
 * scored: a fifth off a decode step's attention whose K and V come from memory. A block's
 * keys past len are not scored (a score's lane is its own key's, and the softmax never
 * reads past len) and its values past len not added (BLOCKED adds +0 for them, which
 * leaves every sum as it is). On AVX2, where a 16-float vector is two registers, the
 * group's queries and sums do not fit the registers, and this is slower than BLOCKED. */
#define FUSED(NAME, KV_T, LOADV)                                                           \
    INLINE void NAME(const vf *q, const KV_T *k, const KV_T *v, const int64_t *slots,        \
                     int64_t len, int64_t stride, int64_t group, const int64_t nc,           \
                     float *scores, vf *part, vf *acc, float *out) {                          \
        const int64_t padded = (len + BLOCK - 1) / BLOCK * BLOCK;                            \
        const int64_t row_bytes = stride * (int64_t)sizeof(KV_T);                           \
        const int64_t head_bytes = nc * 16 * (int64_t)sizeof(KV_T);                          \
        fetch_rows(k, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(k, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            fetch_rows(k, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            fetch_rows(v, slots + j0, n, row_bytes, head_bytes);                             \
            for (int64_t j = 0; j < n; j++) {                                                \
                const KV_T *src = k + slots[j0 + j] * stride;                                \
                vf r[8];                                                                     \
                for (int64_t c = 0; c < nc; c++) r[c] = LOADV(src + c * 16);                 \
                for (int64_t h = 0; h < group; h++) {                                        \
                    const vf *qh = q + h * nc;                                               \
                    vf s = qh[0] * r[0];                                                     \
                    for (int64_t c = 1; c < nc; c++) s += qh[c] * r[c];                      \
                    part[h * BLOCK + j] = s;                                                 \
                }                                                                            \
            }                                                                                \
            for (int64_t h = 0; h < group; h++) {                                            \
                for (int64_t j = n; j < BLOCK; j++) part[h * BLOCK + j] = (vf){0};           \
                const vf sums = sum16(part + h * BLOCK);                                     \
                memcpy(scores + h * padded + j0, &sums, sizeof sums);                        \
            }                                                                                \
        }                                                                                    \
        fetch_rows(v, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(v, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t h = 0; h < group; h++) softmax_rows(scores + h * padded, 1, len);       \
        for (int64_t i = 0; i < group * nc; i++) acc[i] = (vf){0};                           \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            fetch_rows(v, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            for (int64_t j = 0; j < n; j++) {                                                \
                const KV_T *src = v + slots[j0 + j] * stride;                                \
                vf r[8];                                                                     \
                for (int64_t c = 0; c < nc; c++) r[c] = LOADV(src + c * 16);                 \
                for (int64_t h = 0; h < group; h++) {                                        \
                    const float pj = scores[h * padded + j0 + j];                            \
                    for (int64_t c = 0; c < nc; c++) acc[h * nc + c] += pj * r[c];           \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        memcpy(out, acc, sizeof(vf) * (size_t)(group * nc));                                 \
    }

FUSED(fused_f32, float, widen_f32)
FUSED(fused_bf16, uint16_t, widen_bf16)

/* The task of every head size a multiple of 16, with the common head sizes (and on
 * AVX-512 the common group sizes) as constants, so that the loops unroll and the group's
 * queries and sums stay in registers (a quarter off FUSED over a variable group). */
#define SIZES(FN, NC)                                                                        \
    switch (group) {                                                                         \
    case 1: FN(q, k, v, slots, len, stride, 1, NC, scores, part, acc, out); break;           \
    case 2: FN(q, k, v, slots, len, stride, 2, NC, scores, part, acc, out); break;           \
    case 3: FN(q, k, v, slots, len, stride, 3, NC, scores, part, acc, out); break;           \
    case 4: FN(q, k, v, slots, len, stride, 4, NC, scores, part, acc, out); break;           \
    default: FN(q, k, v, slots, len, stride, group, NC, scores, part, acc, out);             \
    }
#define TASK_F32 fused_f32
#define TASK_BF16 fused_bf16
#define MULTI_F32 multi_f32
#define MULTI_BF16 multi_bf16
#elif defined(__AVX2__) && defined(__FMA__)
/* BLOCKED's task for AVX2 builds, in 8-float registers. GCC lowers BLOCKED's 16-float
 * vectors on AVX2 to pairs of registers copied through the stack (each key's row widened
 * into memory, each partial sum stored in 128-bit halves): about nine times the FMAs' time
 * per key. Here a 16-float vector of BLOCKED is two registers, "lo" (its lanes 0-7) and
 * "hi" (8-15). Each key is read once, a chunk of its row at a time, and serves every head
 * of the group (up to four at once: their sums are eight registers); the sixteen lanes of
 * a key's score vector fold as sum16 folds them (lane i + i + 8, then i + i + 4, i + 2,
 * i + 1 within eight lanes), eight keys at a time, by AVX2's own shuffles. The values are
 * added key by key into each head's sums, held in registers (a key past len is not added:
 * BLOCKED adds +0). The results agree with BLOCKED's to rounding, not bit for bit (GCC's
 * contraction of BLOCKED's lowered vectors into FMAs is its own), so on AVX2 a run of a
 * chunk's queries (MULTI's work) is computed query by query by this task: each query's
 * bits are what it gets alone. */
#define AV_HEADS 4

INLINE __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

INLINE __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}

/* The eight scores of keys t[0..7] (each the lane-wise sum of a key's lo and hi halves),
 * folded as sum16 folds its lanes 0-7, into out[0..7]. */
INLINE void fold8(const __m256 *t, float *out) {
    __m256 u[4], w[2];
    for (int i = 0; i < 4; i++)  /* lanes i + i + 4: [key 2i | key 2i + 1] */
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)  /* lanes i + i + 2 */
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88),  /* i + i + 1 */
                                   _mm256_shuffle_ps(w[0], w[1], 0xdd));
    /* z holds keys 0 2 4 6 | 1 3 5 7 */
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3,
                                                                         7)));
}

#define AVX2_TASK(NAME, KV_T, LOAD8)                                                         \
    INLINE void NAME(const vf *qv, const KV_T *k, const KV_T *v, const int64_t *slots,       \
                     int64_t len, int64_t stride, int64_t group, const int64_t nc,           \
                     float *scores, vf *part_v, vf *acc_v, float *out) {                     \
        (void)acc_v;                                                                         \
        const float *q = (const float *)qv;                                                  \
        __m256 *part = (__m256 *)part_v; /* [AV_HEADS][BLOCK] */                             \
        const int64_t dim = nc * 16, padded = (len + BLOCK - 1) / BLOCK * BLOCK;             \
        const int64_t row_bytes = stride * (int64_t)sizeof(KV_T);                           \
        const int64_t head_bytes = dim * (int64_t)sizeof(KV_T);                              \
        for (int64_t h0 = 0; h0 < group; h0 += AV_HEADS) {                                   \
            const int64_t heads = group - h0 < AV_HEADS ? group - h0 : AV_HEADS;             \
            fetch_rows(k, slots, len, row_bytes, head_bytes);                                \
            fetch_rows(k, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                \
            for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                    \
                const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                       \
                fetch_rows(k, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);  \
                for (int64_t j = 0; j < n; j++) {                                            \
                    const KV_T *src = k + slots[j0 + j] * stride;                            \
                    __m256 lo[AV_HEADS], hi[AV_HEADS];                                       \
                    const __m256 r0 = LOAD8(src), r1 = LOAD8(src + 8);                       \
                    for (int64_t h = 0; h < heads; h++) {                                    \
                        const float *qh = q + (h0 + h) * dim;                                \
                        lo[h] = _mm256_mul_ps(_mm256_loadu_ps(qh), r0);                      \
                        hi[h] = _mm256_mul_ps(_mm256_loadu_ps(qh + 8), r1);                  \
                    }                                                                        \
                    for (int64_t c = 1; c < nc; c++) {                                       \
                        const __m256 a = LOAD8(src + 16 * c), b = LOAD8(src + 16 * c + 8);   \
                        for (int64_t h = 0; h < heads; h++) {                                \
                            const float *qh = q + (h0 + h) * dim + 16 * c;                   \
                            lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), a, lo[h]);          \
                            hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), b, hi[h]);      \
                        }                                                                    \
                    }                                                                        \
                    for (int64_t h = 0; h < heads; h++)                                      \
                        part[h * BLOCK + j] = _mm256_add_ps(lo[h], hi[h]);                   \
                }                                                                            \
                for (int64_t h = 0; h < heads; h++) {                                        \
                    for (int64_t j = n; j < BLOCK; j++)                                      \
                        part[h * BLOCK + j] = _mm256_setzero_ps();                           \
                    float *sh = scores + (h0 + h) * padded + j0;                             \
                    fold8(part + h * BLOCK, sh);                                             \
                    fold8(part + h * BLOCK + 8, sh + 8);                                     \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t h = 0; h < group; h++) softmax_rows(scores + h * padded, 1, len);       \
        for (int64_t h = 0; h < group; h++) {                                                \
            const float *p = scores + h * padded;                                            \
            for (int64_t c0 = 0; c0 < nc; c0 += 4) { /* 4 chunks of 16: eight sums */       \
                const int64_t cs = nc - c0 < 4 ? nc - c0 : 4;                                \
                __m256 a[8];                                                                 \
                for (int64_t i = 0; i < 2 * cs; i++) a[i] = _mm256_setzero_ps();             \
                if (h == 0 && c0 == 0) {                                                     \
                    fetch_rows(v, slots, len, row_bytes, head_bytes);                        \
                    fetch_rows(v, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);        \
                }                                                                            \
                for (int64_t j = 0; j < len; j++) {                                          \
                    if (h == 0 && c0 == 0 && j % BLOCK == 0)                                 \
                        fetch_rows(v, slots + j + AHEAD, len - j - AHEAD, row_bytes,         \
                                   head_bytes);                                              \
                    const KV_T *src = v + slots[j] * stride + 16 * c0;                       \
                    const __m256 pj = _mm256_set1_ps(p[j]);                                  \
                    for (int64_t i = 0; i < 2 * cs; i++)                                     \
                        a[i] = _mm256_fmadd_ps(pj, LOAD8(src + 8 * i), a[i]);                \
                }                                                                            \
                for (int64_t i = 0; i < 2 * cs; i++)                                         \
                    _mm256_storeu_ps(out + h * dim + 16 * c0 + 8 * i, a[i]);                 \
            }                                                                                \
        }                                                                                    \
    }

AVX2_TASK(avx2_task_f32, float, load8_f32)
AVX2_TASK(avx2_task_bf16, uint16_t, load8_bf16)

/* MULTI's work, m consecutive queries of one request, on AVX2: each query a task of its own
 * (query i attends slots[0 .. len0 + i]). */
#define AVX2_MULTI(NAME, KV_T, TASK_FN)                                                      \
    INLINE void NAME(const vf *q, int64_t m, const KV_T *k, const KV_T *v,                   \
                     const int64_t *slots, int64_t len0, int64_t stride, int64_t group,      \
                     const int64_t nc, int64_t padded, float *scores, vf *rows, vf *zeros,   \
                     vf *acc, float *out) {                                                  \
        (void)padded, (void)zeros;                                                           \
        for (int64_t i = 0; i < m; i++)                                                      \
            TASK_FN(q + i * group * nc, k, v, slots, len0 + i + 1, stride, group, nc, scores,  \
                    rows, acc, out + i * group * nc * 16);                                   \
    }

AVX2_MULTI(avx2_multi_f32, float, avx2_task_f32)
AVX2_MULTI(avx2_multi_bf16, uint16_t, avx2_task_bf16)
#define MULTI_F32 avx2_multi_f32
#define MULTI_BF16 avx2_multi_bf16

#define SIZES(FN, NC) FN(q, k, v, slots, len, stride, group, NC, scores, part, acc, out);
#define TASK_F32 avx2_task_f32
#define TASK_BF16 avx2_task_bf16
#else
#define SIZES(FN, NC) FN(q, k, v, slots, len, stride, group, NC, scores, part, acc, out);
#define TASK_F32 blocked_f32
#define TASK_BF16 blocked_bf16
#define MULTI_F32 multi_f32
#define MULTI_BF16 multi_bf16
#endif

#define BLOCKED_ANY(NAME, KV_T, FN)                                                          \
    INLINE void NAME(const vf *restrict q, const KV_T *k, const KV_T *v,                     \
                     const int64_t *slots, int64_t len, int64_t stride, int64_t group,       \
                     int64_t nc, float *restrict scores, vf *restrict part,                  \
                     vf *restrict acc, float *restrict out) {                                \
        if (nc == 4) {                                                                       \
            SIZES(FN, 4)                                                                     \
        } else if (nc == 8) {                                                                \
            SIZES(FN, 8)                                                                     \
        } else {                                                                             \
            FN(q, k, v, slots, len, stride, group, nc, scores, part, acc, out);              \
        }                                                                                    \
    }

BLOCKED_ANY(blocked_any_f32, float, TASK_F32)
BLOCKED_ANY(blocked_any_bf16, uint16_t, TASK_BF16)

/* Keys j of one block for ``quad`` queries of one head at once: a[q] += p[q][j] times the
 * block's row j, or (past the query's end ends[q], where p[q][j] is 0) times the zero row
 * ``zeros``, as BLOCKED adds each key of its zero-padded block, in order of j. The quad's
 * sums stay in registers (``quad`` and ``nc`` constant where it is inlined), four
 * independent chains per query instead of BLOCKED's one query's four. */
INLINE void values_block(const int quad, const int64_t nc, const float *const *p,
                         const int64_t *ends, const vf *rows, const vf *zeros, vf *const *a) {
    vf sum[4][8];
    for (int q = 0; q < quad; q++)
        for (int64_t c = 0; c < nc; c++) sum[q][c] = a[q][c];
    for (int64_t j = 0; j < BLOCK; j++)
        for (int q = 0; q < quad; q++) {
            const vf *r = j < ends[q] ? rows + j * nc : zeros;
            const float pj = p[q][j];
            for (int64_t c = 0; c < nc; c++) sum[q][c] += pj * r[c];
        }
    for (int q = 0; q < quad; q++)
        for (int64_t c = 0; c < nc; c++) a[q][c] = sum[q][c];
}

/* m consecutive queries of one request at once (a prefill chunk's, in the batch-invariant
 * mode): query i attends slots[0 .. len0 + i]. Each key (value) block is widened once for
 * all of them instead of once per query, and each query is computed as BLOCKED computes
 * it, in the same order: its scores lane by lane (a score depends on its key alone, so a
 * block holding keys past a query's end gives it the same ones, and the softmax never reads
 * past the end); its sums over values key by key as BLOCKED adds its zero-padded block (a
 * zero row ``zeros`` past the query's end, so a later token's values never enter). So the
 * results are BLOCKED's, bit for bit. q [m][group][nc] scaled; scores [m][group][padded];
 * acc [m][group][nc]; out [m][group][nc * 16]. */
#define MULTI(NAME, KV_T, WIDEN_FN)                                                          \
    INLINE void NAME(const vf *q, int64_t m, const KV_T *k, const KV_T *v,                   \
                     const int64_t *slots, int64_t len0, int64_t stride, int64_t group,      \
                     const int64_t nc, int64_t padded, float *scores, vf *rows, vf *zeros,   \
                     vf *acc, float *out) {                                                  \
        const int64_t len = len0 + m;                                                        \
        const int64_t row_bytes = stride * (int64_t)sizeof(KV_T);                           \
        const int64_t head_bytes = nc * 16 * (int64_t)sizeof(KV_T);                          \
        fetch_rows(k, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(k, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            WIDEN_FN(k, slots + j0, n, stride, nc, rows);                                    \
            fetch_rows(k, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            for (int64_t i = 0; i < m; i++) {                                                \
                if (len0 + i + 1 <= j0) continue;                                            \
                for (int64_t h = 0; h < group; h++) {                                        \
                    const vf *qh = q + (i * group + h) * nc;                                 \
                    vf part[BLOCK];                                                          \
                    for (int64_t j = 0; j < BLOCK; j++) {                                    \
                        vf s = qh[0] * rows[j * nc];                                         \
                        for (int64_t c = 1; c < nc; c++) s += qh[c] * rows[j * nc + c];      \
                        part[j] = s;                                                         \
                    }                                                                        \
                    const vf sums = sum16(part);                                             \
                    memcpy(scores + (i * group + h) * padded + j0, &sums, sizeof sums);      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        fetch_rows(v, slots, len, row_bytes, head_bytes);                                    \
        fetch_rows(v, slots + BLOCK, len - BLOCK, row_bytes, head_bytes);                    \
        for (int64_t i = 0; i < m; i++) {                                                    \
            const int64_t li = len0 + i + 1, pi = (li + BLOCK - 1) / BLOCK * BLOCK;          \
            for (int64_t h = 0; h < group; h++) {                                            \
                float *sh = scores + (i * group + h) * padded;                               \
                softmax_rows(sh, 1, li);                                                     \
                for (int64_t j = li; j < pi; j++) sh[j] = 0.0f;                              \
            }                                                                                \
        }                                                                                    \
        for (int64_t i = 0; i < m * group * nc; i++) acc[i] = (vf){0};                       \
        for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {                                        \
            const int64_t n = len - j0 < BLOCK ? len - j0 : BLOCK;                           \
            WIDEN_FN(v, slots + j0, n, stride, nc, rows);                                    \
            fetch_rows(v, slots + j0 + AHEAD, len - j0 - AHEAD, row_bytes, head_bytes);      \
            /* The queries that reach this block: those from i = j0 - len0 on. */            \
            const int64_t from = j0 - len0 > 0 ? j0 - len0 : 0;                              \
            for (int64_t h = 0; h < group; h++) {                                            \
                int64_t i = from;                                                            \
                const int quad = nc == 4 ? 4 : nc == 8 ? 2 : 0;                              \
                for (; quad && i + quad <= m; i += quad) {                                   \
                    const float *p[4];                                                       \
                    int64_t ends[4];                                                         \
                    vf *a[4];                                                                \
                    for (int q = 0; q < quad; q++) {                                         \
                        const int64_t li = len0 + i + q + 1;                                 \
                        p[q] = scores + ((i + q) * group + h) * padded + j0;                 \
                        ends[q] = li - j0 < BLOCK ? li - j0 : BLOCK;                         \
                        a[q] = acc + ((i + q) * group + h) * nc;                             \
                    }                                                                        \
                    if (nc == 4)                                                             \
                        values_block(4, 4, p, ends, rows, zeros, a);                         \
                    else                                                                     \
                        values_block(2, 8, p, ends, rows, zeros, a);                         \
                }                                                                            \
                for (; i < m; i++) {                                                         \
                    const int64_t li = len0 + i + 1;                                         \
                    const int64_t ni = li - j0 < BLOCK ? li - j0 : BLOCK;                    \
                    const float *p = scores + (i * group + h) * padded + j0;                 \
                    vf *ah = acc + (i * group + h) * nc;                                     \
                    for (int64_t j = 0; j < BLOCK; j++) {                                    \
                        const vf *r = j < ni ? rows + j * nc : zeros;                        \
                        for (int64_t c = 0; c < nc; c++) ah[c] += p[j] * r[c];               \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        memcpy(out, acc, sizeof(vf) * (size_t)(m * group * nc));                             \
    }

MULTI(multi_f32, float, widen_rows_f32)
MULTI(multi_bf16, uint16_t, widen_rows_bf16)

INLINE void *scratch(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* Where the runs of consecutive queries start: query b continues b - 1's run when both are
 * of one row of the table at consecutive lengths (a prefill chunk in the batch-invariant
 * mode), with no window and room in the run (QUERIES at most). first[t], count[t]: run t. */
#define QUERIES 16

/* Runs per thread from which a thread takes every KV head of a run, one after another,
 * rather than one (run, head) task at a time. A slot's row holds all KV heads side by side,
 * so the heads of one run read the same pages: taken together, on one core, the later heads
 * find in L2 the lines the first one's reads and the hardware prefetcher brought, and each
 * core reads pages of its own. Shared one by one, a run's heads went to both cores, each
 * reading a third of every line pair of every page: a 30-layer step of 16 requests at 300
 * positions (SmolLM2-135M's 3 KV heads, two threads) took about an eighth longer. With
 * fewer runs than this, whole runs would leave threads idle. */
#define WHOLE_RUNS 2
static int64_t find_runs(const int64_t *rows, const int64_t *lens, int64_t batch, int multi,
                         int64_t *first, int64_t *count) {
    int64_t runs = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (multi && runs && rows[b] == rows[b - 1] && lens[b] == lens[b - 1] + 1 &&
            count[runs - 1] < QUERIES) {
            count[runs - 1]++;
            continue;
        }
        first[runs] = b;
        count[runs++] = 1;
    }
    return runs;
}

/* q [batch, heads, dim]; pools [slots, kv_heads, dim]; table [*, width] int64 slot of each
 * position; rows, lens [batch]; out [batch, heads, dim]. q and out are float32, or with
 * ``bf16_io`` bfloat16 (out rounded once from the float32 result, as a cast would). Query
 * b attends positions lens[b] - window .. lens[b] - 1 (from 0; window <= 0: all of them).
 * Runs of one request's consecutive queries (find_runs) are tasks of MULTI, with BLOCKED's
 * results; the last runs go first, the longest where a chunk's queries follow its order. */
#define DECODE(NAME, KV_T, TASK_FN, BLOCKED_FN, MULTI_FN)                                    \
    void NAME(const void *q_in, const KV_T *k_pool, const KV_T *v_pool,                      \
              const int64_t *table, int64_t width, const int64_t *rows, const int64_t *lens, \
              void *out_v, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,      \
              float scale, int64_t max_len, int64_t window, int bf16_io, int threads) {      \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim, nc = dim / 16;      \
        const int blocked = dim % 16 == 0;                                                   \
        const int64_t padded = (max_len + BLOCK - 1) / BLOCK * BLOCK;                        \
        int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * batch + 2));                 \
        int64_t *count = first + batch + 1;                                                  \
        const int64_t runs = find_runs(rows, lens, batch, blocked && window <= 0, first,     \
                                       count);                                               \
        int64_t most = 1;                                                                    \
        for (int64_t t = 0; t < runs; t++) most = count[t] > most ? count[t] : most;         \
        /* With runs enough to share out, a thread takes all KV heads of a run in turn       \
         * (WHOLE_RUNS says why); with few, the (run, head) tasks are shared one by one. */  \
        const int64_t chunk = runs >= WHOLE_RUNS * threads ? kv_heads : 1;                   \
        _Pragma("omp parallel num_threads(threads)") {                                       \
            float *scores = scratch(sizeof(float) * (size_t)(most * group * padded));        \
            float *acc = scratch(sizeof(float) * (size_t)(most * group * dim));              \
            float *qs = scratch(sizeof(float) * (size_t)(most * group * dim));               \
            float *res = scratch(sizeof(float) * (size_t)(most * group * dim));              \
            const int64_t widest = dim > 16 * group ? dim : 16 * group; /* rows, part */    \
            vf *block = scratch(sizeof(float) * (size_t)(BLOCK * widest));                   \
            vf *zeros = scratch(sizeof(float) * (size_t)dim);                                \
            memset(zeros, 0, sizeof(float) * (size_t)dim);                                   \
            _Pragma("omp for collapse(2) schedule(dynamic, chunk)")                          \
            for (int64_t u = 0; u < runs; u++) {                                             \
                for (int64_t g = 0; g < kv_heads; g++) {                                     \
                    const int64_t t = most > 1 ? runs - 1 - u : u, b = first[t], m = count[t];        \
                    const KV_T *k = k_pool + g * dim, *v = v_pool + g * dim;                 \
                    const int64_t first_pos =                                                \
                        window > 0 && lens[b] > window ? lens[b] - window : 0;               \
                    const int64_t *slots = table + rows[b] * width + first_pos;              \
                    const int64_t len = lens[b] - first_pos;                                 \
                    const float f = blocked ? scale : 1.0f;                                  \
                    for (int64_t i = 0; i < m; i++) {                                        \
                        const int64_t at = ((b + i) * heads + g * group) * dim;              \
                        for (int64_t e = 0; e < group * dim; e++)                            \
                            qs[i * group * dim + e] =                                        \
                                (bf16_io ? from_bf16(((const bf16 *)q_in)[at + e])           \
                                         : ((const float *)q_in)[at + e]) * f;               \
                    }                                                                        \
                    const vf *qv = (const vf *)qs;                                           \
                    if (m > 1) {                                                             \
                        if (nc == 4)                                                         \
                            MULTI_FN(qv, m, k, v, slots, len - 1, stride, group, 4, padded,  \
                                     scores, block, zeros, (vf *)acc, res);                  \
                        else if (nc == 8)                                                    \
                            MULTI_FN(qv, m, k, v, slots, len - 1, stride, group, 8, padded,  \
                                     scores, block, zeros, (vf *)acc, res);                  \
                        else                                                                 \
                            MULTI_FN(qv, m, k, v, slots, len - 1, stride, group, nc, padded, \
                                     scores, block, zeros, (vf *)acc, res);                  \
                    } else if (blocked) {                                                    \
                        BLOCKED_FN(qv, k, v, slots, len, stride, group, nc, scores, block,   \
                                   (vf *)acc, res);                                          \
                    } else {                                                                 \
                        TASK_FN(qs, k, v, slots, len, stride, group, dim, scale, scores,     \
                                acc, res);                                                   \
                    }                                                                        \
                    for (int64_t i = 0; i < m; i++) {                                        \
                        const int64_t at = ((b + i) * heads + g * group) * dim;              \
                        const float *r = res + i * group * dim;                              \
                        if (bf16_io)                                                         \
                            for (int64_t e = 0; e < group * dim; e++)                        \
                                ((bf16 *)out_v)[at + e] = to_bf16(r[e]);                     \
                        else                                                                 \
                            memcpy((float *)out_v + at, r,                                   \
                                   sizeof(float) * (size_t)(group * dim));                   \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            free(scores);                                                                    \
            free(acc);                                                                       \
            free(qs);                                                                        \
            free(res);                                                                       \
            free(block);                                                                     \
            free(zeros);                                                                     \
        }                                                                                    \
        free(first);                                                                         \
    }

DECODE(decode_attention_f32, float, task_f32, blocked_any_f32, MULTI_F32)
DECODE(decode_attention_bf16, uint16_t, task_bf16, blocked_any_bf16, MULTI_BF16)
