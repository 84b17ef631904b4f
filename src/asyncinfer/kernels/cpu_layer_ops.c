/* The elementwise work between a decoder layer's matrix products, for bfloat16 activations
 * on a CPU: the same functions as asyncinfer.layers.fused, each one pass over its rows
 * instead of the eight to fifteen torch ops (each with its own pass, allocation and thread
 * barrier) that the eager code runs.
 *
 * Each function rounds where torch's eager bfloat16 code rounds, so the results are
 * torch's, bit for bit, except where a float32 sum of squares or an exp is computed in
 * another order (RMSNorm's mean, SiLU): there they differ from torch's by at most a unit
 * in the last place of the bfloat16 result, rarely. Those sums run over GCC's generic
 * 16-float vectors and end in a fixed order, so the AVX2 and the AVX-512 builds of this
 * source give the same bits. Row counts are split over torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* The sum of squares of x[0..n) (n a multiple of 16), in a fixed order: sixteen lanes, then
 * the lanes summed as a tree. */
INLINE float sum_squares(const float *x, int64_t n) {
    vf acc = {0};
    for (int64_t i = 0; i < n; i += 16) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        acc += v * v;
    }
    float lanes[16];
    memcpy(lanes, &acc, sizeof lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* RMSNorm of one row held in float32 ``h`` [n]: out = w * bf16(h * rsqrt(mean(h^2) + eps)),
 * as torch computes ``weight * (h * torch.rsqrt(var + eps)).to(bf16)``. */
INLINE void norm_row(const float *h, const bf16 *w, int64_t n, float eps, bf16 *out) {
    const float scale = 1.0f / sqrtf(sum_squares(h, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(h[i] * scale)));
}

/* rows x [rows, n] (row stride ``x_stride``), weight [n]: out [rows, n] = RMSNorm(x). With
 * ``residual`` [rows, n] not NULL, first r = bf16(residual + x), written to ``res_out``,
 * and the norm is of r (the residual connection fused with the norm after it). */
void add_rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *w,
                       int64_t rows, int64_t n, float eps, bf16 *out, bf16 *res_out,
                       int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float h[n];
        const bf16 *xr = x + r * x_stride;
        if (residual != NULL) {
            const bf16 *rr = residual + r * n;
            bf16 *ro = res_out + r * n;
            for (int64_t i = 0; i < n; i++) {
                ro[i] = to_bf16(from_bf16(xr[i]) + from_bf16(rr[i]));
                h[i] = from_bf16(ro[i]);
            }
        } else {
            for (int64_t i = 0; i < n; i++) h[i] = from_bf16(xr[i]);
        }
        norm_row(h, w, n, eps, out + r * n);
    }
}

/* exp(x) over float32's range (see silu_mul_bf16 for why min and max). */
INLINE float exp_any(float x) {
    return exp_clamped(__builtin_fmaxf(__builtin_fminf(x, 88.0f), -87.0f));
}

/* SwiGLU's activation of gate_up [rows, 2n]: out [rows, n] = bf16(bf16(silu(gate)) * up).
 *
 * exp clamps its argument with min and max instructions, which GCC emits only for finite
 * math: with a comparison and a select instead, it gives each clamped end of the range its
 * own division by a constant (x / (1 + e^88)) for every lane, those quotients are
 * subnormal, each such division takes a microcode assist, and the loop ran four times
 * slower. (Finite math also drops to_bf16's NaN test here: a NaN gate gives garbage, not
 * a NaN.) */
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
void silu_mul_bf16(const bf16 *gate_up, int64_t rows, int64_t n, bf16 *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = gate_up + r * 2 * n, *u = g + n;
        bf16 *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float x = from_bf16(g[i]);
            const float s = from_bf16(to_bf16(x / (1.0f + exp_any(-x))));
            o[i] = to_bf16(s * from_bf16(u[i]));
        }
    }
}

/* One head [dim] rotated as ``x * cos + rotate_half(x) * sin``, each product and the sum
 * rounded to bfloat16 as torch's three ops round them; ``x`` holds float32 values of
 * bfloat16 numbers (a norm's output, or the projection's). */
INLINE void rope_head(const float *x, const bf16 *cos, const bf16 *sin, int64_t dim,
                      bf16 *out) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        const float rot = i < half ? -x[i + half] : x[i - half];
        const float a = from_bf16(to_bf16(x[i] * from_bf16(cos[i])));
        const float b = from_bf16(to_bf16(rot * from_bf16(sin[i])));
        out[i] = to_bf16(a + b);
    }
}

/* Head ``src`` [dim] into float32 ``h``, through Qwen3's per-head RMSNorm when ``w`` is not
 * NULL (rounded to bfloat16, as the norm's output is). */
INLINE void load_head(const bf16 *src, const bf16 *w, int64_t dim, float eps, float *h) {
    for (int64_t i = 0; i < dim; i++) h[i] = from_bf16(src[i]);
    if (w == NULL) return;
    bf16 normed[dim];
    norm_row(h, w, dim, eps, normed);
    for (int64_t i = 0; i < dim; i++) h[i] = from_bf16(normed[i]);
}

/* The fused qkv product [rows, (heads + 2 kv_heads) dim] to q [rows, heads, dim] and k
 * [rows, kv_heads, dim], normed per head when q_w/k_w are given and rotated by cos/sin
 * [rows, dim]; k and v are also written to their ``slots`` of the layer's caches [slots,
 * kv_heads, dim] (bfloat16, or float32 when ``f32_cache``). */
void qk_norm_rope_store_bf16(const bf16 *qkv, const bf16 *cos, const bf16 *sin,
                             const bf16 *q_w, const bf16 *k_w, float eps, int64_t rows,
                             int64_t heads, int64_t kv_heads, int64_t dim, bf16 *q_out,
                             bf16 *k_out, void *k_cache, void *v_cache, const int64_t *slots,
                             int f32_cache, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, kv = kv_heads * dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float h[dim];
        const bf16 *row = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t i = 0; i < heads; i++) {
            load_head(row + i * dim, q_w, dim, eps, h);
            rope_head(h, c, s, dim, q_out + (r * heads + i) * dim);
        }
        for (int64_t i = 0; i < kv_heads; i++) {
            load_head(row + (heads + i) * dim, k_w, dim, eps, h);
            rope_head(h, c, s, dim, k_out + (r * kv_heads + i) * dim);
        }
        const bf16 *k = k_out + r * kv, *v = row + heads * dim + kv;
        if (f32_cache) {
            float *kc = (float *)k_cache + slots[r] * kv, *vc = (float *)v_cache + slots[r] * kv;
            for (int64_t i = 0; i < kv; i++) {
                kc[i] = from_bf16(k[i]);
                vc[i] = from_bf16(v[i]);
            }
        } else {
            memcpy((bf16 *)k_cache + slots[r] * kv, k, sizeof(bf16) * (size_t)kv);
            memcpy((bf16 *)v_cache + slots[r] * kv, v, sizeof(bf16) * (size_t)kv);
        }
    }
}
