"""Small graphs built by hand with onnx-ir for the tests of single passes (test_reorder_experts.py,
test_fuse_moe.py, ...), ONNX Runtime runs of them, and the float64 reference they are held to.

Each pass is tested alone on a graph of a few nodes, through its public interface only
(constructor, `__call__`, the documented attributes such as `records`, `outputs`, `skipped`), and
the tests check what it rewrote and, where numbers are involved, what ONNX Runtime (CPU, one
thread) computes before and after, against a float64 numpy reference (`moe_reference` here,
`_simplified_norm` in test_fuse_skip_norm.py). No torch export runs in these tests.

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

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

FLOAT = ir.DataType.FLOAT
OPSETS = {"": 21, "com.microsoft": 1}
U = float(np.finfo(np.float32).eps) / 2   # unit roundoff of float32
NONLINEAR = 16 * U                         # ORT's vectorized exp / sigmoid: a few ulps, 16 allowed
SILU_SLOPE = 1.1                           # max |d/dg g * sigmoid(g)| = 1.0998 (at g = 2.4)

# the MoE layer of most tests: tokens, width, expert width, experts, experts per token
T, H, I, E, K = 6, 32, 16, 4, 2
ORDER = [2, 0, 3, 1]  # a permutation that moves every expert


def gamma_n(n: int) -> float:
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


def run_model(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs in graph order, by ONNX Runtime's CPU EP on one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def initializer_of(value: ir.Value) -> np.ndarray:
    assert value is not None and value.const_value is not None, f"{value} is not an initializer"
    return value.const_value.numpy()


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def moe_attributes(k: int = K, normalize: bool = True, **extra) -> dict:
    return {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
            "activation_beta": 0.0, "normalize_routing_weights": int(normalize), **extra}


# ---- numpy: quantization and the MoE reference -----------------------------------------------------

def quantize_int4(w: np.ndarray, block: int, rng: np.random.Generator, scale_type: type = np.float32):
    """Asymmetric 4-bit codes of `w` [..., K] in blocks of `block` along K, as QMoE / MatMulNBits store
    them: value = (u - z) * scale with u, z in 0..15, two codes a byte (element 2j in the low nibble),
    zero points packed the same way per row. Returns (packed codes [..., K/2], scales [..., K/block]
    in `scale_type`, packed zero points [..., ceil(K/block/2)], dequantized values)."""
    blocks = w.reshape(*w.shape[:-1], -1, block)
    scales = (np.abs(blocks).max(-1) / 7).astype(scale_type)
    zeros = rng.integers(7, 9, scales.shape).astype(np.uint8)  # codes z - 7 .. z + 7 stay in 0..15
    codes = (np.rint(blocks / scales[..., None]) + zeros[..., None]).astype(np.uint8)
    values = ((codes.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(w.shape)
    codes = codes.reshape(w.shape)
    if zeros.shape[-1] % 2:  # an odd number of blocks: the last byte's high nibble is padding
        zeros = np.concatenate([zeros, np.full((*zeros.shape[:-1], 1), 8, np.uint8)], axis=-1)
    return (codes[..., 0::2] | codes[..., 1::2] << 4, scales, zeros[..., 0::2] | zeros[..., 1::2] << 4,
            values)


def dequantize_qmoe(codes: np.ndarray, scales: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Values of QMoE weights with the default zero point: [E, N, K*bits/8] codes (4 bits: element
    2j in the low nibble of byte j), scales [E, N, K/block] or [E, N] (block 0: one per row)."""
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    centered = codes.astype(np.float32) - (1 << (bits - 1))
    if block == 0:
        return centered * scales[..., None]
    return centered * np.repeat(scales, block, axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclasses.dataclass
class Reference:
    y: np.ndarray          # float64 output [T, H]
    bound: np.ndarray      # first-order error bound of a float32 implementation, per element
    magnitude: np.ndarray  # sum over the chosen experts of |w_e * expert_e(x)|, per element


def router_error(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> float:
    """Largest float32 rounding error of router logits x @ w (+ bias): a dot product of H terms,
    one more rounding for the bias, one for a dequantized weight (MatMulNBits)."""
    return float(gamma_n(w.shape[0] + 2) * (np.abs(x) @ np.abs(w) + (0 if bias is None else np.abs(bias))).max())


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
    probs = softmax(logits)
    y, bound, magnitude = (np.zeros((tokens, hidden)) for _ in range(3))
    # relative error of a routing weight: exp, the softmax's sum and division, the renormalization,
    # and the logits' own error (which moves p_i by at most 2 * max |dl| relative, 4x renormalized)
    weight_rel = NONLINEAR + gamma_n(experts) + 2 * U + (gamma_n(k) + 2 * U if normalize else 0) \
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
            dh = gamma_n(hidden + 1) * (np.abs(fc1[e]) @ ax + np.abs(b1)) + np.abs(fc1[e]).sum(-1) * dx
            g, up, dg, du = h[0::2], h[1::2], dh[0::2], dh[1::2]
            silu = g / (1 + np.exp(-g))
            ds = SILU_SLOPE * dg + (NONLINEAR + U) * np.abs(silu)
            a = silu * up
            da = np.abs(silu) * du + np.abs(up) * ds + ds * du + U * np.abs(a)
            if act_quant:
                da = da + (np.abs(a).max() + da.max()) / 254
            z = fc2[e] @ a + b2
            dz = np.abs(fc2[e]) @ da + gamma_n(width + 1) * (np.abs(fc2[e]) @ np.abs(a) + np.abs(b2))
            y[t] += w * z
            magnitude[t] += np.abs(w * z)
            bound[t] += w * dz + weight_rel * w * np.abs(z)
        bound[t] += gamma_n(k) * magnitude[t]  # adding up the k contributions
    # first order: the neglected products of two errors are below 1 % of the terms kept here
    # (every relative error above is under 1 / 254), so a factor 1.25 covers them
    return Reference(y, 1.25 * bound, magnitude)


def assert_within_reference(actual: np.ndarray, ref: Reference) -> None:
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
                             fc2_bias=self.fc2_bias, logit_error=router_error(x, self.router, self.router_bias))


@dataclasses.dataclass
class MoeModel:
    model: ir.Model
    x: np.ndarray                  # the input to feed
    values: dict[str, np.ndarray]  # every initializer as built, by name
    layers: list[Layer]            # layer i: node blk.i.moe, graph output i


def make_router(b: Builder, x: ir.Value, kind: str, rng: np.random.Generator, name: str):
    """Router logits [T, E] of `x`: 'matmul' (MatMul by W [H, E]), 'bias' (MatMul + Add of a bias
    [E]), 'nbits' (a 4-bit MatMulNBits, block 16, 2-D scales and packed zero points), 'nbits-cast'
    (the same with float16 scales widened by a Cast, as convert writes them), 'computed' (MatMul then
    Mul by 0.5: a subgraph, not one of the router forms the pass permutes).
    Returns (logits value, the router as a float W [H, E], the bias or None)."""
    if kind in ("nbits", "nbits-cast"):
        w = rng.standard_normal((E, H)).astype(np.float32) * 0.25
        codes, scales, zeros, values = quantize_int4(w, 16, rng, np.float16 if kind == "nbits-cast" else np.float32)
        stored = b.const(f"{name}.router.scales", scales)
        if kind == "nbits-cast":
            stored = b.op("Cast", [stored], {"to": ir.DataType.FLOAT}, name=f"{name}.router.scales.widen")
        logits = b.op("MatMulNBits", [x, b.const(f"{name}.router.B", codes.reshape(E, H // 16, 8)), stored,
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


def make_moe_node(b: Builder, x: ir.Value, logits: ir.Value, op: str, rng: np.random.Generator, name: str,
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
        attributes = moe_attributes(normalize=normalize)
    else:
        c1, s1, z1, fc1 = quantize_int4(fc1, 16, rng)
        c2, s2, z2, fc2 = quantize_int4(fc2, 16, rng)
        inputs = [x, logits, b.const(f"{name}.fc1.weight", c1), b.const(f"{name}.fc1.scales", s1),
                  b.const(f"{name}.fc1.bias", fc1_bias), b.const(f"{name}.fc2.weight", c2),
                  b.const(f"{name}.fc2.scales", s2), b.const(f"{name}.fc2.bias", fc2_bias), None, None, None,
                  b.const(f"{name}.fc1.zero_points", z1), b.const(f"{name}.fc2.zero_points", z2)]
        if not normalize:  # the mixing weights, given as QMoE's router_weights (input 14)
            inputs += [None, b.op("Softmax", [logits], {"axis": -1}, name=f"{name}.router_weights")]
        attributes = moe_attributes(normalize=normalize, expert_weight_bits=4, block_size=16)
    out = b.op(op, inputs, attributes, domain="com.microsoft", name=name)
    out.shape = ir.Shape([T, H])
    return out, fc1, fc2, fc1_bias, fc2_bias


def make_moe_model(*specs: tuple[str, str, bool], shared_fc2: bool = False, seed: int = 0) -> MoeModel:
    """MoE layers side by side, each reading the input x [T, H]: spec i = (op, router kind,
    normalize) makes node blk.i.moe and graph output i. `shared_fc2`: the MoE nodes share one fc2."""
    rng = np.random.default_rng(seed)
    b = Builder()
    x = b.input("x", [T, H])
    layers, outputs, fc2_value = [], [], None
    for i, (op, router, normalize) in enumerate(specs):
        logits, w, bias = make_router(b, x, router, rng, f"blk.{i}")
        out, fc1, fc2, fc1_bias, fc2_bias = make_moe_node(b, x, logits, op, rng, f"blk.{i}.moe", normalize, fc2_value)
        if shared_fc2 and op == "MoE":
            fc2_value = out.producer().inputs[4]
        layers.append(Layer(f"blk.{i}.moe", w, bias, fc1, fc2, fc1_bias, fc2_bias, normalize))
        outputs.append(out)
    model = b.model(outputs)
    values = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}
    return MoeModel(model, rng.standard_normal((T, H)).astype(np.float32), values, layers)
