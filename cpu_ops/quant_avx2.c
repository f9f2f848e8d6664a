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

/* quant_scalar.c's quantize_q8_k: the value of largest magnitude found by vector, its first index by a
 * scan, the codes rounded to nearest even as nearbyintf does */
void quantize_q8_k_avx2(const float *x, size_t k, ActRow *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i cap = _mm256_set1_epi32(127), ones = _mm256_set1_epi16(1);
    for (size_t b = 0; b < k / QK_K; b++) {
        const float *xb = x + b * QK_K;
        int8_t *qs = y->qs + b * QK_K;
        int32_t *sums = y->sums + b * (QK_K / 16);
        int finite = 1;
        for (int j = 0; j < QK_K; j += QK8)
            finite &= block_finite(xb + j);
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (!finite || amax == 0.0f) {
            memset(qs, 0, QK_K);
            memset(sums, 0, QK_K / 16 * sizeof(int32_t));
            y->d[b] = finite ? 0.0f : __builtin_nanf("");
            continue;
        }
        int first = 0;
        while (__builtin_fabsf(xb[first]) != amax)
            first++;
        const float iscale = -127.0f / xb[first];
        const __m256 mul = _mm256_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 32) {
            __m256i q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_min_epi32(
                    _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * i), mul),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                    cap);
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qs + j), p);
        }
        for (int s = 0; s < QK_K / 16; s++) {
            __m256i w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * s))), ones);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            sums[s] = _mm_cvtsi128_si32(s4);
        }
        y->d[b] = 1.0f / iscale;
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

/* ---- K-quants: a super-block of 256 elements against Q8_K activations --------------------------------
 * As quant_avx512.c, a half of 8 rows at a time: its codes of one super-block unpacked once into
 * codes[e / 4]; the products summed in 16 bits (no more than the lane holds) and scaled by madd with
 * each row's sub-block scale in both 16-bit halves of its lane. */

/* byte c of each of the half's 8 rows (a packed-scale segment at p, the half's first row at p),
 * zero- or sign-extended to int32 lanes */
ALWAYS_INLINE __m256i byte_lanes(const uint8_t *p, int c) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + ROW_GROUP * c)));
}
ALWAYS_INLINE __m256i signed_byte_lanes(const uint8_t *p, int c) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + ROW_GROUP * c)));
}

/* two 16-bit values in each 32-bit lane (lo, hi): for madd */
ALWAYS_INLINE __m256i pair16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}
static inline int32_t pair_of(int32_t lo, int32_t hi) { return (int32_t)(((uint32_t)hi << 16) | (uint16_t)lo); }

/* chunk c of a code segment at p, the half's 8 rows */
ALWAYS_INLINE __m256i load_chunk(const uint8_t *p, int c) { return _mm256_loadu_si256((const __m256i *)(p + 64 * c)); }

/* the 16-bit sums over chunks [c0, c0 + n) of codes . the activations' four codes there */
ALWAYS_INLINE __m256i chunk_dots16(const __m256i *codes, const int8_t *xq, int c0, int n) {
    __m256i s = _mm256_maddubs_epi16(codes[c0], _mm256_set1_epi32(read_i32(xq + 4 * c0)));
    for (int c = c0 + 1; c < c0 + n; c++)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(codes[c], _mm256_set1_epi32(read_i32(xq + 4 * c))));
    return s;
}

/* Q4_K and Q5_K (quant_avx512.c's layouts), a sub-block at a time in registers for every token of the
 * tile; products summed in 16 bits four chunks at a time (4 x 2 x 31 x 127), scaled by madd */
