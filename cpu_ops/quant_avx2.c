/* AVX2 (with FMA and F16C): quant_scalar.c's results bit for bit. A row group's 16 rows go as two
 * halves of 8, one row a 32-bit lane: four codes of each of 8 rows in one register, the activations'
 * four codes broadcast, maddubs and madd their products into each row's lane. */
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

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* a half's 8 float16 scales */
ALWAYS_INLINE __m256 scales8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* acc += the rows' scales dw times the activation's, times the block's integer sums */
ALWAYS_INLINE __m256 block_acc(__m256 dw, float dx, __m256i sumi, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(sumi), acc);
}

/* Q4_0: per block, 16 rows' float16 d (32 bytes), then 4 chunks of 64 bytes (4 code bytes of each of 16
 * rows: elements 4c..4c+3 low, 16+4c.. high). Nibble products summed in 16 bits: 8 of 2 x 15 x 127. */
ALWAYS_INLINE void q4_0_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 18, *qs = blk + ROW_GROUP * 2 + half * 32;
            const __m256 dw = scales8(blk + half * 16);
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + c * 64));
                lo[c] = _mm256_and_si256(raw, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK8;
                __m256i s16 = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(read_i32(xq + 4 * c))));
                    s16 = _mm256_add_epi16(s16,
                                           _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(read_i32(xq + 16 + 4 * c))));
                }
                __m256i s = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(8 * x[t].sums[b]));
                acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

/* Q8_0: per block, 16 rows' float16 d, then 8 chunks of 64 bytes (codes 4c..4c+3 of each row); signed
 * codes by maddubs of |w| and x with w's sign (|products| <= 128 x 127, two to a 16-bit lane) */
ALWAYS_INLINE void q8_0_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 34, *qs = blk + ROW_GROUP * 2 + half * 32;
            const __m256 dw = scales8(blk + half * 16);
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK8;
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + c * 64));
                    const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(read_i32(xq + 4 * c)), w);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), xv), ones));
                }
                acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

DEFINE_TILE(dot_q4_0, q4_0_group, 0)
DEFINE_TILE(dot_q8_0, q8_0_group, 1)

const KernelTable kernels_avx2 = {"avx2", {dot_q4_0, dot_q8_0}, {quantize_q8_0_avx2}};
