"""Reading an onnx-ir graph whose optional parts are checked where they are read.

onnx-ir types what a model may leave out as optional: a node's input (omitted, or past the end),
a value's producer, its constant tensor, its type and shape, a shape's dimensions (symbolic). A
model is untrusted input, so each of these is read through one function here that either returns
what the caller needs or raises a one-line MoepassError naming the node or value at fault.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import onnx_ir as ir

from moepass.core.errors import MoepassError
from moepass.core.onnx_format import ir_version_for
from moepass.core.ort import OPERATORS


def copy_model(model: ir.Model) -> ir.Model:
    """A copy of `model` that passes change without changing it: new nodes and values, the same
    tensors (onnx-ir's clone: no pass here changes a tensor in place). The clone shares each value's
    type object, which `Value.dtype = ...` changes in place, so each value of the copy gets its own."""
    clone = model.clone()
    for graph in (clone.graph, *clone.graph.subgraphs()):
        values = (*graph.inputs, *graph.initializers.values(), *(out for node in graph for out in node.outputs))
        for value in values:
            if value.type is not None:
                value.type = copy.deepcopy(value.type)
    return clone


def input_at(node: ir.Node, index: int) -> ir.Value | None:
    """Input `index` of `node`; None where it is omitted or past the node's last input."""
    return node.inputs[index] if index < len(node.inputs) else None


def required_input(node: ir.Node, index: int) -> ir.Value:
    value = input_at(node, index)
    if value is None:
        raise MoepassError(f"{node.op_type} node {node.name!r}: input {index} is missing")
    return value


def producer(value: ir.Value | None) -> ir.Node | None:
    """The node that computes `value`; None for a graph input, an initializer or an absent input."""
    return None if value is None else value.producer()


def tensor_of(value: ir.Value | None) -> ir.TensorProtocol:
    """The constant tensor `value` holds (an initializer's or a Constant's)."""
    tensor = None if value is None else value.const_value
    if tensor is None:
        what = "an omitted input" if value is None else f"value {value.name!r}"
        raise MoepassError(f"{what} is not a constant tensor")
    return tensor


def folded(value: ir.Value, limit: int = 256) -> np.ndarray:
    """The array a value computed from constants alone holds (the RoPE tables of
    passes/lower/rope.py rope_tables), as ONNX Runtime folds it when a session loads: the nodes it
    depends on (at most `limit`) run in a CPU session of their own. MoepassError where it depends
    on a graph input, or on more nodes."""
    if value.const_value is not None:
        return value.const_value.numpy()
    graph = value.graph
    if graph is None:
        raise MoepassError(f"value {value.name!r} belongs to no graph")
    nodes: list[ir.Node] = []  # each after the nodes it reads
    seen: set[int] = set()
    constants: dict[str, ir.TensorProtocol] = {}

    def visit(current: ir.Value) -> None:
        if current.const_value is not None:
            constants[current.name or ""] = current.const_value
            return
        node = current.producer()
        if node is None or len(nodes) >= limit:
            raise MoepassError(f"value {value.name!r} is not computed from at most {limit} nodes on constants")
        if id(node) in seen:
            return
        seen.add(id(node))
        for read in node.inputs:
            if read is not None:
                visit(read)
        nodes.append(node)

    visit(value)
    import onnx
    import onnxruntime as ort

    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [ir.serde.serialize_node(n) for n in nodes],
            "folded",
            [],
            [onnx.ValueInfoProto(name=value.name or "")],  # its type is inferred
            [ir.serde.serialize_tensor(t) for t in constants.values()],
        ),
        opset_imports=[onnx.helper.make_opsetid(domain, version) for domain, version in graph.opset_imports.items()],
        ir_version=ir_version_for(graph.opset_imports),  # not onnx's newest: ONNX Runtime 1.31 loads up to 13
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run([value.name or ""], {})[0]
    except Exception as error:  # ONNX Runtime's own errors, one class per status
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise MoepassError(
            f"value {value.name!r}: ONNX Runtime cannot compute it from its constants: {first}"
        ) from None


def stored_constant(value: ir.Value | None) -> ir.Value | None:
    """The initializer that holds `value`: itself, or the one a Cast widens into it (scales stored
    in float16 for a kernel that takes the activation type; ONNX Runtime folds the Cast when the
    session loads); None for a computed value."""
    if value is None or value.const_value is not None:
        return value
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.domain != "" or not node.inputs:
        return None
    source = node.inputs[0]
    return source if source is not None and source.const_value is not None else None


def dims(shape: ir.ShapeProtocol | None, of: str = "a value") -> tuple[int, ...]:
    """A shape's dimensions as integers; MoepassError for an unknown shape or a symbolic dimension."""
    if shape is None:
        raise MoepassError(f"{of}: its shape is unknown")
    if not all(isinstance(d, int) for d in shape):
        raise MoepassError(f"{of}: shape {shape} has symbolic dimensions where a fixed size is needed")
    return tuple(int(d) for d in shape.numpy())


