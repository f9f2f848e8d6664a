"""annotate-layers: mark every node with the device its layer runs on, for ONNX Runtime's layer assignment.

Sets node `metadata_props["layer_ann"]`: each MoE node `gpu/<node>` or `cpu/<node>` by the plan
(with the Casts at a CPU node's float16 boundary: passes/float16.py), every other node `gpu`. With
the session entry `session.layer_assignment_settings` = "gpu(gpu); cpu(cpu)" (prefix rules), ONNX
Runtime assigns the MoE nodes of CPU layers, and so their expert weights, to the CPU EP and
everything else to the GPU EP. Only metadata changes: the
model computes exactly what it did (partition has lowered it for the placement before).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.errors import MoepassError
from moepass.core.moe_nodes import moe_nodes


class AnnotateLayersPass(InPlacePass):
    """Annotate nodes for `on_gpu` ({MoE node name: runs on the GPU})."""

    def __init__(self, on_gpu: dict[str, bool]):
        super().__init__()
        self.on_gpu = on_gpu

    def call(self, model: ir.Model) -> PassResult:
        found = {m.name: m.node for m in moe_nodes(model.graph)}
        unknown = sorted(set(self.on_gpu) - set(found))
        if unknown:
            raise MoepassError(f"the plan names MoE node(s) the model does not have: {', '.join(unknown)}")
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            node.metadata_props[keys.LAYER_ANNOTATION] = "gpu"
        for name, node in found.items():
            annotation = keys.layer_annotation(name, self.on_gpu.get(name, True))
            node.metadata_props[keys.LAYER_ANNOTATION] = annotation
            if not self.on_gpu.get(name, True):  # the Casts at a CPU layer's boundary go with it
                for cast in _boundary_casts(node):
                    cast.metadata_props[keys.LAYER_ANNOTATION] = annotation
        return PassResult(model, modified=True)


def _boundary_casts(node: ir.Node) -> list[ir.Node]:
    """The Casts that only feed `node` (a float16 graph's values into a float32 CPU node) and those
    that only read its output (back to float16)."""
    found = []
    for value in node.inputs:
        if value is None:
            continue
        producer = value.producer()
        if producer is not None and producer.op_type == "Cast" and all(u.node is node for u in value.uses()):
            found.append(producer)
    for out in node.outputs:
        found += [u.node for u in out.uses() if u.node.op_type == "Cast" and len(out.uses()) == 1]
    return found
