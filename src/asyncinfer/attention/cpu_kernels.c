/* CPU kernels of the torch attention backend, compiled at first use for this CPU
 * (asyncinfer.attention.native): decode attention that reads K and V where they lie in the
 * paged pool, through the page table, instead of gathering every request's prefix first.
 *
 * One task per (request, KV head): the query heads that share that KV head are scored
 * against each key as it is read (one load of K and V serves the whole group), with a
 * two-pass softmax in float32. Tasks are independent, so a request's output does not
 * depend on what shares its batch. Built with -march of this CPU: AVX2 or AVX-512 code
 * comes from the same source; the common head sizes (64, 128) get loops of a fixed length,
 * which the compiler unrolls into straight vector code.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* exp(x) for x <= 0 (scores minus their maximum), as Cephes' expf: x = n ln2 + r, then a
 * degree-6 polynomial in r, scaled by 2^n; within 2 ulp, and written so that loops over
 * it vectorize (libm's expf is a call per element). */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

INLINE void load_f32(const float *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = src[i];
}

INLINE void load_bf16(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        union { uint32_t u; float f; } c;
        c.u = (uint32_t)src[i] << 16;
        dst[i] = c.f;
    }
}

/* The softmax of each head's scores [group][len], in place. */
INLINE void softmax_rows(float *scores, int64_t group, int64_t len) {
    for (int64_t h = 0; h < group; h++) {
        float *sh = scores + h * len;
        float top = sh[0];
#pragma omp simd reduction(max : top)
        for (int64_t j = 1; j < len; j++) top = sh[j] > top ? sh[j] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            sh[j] = exp_nonpositive(sh[j] - top);
            sum += sh[j];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t j = 0; j < len; j++) sh[j] *= inv;
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

/* q [batch, heads, dim] float32; pools [slots, kv_heads, dim]; table [*, width] int64 slot
 * of each position; rows, lens [batch]; out [batch, heads, dim] float32. */
#define DECODE(NAME, KV_T, TASK_FN)                                                          \
    void NAME(const float *q, const KV_T *k_pool, const KV_T *v_pool, const int64_t *table,  \
              int64_t width, const int64_t *rows, const int64_t *lens, float *out,           \
              int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale,      \
              int64_t max_len, int threads) {                                                \
        const int64_t group = heads / kv_heads, stride = kv_heads * dim;                     \
        _Pragma("omp parallel num_threads(threads)") {                                       \
            float *scores = malloc(sizeof(float) * (size_t)(group * max_len));               \
            float *acc = malloc(sizeof(float) * (size_t)(group * dim));                      \
            float *qs = malloc(sizeof(float) * (size_t)(group * dim));                       \
            _Pragma("omp for collapse(2) schedule(dynamic, 1)")                              \
            for (int64_t b = 0; b < batch; b++) {                                            \
                for (int64_t g = 0; g < kv_heads; g++) {                                     \
                    const float *qb = q + (b * heads + g * group) * dim;                     \
                    for (int64_t i = 0; i < group * dim; i++) qs[i] = qb[i];                 \
                    const KV_T *k = k_pool + g * dim, *v = v_pool + g * dim;                 \
                    const int64_t *slots = table + rows[b] * width;                          \
                    float *ob = out + (b * heads + g * group) * dim;                         \
                    if (dim == 64)                                                           \
                        TASK_FN(qs, k, v, slots, lens[b], stride, group, 64, scale, scores, acc,    \
                                ob);                                                         \
                    else if (dim == 128)                                                     \
                        TASK_FN(qs, k, v, slots, lens[b], stride, group, 128, scale, scores, acc,   \
                                ob);                                                         \
                    else                                                                     \
                        TASK_FN(qs, k, v, slots, lens[b], stride, group, dim, scale, scores, acc,   \
                                ob);                                                         \
                }                                                                            \
            }                                                                                \
            free(scores);                                                                    \
            free(acc);                                                                       \
            free(qs);                                                                        \
        }                                                                                    \
    }

DECODE(decode_attention_f32, float, task_f32)
DECODE(decode_attention_bf16, uint16_t, task_bf16)