def tensor_dims(tensor: ir.TensorProtocol) -> tuple[int, ...]:
    return dims(tensor.shape, f"tensor {tensor.name!r}")


def dtype_of(value: ir.Value) -> ir.DataType:
    if value.dtype is None:
        raise MoepassError(f"value {value.name!r}: its element type is unknown")
    return value.dtype


def dim(shape: ir.ShapeProtocol | None, axis: int, of: str = "a value") -> int:
    """One fixed dimension of a shape whose others may be symbolic (batch, sequence)."""
    if shape is None or not -len(shape) <= axis < len(shape):
        raise MoepassError(f"{of}: its shape {shape} has no axis {axis}")
    size = shape[axis]
    if not isinstance(size, int):
        raise MoepassError(f"{of}: axis {axis} of its shape {shape} is symbolic where a fixed size is needed")
    return int(size)


def read_rows(tensor: ir.TensorProtocol, first: int = 0, count: int | None = None) -> np.ndarray:
    """Rows [first, first + count) along axis 0 of a tensor (all by default). External data is read
    with pread, as the GGUF path reads: pages read that way stay in the page cache and out of this
    process's RSS, where onnx-ir's memory map of the whole file would count every page touched."""
    shape = tensor_dims(tensor)
    if not shape:  # a scalar: no rows to read
        return tensor.numpy()
    count = shape[0] - first if count is None else count
    if not isinstance(tensor, ir.ExternalTensor) or tensor.dtype.itemsize != int(tensor.dtype.itemsize):
        return tensor.numpy()[first : first + count]
    dtype = tensor.dtype.numpy()
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    with open(tensor.path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), row * count, (tensor.offset or 0) + row * first)
    if len(data) != row * count:
        raise MoepassError(f"{tensor.path}: external data of tensor '{tensor.name}' ends early")
    return np.frombuffer(data, dtype=dtype).reshape((count, *shape[1:]))


_BOOLEAN_OPS = {
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "Xor",
    "IsNaN",
    "IsInf",
}


def infer_dtypes(graph: ir.Graph) -> None:
    """Element types of the values a graph's nodes make and that carry none (onnx-ir tapes leave
    them unset), propagated from the graph's inputs and initializers in topological order: ONNX's
    operator schemas for its own ops, moepass.core.ort's records for ONNX Runtime's."""
    import onnx.defs

    for node in graph:
        domain = node.domain or ""
        key = (domain, node.op_type)
        for index, out in enumerate(node.outputs):
            if out.dtype is not None:
                continue
            dtype = _output_dtype(node, index, key, onnx.defs)
            if dtype is not None:
                out.dtype = dtype


def _output_dtype(node: ir.Node, index: int, key: tuple[str, str], defs) -> ir.DataType | None:
    def input_type(i: int) -> ir.DataType | None:
        value = node.inputs[i] if i < len(node.inputs) else None
        return value.dtype if value is not None else None

    if key in OPERATORS:
        sources = OPERATORS[key].output_types
        source = sources[index] if index < len(sources) else None
        return ir.DataType.FLOAT if source is None else input_type(source)
    op = node.op_type
    if op == "Cast":
        return ir.DataType(node.attributes.get_int("to", 1))
    if op in _BOOLEAN_OPS:
        return ir.DataType.BOOL
    if op in ("ConstantOfShape", "Constant"):
        value = node.attributes.get("value")
        if value is not None and hasattr(value.value, "dtype"):
            return ir.DataType(value.value.dtype)
        return ir.DataType.FLOAT if op == "ConstantOfShape" else None
    if key[0] not in ("", "ai.onnx") or not defs.has(op, key[0]):
        return input_type(0)
    schema = defs.get_schema(op, 21, key[0])
    formal = schema.outputs[min(index, len(schema.outputs) - 1)].type_str
    allowed = {t.type_param_str: t.allowed_type_strs for t in schema.type_constraints}.get(formal, [formal])
    if len(allowed) == 1:  # a fixed type: tensor(int64), or a constraint of one (Shape's T1)
        return _ONNX_TYPES.get(allowed[0])
    for i, param in enumerate(schema.inputs):
        if param.type_str == formal:
            last = len(node.inputs) if param.option == param.option.Variadic else i + 1
            for j in range(i, last):
                found = input_type(j)
                if found is not None:
                    return found
    return None


_ONNX_TYPES = {
    f"tensor({name})": dtype
    for name, dtype in (
        ("float", ir.DataType.FLOAT),
        ("float16", ir.DataType.FLOAT16),
        ("double", ir.DataType.DOUBLE),
        ("int64", ir.DataType.INT64),
        ("int32", ir.DataType.INT32),
        ("bool", ir.DataType.BOOL),
        ("uint8", ir.DataType.UINT8),
        ("int8", ir.DataType.INT8),
    )
}
