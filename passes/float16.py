"""float16: a float32 graph's activations and float weights in float16 where a GPU computes them,
float32 kept where the CPU does, a Cast at every boundary between the two.

ONNX Runtime's CUDA kernels for GroupQueryAttention and QMoE (the CUDA EP's and the CUDA plugin
EP's) are registered for float16 and bfloat16 only (moepass/core/capabilities.py): a float32 graph's
attention and experts cannot run on the GPU. This pass is partition's first step towards the GPU's
form (passes/gpu_form.py): every node but those `keep` names (the MoE nodes of CPU layers, nodes no
CUDA kernel takes) and the nodes that compute from constants alone (the RoPE tables, which ONNX
Runtime folds when the session loads, in float32 as llama.cpp computes them) computes in float16.

What changes: every float32 value a converted node produces or reads (graph inputs such as the KV
cache, graph outputs such as the logits) becomes float16, except the inputs and outputs an operator
fixes to float32 (moepass.core.ort's records: QMoE's global scales, GroupQueryAttention's KV scales, ...); float32
initializers a converted node reads get a float16 copy (their rounding recorded in `rounded`); Cast
nodes that widened float16 weights to float32 now cast to float16 and fold away. A float32 value
crossing into a converted node, or a float16 one into a kept node, gets one Cast per value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core.ir_values import infer_dtypes, read_rows, tensor_dims, tensor_of
from moepass.core.ort import operator

FLOAT, HALF = ir.DataType.FLOAT, ir.DataType.FLOAT16


@dataclasses.dataclass
class Rounded:
    """A float32 initializer stored anew in float16 for the GPU: its relative RMS rounding error."""

    name: str
    rel_rms_error: float


def constant_nodes(graph: ir.Graph) -> set[ir.Node]:
    """Nodes whose every input is a constant or computed from constants alone (ONNX Runtime folds
    them when the session loads): what they compute stays as the model computes it."""
    constant: set[ir.Node] = set()
    for node in graph:  # topological order: producers first
        if all(
            v is None
            or (v.const_value is not None and not v.is_graph_input())
            or (v.producer() is not None and v.producer() in constant)
            for v in node.inputs
        ):
            constant.add(node)
    return constant


def _fixed(node: ir.Node) -> tuple[frozenset[int], frozenset[int]]:
    """The inputs and outputs of `node` its schema fixes to float32 (moepass.core.ort)."""
    op = operator(node)
    return (op.float_inputs, op.float_outputs) if op is not None else (frozenset(), frozenset())


def _half_copy(value: ir.Value, name: str) -> tuple[ir.Value, float]:
    """A float16 initializer of `value`'s float32 values (read when saved) and its rounding error."""
    source = tensor_of(value)
    values = read_rows(source).astype(np.float32)
    half = values.astype(np.float16)
    error = float(np.sum(np.square(half.astype(np.float32) - values), dtype=np.float64))
    reference = float(np.sum(np.square(values), dtype=np.float64))
    tensor = ir.Tensor(half, name=name)
    copy = ir.Value(name=name, type=ir.TensorType(HALF), shape=ir.Shape(tensor_dims(source)), const_value=tensor)
    return copy, float(np.sqrt(error / reference)) if reference else 0.0


@dataclasses.dataclass
class _Border:
    """Where converted and kept nodes meet, each value crossing once: the float16 form of a float32
    value a converted node reads (`copies`: the float16 weights a Cast widened, a float16 copy of an
    initializer, its rounding added to `rounded`, or a Cast) and the float32 form of a float16 value
    a kept node reads (`widened`: a Cast)."""

    graph: ir.Graph
    rounded: list[Rounded]
    copies: dict[ir.Value, ir.Value] = dataclasses.field(default_factory=dict)
    widened: dict[ir.Value, ir.Value] = dataclasses.field(default_factory=dict)

    def half_of(self, value: ir.Value) -> ir.Value:
        graph = self.graph
        widens = value.producer()
        if widens is not None and Float16Pass._is_cast(widens) and widens.inputs and widens.inputs[0] is not None:
            stored = widens.inputs[0]
            if stored.dtype == HALF and stored.const_value is not None:  # float16 weights a Cast widened
                return stored
        if value not in self.copies:
            if value.const_value is not None and not value.is_graph_input():
                copy, error = _half_copy(value, Float16Pass._free(graph, f"{value.name}.float16"))
                graph.register_initializer(copy)
                self.rounded.append(Rounded(value.name or "", error))
            else:  # computed in float32 (a kept node's, a graph input kept float32): cast
                copy = Float16Pass._cast(graph, value, HALF, f"{value.name}.to_float16")
            self.copies[value] = copy
        return self.copies[value]

    def float_of(self, value: ir.Value) -> ir.Value:
        if value not in self.widened:
            self.widened[value] = Float16Pass._cast(self.graph, value, FLOAT, f"{value.name}.to_float32")
        return self.widened[value]


