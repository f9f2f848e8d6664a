"""Unit tests of single graph passes on small graphs built by hand with onnx-ir.

Beside the end-to-end tests (test_fuse_moe.py, test_convert.py, ...), each pass here runs alone on
a graph of a few nodes, through its public interface only (constructor, `__call__`, the documented
attributes such as `records`, `outputs`, `skipped`), and the tests check what it rewrote and, where
numbers are involved, what ONNX Runtime (CPU, one thread) computes before and after, against a
float64 numpy reference written here (`moe_reference`, `_simplified_norm`).

Every graph is built by hand, including the per-expert branch pattern that torch.onnx.export
traces from Hugging Face sparse MoE blocks (`_branches_model`, written after the docstring and
`ExpertBranchesRule` in passes/fuse_moe.py and the exporter notes in fixtures/make_onnx_fixtures.py):
no torch export runs in this file.

Tolerances. An ONNX Runtime output is compared with the float64 reference through a first-order
forward error bound of a float32 implementation (`moe_reference` computes it alongside the value):
a dot product of n terms is off by at most gamma_n * sum|a_i b_i| (gamma_n = n u / (1 - n u),
u = 2**-24 the unit roundoff of float32), an elementwise operation by u of its result, ONNX
Runtime's vectorized exp / sigmoid (polynomial approximations in MLAS) by NONLINEAR = 16 u, and
the errors propagate through the SwiGLU (|silu'| <= 1.1) and the routing weights. Quantized
experts are compared with the reference run on their dequantized values (decoded here), so only
rounding remains, except where ONNX Runtime quantizes the activations to int8 inside the product
(on the CPU EP of ONNX Runtime 1.32: 8-bit block-wise experts always, 4-bit ones and MatMulNBits
at accuracy_level 4): then each activation row is off by at most max|row| / 254 (half a step of
the coarsest scale an absmax or min/max int8 quantizer can pick for that row), which the bound
propagates too; that bound is loose (measured errors are 3-4 % of it), and those tests pin the
layout of the weights through the decoded values instead. Comparisons of two ONNX Runtime runs
of one computation (a reordering) use the tighter bound stated where they are made.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass

from moepass.core.errors import MoepassError
from moepass.passes.activations import QuantizeActivationsPass
from moepass.passes.annotate_layers import AnnotateLayersPass
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.passes.fuse_moe import FuseMoePass
from moepass.passes.fuse_skip_norm import FuseSkipNormPass
from moepass.passes.reorder_experts import ReorderExpertsPass

FLOAT = ir.DataType.FLOAT
OPSETS = {"": 21, "com.microsoft": 1}
U = float(np.finfo(np.float32).eps) / 2   # unit roundoff of float32
NONLINEAR = 16 * U                         # ORT's vectorized exp / sigmoid: a few ulps, 16 allowed
SILU_SLOPE = 1.1                           # max |d/dg g * sigmoid(g)| = 1.0998 (at g = 2.4)

# the MoE layer of most tests: tokens, width, expert width, experts, experts per token
T, H, I, E, K = 6, 32, 16, 4, 2
ORDER = [2, 0, 3, 1]  # a permutation that moves every expert


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


# ---- building graphs ------------------------------------------------------------------------------

class Builder:
    """A graph under construction: inputs, initializers and nodes, each output named after its node."""

    def __init__(self) -> None:
        self.inputs: list[ir.Value] = []
        self.initializers: list[ir.Value] = []
        self.nodes: list[ir.Node] = []

    def input(self, name: str, shape: list, dtype: ir.DataType = FLOAT) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        self.inputs.append(value)
        return value

    def const(self, name: str, array) -> ir.Value:
        array = np.asarray(array)
        tensor = ir.tensor(array, name=name)
        value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(array.shape),
                         const_value=tensor)
        self.initializers.append(value)
        return value

    def op(self, op_type: str, inputs: list, attributes: dict | None = None, *, name: str, domain: str = "",
           outputs: int = 1):
        node = ir.node(op_type, inputs, attributes or {}, domain=domain, name=name, num_outputs=outputs)
        for i, out in enumerate(node.outputs):
            out.name = name if outputs == 1 else f"{name}:{i}"
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)

    def model(self, outputs: list[ir.Value], opsets: dict | None = None) -> ir.Model:
        for out in [*outputs, *(o for n in self.nodes for o in n.outputs if o.shape is not None)]:
            if out.type is None:  # the graph's outputs and the values given a shape here are float
                out.type = ir.TensorType(FLOAT)
        graph = ir.Graph(self.inputs, outputs, nodes=self.nodes, opset_imports=dict(opsets or OPSETS))
        for value in self.initializers:
            graph.register_initializer(value)
        return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs in graph order, by ONNX Runtime's CPU EP on one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _initializer(value: ir.Value) -> np.ndarray:
    assert value is not None and value.const_value is not None, f"{value} is not an initializer"
    return value.const_value.numpy()


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _moe_attributes(k: int = K, normalize: bool = True, **extra) -> dict:
    return {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
            "activation_beta": 0.0, "normalize_routing_weights": int(normalize), **extra}


# ---- numpy: quantization and the MoE reference -----------------------------------------------------

def _quantize_int4(w: np.ndarray, block: int, rng: np.random.Generator):
    """Asymmetric 4-bit codes of `w` [..., K] in blocks of `block` along K, as QMoE / MatMulNBits store
    them: value = (u - z) * scale with u, z in 0..15, two codes a byte (element 2j in the low nibble),
    zero points packed the same way per row. Returns (packed codes [..., K/2], scales [..., K/block],
    packed zero points [..., ceil(K/block/2)], dequantized values)."""
    blocks = w.reshape(*w.shape[:-1], -1, block)
    scales = (np.abs(blocks).max(-1) / 7).astype(np.float32)
    zeros = rng.integers(7, 9, scales.shape).astype(np.uint8)  # codes z - 7 .. z + 7 stay in 0..15
    codes = (np.rint(blocks / scales[..., None]) + zeros[..., None]).astype(np.uint8)
    values = ((codes.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(w.shape)
    codes = codes.reshape(w.shape)
    if zeros.shape[-1] % 2:  # an odd number of blocks: the last byte's high nibble is padding
        zeros = np.concatenate([zeros, np.full((*zeros.shape[:-1], 1), 8, np.uint8)], axis=-1)
    return (codes[..., 0::2] | codes[..., 1::2] << 4, scales, zeros[..., 0::2] | zeros[..., 1::2] << 4,
            values)


def _dequantize_qmoe(codes: np.ndarray, scales: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Values of QMoE weights with the default zero point: [E, N, K*bits/8] codes (4 bits: element
    2j in the low nibble of byte j), scales [E, N, K/block] or [E, N] (block 0: one per row)."""
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    centered = codes.astype(np.float32) - (1 << (bits - 1))
    if block == 0:
        return centered * scales[..., None]
    return centered * np.repeat(scales, block, axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclasses.dataclass
class Reference:
    y: np.ndarray          # float64 output [T, H]
    bound: np.ndarray      # first-order error bound of a float32 implementation, per element
    magnitude: np.ndarray  # sum over the chosen experts of |w_e * expert_e(x)|, per element


def _router_error(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> float:
    """Largest float32 rounding error of router logits x @ w (+ bias): a dot product of H terms,
    one more rounding for the bias, one for a dequantized weight (MatMulNBits)."""
    return float(_gamma(w.shape[0] + 2) * (np.abs(x) @ np.abs(w) + (0 if bias is None else np.abs(bias))).max())


def moe_reference(x, logits, fc1, fc2, *, k=K, normalize=True, fc1_bias=None, fc2_bias=None,
                  act_quant=False, logit_error=0.0) -> Reference:
    """float64 forward of ONNX Runtime's MoE / QMoE (softmax over the logits, top-k, renormalized
    over the k when `normalize`, SwiGLU with fc1 rows gate/up interleaved, fc1 [E, 2I, H], fc2
    [E, H, I]) and the first-order bound of the module docstring. `logit_error` bounds the float32
    error of the logits the implementation computes itself (a router MatMul); `act_quant` adds the
    int8 quantization of fc1's and fc2's input rows."""
    x, logits = np.asarray(x, np.float64), np.asarray(logits, np.float64)
    fc1, fc2 = np.asarray(fc1, np.float64), np.asarray(fc2, np.float64)
    tokens, hidden = x.shape
    experts, width = fc2.shape[0], fc2.shape[2]
    probs = _softmax(logits)
    y, bound, magnitude = (np.zeros((tokens, hidden)) for _ in range(3))
    # relative error of a routing weight: exp, the softmax's sum and division, the renormalization,
    # and the logits' own error (which moves p_i by at most 2 * max |dl| relative, 4x renormalized)
    weight_rel = NONLINEAR + _gamma(experts) + 2 * U + (_gamma(k) + 2 * U if normalize else 0) \
        + (4 if normalize else 2) * logit_error
    for t in range(tokens):
        ranked = np.argsort(-probs[t], kind="stable")
        if k < experts:  # a clear choice: float32 rounding cannot change which experts are picked
            gap = logits[t, ranked[k - 1]] - logits[t, ranked[k]]
            assert gap > 1e-4 + 2 * logit_error, f"token {t}: near tie in the top-k (logit gap {gap:.2g})"
        chosen = ranked[:k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1)
        ax = np.abs(x[t])
        dx = ax.max() / 254 if act_quant else 0.0
        for e, w in zip(chosen, weights):
            b1 = np.zeros(2 * width) if fc1_bias is None else np.asarray(fc1_bias[e], np.float64)
            b2 = np.zeros(hidden) if fc2_bias is None else np.asarray(fc2_bias[e], np.float64)
            h = fc1[e] @ x[t] + b1
            dh = _gamma(hidden + 1) * (np.abs(fc1[e]) @ ax + np.abs(b1)) + np.abs(fc1[e]).sum(-1) * dx
            g, up, dg, du = h[0::2], h[1::2], dh[0::2], dh[1::2]
            silu = g / (1 + np.exp(-g))
            ds = SILU_SLOPE * dg + (NONLINEAR + U) * np.abs(silu)
            a = silu * up
            da = np.abs(silu) * du + np.abs(up) * ds + ds * du + U * np.abs(a)
            if act_quant:
                da = da + (np.abs(a).max() + da.max()) / 254
            z = fc2[e] @ a + b2
            dz = np.abs(fc2[e]) @ da + _gamma(width + 1) * (np.abs(fc2[e]) @ np.abs(a) + np.abs(b2))
            y[t] += w * z
            magnitude[t] += np.abs(w * z)
            bound[t] += w * dz + weight_rel * w * np.abs(z)
        bound[t] += _gamma(k) * magnitude[t]  # adding up the k contributions
    # first order: the neglected products of two errors are below 1 % of the terms kept here
    # (every relative error above is under 1 / 254), so a factor 1.25 covers them
    return Reference(y, 1.25 * bound, magnitude)


def _assert_within(actual: np.ndarray, ref: Reference) -> None:
    error = np.abs(np.asarray(actual, np.float64) - ref.y)
    worst = np.unravel_index(np.argmax(error - ref.bound), error.shape)
    assert np.all(error <= ref.bound), \
        f"error {error[worst]:.3g} > bound {ref.bound[worst]:.3g} at {worst} (|y| {abs(ref.y[worst]):.3g})"


# ---- MoE layers as com.microsoft QMoE / MoE nodes ----------------------------------------------------

@dataclasses.dataclass
class Layer:
    """One MoE layer's numbers as floats (QMoE experts dequantized)."""

    name: str
    router: np.ndarray             # the router as a float matrix W [H, E]: logits = x @ W (+ bias)
    router_bias: np.ndarray | None
    fc1: np.ndarray
    fc2: np.ndarray
    fc1_bias: np.ndarray
    fc2_bias: np.ndarray
    normalize: bool

    def logits(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float64) @ self.router + (0 if self.router_bias is None else self.router_bias)

    def reference(self, x: np.ndarray) -> Reference:
        return moe_reference(x, self.logits(x), self.fc1, self.fc2, normalize=self.normalize, fc1_bias=self.fc1_bias,
                             fc2_bias=self.fc2_bias, logit_error=_router_error(x, self.router, self.router_bias))


@dataclasses.dataclass
class MoeModel:
    model: ir.Model
    x: np.ndarray                  # the input to feed
    values: dict[str, np.ndarray]  # every initializer as built, by name
    layers: list[Layer]            # layer i: node blk.i.moe, graph output i


def _router(b: Builder, x: ir.Value, kind: str, rng: np.random.Generator, name: str):
    """Router logits [T, E] of `x`: 'matmul' (MatMul by W [H, E]), 'bias' (MatMul + Add of a bias
    [E]), 'nbits' (a 4-bit MatMulNBits, block 16, 2-D scales and packed zero points), 'computed'
    (MatMul then Mul by 0.5: a subgraph, not one of the router forms the pass permutes).
    Returns (logits value, the router as a float W [H, E], the bias or None)."""
    if kind == "nbits":
        w = rng.standard_normal((E, H)).astype(np.float32) * 0.25
        codes, scales, zeros, values = _quantize_int4(w, 16, rng)
        logits = b.op("MatMulNBits", [x, b.const(f"{name}.router.B", codes.reshape(E, H // 16, 8)),
                                      b.const(f"{name}.router.scales", scales),
                                      b.const(f"{name}.router.zero_points", zeros)],
                      {"K": H, "N": E, "bits": 4, "block_size": 16}, domain="com.microsoft", name=f"{name}.router")
        return logits, values.T.astype(np.float64), None
    w = rng.standard_normal((H, E)).astype(np.float32) * 0.25
    logits = b.op("MatMul", [x, b.const(f"{name}.router.weight", w)], name=f"{name}.router")
    bias = None
    if kind == "bias":
        bias = rng.standard_normal(E).astype(np.float32)
        logits = b.op("Add", [logits, b.const(f"{name}.router.bias", bias)], name=f"{name}.router_bias")
    elif kind == "computed":
        logits = b.op("Mul", [logits, b.const(f"{name}.half", np.float32(0.5))], name=f"{name}.router_scaled")
        w = w / 2  # exact
    return logits, w.astype(np.float64), bias


def _moe_node(b: Builder, x: ir.Value, logits: ir.Value, op: str, rng: np.random.Generator, name: str,
              normalize: bool = True, fc2_value: ir.Value | None = None):
    """A QMoE (int4, blocks of 16, zero points, biases) or float MoE (biases) node with random
    experts, every expert tensor different (a MoE node may be given its fc2 initializer, to share
    one); returns (output, float fc1, fc2, fc1 bias, fc2 bias)."""
    fc1 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.3
    fc2 = rng.standard_normal((E, H, I)).astype(np.float32) * 0.3
    fc1_bias = rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.1
    fc2_bias = rng.standard_normal((E, H)).astype(np.float32) * 0.1
    if op == "MoE":
        if fc2_value is None:
            fc2_value = b.const(f"{name}.fc2.weight", fc2)
        fc2 = fc2_value.const_value.numpy()
        inputs = [x, logits, b.const(f"{name}.fc1.weight", fc1), b.const(f"{name}.fc1.bias", fc1_bias),
                  fc2_value, b.const(f"{name}.fc2.bias", fc2_bias)]
        attributes = _moe_attributes(normalize=normalize)
    else:
        c1, s1, z1, fc1 = _quantize_int4(fc1, 16, rng)
        c2, s2, z2, fc2 = _quantize_int4(fc2, 16, rng)
        inputs = [x, logits, b.const(f"{name}.fc1.weight", c1), b.const(f"{name}.fc1.scales", s1),
                  b.const(f"{name}.fc1.bias", fc1_bias), b.const(f"{name}.fc2.weight", c2),
                  b.const(f"{name}.fc2.scales", s2), b.const(f"{name}.fc2.bias", fc2_bias), None, None, None,
                  b.const(f"{name}.fc1.zero_points", z1), b.const(f"{name}.fc2.zero_points", z2)]
        if not normalize:  # the mixing weights, given as QMoE's router_weights (input 14)
            inputs += [None, b.op("Softmax", [logits], {"axis": -1}, name=f"{name}.router_weights")]
        attributes = _moe_attributes(normalize=normalize, expert_weight_bits=4, block_size=16)
    out = b.op(op, inputs, attributes, domain="com.microsoft", name=name)
    out.shape = ir.Shape([T, H])
    return out, fc1, fc2, fc1_bias, fc2_bias


def _moe_model(*specs: tuple[str, str, bool], shared_fc2: bool = False, seed: int = 0) -> MoeModel:
    """MoE layers side by side, each reading the input x [T, H]: spec i = (op, router kind,
    normalize) makes node blk.i.moe and graph output i. `shared_fc2`: the MoE nodes share one fc2."""
    rng = np.random.default_rng(seed)
    b = Builder()
    x = b.input("x", [T, H])
    layers, outputs, fc2_value = [], [], None
    for i, (op, router, normalize) in enumerate(specs):
        logits, w, bias = _router(b, x, router, rng, f"blk.{i}")
        out, fc1, fc2, fc1_bias, fc2_bias = _moe_node(b, x, logits, op, rng, f"blk.{i}.moe", normalize, fc2_value)
        if shared_fc2 and op == "MoE":
            fc2_value = out.producer().inputs[4]
        layers.append(Layer(f"blk.{i}.moe", w, bias, fc1, fc2, fc1_bias, fc2_bias, normalize))
        outputs.append(out)
    model = b.model(outputs)
    values = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}
    return MoeModel(model, rng.standard_normal((T, H)).astype(np.float32), values, layers)


def _reordering_bound(reference: Reference) -> np.ndarray:
    """How far a reordered layer's output may move from the original's in one implementation:
    each expert and each logit is computed from the same numbers; the softmax adds the E
    exponentials in the new slot order (gamma_E relative on each weight, one more rounding for
    the division) and the k contributions of a token may be added in another order (gamma_k);
    twice, as both runs round."""
    return 2 * (_gamma(E) + _gamma(K) + 2 * U) * reference.magnitude


# ---- reorder-experts ---------------------------------------------------------------------------------

# (op, router, normalize): every router form the pass permutes, and the computed one it gathers
REORDER_CASES = [("QMoE", "matmul", True), ("QMoE", "bias", True), ("QMoE", "nbits", False),
                 ("QMoE", "computed", False), ("MoE", "matmul", False), ("MoE", "bias", True), ("MoE", "nbits", True),
                 ("MoE", "computed", True)]


@pytest.mark.parametrize("op,router,normalize", REORDER_CASES)
def test_reorder_experts_permutes_experts_and_router_and_keeps_the_output(op, router, normalize):
    built = _moe_model((op, router, normalize))
    model, node, v = built.model, built.model.graph.node("blk.0.moe"), built.values
    reference = built.layers[0].reference(built.x)
    before = _run(model, {"x": built.x})[0]
    _assert_within(before, reference)  # the layer computes what the reference says

    expert_inputs = {i: x.name for i, x in enumerate(node.inputs) if i >= 2 and x is not None and x.is_initializer()}
    assert len(expert_inputs) == (8 if op == "QMoE" else 4)
    result = ReorderExpertsPass({"blk.0.moe": ORDER}, {"blk.0.moe": 2})(model)
    assert result.modified

    for index, name in expert_inputs.items():  # every expert tensor, permuted along axis 0
        original = v[name]
        assert any(not np.array_equal(original[i], original[e]) for i, e in enumerate(ORDER))
        np.testing.assert_array_equal(_initializer(node.inputs[index]), original[ORDER], err_msg=name)
        assert node.inputs[index].name == name  # used by this node only: the name is kept
    assert node.metadata_props["moepass.placement.expert_ids"] == "2,0,3,1"
    assert node.metadata_props["moepass.placement.resident"] == "2"

    # the router: slot i's logit is expert ORDER[i]'s
    router_node = model.graph.node("blk.0.router")
    if router == "nbits":  # MatMulNBits: its rows (N = experts)
        for index, part in ((1, "B"), (2, "scales"), (3, "zero_points")):
            np.testing.assert_array_equal(_initializer(router_node.inputs[index]), v[f"blk.0.router.{part}"][ORDER])
    elif router != "computed":  # MatMul by W [H, E]: its columns
        np.testing.assert_array_equal(_initializer(router_node.inputs[1]), v["blk.0.router.weight"][:, ORDER])
    if router == "bias":
        bias_node = model.graph.node("blk.0.router_bias")
        np.testing.assert_array_equal(_initializer(bias_node.inputs[1]), v["blk.0.router.bias"][ORDER])
    if router == "computed":  # the router weight stays; its result is gathered in the new order
        np.testing.assert_array_equal(_initializer(router_node.inputs[1]), v["blk.0.router.weight"])
        routing = [i for i in (1, 14) if i < len(node.inputs) and node.inputs[i] is not None]
        assert routing == ([1, 14] if op == "QMoE" and not normalize else [1])
        for i in routing:
            gather = node.inputs[i].producer()
            assert gather.op_type == "Gather" and gather.attributes.get_int("axis") == -1
            np.testing.assert_array_equal(_initializer(gather.inputs[1]), ORDER)

    after = _run(model, {"x": built.x})[0]
    _assert_within(after, reference)
    assert np.all(np.abs(after - before) <= _reordering_bound(reference))
    # the logits the node now reads: column i is expert ORDER[i]'s
    ExposeRouterLogitsPass()(model)
    logits = _run(model, {"x": built.x})[1]
    layer = built.layers[0]
    assert np.abs(logits - layer.logits(built.x)[:, ORDER]).max() <= _router_error(built.x, layer.router,
                                                                                    layer.router_bias)


def test_reorder_experts_copies_an_initializer_another_node_still_reads():
    """Two MoE nodes share their fc2 initializer; reordering one gives it a permuted copy under a
    new name, and the other keeps reading the original."""
    built = _moe_model(("MoE", "matmul", True), ("MoE", "bias", True), shared_fc2=True)
    model = built.model
    first, second = model.graph.node("blk.0.moe"), model.graph.node("blk.1.moe")
    shared = first.inputs[4]
    assert second.inputs[4] is shared
    references = [layer.reference(built.x) for layer in built.layers]
    before = _run(model, {"x": built.x})

    ReorderExpertsPass({"blk.0.moe": ORDER}, {"blk.0.moe": 1})(model)
    copy = first.inputs[4]
    assert copy is not shared and copy.name == f"{shared.name}.reordered"
    assert model.graph.initializers[copy.name] is copy and model.graph.initializers[shared.name] is shared
    np.testing.assert_array_equal(_initializer(copy), built.values[shared.name][ORDER])
    assert second.inputs[4] is shared
    np.testing.assert_array_equal(_initializer(shared), built.values[shared.name])
    assert "moepass.placement.expert_ids" not in second.metadata_props
    after = _run(model, {"x": built.x})
    for b_out, a_out, reference in zip(before, after, references):
        _assert_within(a_out, reference)
        assert np.all(np.abs(a_out - b_out) <= _reordering_bound(reference))


def test_reorder_experts_without_resident_count_records_zero():
    built = _moe_model(("MoE", "matmul", True))
    ReorderExpertsPass({"blk.0.moe": [3, 2, 1, 0]}, {})(built.model)
    node = built.model.graph.node("blk.0.moe")
    assert node.metadata_props["moepass.placement.expert_ids"] == "3,2,1,0"
    assert node.metadata_props["moepass.placement.resident"] == "0"


@pytest.mark.parametrize("order,message", [
    ({"blk.9.moe": ORDER}, "no MoE node named 'blk.9.moe'"),
    ({"blk.0.moe": [0, 1, 2]}, "not a permutation of 0..3"),
    ({"blk.0.moe": [0, 1, 2, 2]}, "not a permutation of 0..3"),
    ({"blk.0.moe": [0, 1, 2, 3, 4]}, "not a permutation of 0..3"),
])
def test_reorder_experts_rejects_a_bad_plan_and_leaves_the_model(order, message):
    built = _moe_model(("QMoE", "matmul", True))
    with pytest.raises(MoepassError, match=re.escape(message)):
        ReorderExpertsPass(order, {})(built.model)
    for name, value in built.model.graph.initializers.items():
        np.testing.assert_array_equal(_initializer(value), built.values[name])
    assert not built.model.graph.node("blk.0.moe").metadata_props


def test_reorder_experts_rejects_routers_it_cannot_permute():
    """Logits given as a graph input, or also read by another node, cannot be permuted."""
    b = Builder()
    x, logits = b.input("x", [T, H]), b.input("logits", [T, E])
    out, *_ = _moe_node(b, x, logits, "MoE", np.random.default_rng(0), "blk.0.moe")
    with pytest.raises(MoepassError, match="graph input"):
        ReorderExpertsPass({"blk.0.moe": ORDER}, {})(b.model([out]))

    built = _moe_model(("MoE", "matmul", True))
    graph = built.model.graph
    logits = graph.node("blk.0.moe").inputs[1]
    peek = ir.node("ArgMax", [logits], {"axis": -1}, name="peek")
    graph.append(peek)
    graph.outputs.append(peek.outputs[0])
    expert_values = [v for v in graph.node("blk.0.moe").inputs]
    with pytest.raises(MoepassError, match="also feed ArgMax node 'peek'"):
        ReorderExpertsPass({"blk.0.moe": ORDER}, {})(built.model)
    # checked before anything changed: the experts were not permuted either
    assert list(graph.node("blk.0.moe").inputs) == expert_values
    assert "moepass.placement.expert_ids" not in graph.node("blk.0.moe").metadata_props


def test_reorder_experts_refuses_an_expert_tensor_from_a_constant_node():
    """Found by this test: the pass permuted only the initializer expert inputs, so a Constant node's
    fc2 bias kept the old order while the router was permuted and the output changed silently (by up
    to 0.33 here). The pass now refuses such a node before changing anything."""
    built = _moe_model(("MoE", "matmul", True))
    graph = built.model.graph
    node = graph.node("blk.0.moe")
    bias = node.inputs[5]  # fc2 bias [E, H], as a Constant node instead of an initializer
    constant = ir.node("Constant", [], {"value": ir.tensor(_initializer(bias), name="fc2_bias")}, name="fc2_bias")
    constant.outputs[0].name = "fc2_bias"
    graph.insert_before(node, constant)
    node.replace_input_with(5, constant.outputs[0])
    graph.initializers.pop(bias.name)
    reference = built.layers[0].reference(built.x)
    before = _run(built.model, {"x": built.x})[0]
    _assert_within(before, reference)
    with pytest.raises(MoepassError, match=r"node blk.0.moe: expert input 5 \('fc2_bias'\) is computed"):
        ReorderExpertsPass({"blk.0.moe": ORDER}, {})(built.model)
    np.testing.assert_array_equal(_run(built.model, {"x": built.x})[0], before)  # nothing was changed


# ---- expose-router-logits ----------------------------------------------------------------------------

def test_expose_router_logits_adds_the_logits_of_every_moe_node_as_outputs():
    built = _moe_model(("QMoE", "bias", False), ("MoE", "nbits", True))
    model = built.model
    references = [layer.reference(built.x) for layer in built.layers]
    expose = ExposeRouterLogitsPass()
    assert expose(model).modified

    names = {"blk.0.moe": "moepass.router_logits.blk.0.moe", "blk.1.moe": "moepass.router_logits.blk.1.moe"}
    assert expose.outputs == names
    outputs = list(model.graph.outputs)
    assert [o.name for o in outputs[:2]] == ["blk.0.moe", "blk.1.moe"]  # the model's own outputs come first
    assert [o.name for o in outputs[2:]] == list(names.values())
    for layer, exposed in zip(built.layers, outputs[2:]):
        assert exposed.dtype == FLOAT
        assert [str(d) if isinstance(d, ir.SymbolicDim) else d for d in exposed.shape] == ["tokens", E]
        # an Identity of exactly the value the node reads
        assert exposed.producer().op_type == "Identity"
        assert exposed.producer().inputs[0] is model.graph.node(layer.name).inputs[1]

    results = _run(model, {"x": built.x})
    for layer, reference, y, logits in zip(built.layers, references, results[:2], results[2:]):
        _assert_within(y, reference)  # the layers compute as before
        assert logits.shape == (T, E) and logits.dtype == np.float32
        error = np.abs(logits - layer.logits(built.x))
        assert error.max() <= _router_error(built.x, layer.router, layer.router_bias)


def test_expose_router_logits_leaves_a_model_without_moe_alone():
    b = Builder()
    x = b.input("x", [T, H])
    y = b.op("MatMul", [x, b.const("w", np.eye(H, dtype=np.float32))], name="dense")
    model = b.model([y])
    expose = ExposeRouterLogitsPass()
    assert not expose(model).modified
    assert expose.outputs == {}
    assert [o.name for o in model.graph.outputs] == ["dense"] and _ops(model) == ["MatMul"]


# ---- annotate-layers ---------------------------------------------------------------------------------

def _annotated_model() -> ir.Model:
    """Two MoE layers, and an If whose branches hold a node each (nodes of subgraphs)."""
    built = _moe_model(("QMoE", "matmul", True), ("MoE", "bias", True))
    graph = built.model.graph
    flag = ir.Value(name="flag", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    graph.inputs.append(flag)
    branches = {}
    for branch in ("then", "else"):
        inner = ir.node("Neg" if branch == "then" else "Abs", [graph.outputs[0]], name=f"{branch}.op")
        inner.outputs[0].name = f"{branch}.out"
        branches[f"{branch}_branch"] = ir.Graph([], inner.outputs, nodes=[inner], name=branch)
    choose = ir.node("If", [flag], branches, name="choose")
    graph.append(choose)
    return built.model


def test_annotate_layers_marks_every_node_with_its_device():
    model = _annotated_model()
    result = AnnotateLayersPass({"blk.0.moe": False, "blk.1.moe": True})(model)
    assert result.modified
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    assert {n.name for n in nodes} >= {"then.op", "else.op", "choose", "blk.0.router", "blk.1.router_bias"}
    for node in nodes:
        expected = {"blk.0.moe": "cpu/blk.0.moe", "blk.1.moe": "gpu/blk.1.moe"}.get(node.name, "gpu")
        assert node.metadata_props.get("layer_ann") == expected, node.name


def test_annotate_layers_puts_moe_nodes_the_plan_leaves_out_on_the_gpu():
    model = _annotated_model()
    AnnotateLayersPass({"blk.1.moe": False})(model)
    assert model.graph.node("blk.0.moe").metadata_props["layer_ann"] == "gpu/blk.0.moe"
    assert model.graph.node("blk.1.moe").metadata_props["layer_ann"] == "cpu/blk.1.moe"


def test_annotate_layers_rejects_nodes_the_model_lacks():
    model = _annotated_model()
    with pytest.raises(MoepassError, match=re.escape("blk.7.moe, blk.8.moe")):
        AnnotateLayersPass({"blk.0.moe": True, "blk.8.moe": False, "blk.7.moe": True})(model)
    assert not any("layer_ann" in n.metadata_props for n in ir.traversal.RecursiveGraphIterator(model.graph))


# ---- fuse-skip-norm ----------------------------------------------------------------------------------

NORM_SHAPE = [2, 3, H]


def _norm_model(*, producer: str = "Add", operand: str = "input", axis: int = -1, bias: bool = False,
                sum_use: str = "reused", norm_is_output: bool = False) -> ir.Model:
    """a (op) b -> SimplifiedLayerNormalization(gamma) -> Neg, on [2, 3, H], opset ai.onnx only.
    `operand`: b is a graph input, an initializer or a Constant node's output; `sum_use`: the sum
    is also read by a Mul ('reused', as the residual stream of a decoder), is a graph output
    ('output'), or is read by the normalization only ('none')."""
    rng = np.random.default_rng(3)
    b = Builder()
    a = b.input("a", NORM_SHAPE)
    if operand == "input":
        other = b.input("b", NORM_SHAPE)
    elif operand == "initializer":
        other = b.const("bias", rng.standard_normal(H).astype(np.float32))
    else:
        other = b.op("Constant", [], {"value": ir.tensor(rng.standard_normal(H).astype(np.float32))}, name="bias")
    summed = b.op(producer, [a, other], name="sum")
    inputs = [summed, b.const("gamma", rng.uniform(0.5, 1.5, H).astype(np.float32))]
    if bias:
        inputs.append(b.const("beta", np.full(H, 0.1, np.float32)))
    normed = b.op("SimplifiedLayerNormalization", inputs, {"axis": axis, "epsilon": 1e-5}, name="norm")
    outputs = [normed if norm_is_output else b.op("Neg", [normed], name="next")]
    if sum_use == "reused":
        outputs.append(b.op("Mul", [summed, outputs[0]], name="residual"))
    elif sum_use == "output":
        outputs.append(summed)
    for out in outputs:
        out.shape = ir.Shape(NORM_SHAPE)
    return b.model(outputs, {"": 21})


def _norm_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    return {name: rng.standard_normal(NORM_SHAPE).astype(np.float32) for name in ("a", "b")}


def _simplified_norm(s: np.ndarray, gamma: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 s / sqrt(mean(s^2) + epsilon) * gamma over the last axis, and the error bound of a
    float32 implementation: the mean of H squares (positive terms: gamma_{H+1} relative), the
    epsilon, square root, division and scaling (a rounding each), and the float32 sum s itself
    (u relative on s_i, and on the mean); 8 u in all beside gamma_{H+1}."""
    s = s.astype(np.float64)
    y = s / np.sqrt((s * s).mean(-1, keepdims=True) + epsilon) * gamma
    return y, (_gamma(H + 1) + 8 * U) * np.abs(y)


# "output" and the graph-output tests below found a bug: onnx-ir refused to replace a value that is a
# graph output (replace_graph_outputs was not set), so the pass raised ValueError.
@pytest.mark.parametrize("sum_use", ["reused", "output", "none"])
def test_fuse_skip_norm_fuses_and_keeps_the_numbers(sum_use):
    feeds = _norm_feeds()
    model = _norm_model(sum_use=sum_use)
    before = _run(model, feeds)
    gamma = _initializer(model.graph.initializers["gamma"])
    y, bound = _simplified_norm(feeds["a"] + feeds["b"], gamma, 1e-5)
    fuse = FuseSkipNormPass()
    assert fuse(model).modified and fuse.skipped == []
    fused = model.graph.node("norm")
    assert (fused.domain, fused.op_type) == ("com.microsoft", "SkipSimplifiedLayerNormalization")
    assert _ops(model)[0] == "SkipSimplifiedLayerNormalization" and "Add" not in _ops(model)
    assert [v.name for v in fused.inputs] == ["a", "b", "gamma"]
    assert fused.attributes.get_float("epsilon") == pytest.approx(1e-5)
    assert fused.metadata_props["moepass.fused_from"] == "sum,norm"
    assert model.opset_imports.get("com.microsoft") == 1  # added: the graph imported ai.onnx only
    # output 3 (the sum) takes the old sum's place and name when something else reads it
    assert fused.outputs[3].name == ("norm.unused_sum" if sum_use == "none" else "sum")
    also = {"reused": ["residual"], "output": ["sum"], "none": []}[sum_use]
    assert [o.name for o in model.graph.outputs] == ["next", *also]

    after = _run(model, feeds)
    summed = feeds["a"].astype(np.float64) + feeds["b"]
    for result in (before, after):
        assert np.all(np.abs(-result[0] - y) <= bound)  # Neg is exact
        if sum_use == "output":  # one float32 addition, correctly rounded in both: the same bits
            np.testing.assert_array_equal(result[1], feeds["a"] + feeds["b"])
        if sum_use == "reused":  # sum * -normed: the sum's and the product's rounding on top
            assert np.all(np.abs(result[1] + summed * y) <= np.abs(summed) * bound + 2 * U * np.abs(summed * y))


@pytest.mark.parametrize("kwargs,reason", [
    ({"producer": "Mul"}, "not produced by an Add"),
    ({"producer": "Sub"}, "not produced by an Add"),
    ({"operand": "initializer"}, "an Add operand is a constant"),
    ({"axis": 1}, "normalization over axis 1"),
    ({"bias": True}, "the normalization has a bias"),
])
def test_fuse_skip_norm_leaves_what_it_must_not_fuse(kwargs, reason):
    model = _norm_model(**kwargs)
    ops = _ops(model)
    fuse = FuseSkipNormPass()
    assert not fuse(model).modified
    assert _ops(model) == ops
    assert len(fuse.skipped) == 1 and fuse.skipped[0][0] == "norm" and reason in fuse.skipped[0][1]
    assert "com.microsoft" not in model.opset_imports


def test_fuse_skip_norm_leaves_a_bias_given_by_a_constant_node():
    """Found by this test: a Constant node's bias was fused as a residual, and ONNX Runtime then
    rejected the 1-D skip input."""
    feeds = {"a": _norm_feeds()["a"]}
    model = _norm_model(operand="constant-node", sum_use="none")
    before = _run(model, feeds)
    fuse = FuseSkipNormPass()
    fuse(model)
    assert [reason for _, reason in fuse.skipped] == ["an Add operand is a constant (a bias, not a residual)"]
    np.testing.assert_array_equal(_run(model, feeds)[0], before[0])


def test_fuse_skip_norm_when_the_normalized_value_is_a_graph_output():
    feeds = _norm_feeds()
    model = _norm_model(norm_is_output=True, sum_use="output")
    before = _run(model, feeds)
    assert FuseSkipNormPass()(model).modified
    assert [o.name for o in model.graph.outputs] == ["norm", "sum"]
    after = _run(model, feeds)
    np.testing.assert_array_equal(after[1], before[1])
    y, bound = _simplified_norm(feeds["a"] + feeds["b"], _initializer(model.graph.initializers["gamma"]), 1e-5)
    assert np.all(np.abs(after[0] - y) <= bound)


# ---- quantize-activations ----------------------------------------------------------------------------

def test_quantize_activations_sets_and_clears_accuracy_level_on_quantized_products():
    built = _moe_model(("QMoE", "nbits", True), ("MoE", "matmul", True))
    model = built.model
    references = [layer.reference(built.x) for layer in built.layers]
    quantized = {"blk.0.router": "MatMulNBits", "blk.0.moe": "QMoE"}
    float_ops = {"blk.1.router": "MatMul", "blk.1.moe": "MoE"}
    for name, op in {**quantized, **float_ops}.items():
        assert model.graph.node(name).op_type == op

    assert QuantizeActivationsPass("int8")(model).modified
    assert model.metadata_props["moepass.activations"] == "int8"
    for name in quantized:
        attribute = model.graph.node(name).attributes["accuracy_level"]
        assert (attribute.type, attribute.value) == (ir.AttributeType.INT, 4)
    for name in float_ops:
        assert "accuracy_level" not in model.graph.node(name).attributes
    assert not QuantizeActivationsPass("int8")(model).modified  # already so
    int8 = _run(model, {"x": built.x})
    # int8 activations inside the 4-bit QMoE and MatMulNBits: within the activation-quantization
    # bound, and not the float result (ONNX Runtime honours the level)
    layer = built.layers[0]
    logits_error = _router_error(built.x, layer.router) + float(
        (np.abs(layer.router).sum(0) * np.abs(built.x).max(-1, keepdims=True) / 254).max())
    loose = moe_reference(built.x, layer.logits(built.x), layer.fc1, layer.fc2, fc1_bias=layer.fc1_bias,
                          fc2_bias=layer.fc2_bias, act_quant=True, logit_error=logits_error)
    _assert_within(int8[0], loose)
    assert np.abs(int8[0] - references[0].y).max() > references[0].bound.max()
    _assert_within(int8[1], references[1])

    assert QuantizeActivationsPass("float")(model).modified
    assert model.metadata_props["moepass.activations"] == "float"
    assert not any("accuracy_level" in n.attributes for n in model.graph)
    assert not QuantizeActivationsPass("float")(model).modified
    for result, reference in zip(_run(model, {"x": built.x}), references):
        _assert_within(result, reference)

    with pytest.raises(MoepassError, match="activations must be one of"):
        QuantizeActivationsPass("int4")


# ---- fuse-moe, rule moe-node: float com.microsoft::MoE nodes -----------------------------------------

@dataclasses.dataclass
class FloatMoe:
    model: ir.Model
    feeds: dict[str, np.ndarray]
    fc1: np.ndarray
    fc2: np.ndarray
    fc1_bias: np.ndarray | None

    normalize: bool

    def reference(self, fc1=None, fc2=None, normalize=None, **kwargs) -> Reference:
        """Of the graph output: the layer's output plus x (one more rounding)."""
        x = self.feeds["x"]
        moe = moe_reference(x, self.feeds["logits"], self.fc1 if fc1 is None else fc1, self.fc2 if fc2 is None else fc2,
                            normalize=self.normalize if normalize is None else normalize, fc1_bias=self.fc1_bias,
                            **kwargs)
        y = moe.y + x
        return Reference(y, moe.bound + U * np.abs(y), moe.magnitude)


def _float_moe(hidden: int = H, width: int = I, *, normalize: bool = True, bias: bool = False, fc3: bool = False,
               sparse_mixer: bool = False, fc1_input: bool = False, moe_is_output: bool = False,
               activation: str = "swiglu", seed: int = 5) -> FloatMoe:
    """x [T, hidden] and logits [T, E] (graph inputs) -> com.microsoft::MoE blk.0.moe -> + x (the
    residual, graph output y; or the MoE output itself when `moe_is_output`): fc1 [E, 2 width,
    hidden] (gate/up rows interleaved), fc2 [E, hidden, width]."""
    rng = np.random.default_rng(seed)
    b = Builder()
    x, logits = b.input("x", [T, hidden]), b.input("logits", [T, E])
    fc1 = rng.standard_normal((E, 2 * width, hidden)).astype(np.float32) * 0.3
    fc2 = rng.standard_normal((E, hidden, width)).astype(np.float32) * 0.3
    fc1_bias = rng.standard_normal((E, 2 * width)).astype(np.float32) * 0.1 if bias else None
    inputs = [x, logits, b.input("fc1", list(fc1.shape)) if fc1_input else b.const("blk.0.fc1", fc1),
              b.const("blk.0.fc1_bias", fc1_bias) if bias else None, b.const("blk.0.fc2", fc2)]
    if fc3:
        inputs += [None, b.const("blk.0.fc3", fc1[:, :width])]
    attributes = _moe_attributes(normalize=normalize, activation_type=activation)
    if sparse_mixer:
        attributes["use_sparse_mixer"] = 1
    out = b.op("MoE", inputs, attributes, domain="com.microsoft", name="blk.0.moe")
    out.shape = ir.Shape([T, hidden])
    if not moe_is_output:
        out = b.op("Add", [out, x], name="y")
        out.shape = ir.Shape([T, hidden])
    feeds = {"x": rng.standard_normal((T, hidden)).astype(np.float32),
             "logits": rng.standard_normal((T, E)).astype(np.float32)}
    return FloatMoe(b.model([out]), feeds, fc1, fc2, fc1_bias, normalize)


def _qmoe_weights(node: ir.Node, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """fc1 and fc2 values of a QMoE node without zero points, decoded here."""
    assert len(node.inputs) < 12 or all(v is None for v in node.inputs[11:14]), "zero points not expected"
    return tuple(_dequantize_qmoe(_initializer(node.inputs[w]), _initializer(node.inputs[w + 1]), bits, block)
                 for w in (2, 5))


def _assert_block_error(values: np.ndarray, decoded: np.ndarray, bits: int, block: int) -> None:
    """Each block's RMS error is at most what absmax scaling gives: int8 rounds to half a step of
    absmax/127; int4 scales the signed extreme onto code -8 and the other end may clip by one step
    (absmax/8). The least-squares scale and the re-rounded candidate are kept only when better."""
    k = values.shape[-1]
    block = block or k
    shape = (*values.shape[:-1], k // block, block)
    error = np.sqrt(((decoded - values) ** 2).reshape(shape).mean(-1))
    absmax = np.abs(values).reshape(shape).max(-1)
    limit = absmax / 254 if bits == 8 else absmax / 8
    assert np.all(error <= limit * (1 + 1e-5)), f"block RMS error {np.max(error / limit):.3g} x the limit"


def test_fuse_moe_keeps_float_moe_nodes_unless_asked():
    built = _float_moe()
    fuse = FuseMoePass()  # float_experts="keep"
    assert not fuse(built.model).modified
    [record] = fuse.records
    assert (record.rule, record.anchor, record.fused, record.node) == ("moe-node", "blk.0.moe", False, "")
    assert "already one float MoE node" in record.reason and "int8 or int4" in record.reason
    assert _ops(built.model) == ["MoE", "Add"]


# (float_experts, hidden, width, form, block): K 32/32 takes blocks of 32, 32/16 blocks of 16, 24/12 one scale a row
QUANTIZE_CASES = [("int8", 32, 32, "int8/b32", 32), ("int8", 24, 12, "int8/row", 0), ("int4", 32, 16, "int4/b16", 16)]


@pytest.mark.parametrize("float_experts,hidden,width,form,block", QUANTIZE_CASES)
def test_fuse_moe_quantizes_a_float_moe_node(float_experts, hidden, width, form, block):
    built = _float_moe(hidden, width, bias=True)
    model = built.model
    moe = model.graph.node("blk.0.moe")
    float_out = _run(model, built.feeds)[0]
    fuse = FuseMoePass(float_experts)
    assert fuse(model).modified

    [record] = fuse.records
    assert (record.rule, record.anchor, record.fused, record.reason) == ("moe-node", "blk.0.moe", True, "")
    assert (record.node, record.experts, record.top_k, record.form) == ("blk.0.moe.quantized", E, K, form)
    assert "float com.microsoft::MoE" in record.geometry and form in record.geometry
    qmoe = model.graph.node("blk.0.moe.quantized")
    assert model.graph.node("y").inputs[0] is qmoe.outputs[0]  # the layer's reader reads the new node
    bits = int(float_experts[3])
    assert (qmoe.domain, qmoe.op_type, qmoe.name) == ("com.microsoft", "QMoE", "blk.0.moe.quantized")
    attributes = {a.name: a.value for a in qmoe.attributes.values()}
    assert attributes.pop("expert_weight_bits") == bits
    assert attributes.pop("block_size", 0) == block
    assert attributes == {a.name: a.value for a in moe.attributes.values()}  # the rest is the MoE node's
    assert qmoe.metadata_props["moepass.fused_from"] == "blk.0.moe"
    assert qmoe.metadata_props["moepass.expert_form"] == form
    assert [v.name for v in qmoe.inputs[:2]] == ["x", "logits"]
    assert qmoe.inputs[4] is moe.inputs[3]  # the fc1 bias is kept
    assert len(qmoe.inputs) == 7 or all(v is None for v in qmoe.inputs[7:])

    RemoveUnusedNodesPass()(model)
    assert _ops(model) == ["QMoE", "Add"]
    assert not {"blk.0.fc1", "blk.0.fc2"} & set(model.graph.initializers)

    fc1, fc2 = _qmoe_weights(qmoe, bits, block)
    _assert_block_error(built.fc1, fc1, bits, block)
    _assert_block_error(built.fc2, fc2, bits, block)
    quantized_out = _run(model, built.feeds)[0]
    float_ref = built.reference()
    _assert_within(float_out, float_ref)
    # ONNX Runtime 1.32's CPU QMoE quantizes the activations to int8 with 8-bit block-wise experts
    quantized_ref = built.reference(fc1, fc2, act_quant=bits == 8 and block > 0)
    _assert_within(quantized_out, quantized_ref)
    # hence, from the float MoE node: no further than the weights' quantization moves the reference
    assert np.all(np.abs(quantized_out - float_out) <=
                  np.abs(quantized_ref.y - float_ref.y) + quantized_ref.bound + float_ref.bound)


def test_fuse_moe_gives_qmoe_the_routing_weights_without_renormalization():
    """normalize_routing_weights=0: the float MoE kernel mixes with softmax(logits) as they are; the
    CPU QMoE renormalizes unless it is given them, so it gets softmax(logits) as input 14."""
    built = _float_moe(24, 12, normalize=False)
    model = built.model
    fuse = FuseMoePass("int8")
    fuse(model)
    assert fuse.records[0].fused and fuse.records[0].form == "int8/row"
    qmoe = model.graph.node("blk.0.moe.quantized")
    assert len(qmoe.inputs) == 15 and all(v is None for v in qmoe.inputs[8:14])
    softmax = qmoe.inputs[14].producer()
    assert (softmax.op_type, softmax.domain, softmax.attributes.get_int("axis")) == ("Softmax", "", -1)
    assert softmax.inputs[0] is qmoe.inputs[1] and qmoe.inputs[1].name == "logits"
    RemoveUnusedNodesPass()(model)
    assert _ops(model) == ["Softmax", "QMoE", "Add"]

    out = _run(model, built.feeds)[0]
    fc1, fc2 = _qmoe_weights(qmoe, 8, 0)
    reference = built.reference(fc1, fc2)
    _assert_within(out, reference)
    renormalized = built.reference(fc1, fc2, normalize=True)
    assert np.abs(out - renormalized.y).max() > 100 * reference.bound.max()  # the check tells them apart


@pytest.mark.parametrize("kwargs,reason", [
    ({"fc3": True}, "has separate fc3 weights"),
    ({"sparse_mixer": True}, "uses the sparse mixer"),
    ({"fc1_input": True}, "input 2 is not a constant initializer"),
    ({"activation": "silu"}, "activation silu with swiglu_fusion 1"),
])
def test_fuse_moe_leaves_moe_nodes_qmoe_cannot_take(kwargs, reason):
    built = _float_moe(**kwargs)
    fuse = FuseMoePass("int8")
    assert not fuse(built.model).modified
    [record] = fuse.records
    assert (record.rule, record.anchor, record.fused) == ("moe-node", "blk.0.moe", False)
    assert record.reason.startswith("MoE node 'blk.0.moe': ") and reason in record.reason
    assert _ops(built.model) == ["MoE", "Add"]


def test_fuse_moe_when_the_layer_output_is_a_graph_output():
    """Found by this test: the rewrite raised onnx-ir's ValueError for a layer output that is a graph
    output. The graph output now is the QMoE node's, under its old name."""
    built = _float_moe(24, 12, moe_is_output=True)
    name = built.model.graph.outputs[0].name
    fuse = FuseMoePass("int8")
    assert fuse(built.model).modified
    qmoe = built.model.graph.node("blk.0.moe.quantized")
    assert built.model.graph.outputs[0] is qmoe.outputs[0] and qmoe.outputs[0].name == name
    assert _run(built.model, built.feeds)[0].shape == (T, 24)


# ---- fuse-moe, rule expert-branches: the pattern torch.onnx.export traces from HF sparse MoE blocks --

@dataclasses.dataclass
class Branches:
    model: ir.Model
    x: np.ndarray
    router: np.ndarray        # [hidden, E]
    fc1: np.ndarray           # [E, 2 width, hidden]: expert e's gate / up columns as rows 2i / 2i + 1
    fc2: np.ndarray           # [E, hidden, width]: the down matrices transposed
    normalize: bool

    def reference(self, fc1=None, fc2=None) -> Reference:
        """Of the graph output: the layer's output plus x (one more rounding)."""
        moe = moe_reference(self.x, self.x.astype(np.float64) @ self.router, self.fc1 if fc1 is None else fc1,
                            self.fc2 if fc2 is None else fc2, normalize=self.normalize,
                            logit_error=_router_error(self.x, self.router))
        y = moe.y + self.x
        return Reference(y, moe.bound + U * np.abs(y), moe.magnitude)


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _branches_model(*, hidden: int = H, width: int = I, normalize: bool = True, index: str = "constant",
                    missing: int | None = None, duplicate: bool = False, k_input: bool = False,
                    scaled: int | None = None, wrong_weights: int | None = None, relu: int | None = None,
                    softmax: bool = True, seed: int = 7) -> Branches:
    """A sparse MoE block as Hugging Face writes it (Qwen3-MoE / Mixtral, transformers 4.57) and
    torch.onnx.export unrolls it, by hand:

        logits = x @ W_router; probs = softmax(logits, dim=1); w, sel = topk(probs, K) (w /= w.sum())
        mask = one_hot(sel, E).permute(2, 1, 0)                   # OneHot + Transpose: [E, K, T]
        for e: which, top_x = where(mask[e])                      # Gather of row e (a constant index
                                                                  # or Split output e), NonZero, Gather
               h = down(silu(gate(x[top_x])) * up(x[top_x])) * w[top_x, which, None]
               out.index_add_(0, top_x, h)                        # ScatterElements(add) on zeros + Add
        y = out + x                                               # the residual reads the layer

    The branches are laid out in the graph from the last expert to the first. Breakages for the
    negative tests: `missing` (no branch for that expert), `duplicate` (expert 2's branch reads
    mask row 1), `k_input` (K a graph input), `scaled` / `wrong_weights` (that expert's output is
    also multiplied by a routed scaling factor / by weights gathered from the full softmax),
    `relu` (that expert has relu(gate) * up), `softmax` False (TopK over the logits)."""
    rng = np.random.default_rng(seed)
    b = Builder()
    x = b.input("x", [T, hidden])
    router = rng.standard_normal((hidden, E)).astype(np.float32) * 0.25
    logits = b.op("MatMul", [x, b.const("router.weight", router)], name="router")
    probs = b.op("Softmax", [logits], {"axis": 1}, name="routing") if softmax else logits
    k = b.input("k", [1], ir.DataType.INT64) if k_input else b.const("k", i64(K))
    top, chosen = b.op("TopK", [probs, k], {"axis": -1}, name="topk", outputs=2)
    weights = top
    if normalize:
        total = b.op("ReduceSum", [top, b.const("last_axis", i64(-1))], {"keepdims": 1}, name="topk_sum")
        weights = b.op("Div", [top, total], name="routing_weights")
    mask = b.op("OneHot", [chosen, b.const("n_experts", i64(E)), b.const("off_on", i64(0, 1))], {"axis": -1},
                name="expert_mask")
    mask = b.op("Transpose", [mask], {"perm": [2, 1, 0]}, name="expert_mask_t")
    if index == "split":
        hit = b.op("Split", [b.const("experts_hit", np.arange(E, dtype=np.int64).reshape(E, 1))],
                   {"axis": 0, "num_outputs": E}, name="expert_hit", outputs=E)
    zeros = b.op("ConstantOfShape", [b.op("Shape", [x], name="x_shape")],
                 {"value": ir.tensor(np.zeros(1, np.float32))}, name="zeros")
    acc = zeros
    gates = rng.standard_normal((E, hidden, width)).astype(np.float32) * 0.3
    ups = rng.standard_normal((E, hidden, width)).astype(np.float32) * 0.3
    downs = rng.standard_normal((E, width, hidden)).astype(np.float32) * 0.3
    for e in reversed(range(E)):
        if e == missing:
            continue
        p = f"experts.{e}"
        row = 1 if duplicate and e == 2 else e
        if index == "split":
            picked = b.op("Gather", [mask, hit[row]], {"axis": 0}, name=f"{p}.mask_pick")
            row_mask = b.op("Squeeze", [picked, b.const(f"{p}.axes01", i64(0, 1))], name=f"{p}.mask_row")
        else:
            row_mask = b.op("Gather", [mask, b.const(f"{p}.id", np.array(row, np.int64))], {"axis": 0},
                            name=f"{p}.mask_row")
        where = b.op("NonZero", [row_mask], name=f"{p}.where")
        which = b.op("Gather", [where, b.const(f"{p}.zero", np.array(0, np.int64))], {"axis": 0}, name=f"{p}.which")
        top_x = b.op("Gather", [where, b.const(f"{p}.one", np.array(1, np.int64))], {"axis": 0}, name=f"{p}.top_x")
        tokens = b.op("Gather", [x, top_x], {"axis": 0}, name=f"{p}.tokens")
        gate = b.op("MatMul", [tokens, b.const(f"{p}.gate.weight", gates[e])], name=f"{p}.gate")
        up = b.op("MatMul", [tokens, b.const(f"{p}.up.weight", ups[e])], name=f"{p}.up")
        if e == relu:
            act = b.op("Relu", [gate], name=f"{p}.relu")
        else:
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate], name=f"{p}.sigmoid")], name=f"{p}.silu")
        down = b.op("MatMul", [b.op("Mul", [act, up], name=f"{p}.product"),
                               b.const(f"{p}.down.weight", downs[e])], name=f"{p}.down")
        column = b.op("Unsqueeze", [top_x, b.const(f"{p}.axis1", i64(1))], name=f"{p}.top_x_col")
        which_column = b.op("Unsqueeze", [which, b.const(f"{p}.axis1b", i64(1))], name=f"{p}.which_col")
        pair = b.op("Concat", [column, which_column], {"axis": 1}, name=f"{p}.pair")
        source = probs if e == wrong_weights else weights
        weight = b.op("GatherND", [source, pair], name=f"{p}.weight")
        weight = b.op("Unsqueeze", [weight, b.const(f"{p}.axis1c", i64(1))], name=f"{p}.weight_col")
        weighted = b.op("Mul", [down, weight], name=f"{p}.weighted")
        if e == scaled:
            weighted = b.op("Mul", [weighted, b.const("routed_scaling_factor", np.float32(2.5))], name=f"{p}.scaled")
        rows = b.op("Expand", [column, b.const(f"{p}.row_shape", i64(1, hidden))], name=f"{p}.rows")
        scattered = b.op("ScatterElements", [zeros, rows, weighted], {"axis": 0, "reduction": "add"},
                         name=f"{p}.index_add")
        acc = b.op("Add", [acc, scattered], name=f"{p}.accumulate")
    y = b.op("Add", [acc, x], name="y")
    y.shape = ir.Shape([T, hidden])
    fc1 = np.stack([gates.transpose(0, 2, 1), ups.transpose(0, 2, 1)], axis=2).reshape(E, 2 * width, hidden)
    return Branches(b.model([y]), rng.standard_normal((T, hidden)).astype(np.float32), router.astype(np.float64), fc1,
                    downs.transpose(0, 2, 1).copy(), normalize)



@pytest.mark.parametrize("normalize,index",
                         [(True, "constant"), (False, "constant"), (True, "split"), (False, "split")])
def test_expert_branches_fuse_into_one_float_moe_node(normalize, index):
    built = _branches_model(normalize=normalize, index=index)
    model = built.model
    reference = built.reference()
    before = _run(model, {"x": built.x})[0]
    _assert_within(before, reference)  # the hand-made pattern computes the MoE layer
    router = model.graph.node("router").outputs[0]

    fuse = FuseMoePass()  # float experts kept: one float MoE node, the weights exact
    assert fuse(model).modified
    [record] = fuse.records
    assert (record.rule, record.anchor, record.fused, record.reason, record.node) == \
        ("expert-branches", "topk", True, "", "moe.0")
    assert (record.experts, record.top_k, record.form) == (E, K, "float32")
    assert record.geometry == f"float MatMul experts, K {H}/{I} -> com.microsoft::MoE float32, exact"
    moe = model.graph.node("moe.0")
    assert (moe.domain, moe.op_type) == ("com.microsoft", "MoE")
    assert moe.inputs[0].name == "x" and moe.inputs[1] is router
    assert {a.name: a.value for a in moe.attributes.values()} == _moe_attributes(normalize=normalize)
    assert moe.metadata_props["moepass.fused_from"] == "topk"
    assert moe.metadata_props["moepass.expert_form"] == "float32"
    # expert e's gate and up columns as rows 2i and 2i + 1, its down matrix transposed: bit for bit,
    # in expert order whatever the order of the branches in the graph
    np.testing.assert_array_equal(_initializer(moe.inputs[2]), built.fc1)
    np.testing.assert_array_equal(_initializer(moe.inputs[4]), built.fc2)
    assert model.graph.node("y").inputs[0] is moe.outputs[0]

    RemoveUnusedNodesPass()(model)
    assert _ops(model) == ["MatMul", "MoE", "Add"]
    assert set(model.graph.initializers) == {"router.weight", moe.inputs[2].name, moe.inputs[4].name}
    _assert_within(_run(model, {"x": built.x})[0], reference)


def test_expert_branches_requantized_into_int8_qmoe_get_the_routing_weights():
    """float_experts int8: QMoE int8 with one scale a row (K 24 / 12 take no block of 16 or 32);
    without renormalization the graph's softmax goes to router_weights (input 14)."""
    built = _branches_model(hidden=24, width=12, normalize=False)
    model = built.model
    float_out = _run(model, {"x": built.x})[0]
    softmax = model.graph.node("routing").outputs[0]
    fuse = FuseMoePass("int8")
    assert fuse(model).modified
    [record] = fuse.records
    assert (record.rule, record.fused, record.node, record.experts, record.top_k, record.form) == \
        ("expert-branches", True, "moe.0", E, K, "int8/row")
    assert "requantized" in record.geometry
    qmoe = model.graph.node("moe.0")
    assert (qmoe.op_type, qmoe.attributes.get_int("expert_weight_bits")) == ("QMoE", 8)
    assert "block_size" not in qmoe.attributes
    assert qmoe.attributes.get_int("normalize_routing_weights") == 0
    assert len(qmoe.inputs) == 15 and qmoe.inputs[14] is softmax
    RemoveUnusedNodesPass()(model)
    assert _ops(model) == ["MatMul", "Softmax", "QMoE", "Add"]

    fc1, fc2 = _qmoe_weights(qmoe, 8, 0)
    _assert_block_error(built.fc1, fc1, 8, 0)
    _assert_block_error(built.fc2, fc2, 8, 0)
    quantized_out = _run(model, {"x": built.x})[0]
    float_ref, quantized_ref = built.reference(), built.reference(fc1, fc2)
    _assert_within(float_out, float_ref)
    _assert_within(quantized_out, quantized_ref)
    assert np.all(np.abs(quantized_out - float_out) <=
                  np.abs(quantized_ref.y - float_ref.y) + quantized_ref.bound + float_ref.bound)


@pytest.mark.parametrize("kwargs,culprit", [
    ({"missing": 2}, "the graph has branches for 3 of the router's 4 experts"),
    ({"duplicate": True}, "two branches for expert 1"),
    ({"k_input": True}, "K is not a constant"),
    ({"scaled": 1}, "expert output 'experts.1.down' is multiplied by 'routed_scaling_factor', not by the router's "
                    "top-k weights"),
    ({"wrong_weights": 3}, "expert output 'experts.3.down' is multiplied by 'experts.3.weight_col'"),
    ({"relu": 0}, "the expert branch of 'experts.0.gate', 'experts.0.up' is not down(silu(gate(x)) * up(x))"),
    ({"softmax": False}, "does not select from a Softmax"),
])
def test_expert_branches_that_break_the_pattern_are_left_alone_with_the_reason(kwargs, culprit):
    built = _branches_model(**kwargs)
    model = built.model
    ops, initializers = _ops(model), set(model.graph.initializers)
    fuse = FuseMoePass("int8")
    assert not fuse(model).modified
    [record] = fuse.records
    assert (record.rule, record.anchor, record.fused, record.node, record.form) == \
        ("expert-branches", "topk", False, "", "")
    assert record.reason.startswith("TopK node 'topk': ") and culprit in record.reason, record.reason
    assert _ops(model) == ops and set(model.graph.initializers) == initializers


# ---- fuse-moe, dry run ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["expert-branches", "moe-node"])
def test_fuse_moe_dry_run_records_what_it_would_fuse_and_changes_nothing(which):
    def build():
        return _branches_model().model if which == "expert-branches" else _float_moe().model

    float_experts = "keep" if which == "expert-branches" else "int4"
    model = build()
    ops, outputs = _ops(model), list(model.graph.outputs)
    initializers = {name: v.const_value for name, v in model.graph.initializers.items()}
    dry = FuseMoePass(float_experts, dry_run=True)
    assert not dry(model).modified
    assert _ops(model) == ops and list(model.graph.outputs) == outputs
    assert {name: v.const_value for name, v in model.graph.initializers.items()} == initializers
    assert all(not n.metadata_props for n in model.graph)

    real = FuseMoePass(float_experts)
    assert real(build()).modified
    [planned], [done] = dry.records, real.records
    assert (planned.rule, planned.anchor, planned.fused, planned.reason, planned.node) == \
        (which, done.anchor, True, "", "")
    assert (planned.form, planned.geometry) == (done.form, done.geometry)
    assert planned.form == ("float32" if which == "expert-branches" else "int4/b16")
