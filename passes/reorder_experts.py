"""reorder-experts: store each MoE node's experts in a chosen order (GPU-resident ones first).

An exact rewrite: for every MoE node, the expert tensors (experts on axis 0) are permuted, and so
is the router that produces the node's logits (rows of a MatMulNBits weight, columns of a MatMul
weight, a bias), so the logits for expert slot i are those of the expert now stored in slot i; a
router computed by a subgraph (deepseek2) gets a Gather of its result instead. Routing picks the
same experts, and the model's outputs do not change.

After it, each node's first `resident` experts form one contiguous prefix of every expert tensor:
the GPU-resident group. The node records the mapping in metadata_props:
`moepass.placement.expert_ids` (original id of each slot) and `moepass.placement.resident`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.errors import MoepassError
from moepass.core.ir_values import input_at, read_rows, required_input, stored_constant, tensor_dims, tensor_of
from moepass.core.moe_nodes import EXPERT_INPUTS, ROUTER_LOGITS, ROUTER_WEIGHTS, moe_nodes
from moepass.passes.weights.streaming import StreamedTensor


def _is_constant(value: ir.Value | None) -> bool:
    """An initializer with its tensor (what this pass can permute)."""
    return value is not None and value.is_initializer() and value.const_value is not None


def _permuted(value: ir.Value, order: list[int], axis: int, name: str) -> ir.Value:
    """A new initializer: `value` permuted along `axis`, streamed one slice at a time when saved."""
    source = tensor_of(value)
    shape = tensor_dims(source)
    if axis == 0 and isinstance(source, StreamedTensor) and source.in_expert_order is not None:
        # packed in this run (the GPU form, a GGUF lowered here): packed once, in the new order
        return ir.Value(
            name=name,
            type=value.type,
            shape=ir.Shape(shape),
            const_value=StreamedTensor(source.in_expert_order(order), source.dtype, shape, name),
        )

    def chunks() -> Iterator[np.ndarray]:
        if axis != 0:  # a router's columns: one small matrix
            yield np.ascontiguousarray(np.take(source.numpy(), order, axis=axis))
        elif isinstance(source, (ir.ExternalTensor, ir.Tensor)):
            # an expert at a time, read as fuse-moe reads (out of this process's RSS)
            for e in order:
                yield np.ascontiguousarray(read_rows(source, e, 1)[0])
        else:  # computed on each read: computed once, then taken an expert at a time
            whole = source.numpy()
            for e in order:
                yield np.ascontiguousarray(whole[e])

    tensor = StreamedTensor(chunks, source.dtype, shape, name)
    return ir.Value(name=name, type=value.type, shape=ir.Shape(shape), const_value=tensor)


class ReorderExpertsPass(InPlacePass):
    """Permute each listed MoE node's experts to `orders[node]`; `resident[node]` are stored first."""

    def __init__(self, orders: dict[str, list[int]], resident: dict[str, int]):
        super().__init__()
        self.orders, self.resident = orders, resident

    def _replace(self, graph: ir.Graph, node: ir.Node, index: int, order: list[int], axis: int) -> None:
        """Feed `node` a permuted copy of its input `index`; the copy takes the original's name
        unless something else still uses the original."""
        old = required_input(node, index)
        name = old.name or f"{node.name}.input{index}"
        shared = len(old.uses()) > 1 or old.is_graph_output()
        new = _permuted(old, order, axis, f"{name}.reordered" if shared else name)
        node.replace_input_with(index, new)
        if not shared:
            graph.initializers.pop(name)
        graph.register_initializer(new)

    def call(self, model: ir.Model) -> PassResult:
        """Every node and its router is checked before anything changes: a plan the model cannot
        take leaves it as it was."""
        graph = model.graph
        found = {m.name: m for m in moe_nodes(graph)}
        edits = {}  # node -> (node, input, axis) to permute, or None: gather the routing before the node
        for name, order in self.orders.items():
            if name not in found:
                raise MoepassError(f"no MoE node named {name!r} in the model")
            moe = found[name]
            if sorted(order) != list(range(moe.experts)):
                raise MoepassError(f"node {name}: the expert order is not a permutation of 0..{moe.experts - 1}")
            node = moe.node
            for index in EXPERT_INPUTS[node.op_type]:
                value = input_at(node, index)
                if value is not None and value not in moe.expert_values:
                    raise MoepassError(
                        f"node {name}: expert input {index} ('{value.name}') is computed, not an "
                        "initializer, so its experts cannot be reordered"
                    )
            edits[name] = self._router_edits(node, moe.experts)
        for name, order in self.orders.items():
            moe = found[name]
            node = moe.node
            for index, value in enumerate(node.inputs):
                if value is not None and value in moe.expert_values:
                    self._replace(graph, node, index, order, 0)
            if edits[name] is None:
                self._gather_routing(graph, node, order)
            for router, index, axis in edits[name] or ():
                self._replace(graph, router, index, order, axis)
            node.metadata_props[keys.EXPERT_IDS] = ",".join(str(e) for e in order)
            node.metadata_props[keys.RESIDENT] = str(self.resident.get(name, 0))
        return PassResult(model, bool(self.orders))

    def _router_edits(self, moe: ir.Node, experts: int) -> list[tuple[ir.Node, int, int]] | None:
        """The router inputs to permute (node, input, axis), or None for a router computed by a
        subgraph, whose result is gathered instead; MoepassError for a router that cannot be reordered."""
        logits = required_input(moe, ROUTER_LOGITS)
        router = logits.producer()
        if router is None:
            raise MoepassError(f"node {moe.name}: its router logits are a graph input, which cannot be reordered")
        if (router.domain, router.op_type) not in (("", "MatMul"), ("", "Add"), ("com.microsoft", "MatMulNBits")):
            return None
        edits = []
        for use in logits.uses():
            # the node itself, or a Softmax over the experts that feeds only it (router_weights)
            ok = use.node is moe or (
                use.node.op_type == "Softmax"
                and use.node.attributes.get_int("axis", -1) == -1
                and all(u.node is moe for u in use.node.outputs[0].uses())
            )
            if not ok:
                raise MoepassError(
                    f"node {moe.name}: its router logits also feed {use.node.op_type} node "
                    f"{use.node.name!r}; reordering the experts would change what that node computes"
                )
        if (
            router.op_type == "Add"
            and router.domain == ""
            and _is_constant(input_at(router, 1))
            and tensor_of(input_at(router, 1)).shape.rank() == 1
        ):
            # MatMul + Add(bias [experts]): the bias, then the MatMul feeding only this Add
            edits.append((router, 1, 0))
            product = required_input(router, 0)
            matmul = product.producer()
            if len(product.uses()) != 1 or matmul is None:
                raise MoepassError(f"node {moe.name}: its router's MatMul output feeds more than the bias Add")
            router = matmul
        if router.op_type == "MatMulNBits" and router.domain == "com.microsoft":
            # B [N=experts, k_blocks, blob], scales [N, k_blocks] (or [N*k_blocks]), zero points [N, ...], bias [N]
            for index in (1, 2, 3, 5):
                value = input_at(router, index)
                if value is None:
                    continue
                owner, at = router, index
                cast = value.producer()
                if cast is not None and stored_constant(value) is not None and len(value.uses()) == 1:
                    owner, at, value = cast, 0, required_input(cast, 0)  # float16 scales a Cast widens
                if not _is_constant(value):
                    raise MoepassError(f"node {moe.name}: router input {value.name} is not a constant")
                shape = tensor_dims(tensor_of(value))
                if len(shape) == 1 and index == 2 and shape[0] != experts:
                    raise MoepassError(f"node {moe.name}: flat router scales are not supported")
                edits.append((owner, at, 0))
        elif router.op_type == "MatMul" and router.domain == "" and _is_constant(input_at(router, 1)):
            edits.append((router, 1, -1))  # W^T [hidden, experts]
        else:
            raise MoepassError(
                f"node {moe.name}: its router is a {router.domain or 'ai.onnx'}::{router.op_type} "
                "node; moepass reorders MatMul and MatMulNBits routers with constant weights"
            )
        return edits

    def _gather_routing(self, graph: ir.Graph, moe: ir.Node, order: list[int]) -> None:
        """A router computed by a subgraph (deepseek2's group-limited routing, whose groups are
        ranges of expert ids): its result is permuted instead, by a Gather over the expert axis
        right before the node; anything else reading the routing still sees it in the original order."""
        indices = ir.Value(
            name=f"{moe.name}.expert_order",
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([len(order)]),
            const_value=ir.Tensor(np.array(order, np.int64), name=f"{moe.name}.expert_order"),
        )
        graph.register_initializer(indices)
        for index in (ROUTER_LOGITS, ROUTER_WEIGHTS):  # router scores, router_weights
            source = input_at(moe, index)
            if source is None:
                continue

            gather = ir.Node(
                "",
                "Gather",
                [source, indices],
                attributes=[ir.AttrInt64("axis", -1)],
                name=f"{moe.name}.reorder_routing_{index}",
            )
            graph.insert_before(moe, gather)
            reordered = gather.outputs[0]
            reordered.name = f"{source.name}.reordered"
            reordered.type, reordered.shape = source.type, source.shape
            moe.replace_input_with(index, reordered)
