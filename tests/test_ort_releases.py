"""The ONNX Runtime releases people install: onnxruntime 1.32.0 (`[cpu]`) and onnxruntime-gpu 1.31.1
(`[gpu]`, the newest GPU wheel on the index). Every model moepass writes or builds loads on both
(IR version and opsets: moepass.core.onnx_format), and a form a release cannot run is refused before
the session, naming the release and the form (moepass.core.capabilities.RELEASE_GAPS).

This file runs in both installs (.ci/run runs it in the [gpu] venv too)."""

from __future__ import annotations

import types

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from moepass.core.capabilities import release_refusal
from moepass.core.errors import MoepassError
from moepass.core.model_io import load_model, model_file
from moepass.core.ir_values import folded
from moepass.core.onnx_format import MAX_IR_VERSION, MAX_OPSET, OPSETS, ORT_LIMITS, ir_version_for
from moepass.runtime.providers import plan_session


def _release() -> tuple[int, int]:
    major, minor = ort.__version__.split(".")[:2]
    return int(major), int(minor)


def _loads(ir_version: int, opset: int) -> bool:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ONNX Runtime's own refusal types
        return False
    return True


def test_the_installed_release_loads_what_the_table_says():
    """The table's row for the installed release is what it loads: the newest IR version and opset."""
    assert _release() in ORT_LIMITS, f"ONNX Runtime {ort.__version__} is not in onnx_format.ORT_LIMITS"
    newest_ir, newest_opset = ORT_LIMITS[_release()]
    assert _loads(newest_ir, 21) and not _loads(newest_ir + 1, 21)
    assert _loads(10, newest_opset) and not _loads(10, newest_opset + 1)


def test_models_moepass_writes_load_on_every_supported_release(converted, tmp_path):
    """The IR version of a conversion and of a placed model is the lowest their opsets need, within
    what every supported release loads (onnx 1.23's own default, 14, is not: 1.31.1 refused it)."""
    from moepass.partition import partition

    source = converted("q4_0")
    placed = partition(source, tmp_path / "placed", "8G", calibrate=False, target="layers").output_dir
    for folder in (source, placed):
        proto = onnx.load(str(model_file(folder)), load_external_data=False)
        opsets = {o.domain: o.version for o in proto.opset_import}
        assert proto.ir_version == ir_version_for(opsets) <= MAX_IR_VERSION
        assert opsets.get("", 0) <= MAX_OPSET
    assert ir_version_for(OPSETS) == 10


def test_folding_does_not_take_the_newest_ir_of_onnx(monkeypatch):
    """ir_values.folded builds a model of its own to fold constants: with an onnx whose default IR
    version is past what ONNX Runtime loads, it still gives the values (partition failed on every
    model in the [gpu] install: 'Unsupported model IR version: 14, max supported IR version: 13')."""
    monkeypatch.setattr(onnx, "IR_VERSION", 99)
    data = ir.Value(name="data", const_value=ir.tensor(np.arange(6, dtype=np.float32), name="data"))
    cast = ir.Node("", "Cast", [data], attributes=[ir.AttrInt64("to", ir.DataType.FLOAT16)], name="cast")
    ir.Graph([], [cast.outputs[0]], nodes=[cast], initializers=[data], opset_imports=dict(OPSETS))
    cast.outputs[0].name = "data.to_float16"
    values = folded(cast.outputs[0])
    assert values.dtype == np.float16 and values.tolist() == list(range(6))


def _ort_of(version: str):
    return types.SimpleNamespace(__version__=version, get_available_providers=lambda: ["CPUExecutionProvider"])


def test_prepacked_experts_are_refused_before_1_32(converted):
    """SM80-prepacked experts gave other greedy tokens (demo fixture) or a segfault (Qwen3-30B-A3B
    sizes) on 1.31.1's CPU EP: refused in one line before any session, naming form and release."""
    model = load_model(model_file(converted("q4_0", expert_format="offload")))
    why = release_refusal(model, (1, 31), "ONNX Runtime 1.31.1")
    assert why is not None and "weights_prepacked=1" in why and "1.31.1" in why and "\n" not in why
    assert release_refusal(model, (1, 32), "ONNX Runtime 1.32.0") is None
    with pytest.raises(MoepassError, match=r"SM80-prepacked QMoE experts .* need ONNX Runtime 1\.32"):
        plan_session(_ort_of("1.31.1"), model, {}, device="cpu")
    assert plan_session(_ort_of("1.32.0"), model, {}, device="cpu").provider == "CPUExecutionProvider"


def test_sigmoid_group_routing_is_refused_before_1_32(converted):
    """DeepSeek-V3-style routing (sigmoid over expert groups) is com.microsoft::MoEGroupRouter, which
    onnxruntime-gpu 1.31.1 does not have (its schemas: tests/test_ort_operators.py): refused in one
    line naming the operator and the install that runs it, not ONNX Runtime's own failure."""
    model = load_model(model_file(converted("q4_0", arch="deepseek2")))
    why = release_refusal(model, (1, 31), "ONNX Runtime 1.31.1")
    assert why is not None and "MoEGroupRouter" in why and "moepass[cpu]" in why and "\n" not in why
    assert "no form of this model runs on ONNX Runtime 1.31.1" in why and "expert format" not in why
    assert release_refusal(model, (1, 32), "ONNX Runtime 1.32.0") is None
    if _release() < (1, 32):
        import moepass

        with pytest.raises(MoepassError, match="MoEGroupRouter nodes .* need ONNX Runtime 1.32"):
            moepass.load(converted("q4_0", arch="deepseek2"), device="cpu", threads=1)


def test_the_default_form_runs_on_every_release(converted):
    """Row-major int4/int8 experts, the default forms, run alike on both releases (probed: same greedy
    tokens on every default, int8, float-activation, KV-cache, Q4_K_M and float form): not refused."""
    for kwargs in ({}, {"expert_format": "int8"}):
        model = load_model(model_file(converted("q4_0", **kwargs)))
        assert release_refusal(model, (1, 31), "ONNX Runtime 1.31.1") is None


def test_the_installed_release_runs_what_it_is_not_refused(converted):
    """Whatever this install is, a prepacked model either loads and runs (1.32) or is refused in one
    line (1.31): never a session that runs other values."""
    import moepass

    folder = converted("q4_0", expert_format="offload")
    if _release() >= (1, 32):
        decoder = moepass.load(folder, device="cpu", threads=1)
        assert len(list(decoder.generate([1, 2, 3], 2))) == 2
    else:
        with pytest.raises(MoepassError, match="need ONNX Runtime 1.32"):
            moepass.load(folder, device="cpu", threads=1)


@pytest.mark.parametrize("top_k", [0, -1, "experts + 1"])
def test_a_top_k_outside_the_experts_is_refused_before_onnx_runtime(top_k):
    """ONNX Runtime's MoE kernels do not check k against the experts (a public report: an
    out-of-bounds read): a model whose k is 0, negative or past its experts is refused when read."""
    from support.hand_built import E, make_moe_model

    from moepass.core.moe_nodes import moe_nodes

    built = make_moe_model(("QMoE", "matmul", True))
    node = next(n for n in built.model.graph if n.op_type == "QMoE")
    k = E + 1 if top_k == "experts + 1" else top_k
    node.attributes["k"] = ir.AttrInt64("k", k)
    with pytest.raises(MoepassError, match=rf"k={k} experts per token, but it has {E} experts"):
        moe_nodes(built.model.graph)
    with pytest.raises(MoepassError, match=rf"k={k}"):
        plan_session(_ort_of("1.32.0"), built.model, {}, device="cpu")
