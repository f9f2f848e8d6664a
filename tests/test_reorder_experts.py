"""reorder-experts: a MoE node's experts stored in another order, with its router permuted to match, and the same output.

The graphs, the reference and its tolerances: tests/support/hand_built.py."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import pytest
from support.hand_built import (
    ORDER,
    Builder,
    E,
    H,
    K,
    Reference,
    T,
    U,
    assert_within_reference,
    gamma_n,
    initializer_of,
    make_moe_model,
    make_moe_node,
    router_error,
    run_model,
)

from moepass.core.errors import MoepassError
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.passes.reorder_experts import ReorderExpertsPass


def _reordering_bound(reference: Reference) -> np.ndarray:
    """How far a reordered layer's output may move from the original's in one implementation:
    each expert and each logit is computed from the same numbers; the softmax adds the E
    exponentials in the new slot order (gamma_E relative on each weight, one more rounding for
    the division) and the k contributions of a token may be added in another order (gamma_k);
    twice, as both runs round."""
    return 2 * (gamma_n(E) + gamma_n(K) + 2 * U) * reference.magnitude


# ---- reorder-experts ---------------------------------------------------------------------------------

# (op, router, normalize): every router form the pass permutes, and the computed one it gathers
REORDER_CASES = [("QMoE", "matmul", True), ("QMoE", "bias", True), ("QMoE", "nbits", False), ("QMoE", "nbits-cast", True),
                 ("QMoE", "computed", False), ("MoE", "matmul", False), ("MoE", "bias", True), ("MoE", "nbits", True),
                 ("MoE", "computed", True)]


@pytest.mark.parametrize("op,router,normalize", REORDER_CASES)
def test_reorder_experts_permutes_experts_and_router_and_keeps_the_output(op, router, normalize):
    built = make_moe_model((op, router, normalize))
    model, node, v = built.model, built.model.graph.node("blk.0.moe"), built.values
    reference = built.layers[0].reference(built.x)
    before = run_model(model, {"x": built.x})[0]
    assert_within_reference(before, reference)  # the layer computes what the reference says

    expert_inputs = {i: x.name for i, x in enumerate(node.inputs) if i >= 2 and x is not None and x.is_initializer()}
    assert len(expert_inputs) == (8 if op == "QMoE" else 4)
    result = ReorderExpertsPass({"blk.0.moe": ORDER}, {"blk.0.moe": 2})(model)
    assert result.modified

    for index, name in expert_inputs.items():  # every expert tensor, permuted along axis 0
        original = v[name]
        assert any(not np.array_equal(original[i], original[e]) for i, e in enumerate(ORDER))
        np.testing.assert_array_equal(initializer_of(node.inputs[index]), original[ORDER], err_msg=name)
        assert node.inputs[index].name == name  # used by this node only: the name is kept
    assert node.metadata_props["moepass.placement.expert_ids"] == "2,0,3,1"
    assert node.metadata_props["moepass.placement.resident"] == "2"

    # the router: slot i's logit is expert ORDER[i]'s
    router_node = model.graph.node("blk.0.router")
    if router.startswith("nbits"):  # MatMulNBits: its rows (N = experts)
        for index, part in ((1, "B"), (2, "scales"), (3, "zero_points")):
            stored = router_node.inputs[index]
            if stored.producer() is not None:  # float16 scales: the initializer the Cast widens
                stored = stored.producer().inputs[0]
            np.testing.assert_array_equal(initializer_of(stored), v[f"blk.0.router.{part}"][ORDER])
    elif router != "computed":  # MatMul by W [H, E]: its columns
        np.testing.assert_array_equal(initializer_of(router_node.inputs[1]), v["blk.0.router.weight"][:, ORDER])
    if router == "bias":
        bias_node = model.graph.node("blk.0.router_bias")
        np.testing.assert_array_equal(initializer_of(bias_node.inputs[1]), v["blk.0.router.bias"][ORDER])
    if router == "computed":  # the router weight stays; its result is gathered in the new order
        np.testing.assert_array_equal(initializer_of(router_node.inputs[1]), v["blk.0.router.weight"])
        routing = [i for i in (1, 14) if i < len(node.inputs) and node.inputs[i] is not None]
        assert routing == ([1, 14] if op == "QMoE" and not normalize else [1])
        for i in routing:
            gather = node.inputs[i].producer()
            assert gather.op_type == "Gather" and gather.attributes.get_int("axis") == -1
            np.testing.assert_array_equal(initializer_of(gather.inputs[1]), ORDER)

    after = run_model(model, {"x": built.x})[0]
    assert_within_reference(after, reference)
    assert np.all(np.abs(after - before) <= _reordering_bound(reference))
    # the logits the node now reads: column i is expert ORDER[i]'s
    ExposeRouterLogitsPass()(model)
    logits = run_model(model, {"x": built.x})[1]
    layer = built.layers[0]
    assert np.abs(logits - layer.logits(built.x)[:, ORDER]).max() <= router_error(built.x, layer.router,
                                                                                    layer.router_bias)


def test_reorder_experts_copies_an_initializer_another_node_still_reads():
    """Two MoE nodes share their fc2 initializer; reordering one gives it a permuted copy under a
    new name, and the other keeps reading the original."""
    built = make_moe_model(("MoE", "matmul", True), ("MoE", "bias", True), shared_fc2=True)
    model = built.model
    first, second = model.graph.node("blk.0.moe"), model.graph.node("blk.1.moe")
    shared = first.inputs[4]
    assert second.inputs[4] is shared
    references = [layer.reference(built.x) for layer in built.layers]
    before = run_model(model, {"x": built.x})

    ReorderExpertsPass({"blk.0.moe": ORDER}, {"blk.0.moe": 1})(model)
    copy = first.inputs[4]
    assert copy is not shared and copy.name == f"{shared.name}.reordered"
    assert model.graph.initializers[copy.name] is copy and model.graph.initializers[shared.name] is shared
    np.testing.assert_array_equal(initializer_of(copy), built.values[shared.name][ORDER])
    assert second.inputs[4] is shared
    np.testing.assert_array_equal(initializer_of(shared), built.values[shared.name])
    assert "moepass.placement.expert_ids" not in second.metadata_props
    after = run_model(model, {"x": built.x})
    for b_out, a_out, reference in zip(before, after, references):
        assert_within_reference(a_out, reference)
        assert np.all(np.abs(a_out - b_out) <= _reordering_bound(reference))


def test_reorder_experts_without_resident_count_records_zero():
    built = make_moe_model(("MoE", "matmul", True))
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
    built = make_moe_model(("QMoE", "matmul", True))
    with pytest.raises(MoepassError, match=re.escape(message)):
        ReorderExpertsPass(order, {})(built.model)
    for name, value in built.model.graph.initializers.items():
        np.testing.assert_array_equal(initializer_of(value), built.values[name])
    assert not built.model.graph.node("blk.0.moe").metadata_props


def test_reorder_experts_rejects_routers_it_cannot_permute():
    """Logits given as a graph input, or also read by another node, cannot be permuted."""
    b = Builder()
    x, logits = b.input("x", [T, H]), b.input("logits", [T, E])
    out, *_ = make_moe_node(b, x, logits, "MoE", np.random.default_rng(0), "blk.0.moe")
    with pytest.raises(MoepassError, match="graph input"):
        ReorderExpertsPass({"blk.0.moe": ORDER}, {})(b.model([out]))

    built = make_moe_model(("MoE", "matmul", True))
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
    built = make_moe_model(("MoE", "matmul", True))
    graph = built.model.graph
    node = graph.node("blk.0.moe")
    bias = node.inputs[5]  # fc2 bias [E, H], as a Constant node instead of an initializer
    constant = ir.node("Constant", [], {"value": ir.tensor(initializer_of(bias), name="fc2_bias")}, name="fc2_bias")
    constant.outputs[0].name = "fc2_bias"
    graph.insert_before(node, constant)
    node.replace_input_with(5, constant.outputs[0])
    graph.initializers.pop(bias.name)
    reference = built.layers[0].reference(built.x)
    before = run_model(built.model, {"x": built.x})[0]
    assert_within_reference(before, reference)
    with pytest.raises(MoepassError, match=r"node blk.0.moe: expert input 5 \('fc2_bias'\) is computed"):
        ReorderExpertsPass({"blk.0.moe": ORDER}, {})(built.model)
    np.testing.assert_array_equal(run_model(built.model, {"x": built.x})[0], before)  # nothing was changed


class _CountingRows:
    """A RowSource that counts the rows it packs (every call goes to the GGUF rows it wraps)."""

    def __init__(self, source):
        self.source, self.rows_packed = source, 0

    def __getattr__(self, name):
        return getattr(self.source, name)

    def pack(self, span, form, out):
        self.rows_packed += span[1]
        return self.source.pack(span, form, out)


def test_experts_packed_in_this_run_are_packed_once_in_the_new_order(make_gguf, tmp_path):
    """A model lowered in this run (partition's GPU form, a GGUF partitioned in one step) holds its
    experts as packings to come: reordering them packs each expert once, in the new order, codes and
    scales from one pass; the bytes are the original packing's, permuted. (Read an expert at a time
    from the packed whole, the offload form of a 2-layer Qwen3-30B-A3B-sized model took over 23 minutes.)"""
    from moepass.core.architectures import architecture_of
    from moepass.core.gguf_reader import GGUFModel
    from moepass.core.quants import OFFLOAD_FORM, quant_type
    from moepass.passes.reorder_experts import _permuted
    from moepass.passes.weights.sources import GgufRows
    from moepass.passes.weights.packing import PackedGroup, PackOptions
    from moepass.passes.weights.report import WeightReport

    gguf = GGUFModel(make_gguf("q4_0"))
    arch = architecture_of(gguf)
    hp = arch.read_hparams(gguf)
    tensors = [arch.tensor(gguf, role, 0, hp) for role in ("ffn_gate_exps", "ffn_up_exps")]
    sources = [_CountingRows(GgufRows(t, quant_type(t.ggml_type, t.name))) for t in tensors]
    experts, rows = tensors[0].shape[0], tensors[0].shape[1]
    order = [int(e) for e in np.random.default_rng(0).permutation(experts)]
    report = WeightReport()
    options = PackOptions(scale_dtype=ir.DataType.FLOAT16, prepack=True)
    group = PackedGroup(sources, OFFLOAD_FORM, "fc1", report, options)
    original_codes, original_scales = group.codes.numpy(), group.scales.numpy()
    assert [s.rows_packed for s in sources] == [experts * rows] * 2
    values = {
        name: ir.Value(name=name, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
        for name, t in (("codes", group.codes), ("scales", group.scales))
    }
    codes = _permuted(values["codes"], order, 0, "codes").const_value.numpy()
    scales = _permuted(values["scales"], order, 0, "scales").const_value.numpy()
    assert [s.rows_packed for s in sources] == [2 * experts * rows] * 2  # once more, not once per expert
    np.testing.assert_array_equal(codes, original_codes[order])
    np.testing.assert_array_equal(scales, original_scales[order])
    assert list(report.records) == ["fc1"]  # the packing in the new order shares the group's record
