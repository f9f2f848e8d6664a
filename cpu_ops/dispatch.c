/* The one dispatch table: the quant types the kernels take, and which ISA's kernels run. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

const QuantType quant_types[QUANT_TYPES] = {
    {GGML_Q4_0, "Q4_0", 32, 18, ACT_Q8_0, {{0, 2, 2}, {2, 16, 4}}, 2},
    {GGML_Q8_0, "Q8_0", 32, 34, ACT_Q8_0, {{0, 2, 2}, {2, 32, 4}}, 2},
    {GGML_Q4_K, "Q4_K", 256, 144, ACT_Q8_K, {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 128, 4}}, 4},
    /* Q6_K's codes in the order its kernels read them (a read in order is prefetched; one that jumps
     * between ql and qh streams at a third of the rate): for each half h and part p, the low nibbles
     * of elements 128 h + 16 p.. and 128 h + 32 + 16 p.., then their high pairs */
    {GGML_Q6_K,
     "Q6_K",
     256,
     210,
     ACT_Q8_K,
     {{208, 2, 2},
      {192, 16, 1},
      {0, 16, 4},
      {32, 16, 4},
      {128, 16, 4},
      {16, 16, 4},
      {48, 16, 4},
      {144, 16, 4},
      {64, 16, 4},
      {96, 16, 4},
      {160, 16, 4},
      {80, 16, 4},
      {112, 16, 4},
      {176, 16, 4}},
     14},
    {GGML_Q5_K, "Q5_K", 256, 176, ACT_Q8_K, {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 32, 4}, {48, 128, 4}}, 5},
    {GGML_IQ4_NL, "IQ4_NL", 32, 18, ACT_Q8_0, {{0, 2, 2}, {2, 16, 4}}, 2},
    {GGML_IQ4_XS, "IQ4_XS", 256, 136, ACT_Q8_K, {{0, 2, 2}, {2, 2, 2}, {4, 4, 1}, {8, 128, 4}}, 4},
    {GGML_Q2_K, "Q2_K", 256, 84, ACT_Q8_K, {{80, 2, 2}, {82, 2, 2}, {0, 16, 1}, {16, 64, 4}}, 4},
    {GGML_Q3_K, "Q3_K", 256, 110, ACT_Q8_K, {{108, 2, 2}, {96, 12, 1}, {0, 32, 4}, {32, 64, 4}}, 4},
    {GGML_MXFP4, "MXFP4", 32, 17, ACT_Q8_0, {{0, 1, 1}, {1, 16, 4}}, 2},
    {GGML_Q5_0, "Q5_0", 32, 22, ACT_Q8_0, {{0, 2, 2}, {2, 4, 4}, {6, 16, 4}}, 3},
    {GGML_Q4_1, "Q4_1", 32, 20, ACT_Q8_0, {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}}, 3},
    {GGML_Q5_1, "Q5_1", 32, 24, ACT_Q8_0, {{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}}, 4},
};
const size_t quant_type_count = sizeof quant_types / sizeof quant_types[0];

int quant_type_index(int64_t ggml_type) {
    for (size_t i = 0; i < quant_type_count; i++)
        if (quant_types[i].ggml_type == ggml_type)
            return (int)i;
    return -1;
}

int isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case ISA_SCALAR:
        return 1;
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVX512:
        return isa_supported(ISA_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default:
        return 0;
    }
}

const KernelTable *kernels_by_isa(int isa) {
    static const KernelTable *tables[ISA_COUNT] = {&kernels_scalar, &kernels_avx2, &kernels_avx512};
    return isa >= 0 && isa < ISA_COUNT ? tables[isa] : NULL;
}

const KernelTable *choose_kernels(const char **why) {
    static const char *names[ISA_COUNT] = {"scalar", "avx2", "avx512"};
    const char *asked = getenv("MOEPASS_CPU_ISA");
    *why = NULL;
    if (asked && *asked) {
        for (int isa = 0; isa < ISA_COUNT; isa++)
            if (!strcmp(asked, names[isa])) {
                if (isa_supported(isa))
                    return kernels_by_isa(isa);
                *why = "MOEPASS_CPU_ISA names an instruction set this CPU lacks";
                return NULL;
            }
        *why = "MOEPASS_CPU_ISA is none of scalar, avx2, avx512";
        return NULL;
    }
    for (int isa = ISA_COUNT - 1; isa > 0; isa--)
        if (isa_supported(isa))
            return kernels_by_isa(isa);
    return &kernels_scalar;
}
