"""--expert-format packed: the GGUF's own expert blocks in com.microsoft::MoEPacked nodes (ONNX
Runtime 1.32, whose MoEPacked kernel is CUDA's only), checked as far as a CPU allows: the blobs are
the file's bytes, ONNX Runtime's graph resolution accepts the model (session creation stops only
at the kernel, named), GatherPacked, which runs on the CPU, decodes the blobs
bit for bit as the gguf package does for the types it knows, the runtime refuses the model in one
line on a machine without a CUDA EP, and partition turns it into forms that run: the CPU form for a
CPU layer, the offload form, both from the blobs themselves."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as GT, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import moepass
from moepass.core.formats import read_report
from moepass.core.model_io import load_model
from moepass.core.moe_nodes import PACKED_SLOTS, moe_nodes
from moepass.runtime import load

# the types ONNX Runtime 1.32's CPU GatherPacked decodes (probed: ids 2, 6, 8, 13, 14, 16-18, 20, 22, 23;
# not Q4_K, Q4_1, Q5_1, Q2_K, Q3_K, IQ1_*, IQ3_S, MXFP4)
GATHER_PACKED_TYPES = [GT.Q4_0, GT.Q5_0, GT.Q8_0, GT.Q5_K, GT.Q6_K, GT.IQ4_NL, GT.IQ4_XS, GT.IQ2_XXS, GT.IQ2_XS,
                       GT.IQ3_XXS, GT.IQ2_S]


@pytest.fixture(scope="module")
def packed(make_gguf, tmp_path_factory):
    made = {}

    def get(ggml_type: GT | None = None, preset: str = "q8_0"):
        key = (ggml_type, preset)
        if key not in made:
            kwargs = {"types": {"gate_up": ggml_type, "down": ggml_type}} if ggml_type else {}
            gguf = make_gguf(preset, **kwargs)
            out = tmp_path_factory.mktemp("packed") / "model"
            made[key] = gguf, moepass.convert(gguf, out, expert_format="packed").output_dir
        return made[key]

    return get


def test_the_blobs_are_the_files_bytes_and_onnx_runtime_resolves_the_graph(packed):
    gguf, model_dir = packed(preset="q4_k_m")
    model = load_model(model_dir)
    nodes = moe_nodes(model.graph)
    assert nodes and all(m.node.op_type == "MoEPacked" for m in nodes)
    source = {t.name: np.asarray(t.data) for t in GGUFReader(gguf).tensors}
    for m in nodes:
        layer = m.node.metadata_props["moepass.layer"]
        for role, slot in PACKED_SLOTS.items():
            blob = m.node.inputs[slot].const_value.numpy()
            np.testing.assert_array_equal(blob, source[f"blk.{layer}.ffn_{role}_exps.weight"])
        assert m.node.attributes.get_int("gate_type") == int(GT.Q4_K)
    assert (m.hidden, m.ffn, m.experts) == (256, 256, 8)
    # ONNX Runtime resolves the graph (every node's schema, attributes and types) before it looks for
    # kernels: only the kernel is missing (onnx's own checker does not know ONNX Runtime's ops)
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED.*Could not find an implementation for MoEPacked"):
        ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    records = [w for w in read_report(model_dir).weights if w["target"].startswith("packed ")]
    assert records and all(w["exact"] == [True] for w in records)
    experts = sum(w["bytes"] for w in records)
    assert experts == sum(source[n].nbytes for n in source if "_exps." in n)  # the file's size, not a byte more


@pytest.mark.parametrize("ggml_type", GATHER_PACKED_TYPES, ids=lambda t: t.name)
def test_gather_packed_decodes_the_blobs_as_the_gguf_package_does(ggml_type, packed):
    """ONNX Runtime's own decoder of the packed-weight contract (GatherPacked, on the CPU) reads
    every expert row of the blob bit for bit as gguf-py's dequantizer."""
    gguf, model_dir = packed(ggml_type)
    node = moe_nodes(load_model(model_dir).graph)[0].node
    blob = node.inputs[PACKED_SLOTS["gate"]].const_value.numpy()
    rows = blob.reshape(-1, blob.shape[-1])
    k = gguf_dequantize(rows[:1], ggml_type).shape[-1]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("GatherPacked", ["data", "ids"], ["y"], domain="com.microsoft", K=k,
                               packed_type=int(ggml_type), output_dtype=onnx.TensorProto.FLOAT)],
        "g", [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [len(rows)])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [len(rows), k])],
        [onnx.numpy_helper.from_array(rows, "data")])
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = session.run(None, {"ids": np.arange(len(rows), dtype=np.int64)})[0]
    theirs = gguf_dequantize(rows, ggml_type).astype(np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_the_runtime_refuses_it_without_a_cuda_ep(packed):
    _, model_dir = packed(preset="q4_k_m")
    with pytest.raises(moepass.MoepassError, match=r"blk.0.moe is a com.microsoft::MoEPacked node .* CUDA only.*"
                                                   r"convert without expert_format='packed'"):
        load(model_dir)


def test_partition_makes_forms_that_run_from_the_blobs(packed, converted, tmp_path):
    """--target layers with room for none: every layer's MoEPacked (no CPU kernel) becomes the
    conversion's CPU form, from the blobs; --target offload: the offload form, from the blobs too (no
    GGUF needed). Both compute what the default conversion does (the same forms: the same tokens)."""
    _, model_dir = packed(preset="q4_k_m")
    small = moepass.partition(model_dir, tmp_path / "cpu", "4M", target="layers", calibrate=False, reserve="1M",
                              context=64)
    assert [n.device for n in small.plan.nodes] == ["cpu", "cpu"]
    assert all("MoEPacked blobs" in how for how in small.plan.lowering.reformed.values())
    default = converted("q4_k_m")
    forms = {m.name: str(m.form) for m in moe_nodes(load_model(default).graph)}
    assert small.plan.lowering.forms == forms  # the conversion's own CPU form
    prompt = [5, 77, 200, 13]
    tokens = list(load(default).generate(prompt, 8, stop_ids=()))
    assert list(load(small.output_dir).generate(prompt, 8, stop_ids=())) == tokens
    offload = moepass.partition(model_dir, tmp_path / "offload", "8G", target="offload", calibrate=False)
    assert offload.plan.active and all(n.resident_count == n.experts for n in offload.plan.nodes)
    gpu = moepass.partition(model_dir, tmp_path / "gpu", "8G", target="layers", calibrate=False)
    assert all(m.node.op_type == "MoEPacked" for m in moe_nodes(load_model(gpu.output_dir).graph))  # kept for CUDA


def test_what_moe_packed_cannot_compute_is_refused(make_gguf, tmp_path):
    with pytest.raises(moepass.MoepassError, match="expert_format='packed': MoEPacked has no expert biases"):
        moepass.convert(make_gguf("q8_0", arch="gpt-oss"), tmp_path / "out", expert_format="packed")
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_packed_types(packed):
    _, model_dir = packed(preset="q4_k_m")
    nodes = moepass.inspect(model_dir)["moe_nodes"]
    assert [n["form"] for n in nodes] == ["packed Q4_K/Q4_K/Q4_K", "packed Q4_K/Q4_K/Q6_K"]
    assert all(n["cuda"] is None for n in nodes)  # the kernel table: MoEPacked is CUDA's
