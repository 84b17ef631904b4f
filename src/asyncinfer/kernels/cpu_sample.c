/* The sampler's token choice on a CPU, one pass over each row of logits: the greedy argmax,
 * and the Gumbel-max race of asyncinfer.engine.sampler (``race``, ``gumbel_noise``), whose
 * eager torch code makes about twenty passes over [rows, vocab] int64 and float32 tensors
 * (the hash, two logarithms, the sum, the argmax), a third of a CPU decode step at 49k
 * tokens of vocabulary.
 *
 * The noise is the sampler's, bit for bit up to the logarithms: column c of a row with key
 * (hi, lo) hashes ((c + lo) mod 2^32) through lowbias32, xors hi, hashes again, keeps the
 * top 23 bits u, and takes -log(-log((u + 0.5) / 2^23)). The hash and the uniform are exact
 * integer and float32 steps; the logarithm is Cephes' logf (within an ulp or two of
 * libm's and torch's), so a row's token differs from torch's only where two noisy scores
 * lie within a few ulps of each other. Ties go to the first index and a NaN logit wins,
 * as torch.argmax. Rows are split over the threads; a row's result never depends on
 * another's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

typedef int32_t vi32 __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));

/* Sixteen lanes' largest values ``top`` and where they were ``at`` merged with the ``n`` -
 * ``body`` tail values of row past ``body``: the first index of the largest. */
INLINE int64_t merge_lanes(vf top, vi32 at, const float *tail, int64_t body, int64_t n) {
    float lanes[16];
    int32_t where[16];
    memcpy(lanes, &top, sizeof lanes);
    memcpy(where, &at, sizeof where);
    int64_t best = 0;
    float value = body ? lanes[0] : tail[0];
    if (body)
        for (int j = 1; j < 16; j++)
            if (lanes[j] > value || (lanes[j] == value && where[j] < where[best])) {
                value = lanes[j];
                best = j;
            }
    int64_t index = body ? where[best] : 0;
    for (int64_t i = body; i < n; i++)
        if (tail[i - body] > value) {
            value = tail[i - body];
            index = i;
        }
    return index;
}

INLINE int64_t first_nan(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (row[i] != row[i]) return i;
    return -1;
}

INLINE int any_lane(vi32 x) {
    int32_t lanes[16];
    memcpy(lanes, &x, sizeof lanes);
    int any = 0;
    for (int j = 0; j < 16; j++) any |= lanes[j];
    return any;
}

/* The first index of row's largest value, or of its first NaN, as torch.argmax. Sixteen
 * lanes keep their own largest value and where it was (strictly larger replaces, so each
 * keeps its first); the lanes are then merged, the smallest index among equal values
 * winning. A row with a NaN is scanned again, one value at a time. */
INLINE int64_t argmax_row(const float *row, int64_t n) {
    const int64_t body = n / 16 * 16;
    vf top = {0}, v;
    vi32 at = {0}, pos = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vi32 nan = {0};
    top -= INFINITY;
    for (int64_t i = 0; i < body; i += 16) {
        memcpy(&v, row + i, sizeof v);
        const vi32 more = v > top;
        top = (vf)(((vi32)v & more) | ((vi32)top & ~more));
        at = (pos & more) | (at & ~more);
        nan |= v != v;
        pos += 16;
    }
    const int64_t index = merge_lanes(top, at, row + body, body, n);
    int tail_nan = 0;
    for (int64_t i = body; i < n; i++) tail_nan |= row[i] != row[i];
    return any_lane(nan) || tail_nan ? first_nan(row, n) : index;
}

