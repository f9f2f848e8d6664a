"""Finding the MoE layers of a graph: com.microsoft QMoE / MoE nodes and what feeds them.

Input layout shared by both ops: 0 activations, 1 router logits, 2.. expert weights (QMoE: fc1
weights/scales/bias 2-4, fc2 5-7, fc3 8-10, zero points 11-13; MoE: fc1 weights/bias 2-3, fc2 4-5,
fc3 6-7). Every initializer among the expert inputs has the experts on its first axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

MOE_OPS = ("QMoE", "MoE")
# Inputs that carry per-expert tensors (first axis = experts); router_weights (14) and the
# global FP4/FP8 scales (15..) are per token or per tensor.
EXPERT_INPUTS = {"QMoE": range(2, 14), "MoE": range(2, 8)}


def is_moe(node: ir.Node) -> bool:
    return node.domain == "com.microsoft" and node.op_type in MOE_OPS


@dataclasses.dataclass
class MoeNode:
    node: ir.Node
    experts: int
    top_k: int
    normalize: bool
    expert_values: list[ir.Value]   # initializers with experts on axis 0

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def hidden(self) -> int:
        """Model width: rows of fc2 ([E, hidden, ...] in both ops and every weight format)."""
        fc2 = self.node.inputs[5 if self.node.op_type == "QMoE" else 4]
        return int(fc2.const_value.shape[1])

    @property
    def ffn(self) -> int:
        """Expert intermediate size: fc1 rows are [gate, up] interleaved for SwiGLU, 2 * ffn."""
        rows = int(self.node.inputs[2].const_value.shape[1])
        swiglu = self.node.attributes.get_string("activation_type", "") == "swiglu"
        return rows // 2 if swiglu else rows

    @property
    def bytes_per_expert(self) -> int:
        return sum(tensor_bytes(v) for v in self.expert_values) // self.experts


def tensor_bytes(value: ir.Value) -> int:
    tensor = value.const_value
    return 0 if tensor is None else int(np.prod(tensor.shape.numpy(), dtype=np.int64) * tensor.dtype.itemsize)


def moe_nodes(graph: ir.Graph) -> list[MoeNode]:
    """The MoE nodes of the main graph, in graph order."""
    found = []
    for node in graph:
        if not is_moe(node):
            continue
        inputs = [node.inputs[i] for i in EXPERT_INPUTS[node.op_type] if i < len(node.inputs)]
        values = [v for v in inputs if v is not None and v.is_initializer()]
        experts = int(values[0].const_value.shape[0])
        if any(int(v.const_value.shape[0]) != experts for v in values):
            raise ValueError(f"MoE node {node.name}: expert tensors disagree on the number of experts")
        found.append(MoeNode(node, experts, node.attributes.get_int("k", 1),
                             bool(node.attributes.get_int("normalize_routing_weights", 0)), values))
    return found
