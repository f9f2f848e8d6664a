/* moepass::MatMulPacked on the CPU: Y [.., N] = A [.., K] times the transpose of B, B the GGUF's own
 * blocks [N, row bytes] of GGML type `packed_type` in row groups of `row_group` (kernels.h). A's rows
 * are quantized one by one as llama.cpp quantizes them, so a row's result does not depend on the other
 * rows in the call. */
#include <stdlib.h>

#include "ops.h"

#define OP "MatMulPacked"
#define ROW_CHUNK 64 /* weight rows a task: whole row groups */
#define X_CHUNK 64   /* rows of A a call of the kernels */

typedef struct {
    int64_t type;
    const KernelTable *kernels;
} MatMul;

OrtStatus *matmul_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel) {
    MatMul m = {.kernels = kernels};
    int64_t row_group;
    OrtStatus *status;
    if ((status = packed_type_attribute(info, OP, &m.type)) || (status = row_group_attribute(info, OP, &row_group)))
        return status;
    MatMul *copy = malloc(sizeof m);
    if (!copy)
        return op_error(OP, "out of memory");
    *copy = m;
    *kernel = copy;
    return NULL;
}

typedef struct {
    BlockMatrix b;
    const float *a;
    float *y;
    uint8_t *act;
    size_t rows, k;
    const KernelTable *kernels;
} Work;

static void quantize_task(void *data, size_t t) {
    Work *w = data;
    ActRow x = act_row_at(w->act + t * act_row_bytes(w->k, w->b.act), w->k, w->b.act);
    w->kernels->quantize[w->b.act](w->a + t * w->k, w->k, &x);
}

static void rows_task(void *data, size_t i) {
    Work *w = data;
    size_t r0 = i * ROW_CHUNK, n = w->b.rows - r0 < ROW_CHUNK ? w->b.rows - r0 : ROW_CHUNK;
    ActRow x[X_CHUNK];
    float *outs[X_CHUNK];
    for (size_t t0 = 0; t0 < w->rows; t0 += X_CHUNK) {
        size_t nx = w->rows - t0 < X_CHUNK ? w->rows - t0 : X_CHUNK;
        for (size_t t = 0; t < nx; t++) {
            x[t] = act_row_at(w->act + (t0 + t) * act_row_bytes(w->k, w->b.act), w->k, w->b.act);
            outs[t] = w->y + (t0 + t) * w->b.rows + r0;
        }
        w->b.dot(w->b.data + r0 * w->b.row_bytes, w->b.row_bytes, n, w->b.blocks, x, nx, outs);
    }
}

OrtStatus *matmul_compute(void *kernel, OrtKernelContext *context) {
    const MatMul *m = kernel;
    Tensor a, b;
    OrtStatus *status;
    if ((status = read_input(context, 0, &a, OP)) || (status = read_input(context, 1, &b, OP)))
        return status;
    if (a.type != ORT_ELEMENT_FLOAT || a.rank < 1)
        return op_error(OP, "A must be a float32 tensor [.., K]");
    if (b.rank != 2)
        return op_error(OP, "B must be blocks [N, row bytes]");
    Work w = {.a = a.data, .k = (size_t)a.dims[a.rank - 1], .rows = 1, .kernels = m->kernels};
    if ((status = block_matrix(OP, "B", &b, m->type, w.k, m->kernels, &w.b)))
        return status;
    int64_t dims[MAX_RANK];
    for (size_t i = 0; i + 1 < a.rank; i++)
        w.rows *= (size_t)(dims[i] = a.dims[i]);
    dims[a.rank - 1] = (int64_t)w.b.rows;
    if ((status = make_output(context, 0, dims, a.rank, &w.y)) || w.rows == 0)
        return status;
    if (!(w.act = malloc(w.rows * act_row_bytes(w.k, w.b.act))))
        return op_error(OP, "out of memory for %zu rows", w.rows);
    parallel_for(context, quantize_task, w.rows, &w);
    parallel_for(context, rows_task, (w.b.rows + ROW_CHUNK - 1) / ROW_CHUNK, &w);
    free(w.act);
    return NULL;
}
