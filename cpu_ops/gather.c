/* moepass::GatherPacked on the CPU: Y [.., K] = the rows `indices` [..] of a table of GGUF blocks
 * [N, row bytes] of GGML type `packed_type` (the GGUF's own order, no row groups), each row dequantized
 * as ggml dequantizes it (dequantize_row): the token embedding as llama.cpp reads it, at the file's size. */
#include <stdlib.h>

#include "ops.h"

#define OP "GatherPacked"

typedef struct {
    int64_t type;
} Gather;

OrtStatus *gather_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel) {
    (void)kernels;
    Gather g;
    OrtStatus *status = packed_type_attribute(info, OP, &g.type);
    if (status)
        return status;
    Gather *copy = malloc(sizeof g);
    if (!copy)
        return op_error(OP, "out of memory");
    *copy = g;
    *kernel = copy;
    return NULL;
}

OrtStatus *gather_compute(void *kernel, OrtKernelContext *context) {
    const Gather *g = kernel;
    Tensor table, indices;
    OrtStatus *status;
    if ((status = read_input(context, 0, &table, OP)) || (status = read_input(context, 1, &indices, OP)))
        return status;
    const int index = quant_type_index(g->type);
    const QuantType *q = &quant_types[index];
    if (table.type != ORT_ELEMENT_UINT8 || table.rank != 2 || table.dims[1] % q->block_size || table.dims[0] <= 0)
        return op_error(OP, "the table must be %s blocks [rows, row bytes]", q->name);
    if (indices.type != ORT_ELEMENT_INT64 || indices.rank + 1 > MAX_RANK)
        return op_error(OP, "indices must be an int64 tensor of rank below %d", MAX_RANK);
    const size_t rows = (size_t)table.dims[0], row_bytes = (size_t)table.dims[1];
    const size_t k = row_bytes / (size_t)q->block_size * (size_t)q->block;
    int64_t dims[MAX_RANK];
    size_t count = 1;
    for (size_t i = 0; i < indices.rank; i++)
        count *= (size_t)(dims[i] = indices.dims[i]);
    dims[indices.rank] = (int64_t)k;
    const int64_t *ids = indices.data;
    for (size_t i = 0; i < count; i++) /* every index checked before a row is written */
        if (ids[i] < 0 || (size_t)ids[i] >= rows)
            return op_error(OP, "index %lld is outside the table's %zu rows", (long long)ids[i], rows);
    float *y;
    if ((status = make_output(context, 0, dims, indices.rank + 1, &y)))
        return status;
    const uint8_t *data = table.data;
    for (size_t i = 0; i < count; i++)
        dequantize_row(index, data + (size_t)ids[i] * row_bytes, k, y + i * k);
    return NULL;
}
