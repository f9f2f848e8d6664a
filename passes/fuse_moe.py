"""fuse-moe: the MoE layers of an existing ONNX model become one QMoE (or float MoE) node each.

Written as rules. A rule finds candidate anchors in the graph, checks each one (the answer is
either a `Match` holding everything the rewrite needs, or the reason it does not match, naming the
node at fault), and rewrites a match. Every check runs before anything is rewritten, and a
rewrite only adds the new node and redirects the layer's output to it: the old subgraph becomes
dead and `remove-unused` deletes it, so a layer is either fused whole or left exactly as it was.

Rules:
- `ExpertBranchesRule`: the per-expert branches torch.onnx.export traces from Hugging Face's sparse
  MoE blocks (Qwen3-MoE, Mixtral, and others written the same way): router MatMul -> Softmax ->
  TopK (-> divided by its sum), OneHot mask, and per expert a NonZero, a Gather of its tokens,
  SwiGLU (gate, up, down as MatMul with float weights or as MatMulNBits blobs), the routing weight,
  and a ScatterElements + Add into the output. MatMulNBits blobs `[N, k_blocks, blob]` are QMoE's
  raw rows already (element 2j in the low nibble), so they move bit-exactly when every expert
  matrix shares bits and block size and the block divides K; otherwise they are dequantized and
  requantized (`requantize_form`: the largest block that divides every K, else one scale per row;
  8 bits, or 4 for `float_experts` int4) with the error measured.
- `MoeNodeRule`: com.microsoft::MoE nodes (float experts) are quantized into QMoE when the user asks
  for it (`float_experts` int8 / int4), with the error measured.

The result of each candidate is a `FusionRecord` (fused or not, and why), which convert writes to
moepass.json and `moepass inspect` shows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.errors import MoepassError, wording
from moepass.core.ir_values import input_at, producer, read_rows, required_input, tensor_dims, tensor_of
from moepass.core.moe_nodes import (
    MOE_SLOTS,
    ROUTER_LOGITS,
    Activation,
    ExpertCodes,
    Experts,
    NodeList,
    Router,
    moe_node,
)
from moepass.core.quants import BlockForm, Packed, qmoe_takes, quantize_values, requantize_form, unpack_values
from moepass.passes.weights.packing import PackedGroup, PackOptions, float_expert_stack
from moepass.passes.weights.report import WeightReport
from moepass.passes.weights.sources import Slots


@dataclasses.dataclass
class FusionRecord:
    """What happened to one candidate MoE layer."""

    rule: str
    anchor: str  # the node the rule started from
    fused: bool
    reason: str = ""  # why not, when not fused
    node: str = ""  # the new node, when fused
    experts: int = 0
    top_k: int = 0
    form: str = ""
    geometry: str = ""  # the experts' matrices as found, and what becomes of them

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Mismatch(Exception):
    """A candidate that a rule does not fuse, and why."""


# ---- small graph helpers ------------------------------------------------------------------------


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a Constant node's output, else None."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def consumers(value: ir.Value) -> list[ir.Node]:
    return [use.node for use in value.uses()]


def _through(value: ir.Value | None, ops: tuple[str, ...]) -> ir.Value | None:
    """Walk up from `value` while it is produced by one of `ops` (their first input)."""
    node = producer(value)
    while node is not None and node.op_type in ops:
        value = input_at(node, 0)
        node = producer(value)
    return value


def _node_name(node: ir.Node) -> str:
    return node.name or f"<{node.op_type}>"


# ---- linear layers: MatMul with a constant weight, or MatMulNBits --------------------------------


@dataclasses.dataclass
class Linear:
    """y = x @ W^T with W [N, K]: a MatMul with a constant B [K, N], or a MatMulNBits. The weight
    tensors are held (not read) here, so that they stay reachable once the node is removed."""

    node: ir.Node
    weight: ir.TensorProtocol = dataclasses.field(init=False)  # B, or MatMulNBits' codes
    scales: ir.TensorProtocol | None = dataclasses.field(init=False)  # MatMulNBits only
    zero_points: ir.TensorProtocol | None = dataclasses.field(init=False)  # MatMulNBits only, optional

    def __post_init__(self) -> None:
        self.weight = tensor_of(input_at(self.node, 1))
        self.scales = tensor_of(input_at(self.node, 2)) if self.quantized else None
        zeros = input_at(self.node, 3) if self.quantized else None
        self.zero_points = None if zeros is None else tensor_of(zeros)

    @property
    def quantized(self) -> bool:
        return self.node.op_type == "MatMulNBits"

    @property
    def name(self) -> str:
        return self.weight.name or _node_name(self.node)

    @property
    def shape(self) -> tuple[int, int]:
        if self.quantized:
            return self.node.attributes.get_int("N"), self.node.attributes.get_int("K")
        k, n = tensor_dims(self.weight)
        return n, k

    @property
    def form(self) -> BlockForm | None:
        if not self.quantized:
            return None
        return BlockForm(self.node.attributes.get_int("bits", 4), self.node.attributes.get_int("block_size"))

    def float_weight(self) -> np.ndarray:
        """W [N, K] as float32 (dequantized for MatMulNBits)."""
        if self.form is None:
            return np.ascontiguousarray(read_rows(self.weight).T, dtype=np.float32)
        codes, scales, zeros = self.blobs()
        _, k = self.shape
        return unpack_values(codes, scales, self.form, zeros)[:, :k]

    def blobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """MatMulNBits codes [N, k_blocks * blob] (QMoE's raw row layout), scales [N, k_blocks] and
        packed zero points [N, ceil(k_blocks * bits / 8)] (None: the default)."""
        n, _ = self.shape
        if self.scales is None:
            raise MoepassError(f"{_node_name(self.node)}: a MatMul has no quantized blobs")
        return (
            read_rows(self.weight).reshape(n, -1),
            read_rows(self.scales).reshape(n, -1).astype(np.float32),
            None if self.zero_points is None else read_rows(self.zero_points).reshape(n, -1),
        )


@dataclasses.dataclass
class ExpertMatrix:
    """Expert `expert`'s matrix [N, K] of a float [E, N, K] initializer (a com.microsoft::MoE input),
    read when the model is written."""

    tensor: ir.TensorProtocol
    expert: int
    quantized = False
    form = None

    @property
    def name(self) -> str:
        return f"{self.tensor.name}[{self.expert}]"

    @property
    def shape(self) -> tuple[int, int]:
        _, n, k = tensor_dims(self.tensor)
        return n, k

    def float_weight(self) -> np.ndarray:
        return np.asarray(read_rows(self.tensor, self.expert, 1)[0], dtype=np.float32)


def as_linear(node: ir.Node | None) -> Linear | None:
    """The node as a Linear if it is one with constant weights (and no bias / g_idx for MatMulNBits)."""
    if node is None:
        return None

    def constant_at(index: int) -> bool:
        value = input_at(node, index)
        return value is not None and value.const_value is not None

    if node.op_type == "MatMul" and node.domain == "":
        if constant_at(1) and len(tensor_of(input_at(node, 1)).shape) == 2:
            return Linear(node)
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        extra = [v for v in node.inputs[4:] if v is not None]
        if not extra and constant_at(1) and constant_at(2) and (input_at(node, 3) is None or constant_at(3)):
            return Linear(node)
    return None


# ---- writing the fused experts -----------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """What a match becomes: the form's name, the QMoE form (None: a float MoE node), whether the
    blobs move byte for byte, and the geometry found with its fate (for records and dry runs)."""

    name: str
    form: BlockForm | None
    exact: bool
    geometry: str


class ExpertWriter:
    """Makes the [E, ...] initializers of fused experts, streamed when the model is written and
    recorded in `report`, and puts the new nodes in place of a layer."""

    def __init__(self, graph: ir.Graph, report: WeightReport):
        self.graph, self.report = graph, report

    def replace(self, nodes: list[ir.Node], old: ir.Value, anchor: ir.Node, form: str) -> ir.Node:
        """Put `nodes` (the MoE node last) after the layer's last node and make the MoE node's
        output take the place of `old`; returns the MoE node."""
        node, last = nodes[-1], old.producer()
        if last is None:
            raise MoepassError(f"{_node_name(anchor)}: the layer's output {old.name!r} is not computed by a node")
        out = node.outputs[0]
        if old.is_graph_output():  # the model's interface keeps its names
            out.name, old.name = old.name, f"{old.name}.unfused"
        else:
            out.name = f"{node.name}.output"
        out.type, out.shape = old.type, old.shape
        node.metadata_props.update({keys.FUSED_FROM: _node_name(anchor), keys.EXPERT_FORM: form})
        self.graph.insert_after(last, nodes)
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        return node

    def _initializer(self, tensor: ir.TensorProtocol) -> ir.Value:
        value = ir.Value(
            name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor_dims(tensor)), const_value=tensor
        )
        self.graph.register_initializer(value)
        return value

    def float_stack(self, name: str, groups: Sequence[tuple[Linear, ...]]) -> ir.Value:
        """[E, N * len(group), K] float32 of the groups' matrices (one group per expert), rows interleaved
        (gate/up)."""
        return self._initializer(float_expert_stack(StackedMatrix.of(groups, exact=True), name, self.report))

    def packed_stack(
        self, name: str, groups: Sequence[tuple[Linear | ExpertMatrix, ...]], form: BlockForm, exact: bool
    ) -> Experts:
        """QMoE codes, scales (and zero points) of the groups' matrices (one group per expert), rows
        interleaved: the blobs moved unchanged when `exact`, else requantized from their values (error
        measured)."""
        with_zeros = exact and any(isinstance(lin, Linear) and lin.zero_points is not None for g in groups for lin in g)
        options = PackOptions(zero_points=with_zeros, codes_name="weight")
        packed = PackedGroup(StackedMatrix.of(groups, exact), form, name, self.report, options)
        codes, scales = self._initializer(packed.codes), self._initializer(packed.scales)  # in the file's order
        return Experts(codes, scales, None if packed.zero_points is None else self._initializer(packed.zero_points))


class StackedMatrix:
    """One matrix (gate, up or down) of every expert of a layer, as a weights.RowSource (packed or float):
    a span is one expert's matrix. MatMulNBits blobs move unchanged when `exact` (with their zero
    points, or ONNX Runtime's default ones where the group has zero points and this matrix has none),
    else the matrix's values are quantized."""

    def __init__(self, matrices: list[Linear | ExpertMatrix], exact: bool):
        self.matrices, self.exact = matrices, exact
        self.rows, self.k = matrices[0].shape

    @classmethod
    def of(cls, groups: Sequence[tuple[Linear | ExpertMatrix, ...]], exact: bool) -> list[StackedMatrix]:
        """One source per matrix of the groups (gate, up; or down), each over every expert."""
        return [cls([group[j] for group in groups], exact) for j in range(len(groups[0]))]

    @property
    def shape(self) -> tuple[int, ...]:
        return len(self.matrices), self.rows, self.k

    @property
    def parts(self) -> list[tuple[str, str]]:
        return [
            (m.name, "float32" if m.form is None else f"MatMulNBits{m.form.bits}/b{m.form.block_size}")
            for m in self.matrices
        ]

    def spans(self, multiple: int) -> Iterator[tuple[int, int]]:
        return ((e * self.rows, self.rows) for e in range(len(self.matrices)))

    def part_of(self, first: int) -> int:
        return first // self.rows

    def pack(self, span: tuple[int, int], form: BlockForm, out: Slots) -> Packed:
        matrix = self.matrices[self.part_of(span[0])]
        if self.exact and isinstance(matrix, Linear):
            blob, blob_scales, zeros = matrix.blobs()
            out.codes[...], out.scales[...] = blob, blob_scales
            if out.extra is not None:
                default = 0x88 if form.bits == 4 else form.zero_point
                out.extra[...] = default if zeros is None else zeros[:, : out.extra.shape[-1]]
            return Packed(form, out.codes, out.scales, True)
        # one scale per output row: quantized as one block of K
        done = quantize_values(matrix.float_weight(), form if form.block_size else BlockForm(form.bits, self.k))
        out.codes[...], out.scales[...] = done.weights, done.scales
        return Packed(form, out.codes, out.scales, False, done.error_sq, done.reference_sq)

    def values(self, span: tuple[int, int]) -> np.ndarray:
        return self.matrices[self.part_of(span[0])].float_weight()


# ---- the per-expert branches rule ---------------------------------------------------------------


@dataclasses.dataclass
class Expert:
    gate: Linear
    up: Linear
    down: Linear


@dataclasses.dataclass
class BranchesMatch:
    anchor: ir.Node  # TopK
    hidden: ir.Value  # [tokens, hidden], the router's (and experts') input
    router: ir.Value  # router logits
    softmax: ir.Value  # softmax(router logits)
    top_k: int
    normalize: bool
    experts: list[Expert]
    output: ir.Value  # the accumulated MoE output [tokens, hidden]


_TOKEN_OPS = ("Unsqueeze", "Gather", "Reshape", "Squeeze", "Flatten")
# what lies between an expert's down projection and the scatter of its rows: the routing weight, casts
_WEIGHT_OPS = ("Mul", "Cast", "Reshape", "Unsqueeze", "Expand", "Flatten")
# how a branch picks its tokens' routing weights out of the top-k weights
_GATHER_OPS = (
    "Cast",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Gather",
    "GatherND",
    "GatherElements",
    "Expand",
    "Slice",
)


class ExpertBranchesRule:
    """The per-expert branches of an exported Hugging Face sparse MoE block -> one QMoE node (or a
    float MoE node for float experts kept as float)."""

    name = "expert-branches"

    def __init__(self, float_experts: str = "keep"):
        self.float_experts = float_experts

    def anchors(self, graph: ir.Graph) -> Iterator[ir.Node]:
        return (n for n in graph if n.op_type == "TopK" and n.domain == "")

    def check(self, topk: ir.Node) -> BranchesMatch:
        where = f"TopK node '{_node_name(topk)}'"
        k = constant(input_at(topk, 1))
        if k is None:
            raise Mismatch(f"{where}: K is not a constant")
        softmax = producer(_through(input_at(topk, 0), ("Cast",)))
        if softmax is None or softmax.op_type != "Softmax":
            raise Mismatch(f"{where}: does not select from a Softmax over router logits")
        logits = input_at(softmax, 0)
        router = as_linear(producer(logits))
        hidden = None if router is None else input_at(router.node, 0)
        if router is None or logits is None or hidden is None:
            raise Mismatch(f"{where}: the softmax's input is not a MatMul with a constant weight or a MatMulNBits")
        n_experts, hidden_size = router.shape
        axis = softmax.attributes.get_int("axis", -1)
        if axis not in (-1, 1):
            raise Mismatch(f"{where}: softmax over axis {axis}, not over the experts")
        normalize = any(
            n.op_type == "Div" and input_at(n, 0) is topk.outputs[0] and _is_sum_of(input_at(n, 1), topk)
            for n in consumers(topk.outputs[0])
        )
        experts_by_slot = self._experts(topk, hidden, router, where)
        if sorted(experts_by_slot) != list(range(n_experts)):
            raise Mismatch(
                f"{where}: the graph has branches for {len(experts_by_slot)} of the router's {n_experts} "
                "experts (an export leaves out experts its example input did not reach)"
            )
        experts = [experts_by_slot[e] for e in range(n_experts)]
        for e, ex in enumerate(experts):
            n_ff = ex.gate.shape[0]
            if (
                ex.gate.shape != (n_ff, hidden_size)
                or ex.up.shape != (n_ff, hidden_size)
                or ex.down.shape != (hidden_size, n_ff)
            ):
                raise Mismatch(
                    f"{where}: expert {e}'s matrices {ex.gate.shape}, {ex.up.shape}, {ex.down.shape} do "
                    f"not form a SwiGLU MLP of width {hidden_size}"
                )
        if len({ex.gate.shape for ex in experts}) != 1:
            raise Mismatch(f"{where}: the experts have different widths")
        weights = next(
            (n.outputs[0] for n in consumers(topk.outputs[0]) if normalize and n.op_type == "Div"), topk.outputs[0]
        )
        output = self._output(experts, weights, where)
        return BranchesMatch(
            topk, hidden, logits, softmax.outputs[0], int(np.asarray(k).reshape(-1)[0]), normalize, experts, output
        )

    def target(self, match: BranchesMatch) -> Target:
        linears = [lin for ex in match.experts for lin in (ex.gate, ex.up, ex.down)]
        ks = "/".join(str(k) for k in sorted({lin.shape[1] for lin in linears}, reverse=True))
        if self.float_experts == "keep" and not any(lin.quantized for lin in linears):
            return Target("float32", None, True, f"float MatMul experts, K {ks} -> com.microsoft::MoE float32, exact")
        forms = {lin.form for lin in linears}
        found = ", ".join(sorted(f"{f.bits}-bit blocks of {f.block_size}" for f in forms if f is not None))
        if None in forms:
            found = ", ".join(filter(None, [found, "float"]))
        zeros = " with zero points" if any(lin.zero_points is not None for lin in linears) else ""
        form = next(iter(forms)) if len(forms) == 1 else None
        exact = qmoe_takes(form, [lin.shape[1] for lin in linears])
        if not exact:
            form = requantize_form(
                8 if self.float_experts in ("keep", "int8") else 4, [lin.shape[1] for lin in linears]
            )
        fate = "moved byte for byte" if exact else "requantized, the error reported"
        return Target(str(form), form, exact, f"MatMulNBits {found}{zeros}, K {ks} -> {form}, {fate}")

    def rewrite(self, match: BranchesMatch, index: int, writer: ExpertWriter) -> FusionRecord:
        name = f"moe.{index}"
        target = self.target(match)
        gates_ups = [(ex.gate, ex.up) for ex in match.experts]
        downs = [(ex.down,) for ex in match.experts]
        nodes = NodeList()
        layer = functools.partial(moe_node, nodes.op, name, match.hidden)
        router = Router(match.router, match.top_k, match.normalize)
        if target.form is None:
            layer(
                router,
                Experts(writer.float_stack(f"{name}.fc1", gates_ups)),
                Experts(writer.float_stack(f"{name}.fc2", downs)),
            )
        else:
            fc1 = writer.packed_stack(f"{name}.fc1", gates_ups, target.form, target.exact)
            fc2 = writer.packed_stack(f"{name}.fc2", downs, target.form, target.exact)
            codes = ExpertCodes(target.form.bits, target.form.block_size)
            layer(dataclasses.replace(router, weights=match.softmax), fc1, fc2, codes=codes)
        writer.replace(nodes.nodes, match.output, match.anchor, target.name)
        return FusionRecord(
            self.name,
            _node_name(match.anchor),
            True,
            node=name,
            experts=len(match.experts),
            top_k=match.top_k,
            form=target.name,
            geometry=target.geometry,
        )

    def _experts(self, topk: ir.Node, hidden: ir.Value, router: Linear, where: str) -> dict[int, Expert]:
        """Expert slot -> its SwiGLU: projections that read tokens gathered from `hidden`."""
        token_values, queue, seen = [], deque([hidden]), {id(hidden)}
        while queue:
            value = queue.popleft()
            for node in consumers(value):
                if node.op_type in _TOKEN_OPS and node.inputs[0] is value:
                    out = node.outputs[0]
                    if id(out) not in seen:
                        seen.add(id(out))
                        token_values.append(out)
                        queue.append(out)
        experts: dict[int, Expert] = {}
        for x in token_values:
            projections = [
                lin for lin in map(as_linear, consumers(x)) if lin is not None and lin.node is not router.node
            ]
            if not projections:
                continue
            expert = self._swiglu(projections, where)
            slot = self._slot(x, topk, where)
            if slot in experts:
                raise Mismatch(f"{where}: two branches for expert {slot}")
            experts[slot] = expert
        return experts

    def _swiglu(self, projections: list[Linear], where: str) -> Expert:
        """gate, up, down from down(silu(gate(x)) * up(x)), silu written as g * sigmoid(g)."""
        names = ", ".join(f"'{_node_name(p.node)}'" for p in projections)
        if len(projections) != 2:
            raise Mismatch(
                f"{where}: {len(projections)} projections ({names}) read one expert's tokens, not gate and up"
            )
        for gate, up in (projections, projections[::-1]):
            g = gate.node.outputs[0]
            sigmoid = next((n for n in consumers(g) if n.op_type == "Sigmoid"), None)
            if sigmoid is None:
                continue
            silu = next((n for n in consumers(g) if n.op_type == "Mul" and sigmoid.outputs[0] in n.inputs), None)
            if silu is None:
                continue
            product = next(
                (n for n in consumers(silu.outputs[0]) if n.op_type == "Mul" and up.node.outputs[0] in n.inputs), None
            )
            if product is None:
                continue
            downs = [lin for lin in map(as_linear, consumers(product.outputs[0])) if lin is not None]
            if len(downs) == 1:
                return Expert(gate, up, downs[0])
        raise Mismatch(f"{where}: the expert branch of {names} is not down(silu(gate(x)) * up(x))")

    def _slot(self, tokens: ir.Value, topk: ir.Node, where: str) -> int:
        """Which expert a branch serves: its tokens are gathered by the positions of that expert's row
        of the routing mask (OneHot of the TopK indices); the row is the i-th entry of the list of
        experts hit, traced as output i of a Split (or a constant index)."""
        queue, seen = deque([tokens]), set()
        while queue:
            value = queue.popleft()
            node = value.producer()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "Gather" and self._is_routing_mask(input_at(node, 0), topk):
                index = input_at(node, 1)
                fixed = constant(index)
                if fixed is not None:
                    return int(np.asarray(fixed).reshape(-1)[0])
                source = _through(index, ("Squeeze", "Unsqueeze", "Cast", "Reshape"))
                split = producer(source)
                if split is not None and split.op_type == "Split" and source is not None:
                    return list(split.outputs).index(source)
                raise Mismatch(f"{where}: cannot tell which expert the branch at Gather '{_node_name(node)}' serves")
            queue.extend(v for v in node.inputs if v is not None)
        raise Mismatch(f"{where}: no routing mask found above the expert tokens '{tokens.name}'")

    @staticmethod
    def _is_routing_mask(value: ir.Value | None, topk: ir.Node) -> bool:
        node = producer(_through(value, ("Transpose", "Cast")))
        return (
            node is not None and node.op_type == "OneHot" and _through(input_at(node, 0), ("Cast",)) is topk.outputs[1]
        )

    def _output(self, experts: list[Expert], weights: ir.Value, where: str) -> ir.Value:
        """The value every expert's contribution accumulates into: each branch's output, times its
        routing weight, is scattered onto zeros at its tokens' rows (index_add_) and added to the
        running sum; the sum after the last expert is the layer's output."""
        ends = set()
        for ex in experts:
            scatter = self._scatter(ex.down.node.outputs[0], weights, where)
            value = scatter.outputs[0]
            while True:
                adds = [n for n in consumers(value) if n.op_type == "Add"]
                if len(adds) != 1:
                    break
                value = adds[0].outputs[0]
                following = [n for n in consumers(value) if n.op_type == "Add"]
                if not (len(following) == 1 and any(_is_scatter(v.producer()) for v in following[0].inputs if v)):
                    break
            if value is scatter.outputs[0]:
                raise Mismatch(
                    f"{where}: the scattered outputs of expert branch '{_node_name(ex.down.node)}' are not added up"
                )
            ends.add(value)
        if len(ends) != 1:
            raise Mismatch(f"{where}: the experts' outputs add up into {len(ends)} different values")
        return ends.pop()

    @staticmethod
    def _scatter(value: ir.Value, weights: ir.Value, where: str) -> ir.Node:
        """The ScatterElements / ScatterND that puts an expert's output, times its routing weight, at
        its tokens' rows. The factor must be the router's top-k weights, gathered and reshaped but
        not changed (a model that scales them, say by a routed scaling factor, is not this pattern)."""
        queue, seen, found, factors = deque([value]), set(), [], 0
        while queue:
            current = queue.popleft()
            for node in consumers(current):
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if _is_scatter(node) and input_at(node, 2) is current:
                    found.append(node)
                elif node.op_type in _WEIGHT_OPS:
                    if node.op_type == "Mul":
                        other = input_at(node, 1) if input_at(node, 0) is current else input_at(node, 0)
                        if other is None or _through(other, _GATHER_OPS) is not weights:
                            raise Mismatch(
                                f"{where}: expert output '{value.name}' is multiplied by "
                                f"'{other.name if other else None}', not by the router's top-k weights"
                            )
                        factors += 1
                    queue.extend(node.outputs)
        if len(found) != 1 or factors != 1:
            raise Mismatch(
                f"{where}: the output of '{value.name}' reaches {len(found)} scatter nodes through "
                f"{factors} routing-weight products, not one of each"
            )
        return found[0]


def _is_scatter(node: ir.Node | None) -> bool:
    return node is not None and node.op_type in ("ScatterElements", "ScatterND") and node.domain == ""


def _is_sum_of(value: ir.Value | None, topk: ir.Node) -> bool:
    """`value` is ReduceSum(topk's values): the divisor that renormalizes the top-k weights."""
    node = producer(value)
    return node is not None and node.op_type == "ReduceSum" and input_at(node, 0) is topk.outputs[0]


# ---- com.microsoft::MoE nodes ---------------------------------------------------------------------


@dataclasses.dataclass
class MoeNodeMatch:
    anchor: ir.Node
    activation: Activation


# what a float MoE node's attributes may say: each is carried into the QMoE node by moe_node
_MOE_ATTRIBUTES = {
    "k",
    "activation_type",
    "swiglu_fusion",
    "activation_alpha",
    "activation_beta",
    "swiglu_limit",
    "normalize_routing_weights",
    "use_sparse_mixer",
}


class MoeNodeRule:
    """com.microsoft::MoE nodes (float experts) -> QMoE in int8 / int4, when `float_experts` asks for it."""

    name = "moe-node"

    def __init__(self, float_experts: str = "keep"):
        self.float_experts = float_experts

    def anchors(self, graph: ir.Graph) -> Iterator[ir.Node]:
        return (n for n in graph if n.op_type == "MoE" and n.domain == "com.microsoft")

    def check(self, node: ir.Node) -> MoeNodeMatch:
        where = f"MoE node '{_node_name(node)}'"
        if self.float_experts == "keep":
            int8 = wording().option("--float-experts", "int8")
            raise Mismatch(f"{where}: already one float MoE node; {int8} (or int4) quantizes it into QMoE")
        inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
        if any(inputs[slot] is not None for slot in MOE_SLOTS["fc3"]):
            raise Mismatch(f"{where}: has separate fc3 weights, which ONNX Runtime's CPU QMoE does not take")
        for index in (0, ROUTER_LOGITS, MOE_SLOTS["fc1"][0], MOE_SLOTS["fc2"][0]):
            if input_at(node, index) is None:
                raise Mismatch(f"{where}: input {index} is missing")
        for index in (MOE_SLOTS["fc1"][0], MOE_SLOTS["fc2"][0]):
            value = input_at(node, index)
            if value is None or value.const_value is None:
                raise Mismatch(f"{where}: input {index} is not a constant initializer")
        attributes = node.attributes
        if attributes.get_int("use_sparse_mixer", 0):
            raise Mismatch(f"{where}: uses the sparse mixer")
        unknown = sorted(set(attributes) - _MOE_ATTRIBUTES)
        if unknown:
            raise Mismatch(f"{where}: attribute {unknown[0]} has no QMoE counterpart here")
        kind, fusion = attributes.get_string("activation_type", "relu"), attributes.get_int("swiglu_fusion", 0)
        if (kind, fusion) != ("swiglu", 1):
            raise Mismatch(
                f"{where}: activation {kind} with swiglu_fusion {fusion}; the rule fuses SwiGLU experts "
                "with gate and up rows interleaved (swiglu_fusion 1), the layout QMoE's CPU kernel takes"
            )
        limit = attributes.get("swiglu_limit")
        return MoeNodeMatch(
            node,
            Activation(
                attributes.get_float("activation_alpha", 1.0),
                attributes.get_float("activation_beta", 0.0),
                None if limit is None else limit.as_float(),
            ),
        )

    def target(self, match: MoeNodeMatch) -> Target:
        ks = [tensor_dims(tensor_of(input_at(match.anchor, MOE_SLOTS[fc][0])))[2] for fc in ("fc1", "fc2")]
        form = requantize_form(8 if self.float_experts == "int8" else 4, ks)
        return Target(str(form), form, False, f"float com.microsoft::MoE, K {ks[0]}/{ks[1]} -> {form}, quantized")

    def rewrite(self, match: MoeNodeMatch, index: int, writer: ExpertWriter) -> FusionRecord:
        """The float MoE node -> QMoE, quantized expert by expert as the model is written."""
        moe = match.anchor
        target = self.target(match)
        name = moe.name or f"moe.{index}"
        form = target.form
        if form is None:
            raise MoepassError(f"{_node_name(moe)}: no QMoE form to quantize into")
        stacks = []
        experts = tensor_dims(tensor_of(input_at(moe, MOE_SLOTS["fc1"][0])))[0]
        for fc in ("fc1", "fc2"):
            weights, bias = (input_at(moe, slot) for slot in MOE_SLOTS[fc])
            groups = [(ExpertMatrix(tensor_of(weights), e),) for e in range(tensor_dims(tensor_of(weights))[0])]
            stacks.append(writer.packed_stack(f"{name}.{fc}", groups, form, False))
            stacks[-1].bias = bias
        nodes = NodeList()
        moe_node(
            nodes.op,
            f"{name}.quantized",
            required_input(moe, 0),
            Router(
                required_input(moe, ROUTER_LOGITS),
                moe.attributes.get_int("k", 1),
                bool(moe.attributes.get_int("normalize_routing_weights", 0)),
            ),
            stacks[0],
            stacks[1],
            activation=match.activation,
            codes=ExpertCodes(form.bits, form.block_size),
        )
        node = writer.replace(nodes.nodes, moe.outputs[0], moe, target.name)
        return FusionRecord(
            self.name,
            _node_name(moe),
            True,
            node=_node_name(node),
            experts=experts,
            top_k=moe.attributes.get_int("k", 1),
            form=target.name,
            geometry=target.geometry,
        )


# ---- the pass ----------------------------------------------------------------------------------------


class Rule(Protocol):
    """A fusion rule owns its pattern: where to look, whether a candidate matches (else Mismatch,
    naming the node at fault), what it would become, and the rewrite. FuseMoePass runs every check
    before the first rewrite."""

    name: str

    def anchors(self, graph: ir.Graph) -> Iterator[ir.Node]: ...

    def check(self, anchor: ir.Node) -> Any: ...

    def target(self, match: Any) -> Target: ...

    def rewrite(self, match: Any, index: int, writer: ExpertWriter) -> FusionRecord: ...


def default_rules(float_experts: str = "keep") -> list[Rule]:
    return [ExpertBranchesRule(float_experts), MoeNodeRule(float_experts)]


class FuseMoePass(InPlacePass):
    """Apply the rules; `records` says what happened to every candidate, `report` the weights."""

    def __init__(self, float_experts: str = "keep", dry_run: bool = False, rules: list[Rule] | None = None):
        super().__init__()
        self.dry_run = dry_run
        self.records: list[FusionRecord] = []
        self.report = WeightReport()
        self.rules = default_rules(float_experts) if rules is None else rules

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        checked = []  # (rule, anchor, match or the reason it does not match), in graph order per rule
        for rule in self.rules:
            for anchor in list(rule.anchors(graph)):
                try:
                    checked.append((rule, anchor, rule.check(anchor)))
                except Mismatch as why:
                    checked.append((rule, anchor, str(why)))
        writer = ExpertWriter(graph, self.report)
        fused = 0
        for rule, anchor, result in checked:  # every check is done before the first rewrite
            if isinstance(result, str):
                self.records.append(FusionRecord(rule.name, _node_name(anchor), False, result))
            elif self.dry_run:
                target = rule.target(result)
                self.records.append(
                    FusionRecord(rule.name, _node_name(anchor), True, form=target.name, geometry=target.geometry)
                )
            else:
                self.records.append(rule.rewrite(result, fused, writer))
                fused += 1
        return PassResult(model, fused > 0)
