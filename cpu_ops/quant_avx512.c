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

/* ---- K-quants: a super-block of 256 elements against Q8_K activations --------------------------------
 * A super-block's codes are unpacked 64 elements at a time into 16 registers (codes[c]: four codes of
 * each of the 16 rows, as unsigned bytes), and every token's sub-blocks there summed and scaled before
 * the next 64 (the scales in int32 lanes); exactly as quant_scalar.c's block_q4_k / block_q6_k. */

/* byte c of each of the 16 rows (a packed-scale segment at p), zero- or sign-extended to int32 lanes */
ALWAYS_INLINE __m512i byte_lanes(const uint8_t *p, int c) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + ROW_GROUP * c)));
}
ALWAYS_INLINE __m512i signed_byte_lanes(const uint8_t *p, int c) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + ROW_GROUP * c)));
}

/* two 16-bit values in each 32-bit lane (lo, hi): for vpdpwssd */
ALWAYS_INLINE __m512i pair16(__m512i lo, __m512i hi) {
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
}
static inline int32_t pair_of(int32_t lo, int32_t hi) { return (int32_t)(((uint32_t)hi << 16) | (uint16_t)lo); }

ALWAYS_INLINE __m512i load_chunk(const uint8_t *p, int c) { return _mm512_loadu_si512((const void *)(p + 64 * c)); }

/* the sum over codes[c0 .. c0 + n) of their products with the activations' four codes at xq + 4 (c0 ..) */
ALWAYS_INLINE __m512i chunk_dots(const __m512i *codes, const int8_t *xq, int c0, int n) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int c = 0; c < n; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, codes[c0 + c], bcast(xq + 4 * c));
        s1 = _mm512_dpbusd_epi32(s1, codes[c0 + c + 1], bcast(xq + 4 * c + 4));
    }
    return _mm512_add_epi32(s0, s1);
}

/* Q4_K and Q5_K in a row group: d (32 bytes), dmin (32), the 12 scale bytes (16 each), Q5_K's qh (8
 * chunks: bits of elements l = 4 i.. of every sub-block), 32 code chunks (64 each: chunk 8 j + i holds
 * bytes 4i.. of 64-element part j, elements 64 j + 4i.. low, 64 j + 32 + 4i.. high). `size`: the
 * block's bytes; `with_qh`: Q5_K's fifth bits (bit 2j and 2j + 1 of qh for part j) */
