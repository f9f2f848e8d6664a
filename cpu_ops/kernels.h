/* The kernels' contract: GGML's blocks in row groups, the quantized activations they are multiplied
 * with, and one dispatch table per instruction set, filled once (dispatch.c). Every ISA file computes
 * each value exactly as quant_scalar.c does: a block's integer dot product is exact, and a row's blocks
 * are summed in block order as acc = fmaf(d_weight * d_activation, (float)sumi, acc). So a row's result
 * is bitwise the same on every path and whatever else is in the call.
 *
 * Row groups (the moepass ops' layout; moepass/core/row_groups.py writes it): a matrix's rows go in
 * groups of ROW_GROUP, the rows left after the last whole group as GGML writes them. A group holds its
 * rows' blocks block by block, each block cut into its type's segments (QuantType.segments: float16
 * scales, packed sub-block scales, codes); for each segment in order, the group's rows' bytes of it
 * `unit` bytes a row at a time. The same bytes as the GGUF's, in an order where one vector load holds
 * the float16 scale of every row of the group, or one scale byte, or four codes of every row. */
#ifndef MOEPASS_KERNELS_H
#define MOEPASS_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGML type ids (ggml.h's enum ggml_type, gguf-py's GGMLQuantizationType) */
enum {
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q2_K = 10,
    GGML_Q3_K = 11,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
    GGML_IQ4_NL = 20,
    GGML_IQ4_XS = 23,
    GGML_MXFP4 = 39
};

/* Activations quantized once per row, as llama.cpp quantizes them for each type's dot product:
 * ACT_Q8_0, its Q8_0 blocks (32 codes, the scale rounded to float16, the codes' sum); ACT_Q8_K, its
 * Q8_K blocks (256 codes, a float32 scale, the sums of each 16 codes). */
enum { ACT_Q8_0 = 0, ACT_Q8_K = 1, ACT_FORMATS };
#define QK8 32
#define QK_K 256

#define ROW_GROUP 16  /* rows a group interleaves */
#define MAX_BLOCK 210 /* the largest block the kernels take (Q6_K's) */

typedef struct {
    int8_t *qs;    /* K codes */
    float *d;      /* a scale a block */
    int32_t *sums; /* the codes' sums, a sum a `sum_block` codes */
} ActRow;

typedef struct {
    int block;     /* codes a scale */
    int sum_block; /* codes a sum */
} ActFormat;
static const ActFormat act_formats[ACT_FORMATS] = {{32, 32}, {256, 16}};

/* bytes one quantized activation row of K elements takes (codes, scales, sums) */
static inline size_t act_row_bytes(size_t k, int act) {
    return k + k / (size_t)act_formats[act].block * sizeof(float) + k / (size_t)act_formats[act].sum_block * 4;
}

/* the row at `base` laid out as act_row_bytes(k, act) says */
static inline ActRow act_row_at(uint8_t *base, size_t k, int act) {
    ActRow row;
    size_t scales = k / (size_t)act_formats[act].block * sizeof(float);
    row.d = (float *)base;
    row.sums = (int32_t *)(base + scales);
    row.qs = (int8_t *)(base + scales + k / (size_t)act_formats[act].sum_block * 4);
    return row;
}

/* out[t][r] = row r . x[t], for the n_rows rows at `rows` (row groups, from a group's first row: whole
 * groups, then the matrix's rows left as GGML writes them) of n_blocks blocks, and the n_x rows x */
typedef void (*DotTile)(const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t n_blocks, const ActRow *x,
                        size_t n_x, float *const *out);
/* x (k floats, k a multiple of the format's block) quantized into y */
typedef void (*QuantizeRow)(const float *x, size_t k, ActRow *y);

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_COUNT };

#define MAX_SEGMENTS 14

/* One segment of a block in a row group: `size` bytes from `offset`, laid out `unit` bytes a row at a
 * time (moepass/core/row_groups.py) */
typedef struct {
    int offset, size, unit;
} Segment;

/* One GGUF type the kernels take: its block geometry, row-group segments and activation format (one
 * row per type) */
typedef struct {
    int ggml_type;
    const char *name;
    int block;      /* elements a block */
    int block_size; /* bytes a block */
    int act;        /* ACT_* its activations are quantized to */
    Segment segments[MAX_SEGMENTS];
    int n_segments;
} QuantType;

enum { QUANT_TYPES = 13 }; /* dispatch.c's quant_types, in its order */
typedef struct {
    const char *name;
    DotTile dot[QUANT_TYPES]; /* by quant_types[] index */
    QuantizeRow quantize[ACT_FORMATS];
} KernelTable;

extern const QuantType quant_types[];
extern const size_t quant_type_count;
/* the index of `ggml_type` in quant_types, or -1 where the kernels do not take it */
int quant_type_index(int64_t ggml_type);

extern const KernelTable kernels_scalar, kernels_avx2, kernels_avx512;
/* the rows of a tile past its whole row groups, on the scalar kernels (the SIMD files' remainder) */
void dot_rows_left(int type_index, const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t first,
                   size_t n_blocks, const ActRow *x, size_t n_x, float *const *out);