class Float16Pass(InPlacePass):
    """Float16 for every node but those `keep(node)` says stay float32 (and constant subgraphs)."""

    def __init__(self, keep: Callable[[ir.Node], bool]):
        super().__init__()
        self.keep = keep
        self.rounded: list[Rounded] = []

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        infer_dtypes(graph)  # a tape's values carry no types: what each is decides what converts
        kept = constant_nodes(graph) | {n for n in graph if self.keep(n)}
        half_nodes = [n for n in graph if n not in kept]
        produced, halved_inputs = self._halved_values(graph, half_nodes)
        border = _Border(graph, self.rounded)
        for node in half_nodes:
            fixed_in, _ = _fixed(node)
            for i, value in enumerate(node.inputs):
                if value is None or value.dtype != FLOAT or value in produced or value in halved_inputs:
                    continue
                if i not in fixed_in:
                    node.replace_input_with(i, border.half_of(value))
        for node in list(kept):
            for i, value in enumerate(node.inputs):
                if value is not None and (value in produced or value in halved_inputs):
                    node.replace_input_with(i, border.float_of(value))
        for value in produced | halved_inputs:
            value.dtype = HALF
        self._casts_to_half(graph, half_nodes)
        self._drop_replaced(graph, border.copies)
        return PassResult(model, modified=bool(half_nodes))

    def _halved_values(self, graph: ir.Graph, half_nodes: list[ir.Node]) -> tuple[set[ir.Value], set[ir.Value]]:
        """The float32 values that become float16: those the converted nodes produce (but where the
        operator fixes the output to float32), and the graph inputs only converted nodes read (but
        where the operator fixes the input to float32)."""
        half_set = set(half_nodes)
        # values the converted nodes produce in float16 from now on
        produced = {
            out
            for node in half_nodes
            for i, out in enumerate(node.outputs)
            if out.dtype == FLOAT and i not in _fixed(node)[1] and not self._is_cast(node)
        }
        produced |= {node.outputs[0] for node in half_nodes if self._is_cast(node) and self._cast_to(node) == FLOAT}
        graph_inputs = [v for v in graph.inputs if v.dtype == FLOAT and not v.const_value]
        halved_inputs = {
            v
            for v in graph_inputs
            if v.uses() and all(u.node in half_set and u.idx not in _fixed(u.node)[0] for u in v.uses())
        }
        return produced, halved_inputs

    def _casts_to_half(self, graph: ir.Graph, half_nodes: list[ir.Node]) -> None:
        """Converted Casts to float32 cast to float16; a Cast to the type its input already has goes."""
        for node in half_nodes:
            if self._is_cast(node) and self._cast_to(node) == FLOAT:
                node.attributes["to"] = ir.AttrInt64("to", HALF)
        for node in half_nodes:  # a Cast to the type its input already has is no Cast at all
            source = node.inputs[0] if node.inputs else None
            if self._is_cast(node) and source is not None and source.dtype == self._cast_to(node):
                out = node.outputs[0]
                if out.is_graph_output():
                    continue
                out.replace_all_uses_with(source)
                graph.remove(node, safe=True)

    def _drop_replaced(self, graph: ir.Graph, copies: dict[ir.Value, ir.Value]) -> None:
        """Float32 initializers no node reads any more go (their float16 copies replaced them), and
        each copy takes its original's name."""
        for value in list(copies):
            name = value.name or ""
            if value.const_value is not None and not value.uses() and not value.is_graph_output():
                if name in graph.initializers and not value.is_graph_input():
                    graph.initializers.pop(name)
        for value in list(copies.values()):
            if value.const_value is not None and (value.name or "").endswith(".float16"):
                self._take_name(graph, value)

    @staticmethod
    def _is_cast(node: ir.Node) -> bool:
        return node.op_type == "Cast" and (node.domain or "") == ""

    @staticmethod
    def _cast_to(node: ir.Node) -> ir.DataType:
        return ir.DataType(node.attributes.get_int("to", 0))

    @staticmethod
    def _free(graph: ir.Graph, name: str) -> str:
        taken = graph.initializers
        if name not in taken:
            return name
        index = 1
        while f"{name}.{index}" in taken:
            index += 1
        return f"{name}.{index}"

    @staticmethod
    def _take_name(graph: ir.Graph, copy: ir.Value) -> None:
        """A float16 copy takes its original's name once the original is gone (weights keep their names)."""
        original = (copy.name or "").removesuffix(".float16")
        if original and original not in graph.initializers:
            graph.initializers.pop(copy.name or "")
            copy.name = original
            if copy.const_value is not None:
                copy.const_value.name = original
            graph.register_initializer(copy)

    @staticmethod
    def _cast(graph: ir.Graph, value: ir.Value, to: ir.DataType, name: str) -> ir.Value:
        node = ir.node("Cast", [value], attributes={"to": to}, name=name)
        out = node.outputs[0]
        out.name, out.dtype, out.shape = name, to, value.shape
        producer = value.producer()
        if producer is not None:
            graph.insert_after(producer, node)
        else:
            graph.insert_before(next(iter(graph)), node)
        return out
