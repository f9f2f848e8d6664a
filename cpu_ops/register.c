/* The library's entry point (RegisterCustomOps) and the glue to ONNX Runtime's C ABI: the ops of the
 * "moepass" domain, the OrtApi slots the kernels call, tensors in and out, errors, the thread pool. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define DOMAIN "moepass"

OrtFunctions ort;
static const KernelTable *chosen;

OrtStatus *op_error(const char *op, const char *format, ...) {
    char message[512];
    int n = snprintf(message, sizeof message, "%s::%s: ", DOMAIN, op);
    va_list args;
    va_start(args, format);
    vsnprintf(message + n, sizeof message - (size_t)n, format, args);
    va_end(args);
    return ort.CreateStatus(ORT_INVALID_ARGUMENT, message);
}

OrtStatus *read_input(OrtKernelContext *context, size_t index, Tensor *t, const char *op) {
    memset(t, 0, sizeof *t);
    size_t count = 0;
    OrtStatus *status = ort.KernelContext_GetInputCount(context, &count);
    if (status || index >= count)
        return status;
    if ((status = ort.KernelContext_GetInput(context, index, &t->value)) || !t->value)
        return status;
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((status = ort.GetTensorTypeAndShape(t->value, &info)))
        return status;
    if (!(status = ort.GetTensorElementType(info, &t->type)) && !(status = ort.GetDimensionsCount(info, &t->rank))) {
        if (t->rank > MAX_RANK)
            status = op_error(op, "input %zu has rank %zu", index, t->rank);
        else
            status = ort.GetDimensions(info, t->dims, t->rank);
    }
    ort.ReleaseTensorTypeAndShapeInfo(info);
    if (!status)
        status = ort.GetTensorMutableData((OrtValue *)t->value, &t->data);
    return status;
}

OrtStatus *make_output(OrtKernelContext *context, size_t index, const int64_t *dims, size_t rank, float **data) {
    OrtValue *value = NULL;
    OrtStatus *status = ort.KernelContext_GetOutput(context, index, dims, rank, &value);
    return status ? status : ort.GetTensorMutableData(value, (void **)data);
}

void parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t n, void *data) {
    if (n > 1) {
        OrtStatus *status = ort.KernelContext_ParallelFor(context, fn, n, 0, data);
        if (!status)
            return;
        ort.ReleaseStatus(status);
    }
    for (size_t i = 0; i < n; i++)
        fn(data, i);
}

OrtStatus *block_matrix(const char *op, const char *what, const Tensor *t, int64_t type, size_t k,
                        const KernelTable *kernels, BlockMatrix *m) {
    int index = quant_type_index(type);
    if (index < 0)
        return op_error(op, "%s: GGML type %lld is not one these kernels take", what, (long long)type);
    const QuantType *q = &quant_types[index];
    if (t->type != ORT_ELEMENT_UINT8 || t->rank < 2)
        return op_error(op, "%s: expected uint8 blocks [rows, row bytes]", what);
    int64_t rows = t->dims[t->rank - 2], row_bytes = t->dims[t->rank - 1];
    if (k % (size_t)q->block || (size_t)row_bytes != k / (size_t)q->block * (size_t)q->block_size || rows <= 0)
        return op_error(op, "%s: rows of %lld bytes do not hold %zu %s elements", what, (long long)row_bytes, k,
                        q->name);
    m->data = t->data;
    m->rows = (size_t)rows;
    m->row_bytes = (size_t)row_bytes;
    m->k = k;
    m->blocks = k / (size_t)q->block;
    m->dot = kernels->dot[index];
    m->act = q->act;
    return NULL;
}

OrtStatus *packed_type_attribute(const OrtKernelInfo *info, const char *op, int64_t *out) {
    OrtStatus *status = ort.KernelInfoGetAttribute_int64(info, "packed_type", out);
    if (status) {
        ort.ReleaseStatus(status);
        return op_error(op, "attribute packed_type is required");
    }
    if (quant_type_index(*out) < 0)
        return op_error(op, "packed_type %lld: a GGML type these kernels do not take", (long long)*out);
    return NULL;
}

OrtStatus *row_group_attribute(const OrtKernelInfo *info, const char *op, int64_t *out) {
    OrtStatus *status = ort.KernelInfoGetAttribute_int64(info, "row_group", out);
    if (status) {
        ort.ReleaseStatus(status);
        return op_error(op, "attribute row_group is required (the weights' rows in groups of %d: convert the "
                            "model again with this moepass)", ROW_GROUP);
    }
    if (*out != ROW_GROUP)
        return op_error(op, "row_group %lld: these kernels take rows in groups of %d", (long long)*out, ROW_GROUP);
    return NULL;
}

/* ---- the operator records ----------------------------------------------------------------------- */
typedef struct {
    OrtCustomOp base;
    const char *name;
    size_t inputs, required_inputs;
    int input_types[12];
    OrtStatus *(*create)(const OrtKernelInfo *, const KernelTable *, void **);
    OrtStatus *(*compute)(void *, OrtKernelContext *);
} Op;