ALWAYS_INLINE void affine_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                  size_t first, int size, int with_qh) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m6 = _mm256_set1_epi32(63), one = _mm256_set1_epi8(1);
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        __m256i sumi[TILE_TOKENS], sc[8], mp[4];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * (size_t)size, *scales = blk + 64 + 8 * half;
            const uint8_t *qh = blk + 256 + 32 * half, *qs = (with_qh ? blk + 768 : blk + 256) + 32 * half;
            const __m256 d = scales8(blk + 16 * half), dmin = scales8(blk + 32 + 16 * half);
            __m256i q[12], mn[8];
            for (int c = 0; c < 12; c++)
                q[c] = byte_lanes(scales, c);
            for (int j = 0; j < 4; j++) {
                const __m256i s6 = _mm256_and_si256(q[j], m6);
                sc[j] = _mm256_or_si256(s6, _mm256_slli_epi32(s6, 16));
                mn[j] = _mm256_and_si256(q[j + 4], m6);
                const __m256i s4 = _mm256_or_si256(_mm256_and_si256(q[j + 8], _mm256_set1_epi32(0x0f)),
                                                   _mm256_slli_epi32(_mm256_srli_epi32(q[j], 6), 4));
                sc[j + 4] = _mm256_or_si256(s4, _mm256_slli_epi32(s4, 16));
                mn[j + 4] = _mm256_or_si256(_mm256_srli_epi32(q[j + 8], 4),
                                            _mm256_slli_epi32(_mm256_srli_epi32(q[j + 4], 6), 4));
            }
            for (int i = 0; i < 4; i++)
                mp[i] = pair16(mn[2 * i], mn[2 * i + 1]);
            for (int t = 0; t < nt; t++)
                sumi[t] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) { /* sub-block j: 8 chunks, elements 32 j + 4c.. */
                __m256i codes[8];
                for (int c = 0; c < 8; c++) {
                    const __m256i raw = load_chunk(qs, 8 * (j / 2) + c);
                    codes[c] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, m4);
                    if (with_qh) /* bit j of qh chunk c */
                        codes[c] = _mm256_or_si256(
                            codes[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load_chunk(qh, c), j), one), 4));
                }
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 32 * j;
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(chunk_dots16(codes, xq, 0, 4), sc[j]));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(chunk_dots16(codes, xq, 4, 4), sc[j]));
                }
            }
            for (int t = 0; t < nt; t++) {
                const int32_t *bs = x[t].sums + b * (QK_K / 16);
                __m256i summ = _mm256_setzero_si256();
                for (int i = 0; i < 4; i++)
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mp[i], _mm256_set1_epi32(pair_of(
                                                      bs[4 * i] + bs[4 * i + 1], bs[4 * i + 2] + bs[4 * i + 3]))));
                const __m256 dx = _mm256_set1_ps(x[t].d[b]);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(summ), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

ALWAYS_INLINE void q4_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    affine_k_group(group, n_blocks, x, nt, out, first, 144, 0);
}
ALWAYS_INLINE void q5_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    affine_k_group(group, n_blocks, x, nt, out, first, 176, 1);
}

/* Q6_K (quant_avx512.c's layout, its passes read in order); 2 products of 2 x 63 x 127 to a 16-bit
 * lane, so a sub-block's four chunks in two sums. A super-block's codes are staged through memory
 * (16 AVX2 registers hold no sub-block with its tokens' sums): inside ONNX Runtime the register form
 * measured 1.2-1.3x slower */
ALWAYS_INLINE void q6_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        __m256i codes[64], sc[16], sp[8];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 210, *scales = blk + 32 + 8 * half;
            const __m256 d = scales8(blk + 16 * half);
            for (int s = 0; s < 16; s++) {
                const __m256i v = signed_byte_lanes(scales, s);
                sc[s] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
            }
            for (int i = 0; i < 8; i++)
                sp[i] = pair16(signed_byte_lanes(scales, 2 * i), signed_byte_lanes(scales, 2 * i + 1));
            for (int h2 = 0; h2 < 2; h2++)
                for (int l4 = 0; l4 < 8; l4++) {
                    const uint8_t *pass = blk + 288 + 768 * (2 * h2 + l4 / 4) + 32 * half;
                    const __m256i lo = load_chunk(pass, l4 % 4), hi = load_chunk(pass, 4 + l4 % 4);
                    const __m256i h = load_chunk(pass, 8 + l4 % 4);
                    const int e = 32 * h2 + l4;
                    codes[e] = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                    codes[e + 8] =
                        _mm256_or_si256(_mm256_and_si256(hi, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
                    codes[e + 16] =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4), _mm256_and_si256(h, m30));
                    codes[e + 24] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                                                    _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                }
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK_K;
                const int32_t *bs = x[t].sums + b * (QK_K / 16);
                __m256i sumi = _mm256_setzero_si256(), bias = _mm256_setzero_si256();
                for (int s = 0; s < 16; s++) {
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(chunk_dots16(codes, xq, 4 * s, 2), sc[s]));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(chunk_dots16(codes, xq, 4 * s + 2, 2), sc[s]));
                }
                for (int i = 0; i < 8; i++)
                    bias = _mm256_add_epi32(
                        bias, _mm256_madd_epi16(sp[i], _mm256_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1]))));
                sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(bias, 5));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

