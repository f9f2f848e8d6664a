/* The scalar reference of every kernel: the definition the SIMD files match bit for bit (kernels.h).
 * Each block is gathered from its row group back into GGML's own layout and computed as GGML defines
 * it, one row and one activation row at a time. */
#include <math.h>

#include "kernels.h"

static void quantize_q8_0(const float *x, size_t k, ActRow *y) {
    for (size_t b = 0; b < k / QK8; b++) {
        const float *xb = x + b * QK8;
        if (!block_finite(xb)) {
            nan_block(y, b);
            continue;
        }
        float amax = 0.0f, d, id;
        for (int j = 0; j < QK8; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        q8_scales(amax, &d, &id);
        int32_t sum = 0;
        for (int j = 0; j < QK8; j++) {
            int q = (int)nearbyintf(xb[j] * id);
            y->qs[b * QK8 + j] = (int8_t)q;
            sum += q;
        }
        y->d[b] = d;
        y->sums[b] = sum;
    }
}

/* Q8_K (llama.cpp's quantize_row_q8_K_ref): the value of largest magnitude (the first of them) maps
 * to -127, scale 1 / (-127 / it), codes round-half-even(x * -127 / it) capped at 127, sums of 16 */
static void quantize_q8_k(const float *x, size_t k, ActRow *y) {
    for (size_t b = 0; b < k / QK_K; b++) {
        const float *xb = x + b * QK_K;
        int8_t *qs = y->qs + b * QK_K;
        int finite = 1;
        for (int j = 0; j < QK_K; j += QK8)
            finite &= block_finite(xb + j);
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++)
            if (fabsf(xb[j]) > amax) {
                amax = fabsf(xb[j]);
                max = xb[j];
            }
        if (!finite || amax == 0.0f) {
            memset(qs, 0, QK_K);
            memset(y->sums + b * (QK_K / 16), 0, QK_K / 16 * sizeof(int32_t));
            y->d[b] = finite ? 0.0f : __builtin_nanf("");
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            int q = (int)nearbyintf(iscale * xb[j]);
            qs[j] = (int8_t)(q < 127 ? q : 127);
        }
        for (int s = 0; s < QK_K / 16; s++) {
            int32_t sum = 0;
            for (int j = 0; j < 16; j++)
                sum += qs[s * 16 + j];
            y->sums[b * (QK_K / 16) + s] = sum;
        }
        y->d[b] = 1.0f / iscale;
    }
}

/* Q4_0: float16 d, 16 bytes of nibbles (element j low, element j + 16 high), value d * (q - 8) */
static float block_q4_0(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *qs = blk + 2;
    const int8_t *xq = x->qs + b * QK8;
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++)
        sumi += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + 16];
    sumi -= 8 * x->sums[b];
    return fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
}

/* Q8_0: float16 d, 32 int8 codes, value d * q */
static float block_q8_0(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const int8_t *qs = (const int8_t *)(blk + 2), *xq = x->qs + b * QK8;
    int32_t sumi = 0;
    for (int j = 0; j < QK8; j++)
        sumi += qs[j] * xq[j];
    return fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
}

/* Q4_K: float16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (64
 * elements a 32 bytes: the first 32 low, the next 32 high); value d * scale * q - dmin * min for the
 * 32 elements of each sub-block. Q5_K: qh[32] before the nibbles, bit j of qh[l] the fifth bit of
 * element l of sub-block j. sumi = sum of scale x (q . x), summ = sum of min x (the sub-block's
 * activation sum); acc = fma(d dx, sumi, acc), then fma(-(dmin dx), summ, acc). */
static float affine_k(const uint8_t *blk, const uint8_t *qs, const uint8_t *qh, const ActRow *x, size_t b, float acc) {
    const uint8_t *sc = blk + 4;
    const int8_t *xq = x->qs + b * QK_K;
    const int32_t *bsums = x->sums + b * (QK_K / 16);
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 8; j++) {
        int scale, min;
        q4_k_scale_min(sc, j, &scale, &min);
        const uint8_t *q = qs + (j / 2) * 32;
        int32_t dot = 0;
        for (int l = 0; l < 32; l++)
            dot += ((j % 2 ? q[l] >> 4 : q[l] & 0x0f) | (qh ? ((qh[l] >> j) & 1) << 4 : 0)) * xq[j * 32 + l];
        sumi += scale * dot;
        summ += min * (bsums[2 * j] + bsums[2 * j + 1]);
    }
    const float dx = x->d[b];
    acc = fmaf(read_fp16(blk) * dx, (float)sumi, acc);
    return fmaf(-(read_fp16(blk + 2) * dx), (float)summ, acc);
}

