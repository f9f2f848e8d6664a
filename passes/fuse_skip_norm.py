"""fuse-skip-norm: residual Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization.

A pre-norm decoder adds each block's output to the residual stream and normalizes the sum for the
next block. ONNX Runtime's SkipSimplifiedLayerNormalization does both in one pass over the data
and also returns the sum (output 3), which stays the residual stream.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.ir_values import input_at, producer


def _why_not(add: ir.Node | None, norm: ir.Node) -> str | None:
    """None when the pair fuses, else the reason it does not."""
    if add is None or add.op_type != "Add" or add.domain != "":
        return "the normalized value is not produced by an Add"
    if any(v is None or v.is_initializer() or ir.convenience.get_const_tensor(v) is not None for v in add.inputs):
        return "an Add operand is a constant (a bias, not a residual)"
    axis = norm.attributes.get_int("axis", -1)
    if axis != -1:
        return f"normalization over axis {axis}, the fused op normalizes the last axis"
    if len(norm.inputs) > 2 and norm.inputs[2] is not None:
        return "the normalization has a bias"
    return None


class FuseSkipNormPass(InPlacePass):
    """Fold `Add(a, b) -> SimplifiedLayerNormalization` into one SkipSimplifiedLayerNormalization."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[tuple[str, str]] = []  # (norm node, reason) for the ones left alone

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        for norm in list(graph):
            if norm.op_type != "SimplifiedLayerNormalization" or norm.domain != "":
                continue
            add = producer(input_at(norm, 0))
            reason = _why_not(add, norm)
            if reason or add is None:
                self.skipped.append((norm.name or "", reason or "no Add before it"))
                continue
            summed = add.outputs[0]
            fused = ir.node(
                "SkipSimplifiedLayerNormalization",
                [add.inputs[0], add.inputs[1], norm.inputs[1]],
                attributes={"epsilon": norm.attributes.get_float("epsilon", 1e-5)},
                domain="com.microsoft",
                num_outputs=4,
                name=norm.name,
                metadata_props={keys.FUSED_FROM: f"{add.name},{norm.name}"},
            )
            graph.insert_before(add, fused)
            normed, _, _, residual = fused.outputs
            normed.name, normed.shape, normed.type = norm.outputs[0].name, norm.outputs[0].shape, norm.outputs[0].type
            users_of_sum = [u for u in summed.uses() if u.node is not norm]
            ir.convenience.replace_all_uses_with(norm.outputs[0], normed, replace_graph_outputs=True)
            if users_of_sum or summed.is_graph_output():
                ir.convenience.replace_all_uses_with(summed, residual, replace_graph_outputs=True)
                residual.name = summed.name
            else:
                residual.name = f"{norm.name}.unused_sum"
            graph.remove([norm, add], safe=True)
            modified = True
        if "com.microsoft" not in model.opset_imports and modified:
            model.opset_imports["com.microsoft"] = 1
        return PassResult(model, modified)
