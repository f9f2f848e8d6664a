"""annotate-layers: each node marked with the device of its layer (per-layer placement).

The graphs, the reference and its tolerances: tests/support/hand_built.py."""

from __future__ import annotations

import re

import onnx_ir as ir
import pytest
from support.hand_built import make_moe_model

from moepass.core.errors import MoepassError
from moepass.passes.annotate_layers import AnnotateLayersPass


def _annotated_model() -> ir.Model:
    """Two MoE layers, and an If whose branches hold a node each (nodes of subgraphs)."""
    built = make_moe_model(("QMoE", "matmul", True), ("MoE", "bias", True))
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
