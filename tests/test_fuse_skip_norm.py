"""The fuse-skip-norm pass on tiny hand-built graphs: what it fuses, what it leaves (and why), same numbers."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from moepass.passes import FuseSkipNormPass

H = 8


def _model(bias_add: bool = False, axis: int = -1) -> ir.Model:
    f32 = ir.TensorType(ir.DataType.FLOAT)
    a = ir.Value(name="a", type=f32, shape=ir.Shape([2, 3, H]))
    b = ir.Value(name="b", type=f32, shape=ir.Shape([2, 3, H]))
    gamma = ir.Value(name="gamma", const_value=ir.tensor(np.linspace(0.5, 1.5, H, dtype=np.float32), name="gamma"))
    bias = ir.Value(name="bias", const_value=ir.tensor(np.full(H, 0.25, np.float32), name="bias"))
    add = ir.node("Add", [a, bias if bias_add else b], name="add")
    add.outputs[0].name = "sum"
    norm = ir.node("SimplifiedLayerNormalization", [add.outputs[0], gamma], {"axis": axis, "epsilon": 1e-6},
                   name="norm")
    norm.outputs[0].name = "normed"
    # the sum is used again (the residual stream), as in a decoder
    again = ir.node("Mul", [add.outputs[0], norm.outputs[0]], name="use_both")
    again.outputs[0].name = "y"
    again.outputs[0].type, again.outputs[0].shape = f32, ir.Shape([2, 3, H])
    graph = ir.Graph([a, b], [again.outputs[0]], nodes=[add, norm, again], initializers=[gamma, bias],
                     opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, feeds):
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_fuses_residual_add_and_keeps_numbers():
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 3, H), dtype=np.float32), "b": rng.standard_normal((2, 3, H), dtype=np.float32)}
    before = _run(_model(), feeds)
    model = _model()
    result = FuseSkipNormPass()(model)
    assert result.modified
    assert [n.op_type for n in model.graph] == ["SkipSimplifiedLayerNormalization", "Mul"]
    assert model.graph.node(0).metadata_props["moepass.fused_from"] == "add,norm"
    np.testing.assert_allclose(_run(model, feeds), before, rtol=1e-6, atol=1e-6)


def test_leaves_bias_add_and_other_axes_with_a_reason():
    for model, reason in ((_model(bias_add=True), "constant"), (_model(axis=1), "axis 1")):
        p = FuseSkipNormPass()
        assert not p(model).modified
        assert [n.op_type for n in model.graph] == ["Add", "SimplifiedLayerNormalization", "Mul"]
        assert len(p.skipped) == 1 and reason in p.skipped[0][1]
