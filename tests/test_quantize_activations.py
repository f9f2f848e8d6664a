"""quantize-activations: accuracy_level set (and cleared) on every quantized product.

The graphs, the reference and its tolerances: tests/support/hand_built.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from support.hand_built import assert_within_reference, make_moe_model, moe_reference, router_error, run_model

from moepass.core.errors import MoepassError
from moepass.passes.activations import QuantizeActivationsPass


def test_quantize_activations_sets_and_clears_accuracy_level_on_quantized_products():
    built = make_moe_model(("QMoE", "nbits", True), ("MoE", "matmul", True))
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
    int8 = run_model(model, {"x": built.x})
    # int8 activations inside the 4-bit QMoE and MatMulNBits: within the activation-quantization
    # bound, and not the float result (ONNX Runtime honours the level)
    layer = built.layers[0]
    logits_error = router_error(built.x, layer.router) + float(
        (np.abs(layer.router).sum(0) * np.abs(built.x).max(-1, keepdims=True) / 254).max())
    loose = moe_reference(built.x, layer.logits(built.x), layer.fc1, layer.fc2, fc1_bias=layer.fc1_bias,
                          fc2_bias=layer.fc2_bias, act_quant=True, logit_error=logits_error)
    assert_within_reference(int8[0], loose)
    assert np.abs(int8[0] - references[0].y).max() > references[0].bound.max()
    assert_within_reference(int8[1], references[1])

    assert QuantizeActivationsPass("float")(model).modified
    assert model.metadata_props["moepass.activations"] == "float"
    assert not any("accuracy_level" in n.attributes for n in model.graph)
    assert not QuantizeActivationsPass("float")(model).modified
    for result, reference in zip(run_model(model, {"x": built.x}), references):
        assert_within_reference(result, reference)

    with pytest.raises(MoepassError, match="activations must be one of"):
        QuantizeActivationsPass("int4")