/* iq4_values in both 128-bit lanes: a nibble's signed code by vpshufb */
ALWAYS_INLINE __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_values));
}

/* |w| . (x with w's sign), a 32-bit lane a row: |products| <= 127 x 127, two to a 16-bit lane */
ALWAYS_INLINE __m256i signed_dot(__m256i magnitude, __m256i w, const int8_t *xq, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(read_i32(xq)), w)),
                             scale16);
}

/* IQ4_NL (Q4_0's layout): signed codes iq4_values[q] */
ALWAYS_INLINE void iq4_nl_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), table = iq4_table();
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 18, *qs = blk + ROW_GROUP * 2 + half * 32;
            const __m256 dw = scales8(blk + half * 16);
            __m256i w[8], mag[8]; /* w[c]: elements 4c.. (c < 4), 16 + 4 (c - 4).. */
            for (int c = 0; c < 4; c++) {
                const __m256i raw = load_chunk(qs, c);
                w[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
                w[4 + c] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
            }
            for (int c = 0; c < 8; c++)
                mag[c] = _mm256_abs_epi8(w[c]);
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK8;
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++)
                    s = _mm256_add_epi32(s, signed_dot(mag[c], w[c], xq + (c < 4 ? 4 * c : 16 + 4 * (c - 4)), ones));
                acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

/* MXFP4 (quant_avx512.c's layout): signed codes mxfp4_values[q] (a 0 code gives 0 whatever sign the
 * activation takes), the rows' scales 2^(e - 128) built as float32 bits */
ALWAYS_INLINE void mxfp4_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                               size_t first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4_values));
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 17, *qs = blk + ROW_GROUP + half * 32;
            const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * half)));
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
            const __m256 dw = _mm256_castsi256_ps(
                _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
            __m256i w[8], mag[8];
            for (int c = 0; c < 4; c++) {
                const __m256i raw = load_chunk(qs, c);
                w[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
                w[4 + c] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
            }
            for (int c = 0; c < 8; c++)
                mag[c] = _mm256_abs_epi8(w[c]);
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK8;
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++)
                    s = _mm256_add_epi32(s, signed_dot(mag[c], w[c], xq + (c < 4 ? 4 * c : 16 + 4 * (c - 4)), ones));
                acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

/* each lane's bits 0..3 (of a 32-bit lane a row) as bit 4 of its bytes 0..3: four codes' fifth bits */
ALWAYS_INLINE __m256i fifth_bits(__m256i v) {
    const __m256i bits = _mm256_set1_epi32(0x08040201);
    const __m256i spread = _mm256_and_si256(
        _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4,
                                                4, 8, 8, 8, 8, 12, 12, 12, 12)),
        bits);
    return _mm256_and_si256(_mm256_cmpeq_epi8(spread, bits), _mm256_set1_epi8(0x10));
}

/* Q5_0, Q4_1 and Q5_1 (quant_avx512.c's layouts), a half of 8 rows; 5-bit products summed in 16 bits
 * four chunks at a time (4 x 2 x 31 x 127) */
ALWAYS_INLINE void legacy_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first, int size, int with_min, int with_qh, int offset) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * (size_t)size;
            const uint8_t *qh = blk + (with_min ? 64 : 32), *qs = qh + (with_qh ? 64 : 0) + 32 * half;
            const __m256 dw = scales8(blk + 16 * half), mw = with_min ? scales8(blk + 32 + 16 * half) : _mm256_setzero_ps();
            const __m256i high = with_qh ? load_chunk(qh + 32 * half, 0) : _mm256_setzero_si256();
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m256i raw = load_chunk(qs, c);
                lo[c] = _mm256_and_si256(raw, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                if (with_qh) {
                    lo[c] = _mm256_or_si256(lo[c], fifth_bits(_mm256_srli_epi32(high, 4 * c)));
                    hi[c] = _mm256_or_si256(hi[c], fifth_bits(_mm256_srli_epi32(high, 16 + 4 * c)));
                }
            }
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK8;
                __m256i sl = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(read_i32(xq)));
                __m256i sh = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(read_i32(xq + 16)));
                for (int c = 1; c < 4; c++) {
                    sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(read_i32(xq + 4 * c))));
                    sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(read_i32(xq + 16 + 4 * c))));
                }
                __m256i s = _mm256_add_epi32(_mm256_madd_epi16(sl, ones), _mm256_madd_epi16(sh, ones));
                if (offset)
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * x[t].sums[b]));
                acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
                if (with_min)
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(mw, _mm256_set1_ps(x[t].d[b])),
                                             _mm256_set1_ps((float)x[t].sums[b]), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

