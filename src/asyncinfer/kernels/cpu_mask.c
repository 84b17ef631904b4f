/* Structured output's mask: each constrained row's logits set to -inf wherever its token
 * bitmask (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j) has a
 * clear bit. A grammar allows few tokens in most states, so nearly every word is zero: a
 * whole word is one masked store of 32 values (AVX-512), else a run of plain stores. */

#include "cpu_common.h"

#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static const uint32_t NEG_INF_F32 = 0xff800000u;
static const uint16_t NEG_INF_BF16 = 0xff80u;

INLINE void mask_row_f32(float *row, const uint32_t *bits, int64_t vocab) {
    float neg_inf;
    memcpy(&neg_inf, &NEG_INF_F32, sizeof neg_inf);
    const int64_t whole = vocab / 32;
    for (int64_t w = 0; w < whole; w++) {
        const uint32_t clear = ~bits[w];
        if (!clear) continue;
        float *at = row + 32 * w;
#if defined(__AVX512F__)
        const __m512 fill = _mm512_set1_ps(neg_inf);
        _mm512_mask_storeu_ps(at, (__mmask16)(clear & 0xffffu), fill);
        _mm512_mask_storeu_ps(at + 16, (__mmask16)(clear >> 16), fill);
#else
        if (clear == 0xffffffffu) {
            for (int j = 0; j < 32; j++) at[j] = neg_inf;
        } else {
            for (uint32_t m = clear; m; m &= m - 1) at[__builtin_ctz(m)] = neg_inf;
        }
#endif
    }
    for (int64_t t = whole * 32; t < vocab; t++)
        if (!((bits[t / 32] >> (t % 32)) & 1u)) row[t] = neg_inf;
}

INLINE void mask_row_bf16(bf16 *row, const uint32_t *bits, int64_t vocab) {
    const int64_t whole = vocab / 32;
    for (int64_t w = 0; w < whole; w++) {
        const uint32_t clear = ~bits[w];
        if (!clear) continue;
        bf16 *at = row + 32 * w;
#if defined(__AVX512BW__)
        _mm512_mask_storeu_epi16(at, (__mmask32)clear, _mm512_set1_epi16((short)NEG_INF_BF16));
#else
        if (clear == 0xffffffffu) {
            for (int j = 0; j < 32; j++) at[j] = NEG_INF_BF16;
        } else {
            for (uint32_t m = clear; m; m &= m - 1) at[__builtin_ctz(m)] = NEG_INF_BF16;
        }
#endif
    }
    for (int64_t t = whole * 32; t < vocab; t++)
        if (!((bits[t / 32] >> (t % 32)) & 1u)) row[t] = NEG_INF_BF16;
}

/* For each of the n rows rows[i] of logits (row r at logits + r * stride, float32 or, with
 * is_bf16, bfloat16): its first vocab values masked by bitmask row rows[i] (words_per_row
 * int32 words a row). Rows are split over the threads. */
void mask_rows(void *logits, int64_t stride, int64_t vocab, const int32_t *bitmask,
               int64_t words_per_row, const int64_t *rows, int64_t n, int is_bf16,
               int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *bits = (const uint32_t *)(bitmask + rows[i] * words_per_row);
        if (is_bf16)
            mask_row_bf16((bf16 *)logits + rows[i] * stride, bits, vocab);
        else
            mask_row_f32((float *)logits + rows[i] * stride, bits, vocab);
    }
}
