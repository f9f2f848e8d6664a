"""kv-cache: every GroupQueryAttention's KV cache in another type than the float32 it was lowered in.

float16: the cache's inputs and outputs (past and present keys and values) take float16; ONNX
Runtime converts as it writes and reads them. int8: they take int8, with a fixed scale per KV head
and channel (`k_scale` / `v_scale` [kv_heads, 1, head_size], `k_quant_type` / `v_quant_type`
PER_CHANNEL, `kv_cache_bit_width` 8), the scales calibrated on the written float32 model by
moepass.pipeline.kv_precision (a calibration runs the model, so int8 is given after the model is
written; float16 runs in convert's pipeline, before it is).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core.ir_values import required_input

KINDS = {"float16": ir.DataType.FLOAT16, "int8": ir.DataType.INT8}


class KvCachePass(InPlacePass):
    """Give every GroupQueryAttention a `kind` cache ("float16" or "int8"); `scales`: for int8, each
    present output's name -> its per-channel scales [kv_heads, head_size] (float32)."""

    def __init__(self, kind: str, scales: dict[str, np.ndarray] | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kv-cache: {kind!r} is not one of {', '.join(KINDS)}")
        if (kind == "int8") != (scales is not None):
            raise ValueError("kv-cache: an int8 cache takes calibrated scales, and only it")
        self.kind, self.scales = kind, scales or {}

    def call(self, model: ir.Model) -> PassResult:
        attention = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
        for node in attention:
            for value in (required_input(node, 3), required_input(node, 4), node.outputs[1], node.outputs[2]):
                value.type = ir.TensorType(KINDS[self.kind])
            if self.kind == "int8":
                self._quantized(model.graph, node)
        return PassResult(model, modified=bool(attention))

    def _quantized(self, graph: ir.Graph, node: ir.Node) -> None:
        node.resize_inputs(14)  # k_scale, v_scale: inputs 12 and 13, the optional ones before them left empty
        for index, output in ((12, node.outputs[1]), (13, node.outputs[2])):
            present = output.name or ""
            scale = self.scales[present].astype(np.float32)[:, None, :]  # [kv_heads, 1, head_size]
            name = present.replace("present.", "kv_scale.")
            initializer = ir.Value(
                name=name,
                type=ir.TensorType(ir.DataType.FLOAT),
                shape=ir.Shape(scale.shape),
                const_value=ir.tensor(scale, name=name),
            )
            graph.register_initializer(initializer)
            node.replace_input_with(index, initializer)
        for key in ("k_quant_type", "v_quant_type"):
            node.attributes[key] = ir.AttrString(key, "PER_CHANNEL")
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