ALWAYS_INLINE void affine_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                  size_t first, int size, int with_qh) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m6 = _mm512_set1_epi32(63), one = _mm512_set1_epi8(1);
    __m512 acc[TILE_TOKENS];
    __m512i sumi[TILE_TOKENS], sc[8], mp[4];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * (size_t)size, *scales = blk + 64, *qh = blk + 256;
        const uint8_t *qs = with_qh ? blk + 768 : blk + 256;
        __m512i q[12], mn[8], high[8];
        for (int c = 0; c < 12; c++)
            q[c] = byte_lanes(scales, c);
        for (int j = 0; j < 4; j++) {
            sc[j] = _mm512_and_si512(q[j], m6);
            mn[j] = _mm512_and_si512(q[j + 4], m6);
            sc[j + 4] = _mm512_or_si512(_mm512_and_si512(q[j + 8], _mm512_set1_epi32(0x0f)),
                                        _mm512_slli_epi32(_mm512_srli_epi32(q[j], 6), 4));
            mn[j + 4] = _mm512_or_si512(_mm512_srli_epi32(q[j + 8], 4), _mm512_slli_epi32(_mm512_srli_epi32(q[j + 4], 6), 4));
        }
        for (int i = 0; i < 4; i++)
            mp[i] = pair16(mn[2 * i], mn[2 * i + 1]);
        for (int c = 0; c < 8 && with_qh; c++)
            high[c] = load_chunk(qh, c);
        for (int t = 0; t < nt; t++)
            sumi[t] = _mm512_setzero_si512();
        for (int j64 = 0; j64 < 4; j64++) {
            __m512i codes[16];
            for (int c = 0; c < 8; c++) {
                const __m512i raw = load_chunk(qs, 8 * j64 + c);
                codes[c] = _mm512_and_si512(raw, m4);
                codes[8 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                if (with_qh) { /* high[c]'s bits 0 and 1 are sub-blocks 2 j64 and 2 j64 + 1's */
                    codes[c] = _mm512_or_si512(codes[c], _mm512_slli_epi16(_mm512_and_si512(high[c], one), 4));
                    codes[8 + c] = _mm512_or_si512(
                        codes[8 + c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high[c], 1), one), 4));
                    high[c] = _mm512_srli_epi16(high[c], 2);
                }
            }
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = x[t].qs + b * QK_K + 64 * j64;
                const __m512i lo = _mm512_mullo_epi32(chunk_dots(codes, xq, 0, 8), sc[2 * j64]);
                const __m512i hi = _mm512_mullo_epi32(chunk_dots(codes, xq + 32, 8, 8), sc[2 * j64 + 1]);
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(lo, hi));
            }
        }
        const __m512 d = scales16(blk), dmin = scales16(blk + 32);
        for (int t = 0; t < nt; t++) {
            const int32_t *bs = x[t].sums + b * (QK_K / 16);
            __m512i summ = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                summ = _mm512_dpwssd_epi32(summ, mp[i], _mm512_set1_epi32(pair_of(bs[4 * i] + bs[4 * i + 1],
                                                                                   bs[4 * i + 2] + bs[4 * i + 3])));
            const __m512 dx = _mm512_set1_ps(x[t].d[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sumi[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(summ), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

ALWAYS_INLINE void q4_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    affine_k_group(group, n_blocks, x, nt, out, first, 144, 0);
}
ALWAYS_INLINE void q5_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    affine_k_group(group, n_blocks, x, nt, out, first, 176, 1);
}

/* a's bits where mask is clear, b's where it is set (one vpternlogd) */
ALWAYS_INLINE __m512i take_bits(__m512i a, __m512i b, __m512i mask) {
    return _mm512_ternarylogic_epi32(a, b, mask, 0xd8);
}

/* Q6_K in a row group: d (32 bytes), the 16 scale bytes (16 each), then four passes of 768 bytes (half
 * h, part p: 4 chunks of low nibbles of ql bytes 64 h + 16 p.., 4 of ql bytes 64 h + 32 + 16 p.., 4 of
 * high pairs of qh bytes 32 h + 16 p..; dispatch.c). A pass holds the 16-element sub-blocks
 * 8 h + p + {0, 2, 4, 6}, four chunks each. */
ALWAYS_INLINE void q6_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* 16-bit lane 2 r of a pair's registers takes row r's first scale, 2 r + 1 its second */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 acc[TILE_TOKENS];
    __m512i sumi[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 210, *scales = blk + 32;
        for (int t = 0; t < nt; t++)
            sumi[t] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 2; part++) {
                __m512i codes[16]; /* codes[4 k + i]: elements 128 half + 32 k + 16 part + 4 i.. */
                const uint8_t *pass = blk + 288 + 768 * (2 * half + part);
                /* the next block's pass asked for ahead of its use: a pass reads its 12 lines out of order,
                 * and with the hardware's prefetcher alone a 65,536 x 2,048 matrix at one token on two
                 * threads ran at 31 GMAC/s, half the memory's bandwidth (36 with this) */
                for (int l = 0; l < 768; l += 64)
                    _mm_prefetch((const char *)(pass + ROW_GROUP * 210 + l), _MM_HINT_T0);
                for (int i = 0; i < 4; i++) {
                    const __m512i lo = load_chunk(pass, i), hi = load_chunk(pass, 4 + i), h = load_chunk(pass, 8 + i);
                    /* a code's low nibble (bits 6 and 7 clear) beside its pair of h moved to bits 4 and 5 */
                    codes[i] = take_bits(_mm512_and_si512(lo, m4), _mm512_slli_epi16(h, 4), m30);
                    codes[4 + i] = take_bits(_mm512_and_si512(hi, m4), _mm512_slli_epi16(h, 2), m30);
                    codes[8 + i] = take_bits(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4), h, m30);
                    codes[12 + i] =
                        take_bits(_mm512_and_si512(_mm512_srli_epi16(hi, 4), m4), _mm512_srli_epi16(h, 2), m30);
                }
                __m512i sc[4];
                for (int k = 0; k < 4; k++)
                    sc[k] = signed_byte_lanes(scales, 8 * half + 2 * k + part);
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 128 * half + 16 * part;
                    for (int k = 0; k < 4; k++) {
                        __m512i dot = _mm512_setzero_si512();
                        for (int i = 0; i < 4; i++)
                            dot = _mm512_dpbusd_epi32(dot, codes[4 * k + i], bcast(xq + 32 * k + 4 * i));
                        sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dot, sc[k]));
                    }
                }
            }
        /* less 32 x the activations' sums times the scales, a pair of sub-blocks a vpdpwssd */
        __m512i sp[8];
        for (int i = 0; i < 8; i++)
            sp[i] = _mm512_permutexvar_epi16(
                pairs, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(scales + 2 * ROW_GROUP * i))));
        const __m512 d = scales16(blk);
        for (int t = 0; t < nt; t++) {
            const int32_t *bs = x[t].sums + b * (QK_K / 16);
            __m512i bias = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++)
                bias = _mm512_dpwssd_epi32(bias, sp[i], _mm512_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1])));
            const __m512i s = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(bias, 5));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b])), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* iq4_values + 128 in every 128-bit lane: a nibble's unsigned code by vpshufb */