static float block_q4_k(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    return affine_k(blk, blk + 16, NULL, x, b, acc);
}

static float block_q5_k(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    return affine_k(blk, blk + 48, blk + 16, x, b, acc);
}

/* Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16 d; value
 * d * scale * (q - 32) for each 16 elements. sumi = sum of scale x (q . x - 32 x the sub-block's
 * activation sum); acc = fma(d dx, sumi, acc). */
static float block_q6_k(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192), *xq = x->qs + b * QK_K;
    const int32_t *bsums = x->sums + b * (QK_K / 16);
    int32_t dots[16] = {0};
    for (int half = 0; half < 2; half++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = ql[64 * half + l], hi = ql[64 * half + l + 32], h = qh[32 * half + l];
            const int e = 128 * half + l;
            dots[e / 16] += ((lo & 0x0f) | ((h & 3) << 4)) * xq[e];
            dots[(e + 32) / 16] += ((hi & 0x0f) | (((h >> 2) & 3) << 4)) * xq[e + 32];
            dots[(e + 64) / 16] += ((lo >> 4) | (((h >> 4) & 3) << 4)) * xq[e + 64];
            dots[(e + 96) / 16] += ((hi >> 4) | (((h >> 6) & 3) << 4)) * xq[e + 96];
        }
    int32_t sumi = 0;
    for (int s = 0; s < 16; s++)
        sumi += sc[s] * (dots[s] - 32 * bsums[s]);
    return fmaf(read_fp16(blk + 208) * x->d[b], (float)sumi, acc);
}

/* IQ4_NL: float16 d, 16 bytes of nibbles as Q4_0's, each an index into iq4_values; value d * it */
static float block_iq4_nl(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *qs = blk + 2;
    const int8_t *xq = x->qs + b * QK8;
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++)
        sumi += iq4_values[qs[j] & 0x0f] * xq[j] + iq4_values[qs[j] >> 4] * xq[j + 16];
    return fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
}

/* IQ4_XS: float16 d, the high 2 bits of eight 6-bit scales (uint16), their low 4 bits (4 bytes), 128
 * bytes of nibbles (16 a 32-element sub-block, as IQ4_NL's); value d * (scale - 32) * iq4_values[q] */
static float block_iq4_xs(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const unsigned scales_h = blk[2] | (unsigned)blk[3] << 8;
    const uint8_t *scales_l = blk + 4, *qs = blk + 8;
    const int8_t *xq = x->qs + b * QK_K;
    int32_t sumi = 0;
    for (int ib = 0; ib < 8; ib++) {
        const int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0x0f) | (((scales_h >> 2 * ib) & 3) << 4);
        const uint8_t *q = qs + 16 * ib;
        int32_t dot = 0;
        for (int j = 0; j < 16; j++)
            dot += iq4_values[q[j] & 0x0f] * xq[32 * ib + j] + iq4_values[q[j] >> 4] * xq[32 * ib + 16 + j];
        sumi += (ls - 32) * dot;
    }
    return fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
}

/* Q2_K: 16 scale bytes (low nibble the 16-element sub-block's scale, high its minimum), 64 bytes of
 * 2-bit codes, float16 d and dmin: element 128 n + 32 j + l (l < 32) is bits 2j.. of qs[32 n + l],
 * in sub-block (128 n + 32 j + l) / 16; value d * scale * q - dmin * min (acc as Q4_K's) */
