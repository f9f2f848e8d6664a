/* The few pieces of ONNX Runtime's C ABI that moepass's kernels use, declared from the published C API
 * reference (onnxruntime_c_api.h is not shipped by any wheel): opaque handles, the OrtApiBase entry,
 * the OrtCustomOp record, and the OrtApi functions called, by their fixed slot in the OrtApi table
 * (ONNX Runtime never moves a slot: it holds them with static_asserts). */
#ifndef MOEPASS_ORT_ABI_H
#define MOEPASS_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtApi OrtApi; /* a table of function pointers, read by slot below */
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_ELEMENT_UNDEFINED = 0, ORT_ELEMENT_FLOAT = 1, ORT_ELEMENT_UINT8 = 2, ORT_ELEMENT_INT64 = 7 };
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ORT_IO_REQUIRED = 0, ORT_IO_OPTIONAL = 1 };

typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *op);
    int (*GetInputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const OrtCustomOp *op);
    int (*GetOutputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    /* later fields (shape inference, opset range, in-place and alias maps) are read only from version 17 on */
};
/* CreateKernelV2 / KernelComputeV2 are read from this version on; the fields after them are not */
#define MOEPASS_CUSTOM_OP_VERSION 16
/* the oldest OrtApi version whose slots these kernels call (KernelContext_ParallelFor came in 17) */
#define MOEPASS_ORT_API_VERSION 17

/* OrtApi slots */
#define ORT_SLOT_CreateStatus 0
#define ORT_SLOT_CreateCustomOpDomain 26
#define ORT_SLOT_CustomOpDomain_Add 27
#define ORT_SLOT_AddCustomOpDomain 28
#define ORT_SLOT_GetTensorMutableData 51
#define ORT_SLOT_GetTensorElementType 60
#define ORT_SLOT_GetDimensionsCount 61
#define ORT_SLOT_GetDimensions 62
#define ORT_SLOT_GetTensorTypeAndShape 65
#define ORT_SLOT_KernelInfoGetAttribute_float 85
#define ORT_SLOT_KernelInfoGetAttribute_int64 86
#define ORT_SLOT_KernelInfoGetAttribute_string 87
#define ORT_SLOT_KernelContext_GetInputCount 88
#define ORT_SLOT_KernelContext_GetInput 90
#define ORT_SLOT_KernelContext_GetOutput 91
#define ORT_SLOT_ReleaseStatus 93
#define ORT_SLOT_ReleaseTensorTypeAndShapeInfo 99
#define ORT_SLOT_KernelContext_ParallelFor 274

/* The OrtApi functions called, typed, looked up once from the table ONNX Runtime hands in. */
typedef struct OrtFunctions {
    OrtStatus *(*CreateStatus)(int code, const char *message);
    OrtStatus *(*CreateCustomOpDomain)(const char *domain, OrtCustomOpDomain **out);
    OrtStatus *(*CustomOpDomain_Add)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
    OrtStatus *(*AddCustomOpDomain)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
    OrtStatus *(*GetTensorMutableData)(OrtValue *value, void **out);
    OrtStatus *(*GetTensorElementType)(const OrtTensorTypeAndShapeInfo *info, int *out);
    OrtStatus *(*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
    OrtStatus *(*GetDimensions)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t count);
    OrtStatus *(*GetTensorTypeAndShape)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
    OrtStatus *(*KernelInfoGetAttribute_float)(const OrtKernelInfo *info, const char *name, float *out);
    OrtStatus *(*KernelInfoGetAttribute_int64)(const OrtKernelInfo *info, const char *name, int64_t *out);
    OrtStatus *(*KernelInfoGetAttribute_string)(const OrtKernelInfo *info, const char *name, char *out, size_t *size);
    OrtStatus *(*KernelContext_GetInputCount)(const OrtKernelContext *context, size_t *out);
    OrtStatus *(*KernelContext_GetInput)(const OrtKernelContext *context, size_t index, const OrtValue **out);
    OrtStatus *(*KernelContext_GetOutput)(OrtKernelContext *context, size_t index, const int64_t *dims,
                                          size_t count, OrtValue **out);
    void (*ReleaseStatus)(OrtStatus *status);
    void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo *info);
    OrtStatus *(*KernelContext_ParallelFor)(const OrtKernelContext *context, void (*fn)(void *, size_t),
                                            size_t total, size_t batches, void *data);
} OrtFunctions;

/* filled by RegisterCustomOps from the OrtApi it is handed */
extern OrtFunctions ort;

#endif