ALWAYS_INLINE __m512i iq4_table(void) {
    __m128i values = _mm_loadu_si128((const __m128i *)iq4_values);
    return _mm512_broadcast_i32x4(_mm_xor_si128(values, _mm_set1_epi8((char)0x80)));
}

/* IQ4_NL (Q4_0's layout): codes iq4_values[q] + 128, the product less 128 x the activations' sum */
ALWAYS_INLINE void iq4_nl_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), table = iq4_table();
    __m512 acc[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 18, *qs = blk + ROW_GROUP * 2;
        const __m512 dw = scales16(blk);
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i raw = load_chunk(qs, c);
            lo[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
            hi[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].qs + b * QK8;
            __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                sl = _mm512_dpbusd_epi32(sl, lo[c], bcast(xq + 4 * c));
                sh = _mm512_dpbusd_epi32(sh, hi[c], bcast(xq + 16 + 4 * c));
            }
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(sl, sh), _mm512_set1_epi32(128 * x[t].sums[b]));
            acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* MXFP4 in a row group: 16 exponent bytes, then Q4_0's code chunks; codes mxfp4_values[q] + 128, the
 * rows' scales 2^(e - 128) built as float32 bits */
ALWAYS_INLINE void mxfp4_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                               size_t first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)mxfp4_values), _mm_set1_epi8((char)0x80)));
    __m512 acc[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 17, *qs = blk + ROW_GROUP;
        const __m512i e = byte_lanes(blk, 0);
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        const __m512 dw = _mm512_castsi512_ps(
            _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i raw = load_chunk(qs, c);
            lo[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
            hi[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].qs + b * QK8;
            __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                sl = _mm512_dpbusd_epi32(sl, lo[c], bcast(xq + 4 * c));
                sh = _mm512_dpbusd_epi32(sh, hi[c], bcast(xq + 16 + 4 * c));
            }
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(sl, sh), _mm512_set1_epi32(128 * x[t].sums[b]));
            acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* each lane's bits 0..3 (of a 32-bit lane a row) as bit 4 of its bytes 0..3: four codes' fifth bits */
ALWAYS_INLINE __m512i fifth_bits(__m512i v) {
    const __m512i spread = _mm512_shuffle_epi8(
        v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12)));
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201)), _mm512_set1_epi8(0x10));
}

/* Q5_0, Q4_1 and Q5_1 in a row group: d (32 bytes), m (32; the types with minimums), qh (one chunk of
 * 64: a row's 32 fifth bits a lane; the 5-bit types), then Q4_0's 4 code chunks. `size`: the block's
 * bytes; `offset`: subtracted from every code (Q5_0's 16) */
ALWAYS_INLINE void legacy_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first, int size, int with_min, int with_qh, int offset) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[TILE_TOKENS];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * (size_t)size;
        const uint8_t *qh = blk + (with_min ? 64 : 32), *qs = qh + (with_qh ? 64 : 0);
        const __m512 dw = scales16(blk), mw = with_min ? scales16(blk + 32) : _mm512_setzero_ps();
        const __m512i high = with_qh ? load_chunk(qh, 0) : _mm512_setzero_si512();
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i raw = load_chunk(qs, c);
            lo[c] = _mm512_and_si512(raw, m4);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            if (with_qh) {
                lo[c] = _mm512_or_si512(lo[c], fifth_bits(_mm512_srli_epi32(high, 4 * c)));
                hi[c] = _mm512_or_si512(hi[c], fifth_bits(_mm512_srli_epi32(high, 16 + 4 * c)));
            }
        }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].qs + b * QK8;
            __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                sl = _mm512_dpbusd_epi32(sl, lo[c], bcast(xq + 4 * c));
                sh = _mm512_dpbusd_epi32(sh, hi[c], bcast(xq + 16 + 4 * c));
            }
            __m512i s = _mm512_add_epi32(sl, sh);
            if (offset)
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * x[t].sums[b]));
            acc[t] = block_acc(dw, x[t].d[b], s, acc[t]);
            if (with_min)
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(mw, _mm512_set1_ps(x[t].d[b])),
                                         _mm512_set1_ps((float)x[t].sums[b]), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
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