static float block_q2_k(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *sc = blk, *qs = blk + 16;
    const int8_t *xq = x->qs + b * QK_K;
    const int32_t *bsums = x->sums + b * (QK_K / 16);
    int32_t dots[16] = {0}, sumi = 0, summ = 0;
    for (int e = 0; e < QK_K; e++)
        dots[e / 16] += ((qs[32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3) * xq[e];
    for (int s = 0; s < 16; s++) {
        sumi += (sc[s] & 0x0f) * dots[s];
        summ += (sc[s] >> 4) * bsums[s];
    }
    const float dx = x->d[b];
    acc = fmaf(read_fp16(blk + 80) * dx, (float)sumi, acc);
    return fmaf(-(read_fp16(blk + 82) * dx), (float)summ, acc);
}

/* Q3_K: 32 bytes of high bits, 64 of 2-bit codes, 12 bytes of sixteen 6-bit scales, float16 d: element
 * 128 n + 32 j + l is bits 2j.. of qs[32 n + l] plus 4 x bit 4n + j of hmask[l], value
 * d * (scale - 32) * (that - 4) for its 16-element sub-block */
static float block_q3_k(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *hmask = blk, *qs = blk + 32, *sc = blk + 96;
    const int8_t *xq = x->qs + b * QK_K;
    const int32_t *bsums = x->sums + b * (QK_K / 16);
    int32_t dots[16] = {0}, sumi = 0;
    for (int e = 0; e < QK_K; e++) {
        const int n = e / 128, j = e % 128 / 32, l = e % 32;
        const int u = ((qs[32 * n + l] >> (2 * j)) & 3) | (((hmask[l] >> (4 * n + j)) & 1) << 2);
        dots[e / 16] += u * xq[e];
    }
    for (int s = 0; s < 16; s++)
        sumi += q3_k_scale(sc, s) * (dots[s] - 4 * bsums[s]);
    return fmaf(read_fp16(blk + 108) * x->d[b], (float)sumi, acc);
}

/* MXFP4: exponent byte e, 16 bytes of nibbles as Q4_0's, each an index into mxfp4_values; value
 * 2^(e - 128) * it */
static float block_mxfp4(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const uint8_t *qs = blk + 1;
    const int8_t *xq = x->qs + b * QK8;
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++)
        sumi += mxfp4_values[qs[j] & 0x0f] * xq[j] + mxfp4_values[qs[j] >> 4] * xq[j + 16];
    return fmaf(e8m0_half(blk[0]) * x->d[b], (float)sumi, acc);
}

/* the integer dot product of a block of 32 nibbles as Q4_0's (element j low, j + 16 high), each with a
 * fifth bit from the 32-bit qh where it is given (bit j of element j), with the activations' codes */
static int32_t nibble_dot(const uint8_t *qs, const uint8_t *qh, const int8_t *xq) {
    uint32_t high = 0;
    if (qh)
        memcpy(&high, qh, sizeof high);
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++)
        sumi += ((qs[j] & 0x0f) | ((high >> j & 1) << 4)) * xq[j] + ((qs[j] >> 4) | ((high >> (j + 16) & 1) << 4)) * xq[j + 16];
    return sumi;
}

/* Q5_0: float16 d, qh (the fifth bits), 16 bytes of nibbles; value d * (q - 16) */
static float block_q5_0(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const int32_t sumi = nibble_dot(blk + 6, blk + 2, x->qs + b * QK8) - 16 * x->sums[b];
    return fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
}

/* Q4_1 and Q5_1: float16 d and m, (Q5_1: qh), nibbles; value d * q + m: acc = fma(d dx, sumi, acc),
 * then fma(m dx, the activations' code sum, acc) */
static float block_q4_1(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const float dx = x->d[b];
    acc = fmaf(read_fp16(blk) * dx, (float)nibble_dot(blk + 4, NULL, x->qs + b * QK8), acc);
    return fmaf(read_fp16(blk + 2) * dx, (float)x->sums[b], acc);
}

static float block_q5_1(const uint8_t *blk, const ActRow *x, size_t b, float acc) {
    const float dx = x->d[b];
    acc = fmaf(read_fp16(blk) * dx, (float)nibble_dot(blk + 8, blk + 4, x->qs + b * QK8), acc);
    return fmaf(read_fp16(blk + 2) * dx, (float)x->sums[b], acc);
}