/* The index of each row's largest value, x [rows, n] float32 -> out [rows]: the first one
 * among equals, and the first NaN if a row has one, as torch.argmax. A greedy batch's
 * sampling is this one pass; torch's argmax runs each row on one thread. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

/* lowbias32: a bijective 32-bit mixer (the sampler's ``_hash32``). */
INLINE vu32 hash32(vu32 x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* log(x) for normal x > 0, as Cephes' logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a
 * degree-9 polynomial in m - 1. */
INLINE vf log_positive(vf x) {
    const vi32 bits = (vi32)x;
    vi32 e = ((bits >> 23) & 0xff) - 126;                   /* x = m 2^e, m in [1/2, 1) */
    vf m = (vf)((bits & 0x007fffff) | 0x3f000000);
    const vi32 low = m < 0.707106781186547524f;              /* then m = 2m, e = e - 1 */
    e += low;
    m = m + (vf)((vi32)m & low) - 1.0f;
    const vf z = m * m;
    vf y = 7.0376836292e-2f * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const vf fe = __builtin_convertvector(e, vf);
    y += -2.12194440e-4f * fe;
    y += -0.5f * z;
    return m + y + 0.693359375f * fe;
}

/* The Gumbel noise of columns c0 .. c0 + 15 of a row keyed (hi, lo). */
INLINE vf noise16(uint32_t c0, uint32_t lo, uint32_t hi) {
    const vu32 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vu32 bits = hash32(hash32(lane + (c0 + lo)) ^ hi);
    const vf uniform = (__builtin_convertvector(bits >> 9, vf) + 0.5f) * (1.0f / (1 << 23));
    return -log_positive(-log_positive(uniform));
}

/* Row's noise [n] into out: the sampler's ``gumbel_noise`` of one key. */
INLINE void noise_row(int64_t key, int64_t n, float *out) {
    const uint32_t lo = (uint32_t)key, hi = (uint32_t)((uint64_t)key >> 32);
    for (int64_t c = 0; c < n; c += 16) {
        const vf g = noise16((uint32_t)c, lo, hi);
        if (c + 16 <= n)
            memcpy(out + c, &g, sizeof g);
        else
            memcpy(out + c, &g, sizeof(float) * (size_t)(n - c));
    }
}

/* argmax(row * inv_t + noise), the first index among equals; a NaN logit wins. */
INLINE int64_t race_row(const float *row, int64_t n, float inv_t, int64_t key) {
    const uint32_t lo = (uint32_t)key, hi = (uint32_t)((uint64_t)key >> 32);
    const int64_t body = n / 16 * 16;
    vf top = {0}, v;
    vi32 at = {0}, pos = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vi32 nan = {0};
    top -= INFINITY;
    for (int64_t i = 0; i < body; i += 16) {
        memcpy(&v, row + i, sizeof v);
        nan |= v != v;
        const vf scaled = v * inv_t;
        v = scaled + noise16((uint32_t)i, lo, hi);
        const vi32 more = v > top;
        top = (vf)(((vi32)v & more) | ((vi32)top & ~more));
        at = (pos & more) | (at & ~more);
        pos += 16;
    }
    float tail[16];
    int tail_nan = 0;
    if (body < n) {
        const vf g = noise16((uint32_t)body, lo, hi);
        float noise[16];
        memcpy(noise, &g, sizeof noise);
        for (int64_t i = body; i < n; i++) {
            tail_nan |= row[i] != row[i];
            const float scaled = row[i] * inv_t;
            tail[i - body] = scaled + noise[i - body];
        }
    }
    if (any_lane(nan) || tail_nan) return first_nan(row, n);
    return merge_lanes(top, at, tail, body, n);
}

/* The sampler's ``race`` over x [rows, n] float32: row r's token argmax(x[r] * inv_t[r] +
 * noise(keys[r])), or its argmax where inv_t[r] is 0 (greedy). */
void race_rows_f32(const float *x, int64_t rows, int64_t n, const float *inv_t,
                   const int64_t *keys, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        out[r] = inv_t[r] == 0.0f ? argmax_row(x + r * n, n)
                                  : race_row(x + r * n, n, inv_t[r], keys[r]);
}

/* The sampler's ``gumbel_noise``: out [rows, n] float32, row r's noise of keys[r]. */
void gumbel_rows_f32(const int64_t *keys, int64_t rows, int64_t n, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) noise_row(keys[r], n, out + r * n);
}