/* IQ4_XS in a row group: d (32 bytes), scales_h (16 x uint16), scales_l (4 chunks of 16), 32 code
 * chunks (64 each; chunk 4 ib + i: bytes 4i.. of sub-block ib, elements 32 ib + 4i.. low, +16 high) */
ALWAYS_INLINE void iq4_xs_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                                size_t first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), table = iq4_table();
    __m512 acc[TILE_TOKENS];
    __m512i sumi[TILE_TOKENS], ls[8], lp[4];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 136, *qs = blk + 128;
        const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        for (int ib = 0; ib < 8; ib++) {
            const __m512i low = _mm512_srli_epi32(byte_lanes(blk + 64, ib / 2), 4 * (ib % 2));
            const __m512i six = _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi32(0x0f)),
                                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * ib),
                                                                                   _mm512_set1_epi32(3)),
                                                                  4));
            ls[ib] = _mm512_sub_epi32(six, _mm512_set1_epi32(32));
        }
        for (int i = 0; i < 4; i++)
            lp[i] = pair16(ls[2 * i], ls[2 * i + 1]);
        for (int t = 0; t < nt; t++)
            sumi[t] = _mm512_setzero_si512();
        for (int pair = 0; pair < 4; pair++) { /* sub-blocks 2 pair and 2 pair + 1 */
            __m512i codes[16];                 /* codes[8 s + 4 h + i]: sub-block 2 pair + s, half h, chunk i */
            for (int s2 = 0; s2 < 2; s2++)
                for (int i = 0; i < 4; i++) {
                    const __m512i raw = load_chunk(qs, 4 * (2 * pair + s2) + i);
                    codes[8 * s2 + i] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
                    codes[8 * s2 + 4 + i] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
                }
            for (int t = 0; t < nt; t++)
                for (int s2 = 0; s2 < 2; s2++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 32 * (2 * pair + s2);
                    const __m512i dot = chunk_dots(codes, xq, 8 * s2, 8);
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dot, ls[2 * pair + s2]));
                }
        }
        const __m512 d = scales16(blk);
        for (int t = 0; t < nt; t++) {
            const int32_t *bs = x[t].sums + b * (QK_K / 16);
            __m512i bias = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                bias = _mm512_dpwssd_epi32(bias, lp[i], _mm512_set1_epi32(pair_of(bs[4 * i] + bs[4 * i + 1],
                                                                                   bs[4 * i + 2] + bs[4 * i + 3])));
            const __m512i s = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(bias, 7));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b])), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* Q2_K in a row group: d, dmin (32 bytes each), 16 scale bytes (16 each), 16 code chunks (64 each:
 * chunk 8 n + i holds qs bytes 32 n + 4i.., whose bits 2j.. are elements 128 n + 32 j + 4i..) */
