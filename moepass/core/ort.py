"""ONNX Runtime's operators that moepass writes beyond ONNX's own, one record each: the type each
output takes, the inputs and outputs fixed to float32 whatever the graph computes in, whether it
is a quantized matrix product (accuracy_level), and the activation types its CUDA kernel is
registered for (None: no CUDA kernel), with the source file that says so. The passes and the
capability checks read their facts from here (ir_values.infer_dtypes, passes.float16,
passes.activations, capabilities.cuda_refusal); tests/test_ort_operators.py checks every record
against the operator schemas and kernel registrations of the installed ONNX Runtime wheel.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

CUDA_CONTRIB = "onnxruntime/contrib_ops/cuda/"
CUDA_REGISTRY = CUDA_CONTRIB + "cuda_contrib_kernels.cc"
HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
FLOATS = (ir.DataType.FLOAT, *HALF)


@dataclasses.dataclass(frozen=True)
class Operator:
    """One operator as moepass's graphs use it.

    output_types: for each output, the input whose element type it takes (None: float32 whatever
        the inputs), as its schema's type constraints say.
    float_inputs, float_outputs: the slots its schema fixes to float32 (a float16 graph keeps them).
    quantized_matmul: a quantized matrix product, whose accuracy_level sets int8 activations.
    cuda_types: the activation types its CUDA kernel is registered for; None: no CUDA kernel.
    cuda_source: where that registration (or its absence) was read.
    """

    domain: str
    op_type: str
    output_types: tuple[int | None, ...]
    float_inputs: frozenset[int] = frozenset()
    float_outputs: frozenset[int] = frozenset()
    quantized_matmul: bool = False
    cuda_types: tuple[ir.DataType, ...] | None = FLOATS
    cuda_source: str = CUDA_REGISTRY

    @property
    def key(self) -> tuple[str, str]:
        return self.domain, self.op_type


OPERATORS: dict[tuple[str, str], Operator] = {
    op.key: op
    for op in (
        Operator(
            "com.microsoft",
            "QMoE",
            (0,),
            float_inputs=frozenset({15, 16, 17, 18}),  # the global and activation scales
            quantized_matmul=True,
            cuda_types=HALF,
            cuda_source=CUDA_CONTRIB + "moe/moe_quantization.cc",
        ),
        Operator("com.microsoft", "MoE", (0,), cuda_source=CUDA_CONTRIB + "moe/moe.cc"),
        # ONNX Runtime 1.32's schema: float16/bfloat16, CUDA only ("CUDA execution requires weights in
        # device memory"); which GGML type ids its CUDA kernel decodes is not known here (docs/gpu.md)
        Operator(
            "com.microsoft",
            "MoEPacked",
            (0,),
            cuda_types=HALF,
            cuda_source="the 1.32 MoEPacked schema (docs/PackedWeightFormats.md)",
        ),
        Operator(
            "com.microsoft",
            "GroupQueryAttention",
            (0, 3, 3, 0),
            float_inputs=frozenset({12, 13}),  # k_scale, v_scale
            cuda_types=HALF,
            cuda_source=CUDA_CONTRIB + "bert/group_query_attention.cc",
        ),
        Operator(
            "com.microsoft",
            "MatMulNBits",
            (0,),
            quantized_matmul=True,
            cuda_source=CUDA_CONTRIB + "quantization/matmul_nbits.cc",
        ),
        Operator(
            "com.microsoft",
            "GatherBlockQuantized",
            (2,),
            cuda_source=CUDA_CONTRIB + "quantization/gather_block_quantized.cc",
        ),
        Operator(
            "com.microsoft", "SkipSimplifiedLayerNormalization", (0, None, None, 0), float_outputs=frozenset({1, 2})
        ),
        Operator(
            "",
            "SimplifiedLayerNormalization",
            (1, None),
            float_outputs=frozenset({1}),
            cuda_source=CUDA_CONTRIB + "layer_norm.cc",
        ),
        Operator(
            "com.microsoft",
            "MoEGroupRouter",
            (0, None, None),
            float_inputs=frozenset({1}),
            float_outputs=frozenset({1, 2}),
            cuda_types=None,  # no such kernel in the registry read
        ),
    )
}


def operator(node: ir.Node) -> Operator | None:
    """The record of `node`'s operator; None for ONNX's own operators (their schemas say it all)."""
    return OPERATORS.get((node.domain or "", node.op_type))
