/* The scalar reference of every kernel: the definition the SIMD files match bit for bit (kernels.h). */
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

/* Q4_0: float16 d, 16 bytes of nibbles (element j low, element j + 16 high), value d * (q - 8) */
static void dot_q4_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, const ActRow *x, size_t n_blocks,
                     float *out) {
    for (size_t r = 0; r < n_rows; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = w + b * 18, *qs = blk + 2;
            const int8_t *xq = x->qs + b * QK8;
            int32_t sumi = 0;
            for (int j = 0; j < 16; j++)
                sumi += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + 16];
            sumi -= 8 * x->sums[b];
            acc = fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
        }
        out[r] = acc;
    }
}

/* Q8_0: float16 d, 32 int8 codes, value d * q */
static void dot_q8_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, const ActRow *x, size_t n_blocks,
                     float *out) {
    for (size_t r = 0; r < n_rows; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *blk = w + b * 34;
            const int8_t *qs = (const int8_t *)(blk + 2), *xq = x->qs + b * QK8;
            int32_t sumi = 0;
            for (int j = 0; j < QK8; j++)
                sumi += qs[j] * xq[j];
            acc = fmaf(read_fp16(blk) * x->d[b], (float)sumi, acc);
        }
        out[r] = acc;
    }
}

const KernelTable kernels_scalar = {"scalar", {dot_q4_0, dot_q8_0}, {quantize_q8_0}};
