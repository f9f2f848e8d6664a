/* AVX-512 with VNNI (vpdpbusd on 256-bit registers, AVX512VL): quant_scalar.c's results bit for bit,
 * four rows at a time. Activations are quantized by the AVX2 code (every such CPU has AVX2). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#include "kernels.h"

static inline __m128i sum4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128 scales4(const uint8_t *b0, const uint8_t *b1, const uint8_t *b2, const uint8_t *b3) {
    uint16_t h[8] = {0};
    memcpy(h, b0, 2), memcpy(h + 1, b1, 2), memcpy(h + 2, b2, 2), memcpy(h + 3, b3, 2);
    return _mm_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

static inline __m256i q4_0_dot(const uint8_t *qs, __m256i x) {
    const __m128i m4 = _mm_set1_epi8(0x0f), raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

static void dot_q4_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, const ActRow *x, size_t n_blocks,
                     float *out) {
    size_t r = 0;
    for (; r + 4 <= n_rows; r += 4) {
        const uint8_t *w = rows + r * row_bytes;
        __m128 acc = _mm_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->qs + b * QK8));
            const uint8_t *b0 = w + b * 18, *b1 = b0 + row_bytes, *b2 = b1 + row_bytes, *b3 = b2 + row_bytes;
            __m128i s = sum4(q4_0_dot(b0 + 2, xv), q4_0_dot(b1 + 2, xv), q4_0_dot(b2 + 2, xv), q4_0_dot(b3 + 2, xv));
            s = _mm_sub_epi32(s, _mm_set1_epi32(8 * x->sums[b]));
            __m128 d = _mm_mul_ps(scales4(b0, b1, b2, b3), _mm_set1_ps(x->d[b]));
            acc = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s), acc);
        }
        _mm_storeu_ps(out + r, acc);
    }
    if (r < n_rows)
        kernels_scalar.dot[0](rows + r * row_bytes, row_bytes, n_rows - r, x, n_blocks, out + r);
}

static inline __m256i q8_dot(const uint8_t *qs, __m256i xv) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)qs);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
}

static void dot_q8_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, const ActRow *x, size_t n_blocks,
                     float *out) {
    size_t r = 0;
    for (; r + 4 <= n_rows; r += 4) {
        const uint8_t *w = rows + r * row_bytes;
        __m128 acc = _mm_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->qs + b * QK8));
            const uint8_t *b0 = w + b * 34, *b1 = b0 + row_bytes, *b2 = b1 + row_bytes, *b3 = b2 + row_bytes;
            __m128i s = sum4(q8_dot(b0 + 2, xv), q8_dot(b1 + 2, xv), q8_dot(b2 + 2, xv), q8_dot(b3 + 2, xv));
            __m128 d = _mm_mul_ps(scales4(b0, b1, b2, b3), _mm_set1_ps(x->d[b]));
            acc = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s), acc);
        }
        _mm_storeu_ps(out + r, acc);
    }
    if (r < n_rows)
        kernels_scalar.dot[1](rows + r * row_bytes, row_bytes, n_rows - r, x, n_blocks, out + r);
}

const KernelTable kernels_avx512 = {"avx512", {dot_q4_0, dot_q8_0}, {quantize_q8_0_avx2}};
