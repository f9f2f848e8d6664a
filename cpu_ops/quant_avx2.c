/* AVX2 (with FMA and F16C): quant_scalar.c's results bit for bit, four rows at a time. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include "kernels.h"

void quantize_q8_0_avx2(const float *x, size_t k, ActRow *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (size_t b = 0; b < k / QK8; b++) {
        const float *xb = x + b * QK8;
        if (!block_finite(xb)) {
            nan_block(y, b);
            continue;
        }
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4), d, id;
        q8_scales(amax, &d, &id);
        const __m256 mul = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT |
                                                                                    _MM_FROUND_NO_EXC));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(y->qs + b * QK8), p);
        y->d[b] = d;
        y->sums[b] = _mm_cvtsi128_si32(s4);
    }
}

/* the four rows' 8-lane partial sums, summed per row: [row0, row1, row2, row3] */
static inline __m128i sum4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128 scales4(const uint8_t *b0, const uint8_t *b1, const uint8_t *b2, const uint8_t *b3) {
    uint16_t h[8] = {0};
    memcpy(h, b0, 2), memcpy(h + 1, b1, 2), memcpy(h + 2, b2, 2), memcpy(h + 3, b3, 2);
    return _mm_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

static inline __m256i q4_0_codes(const uint8_t *qs) {
    const __m128i m4 = _mm_set1_epi8(0x0f), raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

static inline __m256i dot32_u8s8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
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
            __m128i s = sum4(dot32_u8s8(q4_0_codes(b0 + 2), xv), dot32_u8s8(q4_0_codes(b1 + 2), xv),
                             dot32_u8s8(q4_0_codes(b2 + 2), xv), dot32_u8s8(q4_0_codes(b3 + 2), xv));
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
    return dot32_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
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

const KernelTable kernels_avx2 = {"avx2", {dot_q4_0, dot_q8_0}, {quantize_q8_0_avx2}};