ALWAYS_INLINE void q2_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m512i m3 = _mm512_set1_epi8(3);
    __m512 acc[TILE_TOKENS];
    __m512i sumi[TILE_TOKENS], sc[16], mp[8];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 84, *scales = blk + 64, *qs = blk + 320;
        __m512i mn[16];
        for (int s = 0; s < 16; s++) {
            const __m512i v = byte_lanes(scales, s);
            sc[s] = _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
            mn[s] = _mm512_srli_epi32(v, 4);
        }
        for (int i = 0; i < 8; i++)
            mp[i] = pair16(mn[2 * i], mn[2 * i + 1]);
        for (int t = 0; t < nt; t++)
            sumi[t] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++) {
            __m512i raw[8];
            for (int i = 0; i < 8; i++)
                raw[i] = load_chunk(qs, 8 * n + i);
            for (int j = 0; j < 4; j++) {
                __m512i codes[8];
                for (int i = 0; i < 8; i++)
                    codes[i] = _mm512_and_si512(_mm512_srli_epi16(raw[i], 2 * j), m3);
                const int sub = 8 * n + 2 * j;
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 128 * n + 32 * j;
                    const __m512i lo = _mm512_mullo_epi32(chunk_dots(codes, xq, 0, 4), sc[sub]);
                    const __m512i hi = _mm512_mullo_epi32(chunk_dots(codes, xq + 16, 4, 4), sc[sub + 1]);
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(lo, hi));
                }
            }
        }
        const __m512 d = scales16(blk), dmin = scales16(blk + 32);
        for (int t = 0; t < nt; t++) {
            const int32_t *bs = x[t].sums + b * (QK_K / 16);
            __m512i summ = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++)
                summ = _mm512_dpwssd_epi32(summ, mp[i], _mm512_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1])));
            const __m512 dx = _mm512_set1_ps(x[t].d[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sumi[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(summ), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
}

/* Q3_K in a row group: d (32 bytes), 12 scale bytes (16 each), 8 high-bit chunks (64 each: hmask bytes
 * 4i.., bit 4n + j of element 128 n + 32 j + 4i..), 16 code chunks as Q2_K's */
ALWAYS_INLINE void q3_k_group(const uint8_t *group, size_t n_blocks, const ActRow *x, int nt, float *const *out,
                              size_t first) {
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    __m512 acc[TILE_TOKENS];
    __m512i sumi[TILE_TOKENS], sc[16], sp[8];
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = group + b * ROW_GROUP * 110, *scales = blk + 32, *hmask = blk + 224, *qs = blk + 736;
        for (int s = 0; s < 16; s++) { /* q3_k_scale, a lane a row */
            const __m512i low = s < 8 ? _mm512_and_si512(byte_lanes(scales, s), _mm512_set1_epi32(0x0f))
                                      : _mm512_srli_epi32(byte_lanes(scales, s - 8), 4);
            const __m512i high =
                _mm512_and_si512(_mm512_srli_epi32(byte_lanes(scales, 8 + s % 4), 2 * (s / 4)), _mm512_set1_epi32(3));
            sc[s] = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
        }
        for (int i = 0; i < 8; i++)
            sp[i] = pair16(sc[2 * i], sc[2 * i + 1]);
        __m512i hm[8];
        for (int i = 0; i < 8; i++)
            hm[i] = load_chunk(hmask, i);
        for (int t = 0; t < nt; t++)
            sumi[t] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++) {
            __m512i raw[8];
            for (int i = 0; i < 8; i++)
                raw[i] = load_chunk(qs, 8 * n + i);
            for (int j = 0; j < 4; j++) {
                __m512i codes[8];
                const int bit = 4 * n + j; /* hmask's bit for these codes, moved to bit 2 */
                for (int i = 0; i < 8; i++) {
                    const __m512i high =
                        bit >= 2 ? _mm512_srli_epi16(hm[i], bit - 2) : _mm512_slli_epi16(hm[i], 2 - bit);
                    codes[i] = take_bits(_mm512_and_si512(high, four), _mm512_srli_epi16(raw[i], 2 * j), m3);
                }
                const int sub = 8 * n + 2 * j;
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = x[t].qs + b * QK_K + 128 * n + 32 * j;
                    const __m512i lo = _mm512_mullo_epi32(chunk_dots(codes, xq, 0, 4), sc[sub]);
                    const __m512i hi = _mm512_mullo_epi32(chunk_dots(codes, xq + 16, 4, 4), sc[sub + 1]);
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(lo, hi));
                }
            }
        }
        const __m512 d = scales16(blk);
        for (int t = 0; t < nt; t++) {
            const int32_t *bs = x[t].sums + b * (QK_K / 16);
            __m512i bias = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++)
                bias = _mm512_dpwssd_epi32(bias, sp[i], _mm512_set1_epi32(pair_of(bs[2 * i], bs[2 * i + 1])));
            const __m512i s = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(bias, 2));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b])), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out[t] + first, acc[t]);
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

const KernelTable kernels_avx512 = {
    "avx512",
    {dot_q4_0, dot_q8_0, dot_q4_k, dot_q6_k, dot_q5_k, dot_iq4_nl, dot_iq4_xs, dot_q2_k, dot_q3_k, dot_mxfp4,
     dot_q5_0, dot_q4_1, dot_q5_1},
    {quantize_q8_0_avx2, quantize_q8_k_avx2}};
