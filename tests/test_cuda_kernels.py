"""The CUDA kernel table (moepass.core.capabilities): which nodes ONNX Runtime's CUDA EP takes, as
inspect and partition report it before any session exists. A default conversion (float32 graph)
has no CUDA QMoE or GroupQueryAttention; the offload form (float16 graph) runs every node there."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from click.testing import CliRunner

import moepass
from moepass.cli import main
from moepass.core.capabilities import CUDA_KERNELS, activation_dtype, cuda_refusal, cuda_refusals


def test_inspect_lists_per_node_what_the_cuda_ep_takes(converted):
    default = moepass.inspect(converted("q4_0"))
    assert {n["node"]: n["cuda"] for n in default["moe_nodes"]} == {
        "blk.0.moe": "QMoE in float32: the CUDA kernel is registered for float16/bfloat16 "
                     "(onnxruntime/contrib_ops/cuda/moe/moe_quantization.cc)",
        "blk.1.moe": "QMoE in float32: the CUDA kernel is registered for float16/bfloat16 "
                     "(onnxruntime/contrib_ops/cuda/moe/moe_quantization.cc)"}
    assert sum("GroupQueryAttention in float32" in why for why in default["cuda_refused"].values()) == 2
    offload = moepass.inspect(converted("q4_0", expert_format="offload"))
    assert all(n["cuda"] is None for n in offload["moe_nodes"]) and offload["cuda_refused"] == {}
    text = CliRunner().invoke(main, ["inspect", str(converted("q4_0"))]).stdout
    assert "CUDA EP       4 nodes it has no kernel for (they would run on the CPU):" in text
    assert "convert --expert-format offload writes a float16 graph whose every node the CUDA EP takes" in text
    assert json.loads(CliRunner().invoke(main, ["inspect", str(converted("q4_0")), "--json"]).stdout)["cuda_refused"]


def test_a_default_conversion_is_placed_in_its_gpu_form(converted, tmp_path):
    """A default conversion's MoE layers (float32 QMoE) have no CUDA kernel. Lowered (partition's
    default), every node the plan puts on the GPU is in a form the table says the CUDA EP takes, and
    every layer is placed at 8G. Kept in its form (--keep-form), partition says before planning which
    layers have no kernel, naming node and rule and the way out; the plan keeps them on the CPU,
    spending no VRAM on them, and predicts no gain; --mode required refuses."""
    lowered = moepass.partition(converted("q4_0"), tmp_path / "g", "8G", target="layers", mode="required")
    assert {n.device for n in lowered.plan.nodes} == {"gpu"} and lowered.warnings == []
    assert cuda_refusals(ir.load(tmp_path / "g" / "model.onnx")) == {}
    warnings: list[str] = []
    plan = moepass.partition(converted("q4_0"), tmp_path / "p", "8G", target="layers", warn=warnings.append,
                             lower=False)
    assert warnings[0].endswith("ONNX Runtime's CUDA EP has no kernel for 2 of 2 MoE layers (blk.0.moe: QMoE in "
                                "float32: the CUDA kernel is registered for float16/bfloat16 (onnxruntime/contrib_ops"
                                "/cuda/moe/moe_quantization.cc)): with lower=False they run on the CPU whatever the "
                                "plan; without it partition writes the GPU form, whose every GPU node the CUDA EP "
                                "takes")
    assert len(warnings) == 1  # not also "0 of 2 layers fit"
    assert {n.device for n in plan.plan.nodes} == {"cpu"} and plan.plan.memory.resident_expert_bytes == 0
    decode = plan.plan.prediction.decode_ms_per_token
    assert decode.cpu_only is not None and decode.cold_experts_on_cpu >= decode.cpu_only  # no gain promised
    with pytest.raises(moepass.MoepassError, match="CUDA EP has no kernel for 2 of 2 MoE layers"):
        moepass.partition(converted("q4_0"), tmp_path / "r", "8G", target="layers", mode="required", lower=False)
    forced = moepass.partition(converted("q4_0"), tmp_path / "f", "8G", target="layers", kernel_table=False, lower=False)
    assert {n.device for n in forced.plan.nodes} == {"gpu"}


def _node(op: str, domain: str = "com.microsoft", dtype=ir.DataType.FLOAT16, **attributes) -> ir.Node:
    x = ir.Value(name="x", type=ir.TensorType(dtype))
    return ir.node(op, [x], attributes=attributes, domain=domain)


@pytest.mark.parametrize("op,dtype,attributes,says", [
    ("QMoE", ir.DataType.FLOAT16, {"expert_weight_bits": 2}, "expert_weight_bits 2"),
    ("QMoE", ir.DataType.FLOAT, {}, "QMoE in float32"),
    ("GroupQueryAttention", ir.DataType.FLOAT, {}, "GroupQueryAttention in float32"),
    ("MatMulNBits", ir.DataType.FLOAT16, {"bits": 2}, "bits 2"),
    ("MoEGroupRouter", ir.DataType.FLOAT16, {}, "registers no kernel"),
])
def test_the_rules_name_what_a_node_breaks(op, dtype, attributes, says):
    assert says in cuda_refusal(_node(op, dtype=dtype, **attributes))


def test_what_the_cuda_ep_takes_has_no_refusal():
    assert cuda_refusal(_node("MatMulNBits", dtype=ir.DataType.FLOAT, bits=4)) is None  # float32 MatMulNBits: yes
    assert cuda_refusal(_node("SkipSimplifiedLayerNormalization", dtype=ir.DataType.FLOAT)) is None
    assert cuda_refusal(_node("MatMul", domain="", dtype=ir.DataType.FLOAT)) is None
    assert "not in moepass's CUDA table" in cuda_refusal(_node("Unheard", dtype=ir.DataType.FLOAT16))
    assert all(k[0] in ("", "com.microsoft") for k in CUDA_KERNELS)


def test_the_graph_type_comes_from_the_kv_cache(converted):
    assert activation_dtype(ir.load(converted("q4_0") / "model.onnx")) == ir.DataType.FLOAT
    offload = ir.load(converted("q4_0", expert_format="offload") / "model.onnx")
    assert activation_dtype(offload) == ir.DataType.FLOAT16 and cuda_refusals(offload) == {}
