/* AVX-512 with VNNI: quant_scalar.c's results bit for bit. A row group's 16 rows in one register, a
 * row a 32-bit lane: four codes of each row, the activations' four codes broadcast, vpdpbusd adds their
 * products into each row's lane. Activations are quantized by the AVX2 code (every such CPU has AVX2). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#include "kernels.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* the group's 16 float16 scales */
ALWAYS_INLINE __m512 scales16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* acc += the rows' scales dw times the activation's, times the block's integer sums */
ALWAYS_INLINE __m512 block_acc(__m512 dw, float dx, __m512i sumi, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(sumi), acc);
}

ALWAYS_INLINE __m512i bcast(const int8_t *p) { return _mm512_set1_epi32(read_i32(p)); }

/* Q4_0 (the layout of quant_avx2.c's q4_0_group): unsigned nibbles times signed activations, less 8 x
 * the activations' block sum */
ALWAYS_INLINE void q4_0_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 18, *qs = blk + ROW_GROUP * 2;
        const __m512 dw = scales16(blk);
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qs + c * 64));
            lo[c] = _mm512_and_si512(raw, m4);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].qs + b * QK8;
            __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                sl = _mm512_dpbusd_epi32(sl, lo[c], bcast(xq + 4 * c));
                sh = _mm512_dpbusd_epi32(sh, hi[c], bcast(xq + 16 + 4 * c));
            }
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(sl, sh), _mm512_set1_epi32(8 * x[t].sums[b]));
            acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* Q8_0: signed codes made unsigned (w + 128, by flipping the top bit), the product with the activations
 * less 128 x their block sum */
ALWAYS_INLINE void q8_0_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m512i top = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 34, *qs = blk + ROW_GROUP * 2;
        const __m512 dw = scales16(blk);
        __m512i w[8];
        for (int c = 0; c < 8; c++)
            w[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qs + c * 64)), top);
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].qs + b * QK8;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[c], bcast(xq + 4 * c));
                s1 = _mm512_dpbusd_epi32(s1, w[c + 1], bcast(xq + 4 * c + 4));
            }
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * x[t].sums[b]));
            acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

DEFINE_TILE(dot_q4_0, q4_0_group, 0)
DEFINE_TILE(dot_q8_0, q8_0_group, 1)

const KernelTable kernels_avx512 = {"avx512", {dot_q4_0, dot_q8_0}, {quantize_q8_0_avx2}};