static const char *op_name(const OrtCustomOp *op) { return ((const Op *)op)->name; }
static const char *op_provider(const OrtCustomOp *op) {
    (void)op;
    return "CPUExecutionProvider";
}
static int op_input_type(const OrtCustomOp *op, size_t i) { return ((const Op *)op)->input_types[i]; }
static size_t op_input_count(const OrtCustomOp *op) { return ((const Op *)op)->inputs; }
static int op_output_type(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return ORT_ELEMENT_FLOAT;
}
static size_t op_output_count(const OrtCustomOp *op) {
    (void)op;
    return 1;
}
static int op_input_characteristic(const OrtCustomOp *op, size_t i) {
    return i < ((const Op *)op)->required_inputs ? ORT_IO_REQUIRED : ORT_IO_OPTIONAL;
}
static int op_output_characteristic(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return ORT_IO_REQUIRED;
}
static int op_memory_type(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return 0; /* OrtMemTypeDefault */
}
static int op_one(const OrtCustomOp *op) {
    (void)op;
    return 1;
}

typedef struct {
    OrtStatus *(*compute)(void *, OrtKernelContext *);
    void *state;
} Kernel;

static OrtStatus *op_create(const OrtCustomOp *base, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)api;
    const Op *op = (const Op *)base;
    Kernel *kernel = calloc(1, sizeof *kernel);
    if (!kernel)
        return ort.CreateStatus(ORT_FAIL, "moepass: out of memory");
    kernel->compute = op->compute;
    OrtStatus *status = op->create(info, chosen, &kernel->state);
    if (status) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}

static OrtStatus *op_compute(void *kernel, OrtKernelContext *context) {
    Kernel *k = kernel;
    return k->compute(k->state, context);
}

static void op_destroy(void *kernel) {
    if (kernel)
        free(((Kernel *)kernel)->state);
    free(kernel);
}

#define OP_RECORD(NAME, INPUTS, REQUIRED, TYPES, CREATE, COMPUTE)                                                  \
    {{MOEPASS_CUSTOM_OP_VERSION, NULL, op_name, op_provider, op_input_type, op_input_count, op_output_type,       \
      op_output_count, NULL, op_destroy, op_input_characteristic, op_output_characteristic, op_memory_type, op_one, \
      op_one, op_one, op_one, op_create, op_compute},                                                             \
     NAME, INPUTS, REQUIRED, TYPES, CREATE, COMPUTE}

enum { F = ORT_ELEMENT_FLOAT, U8 = ORT_ELEMENT_UINT8, I64 = ORT_ELEMENT_INT64 };
/* moepass::MoEPacked: hidden [.., H], router logits [T, E], gate, up, down blobs [E, rows, row bytes],
 * then optional router_weights [T, E], gate and up biases [E, ffn], down bias [E, H]; moepass::MatMulPacked:
 * A [.., K], B blocks [N, row bytes]; moepass::GatherPacked: a table of blocks [N, row bytes], indices [..] */
static Op ops[] = {
    OP_RECORD("MoEPacked", 9, 5, ((int[12]){F, F, U8, U8, U8, F, F, F, F}), moe_create, moe_compute),
    OP_RECORD("MatMulPacked", 2, 2, ((int[12]){F, U8}), matmul_create, matmul_compute),
    OP_RECORD("GatherPacked", 2, 2, ((int[12]){U8, I64}), gather_create, gather_compute),
};

static OrtCustomOpDomain *domain;

