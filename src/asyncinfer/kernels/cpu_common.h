/* What the CPU kernels' sources share (asyncinfer.kernels.cpu compiles them together). */
#ifndef ASYNCINFER_CPU_COMMON_H
#define ASYNCINFER_CPU_COMMON_H

#include <math.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

typedef uint16_t bf16;

INLINE float from_bf16(bf16 x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* float32 to bfloat16, rounding to nearest even (NaN stays a quiet NaN), as torch does. */
INLINE bf16 to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if (f != f) return 0x7fc0;
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <string.h>

/* Configures this thread's AMX tiles as the kernels use them: eight tiles (palette 1) of 16
 * rows by 64 bytes (16 bf16 pairs, or 16 floats, a row). */
INLINE void amx_configure(void) {
    struct {
        uint8_t palette, start_row;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values at p (any alignment) widened to float32, exactly. */
INLINE __m512 widen16_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
#endif

/* GCC's generic vector of 16 floats: one AVX-512 register, or two AVX2 ones. */
typedef float vf __attribute__((vector_size(64)));

/* exp(x) for x already clamped to [-87, 88], as Cephes' expf: x = k ln2 + f, a degree-6
 * polynomial in f, scaled by 2^k; within 2 ulp, and written so that loops over it
 * vectorize (libm's expf is a call per element). Callers clamp as their range allows. */
INLINE float exp_clamped(float x) {
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * s.f;
}

#endif
