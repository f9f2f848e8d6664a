"""expose-router-logits: make each MoE node's router logits a graph output (for profiling copies).

The profiler runs this on a copy of a converted model so that one ONNX Runtime run yields, beside
the logits, the [tokens, experts] router logits of every MoE layer.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.ir_values import dims, required_input
from moepass.core.moe_nodes import ROUTER_LOGITS, is_moe


class ExposeRouterLogitsPass(InPlacePass):
    """Add `moepass.router_logits.<node>` outputs; `outputs` maps node name -> output name."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[str, str] = {}

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        for node in graph:
            if not is_moe(node):
                continue
            logits = required_input(node, ROUTER_LOGITS)
            node_name = node.name or f"<{node.op_type}>"
            experts = dims(required_input(node, 2).shape, f"{node_name}'s fc1 weights")[0]
            name = keys.ROUTER_LOGITS_PREFIX + node_name
            # An Identity keeps the original value's name and users untouched.
            exposed = ir.node("Identity", [logits], name=f"{node_name}.expose_router")
            exposed.outputs[0].name = name
            # the router logits have the activation type (float16 in the offload format), as the node's output
            exposed.outputs[0].dtype = logits.dtype or node.outputs[0].dtype or ir.DataType.FLOAT
            exposed.outputs[0].shape = ir.Shape(["tokens", experts])
            graph.insert_after(node, exposed)
            graph.outputs.append(exposed.outputs[0])
            self.outputs[node_name] = name
        return PassResult(model, bool(self.outputs))
