"""ONNX Runtime's MoE operators: how a com.microsoft::QMoE / MoE node is laid out, made and found.

Input slots (ONNX Runtime's contrib op schema): 0 activations [T, H], 1 router logits [T, E]
(the kernel does softmax, top-k and renormalization over the k), then the experts. QMoE: fc1
weights/scales/bias 2-4, fc2 5-7, fc3 8-10, zero points 11-13, router_weights 14 (the mixing
weights; the selection still follows input 1), FP4/FP8 global scales 15 and up. MoE: fc1
weights/bias 2-3, fc2 4-5, fc3 6-7. Every initializer among the expert inputs has the experts on
its first axis. `moe_node` is the one place that writes this layout; `moe_nodes` reads it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from moepass.core import keys
from moepass.core.errors import MoepassError
from moepass.core.ir_values import input_at, tensor_dims, tensor_of
from moepass.core.quants import BlockForm, parse_form
from moepass.core.row_groups import ROW_GROUP

MOE_OPS = ("QMoE", "MoE", "MoEPacked")
# Inputs that carry per-expert tensors (first axis = experts); router_weights (14) and the
# global FP4/FP8 scales (15..) are per token or per tensor.
EXPERT_INPUTS = {"QMoE": range(2, 14), "MoE": range(2, 8), "MoEPacked": range(2, 5)}
# com.microsoft::MoEPacked (ONNX Runtime 1.32, CUDA only): the GGUF's own expert blocks, one blob
# [E, rows, row bytes] per projection, typed by GGML type id; router_weights at 5
PACKED_SLOTS = {"gate": 2, "up": 3, "down": 4}
# the domain of moepass's own operators (moepass.cpu_ops: the same MoEPacked contract on the CPU)
NATIVE_DOMAIN = "moepass"
PACKED_ROUTER_WEIGHTS = 5
ROUTER_LOGITS = 1
# weights, scales, bias, zero points
QMOE_SLOTS: dict[str, tuple[int, ...]] = {"fc1": (2, 3, 4, 11), "fc2": (5, 6, 7, 12), "fc3": (8, 9, 10, 13)}
MOE_SLOTS: dict[str, tuple[int, ...]] = {"fc1": (2, 3), "fc2": (4, 5), "fc3": (6, 7)}  # weights, bias
ROUTER_WEIGHTS = 14  # QMoE only


@dataclasses.dataclass(frozen=True)
class Activation:
    """An expert activation as QMoE computes it: gate' * sigmoid(alpha * gate') * (up' + beta), with
    gate' = min(gate, limit) and up' = clamp(up, -limit, limit) when `limit` is set. fc1 holds gate
    and up rows interleaved (row 2i gate_i, row 2i+1 up_i: swiglu_fusion=1, the only layout ONNX
    Runtime's CPU kernel takes)."""

    alpha: float
    beta: float
    limit: float | None = None
    text: str = ""


SWIGLU = Activation(1.0, 0.0, None, "SwiGLU")


@dataclasses.dataclass
class Experts:
    """One projection (fc1: gate and up interleaved; fc2: down) of every expert: [E, N, ...]
    initializers. `scales` is None for float experts (com.microsoft::MoE)."""

    weights: ir.Value
    scales: ir.Value | None = None
    zero_points: ir.Value | None = None
    bias: ir.Value | None = None


@dataclasses.dataclass(frozen=True)
class Router:
    """What picks and weighs a MoE node's experts: the router logits [T, E], the `top_k` experts kept
    per token, whether their weights are renormalized over the k (`normalize`), and, for a QMoE node
    that does not renormalize, the mixing `weights` the graph has already (None: moe_node makes
    softmax(logits))."""

    logits: ir.Value
    top_k: int
    normalize: bool
    weights: ir.Value | None = None


@dataclasses.dataclass(frozen=True)
class ExpertCodes:
    """How a QMoE node's experts are quantized: `bits` 4 or 8, `block_size` 0 for one scale per row,
    `prepacked` for the SM80 layout (else row-major codes)."""

    bits: int
    block_size: int = 0
    prepacked: bool = False


# tape.op's signature: (op_type, inputs, attributes, *, domain, name) -> the node's output
MakeOp = Callable[..., ir.Value]


def moe_node(
    op: MakeOp,
    name: str,
    hidden: ir.Value,
    router: Router,
    fc1: Experts,
    fc2: Experts,
    *,
    activation: Activation = SWIGLU,
    codes: ExpertCodes | None = None,
) -> ir.Value:
    """One MoE layer as a com.microsoft::QMoE node (`codes`: its experts' bits, block size and
    layout) or a float com.microsoft::MoE node (no `codes`, or 0 bits); returns its output.

    `op` makes each node (an onnx-ir Tape's `op`, or `NodeList.op` for a rewrite). Without
    `router.normalize`, ONNX Runtime's CPU QMoE still renormalizes the top-k weights unless it is
    given them: softmax(logits) goes to router_weights (made here unless the graph has it already,
    `router.weights`). The float MoE kernel honours normalize_routing_weights=0 by itself."""
    normalize, router_logits = router.normalize, router.logits
    attributes = {
        "k": router.top_k,
        "activation_type": "swiglu",
        "swiglu_fusion": 1,
        "activation_alpha": activation.alpha,
        "activation_beta": activation.beta,
        "normalize_routing_weights": int(normalize),
    }
    if activation.limit is not None:
        attributes["swiglu_limit"] = activation.limit
    if codes is None or not codes.bits:  # every slot up to fc2's bias written, absent ones empty
        moe_inputs: list[ir.Value | None] = [hidden, router_logits, None, None, None, None]
        for experts, slots in ((fc1, MOE_SLOTS["fc1"]), (fc2, MOE_SLOTS["fc2"])):
            moe_inputs[slots[0]], moe_inputs[slots[1]] = experts.weights, experts.bias
        return op("MoE", moe_inputs, attributes, domain="com.microsoft", name=name)
    attributes["expert_weight_bits"] = codes.bits
    if codes.block_size:
        attributes["block_size"] = codes.block_size
    # 0: row-major codes, 1: the SM80 layout. Never left out: -1, the default, is each EP's own
    # layout (the CPU EP's row-major codes, the CUDA EP's SM80 layout: row-major codes read so are garbage)
    attributes["weights_prepacked"] = int(codes.prepacked)
    inputs: list[ir.Value | None] = [None] * (ROUTER_WEIGHTS + 1)
    inputs[:2] = hidden, router_logits
    for experts, slots in ((fc1, QMOE_SLOTS["fc1"]), (fc2, QMOE_SLOTS["fc2"])):
        for slot, value in zip(slots, (experts.weights, experts.scales, experts.bias, experts.zero_points)):
            inputs[slot] = value
    if not normalize:
        inputs[ROUTER_WEIGHTS] = router.weights or op(
            "Softmax", [router_logits], {"axis": -1}, name=f"{name}.router_weights"
        )
    return op("QMoE", _trimmed(inputs), attributes, domain="com.microsoft", name=name)


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A MoEPacked node's experts: the GGUF's own gate, up and down blocks [E, rows, row bytes], their
    GGML type ids and, for moepass's own node only, their biases [E, rows] float32."""

    blobs: tuple[ir.Value, ir.Value, ir.Value]
    types: tuple[int, int, int]
    biases: tuple[ir.Value, ir.Value, ir.Value] | None = None


def packed_moe_node(
    op: MakeOp,
    name: str,
    hidden: ir.Value,
    router: Router,
    experts: PackedExperts,
    *,
    domain: str = "com.microsoft",
    activation: Activation = SWIGLU,
) -> ir.Value:
    """One MoE layer as a MoEPacked node over the GGUF's own expert blocks, SwiGLU, the legacy routing
    (softmax of the logits, top-k, renormalized over the k where `router.normalize`). `domain`
    com.microsoft: ONNX Runtime's (CUDA only); NATIVE_DOMAIN: the same contract in float32, the blobs'
    rows in row groups, run on the CPU by moepass.cpu_ops, which also takes the experts' biases and a
    clamped or shifted SwiGLU (QMoE's activation_alpha, activation_beta and swiglu_limit)."""
    attributes: dict[str, object] = {
        "k": router.top_k,
        "activation_type": "swiglu",
        "gate_type": experts.types[0],
        "up_type": experts.types[1],
        "down_type": experts.types[2],
        "normalize_routing_weights": int(router.normalize),
    }
    if domain == NATIVE_DOMAIN:  # each expert's rows in row groups (moepass.core.row_groups)
        attributes["row_group"] = ROW_GROUP
        if activation != SWIGLU:
            attributes["activation_alpha"] = float(activation.alpha)
            attributes["activation_beta"] = float(activation.beta)
            if activation.limit is not None:
                attributes["swiglu_limit"] = float(activation.limit)
    elif experts.biases is not None or activation != SWIGLU:
        raise ValueError("com.microsoft::MoEPacked takes no expert biases and only the plain SwiGLU")
    inputs: list[ir.Value | None] = [hidden, router.logits, *experts.blobs, None, *(experts.biases or ())]
    return op("MoEPacked", _trimmed(inputs), attributes, domain=domain, name=name)


def _trimmed(inputs: list[ir.Value | None]) -> list[ir.Value | None]:
    """Trailing absent inputs dropped (ONNX Runtime counts the inputs a node has)."""
    while inputs and inputs[-1] is None:
        inputs = inputs[:-1]
    return inputs


class NodeList:
    """A MakeOp for rewrites: the nodes made, in order, to insert into a graph."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def op(
        self,
        op_type: str,
        inputs: list[ir.Value | None],
        attributes: dict | None = None,
        *,
        domain: str = "",
        name: str | None = None,
    ) -> ir.Value:
        node = ir.node(op_type, inputs, attributes=attributes, domain=domain, name=name)
        self.nodes.append(node)
        return node.outputs[0]


def is_moe(node: ir.Node) -> bool:
    return (node.domain == "com.microsoft" and node.op_type in MOE_OPS) or is_native(node)


def is_native(node: ir.Node) -> bool:
    """A moepass::MoEPacked node: the GGUF's own blocks, run on the CPU by moepass.cpu_ops."""
    return node.domain == NATIVE_DOMAIN and node.op_type == "MoEPacked"


def is_cuda_packed(node: ir.Node) -> bool:
    """A com.microsoft::MoEPacked node: the GGUF's own blocks, which ONNX Runtime runs on CUDA only."""
    return node.domain == "com.microsoft" and node.op_type == "MoEPacked"


@dataclasses.dataclass
class MoeNode:
    node: ir.Node
    experts: int
    top_k: int
    normalize: bool
    expert_values: list[ir.Value]  # initializers with experts on axis 0

    @property
    def name(self) -> str:
        return self.node.name or ""

    def _rows(self, projection: str) -> int:
        """Output rows of fc1 or fc2: axis 1 of QMoE's scales ([E, N, blocks] in the raw and the
        prepacked layout alike, whose codes are [E, N, K/2] and [E, K, N/2]), of MoE's weights, or
        of MoEPacked's gate (its fc1 rows, half the interleaved fc1's) and down blobs."""
        op = self.node.op_type
        if op == "MoEPacked":
            slot = PACKED_SLOTS["gate" if projection == "fc1" else "down"]
            return tensor_dims(tensor_of(input_at(self.node, slot)))[1] * (2 if projection == "fc1" else 1)
        slot = QMOE_SLOTS[projection][1] if op == "QMoE" else MOE_SLOTS[projection][0]
        return tensor_dims(tensor_of(input_at(self.node, slot)))[1]

    @property
    def form(self) -> BlockForm | None:
        """The QMoE form moepass recorded on the node (None: float, or a node another tool made)."""
        return parse_form(self.node.metadata_props.get(keys.EXPERT_FORM, ""))

    @property
    def width(self) -> int:
        """What the node takes and gives per token: the rows of fc2 (the model width, widened by
        block-sum features' columns where fc1 has them: passes/lower/block_sums.py)."""
        return self._rows("fc2")

    @property
    def hidden(self) -> int:
        """Model width: the rows of fc2, less block-sum features' columns."""
        form = self.form
        return form.unwidened(self.width) if form is not None else self.width

    @property
    def ffn(self) -> int:
        """Expert intermediate size: fc1 rows are [gate, up] interleaved for SwiGLU, 2 * ffn."""
        rows = self._rows("fc1")
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
        if not values:
            raise MoepassError(f"MoE node {node.name}: no expert tensor is an initializer")
        experts = tensor_dims(tensor_of(values[0]))[0]
        if any(tensor_dims(tensor_of(v))[0] != experts for v in values):
            raise MoepassError(f"MoE node {node.name}: expert tensors disagree on the number of experts")
        top_k = node.attributes.get_int("k", 1)
        if not 1 <= top_k <= experts:  # ONNX Runtime's MoE kernels do not check k (an out-of-bounds read)
            raise MoepassError(f"MoE node {node.name}: k={top_k} experts per token, but it has {experts} experts")
        found.append(
            MoeNode(
                node,
                experts,
                top_k,
                bool(node.attributes.get_int("normalize_routing_weights", 0)),
                values,
            )
        )
    return found