typedef float (*BlockDot)(const uint8_t *blk, const ActRow *x, size_t b, float acc);
static const BlockDot block_dots[QUANT_TYPES] = {block_q4_0,   block_q8_0,   block_q4_k, block_q6_k, block_q5_k,
                                                 block_iq4_nl, block_iq4_xs, block_q2_k, block_q3_k, block_mxfp4,
                                                 block_q5_0,   block_q4_1,   block_q5_1};

/* block b of row i of the row group at `group`, in GGML's own layout */
static void group_block(const uint8_t *group, size_t b, int i, const QuantType *q, uint8_t *blk) {
    const uint8_t *src = group + b * ROW_GROUP * (size_t)q->block_size;
    for (int s = 0; s < q->n_segments; s++) {
        const Segment *seg = &q->segments[s];
        for (int c = 0; c < seg->size / seg->unit; c++)
            memcpy(blk + seg->offset + c * seg->unit, src + (c * ROW_GROUP + i) * seg->unit, (size_t)seg->unit);
        src += ROW_GROUP * seg->size;
    }
}

void dot_rows_left(int type_index, const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t first,
                   size_t n_blocks, const ActRow *x, size_t n_x, float *const *out) {
    const QuantType *q = &quant_types[type_index];
    const BlockDot dot = block_dots[type_index];
    size_t grouped = n_rows / ROW_GROUP * ROW_GROUP;
    uint8_t blk[MAX_BLOCK];
    for (size_t r = first; r < n_rows; r++) {
        for (size_t t = 0; t < n_x; t++) {
            float acc = 0.0f;
            for (size_t b = 0; b < n_blocks; b++) {
                const uint8_t *src;
                if (r < grouped) {
                    group_block(rows + r / ROW_GROUP * ROW_GROUP * row_bytes, b, (int)(r % ROW_GROUP), q, blk);
                    src = blk;
                } else {
                    src = rows + r * row_bytes + b * (size_t)q->block_size;
                }
                acc = dot(src, &x[t], b, acc);
            }
            out[t][r] = acc;
        }
    }
}

#define SCALAR_TILE(NAME, TYPE_INDEX)                                                                         \
    static void NAME(const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t n_blocks, const ActRow *x, \
                     size_t n_x, float *const *out) {                                                         \
        dot_rows_left(TYPE_INDEX, rows, row_bytes, n_rows, 0, n_blocks, x, n_x, out);                        \
    }
SCALAR_TILE(dot_q4_0, 0)
SCALAR_TILE(dot_q8_0, 1)
SCALAR_TILE(dot_q4_k, 2)
SCALAR_TILE(dot_q6_k, 3)
SCALAR_TILE(dot_q5_k, 4)
SCALAR_TILE(dot_iq4_nl, 5)
SCALAR_TILE(dot_iq4_xs, 6)
SCALAR_TILE(dot_q2_k, 7)
SCALAR_TILE(dot_q3_k, 8)
SCALAR_TILE(dot_mxfp4, 9)
SCALAR_TILE(dot_q5_0, 10)
SCALAR_TILE(dot_q4_1, 11)
SCALAR_TILE(dot_q5_1, 12)

const KernelTable kernels_scalar = {
    "scalar",
    {dot_q4_0, dot_q8_0, dot_q4_k, dot_q6_k, dot_q5_k, dot_iq4_nl, dot_iq4_xs, dot_q2_k, dot_q3_k, dot_mxfp4,
     dot_q5_0, dot_q4_1, dot_q5_1},
    {quantize_q8_0, quantize_q8_k}};

/* ---- a block's values, as ggml's dequantize_row_* computes them (GatherPacked's rows) -------------------
 * Each value in ggml's float order, no operation contracted (the library is built -ffp-contract=off):
 * the values gguf-py's dequantize gives too, bit for bit (tests/test_cpu_ops.py). */