/* the instruction set the kernels run ("scalar", "avx2", "avx512"), for moepass.cpu_ops */
__attribute__((visibility("default"))) const char *moepass_cpu_isa(void) {
    const char *why;
    const KernelTable *table = choose_kernels(&why);
    return table ? table->name : why;
}

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(MOEPASS_ORT_API_VERSION);
    if (!api) {
        fprintf(stderr, "moepass.cpu_ops: ONNX Runtime %s offers no API version %d\n", base->GetVersionString(),
                MOEPASS_ORT_API_VERSION);
        return NULL; /* without an OrtApi no status can be made; ONNX Runtime then lacks the ops and says so */
    }
    void *const *slots = (void *const *)api;
#define SLOT(NAME) memcpy(&ort.NAME, &slots[ORT_SLOT_##NAME], sizeof(void *))
    SLOT(CreateStatus), SLOT(CreateCustomOpDomain), SLOT(CustomOpDomain_Add), SLOT(AddCustomOpDomain);
    SLOT(GetTensorMutableData), SLOT(GetTensorElementType), SLOT(GetDimensionsCount), SLOT(GetDimensions);
    SLOT(GetTensorTypeAndShape), SLOT(KernelInfoGetAttribute_float), SLOT(KernelInfoGetAttribute_int64);
    SLOT(KernelInfoGetAttribute_string);
    SLOT(KernelContext_GetInputCount), SLOT(KernelContext_GetInput), SLOT(KernelContext_GetOutput);
    SLOT(ReleaseStatus), SLOT(ReleaseTensorTypeAndShapeInfo), SLOT(KernelContext_ParallelFor);
#undef SLOT
    const char *why;
    chosen = choose_kernels(&why);
    if (!chosen)
        return ort.CreateStatus(ORT_INVALID_ARGUMENT, why);
    OrtStatus *status;
    if (!domain) { /* one domain for the process: ONNX Runtime keeps a pointer to it in every session */
        if ((status = ort.CreateCustomOpDomain(DOMAIN, &domain)))
            return status;
        for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
            if ((status = ort.CustomOpDomain_Add(domain, &ops[i].base)))
                return status;
    }
    return ort.AddCustomOpDomain(options, domain);
}

/* ---- the kernels alone, for tests (moepass.cpu_ops.matmul): no ONNX Runtime in between ---------------- */

/* y [rows, n] = a [rows, k] times the transpose of the blocks b [n, row bytes] of `type` (in row groups),
 * on `isa`'s kernels, the rows of a as one tile; 0, or -1 where the ISA or type is not there or the bytes
 * do not hold k elements a row */
__attribute__((visibility("default"))) int moepass_matmul(int isa, int64_t type, const uint8_t *b, size_t n,
                                                          size_t row_bytes, const float *a, size_t rows, size_t k,
                                                          float *y) {
    int index = quant_type_index(type);
    const KernelTable *table = isa_supported(isa) ? kernels_by_isa(isa) : NULL;
    if (!table || index < 0 || k % (size_t)quant_types[index].block ||
        row_bytes != k / (size_t)quant_types[index].block * (size_t)quant_types[index].block_size)
        return -1;
    const int format = quant_types[index].act;
    uint8_t *act = malloc(rows * act_row_bytes(k, format) + 1);
    ActRow *x = malloc(rows * sizeof *x + 1);
    float **out = malloc(rows * sizeof *out + 1);
    int failed = !act || !x || !out;
    for (size_t t = 0; !failed && t < rows; t++) {
        x[t] = act_row_at(act + t * act_row_bytes(k, format), k, format);
        out[t] = y + t * n;
        table->quantize[format](a + t * k, k, &x[t]);
    }
    if (!failed)
        table->dot[index](b, row_bytes, n, k / (size_t)quant_types[index].block, x, rows, out);
    free(act), free(x), free(out);
    return failed ? -1 : 0;
}

/* x [k] quantized on `isa`'s kernels to activation format `act` (ACT_*) into codes [k], scales [k / its
 * block] and sums [k / its sum block] */
__attribute__((visibility("default"))) int moepass_quantize(int isa, int act, const float *x, size_t k, int8_t *qs,
                                                            float *d, int32_t *sums) {
    const KernelTable *table = isa_supported(isa) ? kernels_by_isa(isa) : NULL;
    if (!table || act < 0 || act >= ACT_FORMATS || k % (size_t)act_formats[act].block)
        return -1;
    ActRow y = {qs, d, sums};
    table->quantize[act](x, k, &y);
    return 0;
}