/* a row of k elements of quant_types[type_index] in the GGUF's own order, as ggml dequantizes it */
void dequantize_row(int type_index, const uint8_t *row, size_t k, float *y);
/* every AVX-512 CPU has AVX2: its table takes these quantizers */
void quantize_q8_0_avx2(const float *x, size_t k, ActRow *y);
void quantize_q8_k_avx2(const float *x, size_t k, ActRow *y);
/* the best table this CPU runs, or the one MOEPASS_CPU_ISA names (scalar, avx2, avx512; never one the
 * CPU lacks: then NULL and `why` says so) */
const KernelTable *choose_kernels(const char **why);
int isa_supported(int isa);
const KernelTable *kernels_by_isa(int isa);

/* The tile function `NAME` of a SIMD file: GROUP(group, n_blocks, x, nt, out, first row) computes one
 * row group against nt (1 to TILE_TOKENS, a constant where it is inlined) activation rows; the rows
 * past the whole groups go to the scalar kernel of quant_types[TYPE_INDEX]. */
#define TILE_TOKENS 4
#define DEFINE_TILE(NAME, GROUP, TYPE_INDEX)                                                                  \
    static void NAME(const uint8_t *rows, size_t row_bytes, size_t n_rows, size_t n_blocks, const ActRow *x, \
                     size_t n_x, float *const *out) {                                                         \
        size_t groups = n_rows / ROW_GROUP;                                                                   \
        for (size_t g = 0; g < groups; g++) {                                                                 \
            const uint8_t *group = rows + g * ROW_GROUP * row_bytes;                                          \
            size_t t = 0, first = g * ROW_GROUP;                                                              \
            for (; t + TILE_TOKENS <= n_x; t += TILE_TOKENS)                                                  \
                GROUP(group, n_blocks, x + t, TILE_TOKENS, out + t, first);                                   \
            switch (n_x - t) {                                                                                \
            case 3:                                                                                           \
                GROUP(group, n_blocks, x + t, 3, out + t, first);                                             \
                break;                                                                                        \
            case 2:                                                                                           \
                GROUP(group, n_blocks, x + t, 2, out + t, first);                                             \
                break;                                                                                        \
            case 1:                                                                                           \
                GROUP(group, n_blocks, x + t, 1, out + t, first);                                             \
                break;                                                                                        \
            }                                                                                                 \
        }                                                                                                     \
        if (groups * ROW_GROUP < n_rows)                                                                      \
            dot_rows_left(TYPE_INDEX, rows, row_bytes, n_rows, groups * ROW_GROUP, n_blocks, x, n_x, out);    \
    }

static inline int32_t read_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half <-> float, round to nearest even (the F16C instructions' results, bit for bit) */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or NaN (quiet) */
        return (uint16_t)(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 | ((abs >> 13) & 0x3ff) : 0));
    if (abs >= 0x477ff000u) /* rounds to infinity */
        return (uint16_t)(sign | 0x7c00);
    if (abs < 0x38800000u) { /* subnormal half or zero */
        if (abs < 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = abs >> 23, man = (abs & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((abs >> 13) - (112u << 10)), rest = abs & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1)))
        half++;
    return (uint16_t)(sign | half);
}

/* whether a block of activations is all finite: a block with a NaN or an infinity gets no codes and a
 * NaN scale, so the rows it meets come out NaN on every path */
static inline int block_finite(const float *x) {
    int finite = 1;
    for (int j = 0; j < QK8; j++)
        finite &= (x[j] - x[j]) == 0.0f;
    return finite;
}

static inline void nan_block(ActRow *y, size_t b) {
    memset(y->qs + b * QK8, 0, QK8);
    y->d[b] = __builtin_nanf("");
    y->sums[b] = 0;
}

/* Q4_K's (and Q5_K's) j-th 6-bit scale and min of the 12 packed bytes q (ggml's get_scale_min_k4) */
static inline void q4_k_scale_min(const uint8_t *q, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K's s-th 6-bit scale of its 12 packed bytes q, less 32 (ggml's kmask unpacking, byte by byte) */
static inline int q3_k_scale(const uint8_t *q, int s) {
    const int i = s % 4, low = s < 8 ? q[s] & 0x0f : q[s - 8] >> 4, high = (q[8 + i] >> (2 * (s / 4))) & 3;
    return (low | high << 4) - 32;
}

/* IQ4_NL's and IQ4_XS's 16 code values (ggml's kvalues_iq4nl) */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* MXFP4's E2M1 values doubled into integers (ggml's kvalues_mxfp4), and its exponent byte e as the
 * float32 2^(e - 128) that multiplies them (ggml's e8m0 to float, halved; e < 2 a subnormal) */
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float read_fp16(const uint8_t *p) { return fp16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

/* a block's activation scale: amax / 127 rounded to float16 as llama.cpp stores it, and the factor
 * the codes are made with (127 / amax, 0 for an all-zero block) */
static inline void q8_scales(float amax, float *d, float *id) {
    *d = fp16_to_f32(f32_to_fp16(amax / 127.0f));
    *id = amax != 0.0f ? 127.0f / amax : 0.0f;
}

#endif