static void dequantize_block(int ggml_type, const uint8_t *b, float *y) {
    switch (ggml_type) {
    case GGML_Q4_0: {
        const float d = read_fp16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[2 + j] & 0x0f) - 8) * d;
            y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
        }
        break;
    }
    case GGML_Q4_1: {
        const float d = read_fp16(b), m = read_fp16(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[4 + j] & 0x0f) * d + m;
            y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
        }
        break;
    }
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int affine = ggml_type == GGML_Q5_1, at = affine ? 4 : 2;
        const float d = read_fp16(b), m = affine ? read_fp16(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + at, 4);
        const uint8_t *qs = b + at + 4;
        for (int j = 0; j < 16; j++) {
            const int x0 = (qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10), x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
            if (affine) {
                y[j] = (float)x0 * d + m;
                y[j + 16] = (float)x1 * d + m;
            } else {
                y[j] = (float)(x0 - 16) * d;
                y[j + 16] = (float)(x1 - 16) * d;
            }
        }
        break;
    }
    case GGML_Q8_0: {
        const float d = read_fp16(b);
        for (int j = 0; j < 32; j++)
            y[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case GGML_IQ4_NL: {
        const float d = read_fp16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)iq4_values[b[2 + j] & 0x0f];
            y[j + 16] = d * (float)iq4_values[b[2 + j] >> 4];
        }
        break;
    }
    case GGML_MXFP4: {
        const float d = e8m0_half(b[0]);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)mxfp4_values[b[1 + j] & 0x0f] * d;
            y[j + 16] = (float)mxfp4_values[b[1 + j] >> 4] * d;
        }
        break;
    }
    case GGML_Q2_K: { /* scales[16], qs[64], d, dmin */
        const float d = read_fp16(b + 80), min = read_fp16(b + 82);
        const uint8_t *sc = b, *q = b + 16;
        int is = 0;
        for (int n = 0; n < QK_K; n += 128, q += 32)
            for (int shift = 0; shift < 8; shift += 2)
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)(sc[is] & 0x0f), ml = min * (float)(sc[is] >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
                }
        break;
    }
    case GGML_Q3_K: { /* hmask[32], qs[64], scales[12], d */
        const float d = read_fp16(b + 108);
        const uint8_t *hm = b, *q = b + 32;
        int is = 0, m = 1;
        for (int n = 0; n < QK_K; n += 128, q += 32)
            for (int shift = 0; shift < 8; shift += 2, m <<= 1)
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)q3_k_scale(b + 96, is);
                    for (int l = 16 * half; l < 16 * half + 16; l++)
                        *y++ = dl * (float)(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
        break;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: { /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
        const int five = ggml_type == GGML_Q5_K;
        const float d = read_fp16(b), min = read_fp16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *q = b + (five ? 48 : 16);
        for (int j = 0, is = 0; j < QK_K; j += 64, q += 32, is += 2) {
            int sc, mn;
            q4_k_scale_min(scales, is, &sc, &mn);
            const float d1 = d * (float)sc, m1 = min * (float)mn;
            q4_k_scale_min(scales, is + 1, &sc, &mn);
            const float d2 = d * (float)sc, m2 = min * (float)mn;
            const int u1 = 1 << (j / 32), u2 = 2 << (j / 32);
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (float)((q[l] & 0x0f) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (float)((q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
        }
        break;
    }
    case GGML_Q6_K: { /* ql[128], qh[64], scales[16], d */
        const float d = read_fp16(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        break;
    }
    case GGML_IQ4_XS: { /* d, scales_h (2 bytes), scales_l[4], qs[128] */
        const float d = read_fp16(b);
        const unsigned scales_h = (unsigned)(b[2] | (b[3] << 8));
        const uint8_t *qs = b + 8;
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32, qs += 16) {
            const int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0x0f) | (((scales_h >> 2 * ib) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            for (int j = 0; j < 16; j++) {
                y[j] = dl * (float)iq4_values[qs[j] & 0x0f];
                y[j + 16] = dl * (float)iq4_values[qs[j] >> 4];
            }
        }
        break;
    }
    }
}

void dequantize_row(int type_index, const uint8_t *row, size_t k, float *y) {
    const QuantType *q = &quant_types[type_index];
    for (size_t b = 0; b < k / (size_t)q->block; b++)
        dequantize_block(q->ggml_type, row + b * (size_t)q->block_size, y + b * (size_t)q->block);
}
