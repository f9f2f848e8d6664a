"""expose-router-logits: make each MoE node's router logits a graph output (for profiling copies).

The profiler runs this on a copy of a converted model so that one ONNX Runtime run yields, beside
the logits, the [tokens, experts] router logits of every MoE layer.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
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
            logits = node.inputs[ROUTER_LOGITS]
            name = keys.ROUTER_LOGITS_PREFIX + node.name
            # An Identity keeps the original value's name and users untouched.
            exposed = ir.node("Identity", [logits], name=f"{node.name}.expose_router")
            exposed.outputs[0].name = name
            # the router logits have the activation type (float16 in the offload format), as the node's output
            exposed.outputs[0].dtype = logits.dtype or node.outputs[0].dtype or ir.DataType.FLOAT
            exposed.outputs[0].shape = ir.Shape(["tokens", node.inputs[2].shape[0]])
            graph.insert_after(node, exposed)
            graph.outputs.append(exposed.outputs[0])
            self.outputs[node.name] = name
        return PassResult(model, bool(self.outputs))
