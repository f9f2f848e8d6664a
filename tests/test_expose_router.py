"""expose-router-logits: every MoE node's router logits become graph outputs (what `moepass profile` reads).

The graphs, the reference and its tolerances: tests/support/hand_built.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from support.hand_built import (
    FLOAT,
    Builder,
    E,
    H,
    T,
    assert_within_reference,
    make_moe_model,
    op_types,
    router_error,
    run_model,
)

from moepass.passes.expose_router import ExposeRouterLogitsPass


def test_expose_router_logits_adds_the_logits_of_every_moe_node_as_outputs():
    built = make_moe_model(("QMoE", "bias", False), ("MoE", "nbits", True))
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

    results = run_model(model, {"x": built.x})
    for layer, reference, y, logits in zip(built.layers, references, results[:2], results[2:]):
        assert_within_reference(y, reference)  # the layers compute as before
        assert logits.shape == (T, E) and logits.dtype == np.float32
        error = np.abs(logits - layer.logits(built.x))
        assert error.max() <= router_error(built.x, layer.router, layer.router_bias)


def test_expose_router_logits_leaves_a_model_without_moe_alone():
    b = Builder()
    x = b.input("x", [T, H])
    y = b.op("MatMul", [x, b.const("w", np.eye(H, dtype=np.float32))], name="dense")
    model = b.model([y])
    expose = ExposeRouterLogitsPass()
    assert not expose(model).modified
    assert expose.outputs == {}
    assert [o.name for o in model.graph.outputs] == ["dense"] and op_types(model) == ["MatMul"]
