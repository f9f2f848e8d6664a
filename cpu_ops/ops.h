/* What the operators share: reading ONNX Runtime's tensors through the OrtApi, errors as OrtStatus,
 * the session's thread pool, and the row products over GGUF blocks that both operators run. */
#ifndef MOEPASS_OPS_H
#define MOEPASS_OPS_H

#include "kernels.h"
#include "ort_abi.h"

#define MAX_RANK 8

typedef struct {
    const OrtValue *value;
    int type;
    size_t rank;
    int64_t dims[MAX_RANK];
    void *data;
} Tensor;

/* an error naming the operator, as ONNX Runtime raises it */
OrtStatus *op_error(const char *op, const char *format, ...) __attribute__((format(printf, 2, 3)));
/* input `index` (absent optional input: t->value NULL) */
OrtStatus *read_input(OrtKernelContext *context, size_t index, Tensor *t, const char *op);
OrtStatus *make_output(OrtKernelContext *context, size_t index, const int64_t *dims, size_t rank, float **data);
/* fn(data, i) for i in [0, n) on the session's intra-op threads (serially where there are none) */
void parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t n, void *data);

/* a [rows, row bytes] matrix of one GGUF type, checked against the K its rows hold */
typedef struct {
    const uint8_t *data;
    size_t rows, row_bytes, k, blocks;
    DotTile dot;
    int act;
} BlockMatrix;

/* the matrix of `type` in the last two axes of t (rank 2, or 3 with `experts` first), its rows holding
 * `k` elements; an error naming `what` where the bytes do not hold that */
OrtStatus *block_matrix(const char *op, const char *what, const Tensor *t, int64_t type, size_t k,
                        const KernelTable *kernels, BlockMatrix *m);

/* the packed_type attribute: required, a GGML type the kernels take */
OrtStatus *packed_type_attribute(const OrtKernelInfo *info, const char *op, int64_t *out);

/* the row_group attribute: required, and the kernels' ROW_GROUP (a model of other rows is refused) */
OrtStatus *row_group_attribute(const OrtKernelInfo *info, const char *op, int64_t *out);

OrtStatus *moe_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel);
OrtStatus *moe_compute(void *kernel, OrtKernelContext *context);
OrtStatus *matmul_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel);
OrtStatus *matmul_compute(void *kernel, OrtKernelContext *context);
OrtStatus *gather_create(const OrtKernelInfo *info, const KernelTable *kernels, void **kernel);
OrtStatus *gather_compute(void *kernel, OrtKernelContext *context);

#endif