ALWAYS_INLINE void q5_0_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    legacy_group(group, n_blocks, x, nt, out, first, 22, 0, 1, 16);
}
ALWAYS_INLINE void q4_1_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    legacy_group(group, n_blocks, x, nt, out, first, 20, 1, 0, 0);
}
ALWAYS_INLINE void q5_1_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    legacy_group(group, n_blocks, x, nt, out, first, 24, 1, 1, 0);
}

/* IQ4_XS (quant_avx512.c's layout): signed codes, each sub-block's scale - 32 by madd; 16 elements at a
 * time in registers for every token */
ALWAYS_INLINE void iq4_xs_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), table = iq4_table();
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        __m256i sumi[TILE_TOKENS], ls[8];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 136, *qs = blk + 128 + 32 * half;
            const __m256 d = scales8(blk + 16 * half);
            const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * half)));
            for (int ib = 0; ib < 8; ib++) {
                const __m256i low = _mm256_srli_epi32(byte_lanes(blk + 64 + 8 * half, ib / 2), 4 * (ib % 2));
                const __m256i six = _mm256_or_si256(
                    _mm256_and_si256(low, _mm256_set1_epi32(0x0f)),
                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * ib), _mm256_set1_epi32(3)), 4));
                const __m256i v = _mm256_sub_epi32(six, _mm256_set1_epi32(32));
                ls[ib] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
            }
            for (int t = 0; t < nt; t++)
                sumi[t] = _mm256_setzero_si256();
            for (int run = 0; run < 16; run++) { /* sub-block run / 2, its low (even) or high nibbles */
                const int ib = run / 2, shift = 4 * (run % 2);
                __m256i w[4], mag[4];
                for (int i = 0; i < 4; i++) {
                    const __m256i raw = load_chunk(qs, 4 * ib + i);
                    w[i] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, shift), m4));
                    mag[i] = _mm256_abs_epi8(w[i]);
                }
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 32 * ib + 4 * shift; /* elements 32 ib (+ 16).. */
                    for (int i = 0; i < 4; i++)
                        sumi[t] = _mm256_add_epi32(sumi[t], signed_dot(mag[i], w[i], xq + 4 * i, ls[ib]));
                }
            }
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

/* Q2_K and Q3_K (quant_avx512.c's layouts), a half of 8 rows: each token's sum over the super-block's
 * 16 sub-blocks of scale x (codes . x), the codes of 2 bits (and Q3_K's third from `hmask`; NULL for
 * Q2_K) made 32 elements at a time in registers; a sub-block's four chunks summed in 16 bits
 * (4 x 2 x 7 x 127 at most) and scaled by madd */
ALWAYS_INLINE void low_bit_sums(const uint8_t *qs, const uint8_t *hmask, const ActRow *x, size_t b, int nt,
                                const __m256i *sc, __m256i *sumi) {
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int t = 0; t < nt; t++)
        sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int n = 0; n < 2; n++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* elements 128 n + 32 j + 4i..: sub-blocks 8 n + 2 j and the next */
            __m256i codes[8];
            for (int i = 0; i < 8; i++) {
                codes[i] = _mm256_and_si256(_mm256_srli_epi16(load_chunk(qs, 8 * n + i), 2 * j), m3);
                if (hmask)
                    codes[i] = _mm256_or_si256(
                        codes[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load_chunk(hmask, i), 4 * n + j), one), 2));
            }
            const int sub = 8 * n + 2 * j;
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK_K + 128 * n + 32 * j;
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(chunk_dots16(codes, xq, 0, 4), sc[sub]));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(chunk_dots16(codes, xq, 4, 4), sc[sub + 1]));
            }
        }
}

