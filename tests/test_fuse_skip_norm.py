"""fuse-skip-norm: a residual Add and the SimplifiedLayerNormalization after it become one SkipSimplifiedLayerNormalization.

The graphs, the reference and its tolerances: tests/support/hand_built.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from support.hand_built import Builder, H, U, gamma_n, initializer_of, op_types, run_model

from moepass.passes.fuse_skip_norm import FuseSkipNormPass

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
    return y, (gamma_n(H + 1) + 8 * U) * np.abs(y)


# "output" and the graph-output tests below found a bug: onnx-ir refused to replace a value that is a
# graph output (replace_graph_outputs was not set), so the pass raised ValueError.
@pytest.mark.parametrize("sum_use", ["reused", "output", "none"])
def test_fuse_skip_norm_fuses_and_keeps_the_numbers(sum_use):
    feeds = _norm_feeds()
    model = _norm_model(sum_use=sum_use)
    before = run_model(model, feeds)
    gamma = initializer_of(model.graph.initializers["gamma"])
    y, bound = _simplified_norm(feeds["a"] + feeds["b"], gamma, 1e-5)
    fuse = FuseSkipNormPass()
    assert fuse(model).modified and fuse.skipped == []
    fused = model.graph.node("norm")
    assert (fused.domain, fused.op_type) == ("com.microsoft", "SkipSimplifiedLayerNormalization")
    assert op_types(model)[0] == "SkipSimplifiedLayerNormalization" and "Add" not in op_types(model)
    assert [v.name for v in fused.inputs] == ["a", "b", "gamma"]
    assert fused.attributes.get_float("epsilon") == pytest.approx(1e-5)
    assert fused.metadata_props["moepass.fused_from"] == "sum,norm"
    assert model.opset_imports.get("com.microsoft") == 1  # added: the graph imported ai.onnx only
    # output 3 (the sum) takes the old sum's place and name when something else reads it
    assert fused.outputs[3].name == ("norm.unused_sum" if sum_use == "none" else "sum")
    also = {"reused": ["residual"], "output": ["sum"], "none": []}[sum_use]
    assert [o.name for o in model.graph.outputs] == ["next", *also]

    after = run_model(model, feeds)
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
    ops = op_types(model)
    fuse = FuseSkipNormPass()
    assert not fuse(model).modified
    assert op_types(model) == ops
    assert len(fuse.skipped) == 1 and fuse.skipped[0][0] == "norm" and reason in fuse.skipped[0][1]
    assert "com.microsoft" not in model.opset_imports


def test_fuse_skip_norm_leaves_a_bias_given_by_a_constant_node():
    """Found by this test: a Constant node's bias was fused as a residual, and ONNX Runtime then
    rejected the 1-D skip input."""
    feeds = {"a": _norm_feeds()["a"]}
    model = _norm_model(operand="constant-node", sum_use="none")
    before = run_model(model, feeds)
    fuse = FuseSkipNormPass()
    fuse(model)
    assert [reason for _, reason in fuse.skipped] == ["an Add operand is a constant (a bias, not a residual)"]
    np.testing.assert_array_equal(run_model(model, feeds)[0], before[0])


def test_fuse_skip_norm_when_the_normalized_value_is_a_graph_output():
    feeds = _norm_feeds()
    model = _norm_model(norm_is_output=True, sum_use="output")
    before = run_model(model, feeds)
    assert FuseSkipNormPass()(model).modified
    assert [o.name for o in model.graph.outputs] == ["norm", "sum"]
    after = run_model(model, feeds)
    np.testing.assert_array_equal(after[1], before[1])
    y, bound = _simplified_norm(feeds["a"] + feeds["b"], initializer_of(model.graph.initializers["gamma"]), 1e-5)
    assert np.all(np.abs(after[0] - y) <= bound)
