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

typedef float (*BlockDot)(const uint8_t *blk, const ActRow *x, size_t b, float acc);
static const BlockDot block_dots[] = {block_q4_0, block_q8_0}; /* by quant_types[] index */

/* block b of row i of the row group at `group`, in GGML's own layout */
static void group_block(const uint8_t *group, size_t b, int i, const QuantType *q, uint8_t *blk) {
    const uint8_t *src = group + b * ROW_GROUP * (size_t)q->block_size;
    memcpy(blk, src + i * q->header, (size_t)q->header);
    src += ROW_GROUP * q->header;
    for (int c = 0; c < (q->block_size - q->header) / GROUP_CHUNK; c++)
        memcpy(blk + q->header + c * GROUP_CHUNK, src + (c * ROW_GROUP + i) * GROUP_CHUNK, GROUP_CHUNK);
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

static void dot_q4_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t n_blocks, const ActRow *x,
                     size_t n_x, float *const *out) {
    dot_rows_left(0, rows, row_bytes, n_rows, 0, n_blocks, x, n_x, out);
}

static void dot_q8_0(const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t n_blocks, const ActRow *x,
                     size_t n_x, float *const *out) {
    dot_rows_left(1, rows, row_bytes, n_rows, 0, n_blocks, x, n_x, out);
}

const KernelTable kernels_scalar = {"scalar", {dot_q4_0, dot_q8_0}, {quantize_q8_0}};