ALWAYS_INLINE void q2_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        __m256i sumi[TILE_TOKENS], sc[16], mp[8];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 84, *scales = blk + 64 + 8 * half;
            const __m256 d = scales8(blk + 16 * half), dmin = scales8(blk + 32 + 16 * half);
            __m256i mn[16];
            for (int s = 0; s < 16; s++) {
                const __m256i v = byte_lanes(scales, s), s4 = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
                sc[s] = _mm256_or_si256(s4, _mm256_slli_epi32(s4, 16));
                mn[s] = _mm256_srli_epi32(v, 4);
            }
            for (int i = 0; i < 8; i++)
                mp[i] = pair16(mn[2 * i], mn[2 * i + 1]);
            low_bit_sums(blk + 320 + 32 * half, NULL, x, b, nt, sc, sumi);
            for (int t = 0; t < nt; t++) {
                const int32_t *bs = x[t].sums + b * (QK_K / 16);
                __m256i summ = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++)
                    summ = _mm256_add_epi32(
                        summ, _mm256_madd_epi16(mp[i], _mm256_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1]))));
                const __m256 dx = _mm256_set1_ps(x[t].d[b]);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(summ), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

ALWAYS_INLINE void q3_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    for (int half = 0; half < 2; half++) {
        __m256 acc[TILE_TOKENS];
        __m256i sumi[TILE_TOKENS], sc[16], sp[8];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_ps();
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = group + b * ROW_GROUP * 110, *scales = blk + 32 + 8 * half;
            const __m256 d = scales8(blk + 16 * half);
            __m256i v[16];
            for (int s = 0; s < 16; s++) {
                const __m256i low = s < 8 ? _mm256_and_si256(byte_lanes(scales, s), _mm256_set1_epi32(0x0f))
                                          : _mm256_srli_epi32(byte_lanes(scales, s - 8), 4);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi32(byte_lanes(scales, 8 + s % 4), 2 * (s / 4)),
                                                      _mm256_set1_epi32(3));
                v[s] = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
                sc[s] = _mm256_or_si256(_mm256_and_si256(v[s], _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v[s], 16));
            }
            for (int i = 0; i < 8; i++)
                sp[i] = pair16(v[2 * i], v[2 * i + 1]);
            low_bit_sums(blk + 736 + 32 * half, blk + 224 + 32 * half, x, b, nt, sc, sumi);
            for (int t = 0; t < nt; t++) {
                const int32_t *bs = x[t].sums + b * (QK_K / 16);
                __m256i bias = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++)
                    bias = _mm256_add_epi32(
                        bias, _mm256_madd_epi16(sp[i], _mm256_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1]))));
                const __m256i sum = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(bias, 2));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[t].d[b])), _mm256_cvtepi32_ps(sum), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out[t] + first + half * 8, acc[t]);
    }
}

DEFINE_TILE(dot_q4_0, q4_0_group, 0)
DEFINE_TILE(dot_q8_0, q8_0_group, 1)
DEFINE_TILE(dot_q4_k, q4_k_group, 2)
DEFINE_TILE(dot_q6_k, q6_k_group, 3)
DEFINE_TILE(dot_q5_k, q5_k_group, 4)
DEFINE_TILE(dot_iq4_nl, iq4_nl_group, 5)
DEFINE_TILE(dot_iq4_xs, iq4_xs_group, 6)
DEFINE_TILE(dot_q2_k, q2_k_group, 7)
DEFINE_TILE(dot_q3_k, q3_k_group, 8)
DEFINE_TILE(dot_mxfp4, mxfp4_group, 9)
DEFINE_TILE(dot_q5_0, q5_0_group, 10)
DEFINE_TILE(dot_q4_1, q4_1_group, 11)
DEFINE_TILE(dot_q5_1, q5_1_group, 12)

const KernelTable kernels_avx2 = {
    "avx2",
    {dot_q4_0, dot_q8_0, dot_q4_k, dot_q6_k, dot_q5_k, dot_iq4_nl, dot_iq4_xs, dot_q2_k, dot_q3_k, dot_mxfp4,
     dot_q5_0, dot_q4_1, dot_q5_1},
    {quantize_q8_0_avx2, quantize_q8_k_avx2}};
