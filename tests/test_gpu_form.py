"""partition's GPU form (passes/gpu_form.py, passes/float16.py), checked on the CPU EP, which runs
float16 graphs and SM80-prepacked experts: for every GGUF type, `partition --vram 8G` of a default
conversion places every layer (--target layers) or expert (--target offload), every node the plan
puts on the GPU is in a form ONNX Runtime's CUDA kernels take (moepass.core.capabilities) or its
expert offload takes, and the placed model computes what the unplaced one does, as closely as
convert's own float16 offload form of the same file does.

Against an oracle nobody here wrote, the placed forms' fidelity is tests/test_trained_agreement.py's
test_the_gpu_form_beside_llama_cpp (KL divergence beside llama.cpp on the same file, and beside its
Q4_0 for the int4 offload form). What is not checked here: a GPU. docs/gpu.md says what has run where."""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import onnx_ir as ir
import pytest
from gguf import GGMLQuantizationType as GT
from support.gpu_form import gpu_nodes_are_taken

import make_fixtures
import moepass
from moepass.core.capabilities import layout_problems
from moepass.core.formats import read_plan
from moepass.core.model_io import load_model
from moepass.core.moe_nodes import moe_nodes
from moepass.core.quants import QUANT_TYPES
from moepass.runtime import load

IDS = np.array([[5, 77, 200, 13, 99, 150, 7, 260]])
ROLES = ("embd", "attn", "attn_v", "gate_up", "down", "output")
# every type moepass converts, for every weight of the file (the router stays F32, as llama.cpp keeps it)
TYPES = [t for t in QUANT_TYPES]


def _logits(model_dir) -> np.ndarray:
    decoder = load(model_dir)
    return decoder.forward(IDS, decoder.empty_cache())[0][0].astype(np.float64)


@pytest.fixture(scope="module")
def type_models(make_gguf, converted, tmp_path_factory):
    """type -> (its GGUF, its default conversion, its offload conversion)."""
    made = {}

    def get(ggml_type: GT):
        if ggml_type not in made:
            kwargs = {"types": {role: ggml_type for role in ROLES}}
            made[ggml_type] = (make_gguf("q8_0", **kwargs), converted("q8_0", **kwargs),
                               converted("q8_0", expert_format="offload", **kwargs))
        return made[ggml_type]

    return get


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_every_type_is_placed_in_the_gpus_form(ggml_type, type_models, tmp_path):
    gguf, default, offload = type_models(ggml_type)
    reference = _logits(default)
    converted_error = np.abs(_logits(offload) - reference).max()  # convert's float16 form, same file
    floats = QUANT_TYPES[ggml_type].storage == "float"
    for target in ("layers", "offload"):
        if target == "offload" and floats:  # float experts are no QMoE: refused, naming the way
            with pytest.raises(moepass.MoepassError, match="float MoE node.*float_experts='int4'"):
                moepass.partition(default, tmp_path / target, "8G", target=target, calibrate=False)
            continue
        placed = moepass.partition(default, tmp_path / target, "8G", target=target, calibrate=False)
        assert placed.plan.active and placed.warnings == [], placed.warnings
        if target == "layers":
            assert {n.device for n in placed.plan.nodes} == {"gpu"}
        else:
            assert all(n.resident_count == n.experts for n in placed.plan.nodes)
        gpu_nodes_are_taken(placed.output_dir, target)
        ours = _logits(placed.output_dir)
        assert np.isfinite(ours).all()
        # as close to the unplaced model as convert's own float16 offload form (requantized to int4
        # where the type is not Q4_0) is, or closer: the layers target keeps 8-bit forms at 8 bits
        error = np.abs(ours - reference).max()
        assert error <= 1.5 * converted_error + 1e-6, (target, error, converted_error)


def test_a_cpu_layer_keeps_its_cpu_form_and_float32(converted, tmp_path):
    """--target layers at a budget for one of two layers: the first layer's MoE node stays as the
    conversion made it (float32, its fast CPU form, its weights the source's bytes), between Casts
    to and from the float16 graph, annotated for the CPU with them; the last layer's node is in the
    GPU's form; the placed model agrees with the unplaced one to float16 rounding."""
    source = converted("q4_k_m")
    full = moepass.partition(source, tmp_path / "full", "8G", target="layers", calibrate=False)
    one_layer = full.plan.memory.non_expert_bytes + full.plan.memory.kv_cache_bytes + full.plan.memory.work_bytes + \
        full.plan.memory.reserve_bytes + full.plan.nodes[-1].experts * full.plan.nodes[-1].bytes_per_expert + 1024
    placed = moepass.partition(source, tmp_path / "one", one_layer, target="layers", calibrate=False)
    assert [n.device for n in placed.plan.nodes] == ["cpu", "gpu"]
    model = load_model(placed.output_dir)
    first, last = moe_nodes(model.graph)
    assert first.node.outputs[0].dtype == ir.DataType.FLOAT and last.node.outputs[0].dtype == ir.DataType.FLOAT16
    assert first.node.metadata_props["layer_ann"] == "cpu/blk.0.moe"
    feeding = [v.producer() for v in first.node.inputs[:2]]
    assert all(p is not None and p.op_type == "Cast" and p.metadata_props["layer_ann"] == "cpu/blk.0.moe"
               for p in feeding)
    shared = os.stat(placed.output_dir / "shared.onnx.data").st_ino == os.stat(source / "model.onnx.data").st_ino
    assert shared and first.expert_values[0].const_value.location == "shared.onnx.data"
    gpu_nodes_are_taken(placed.output_dir, "layers")
    reference, half = _logits(source), _logits(converted("q4_k_m", expert_format="offload"))
    assert np.abs(_logits(placed.output_dir) - reference).max() <= np.abs(half - reference).max()


def test_a_gguf_is_converted_and_placed_in_one_step(make_gguf, converted, tmp_path):
    """`partition MODEL.gguf`: lowered with convert's defaults and written once, in the GPU's form;
    the same model as converting first and placing the conversion."""
    gguf = make_gguf("q4_k_m")
    direct = moepass.partition(gguf, tmp_path / "direct", "8G", target="offload", calibrate=False)
    twice = moepass.partition(converted("q4_k_m", expert_format="auto"), tmp_path / "twice", "8G", target="offload",
                              calibrate=False)
    assert direct.plan.active and read_plan(direct.output_dir).lowering.weights.startswith("model.onnx.data written")
    assert json.loads((direct.output_dir / "moepass.json").read_text())["source"]["file"] == gguf.name
    assert (direct.output_dir / "tokenizer.json").is_file() and (direct.output_dir / "genai_config.json").is_file()
    np.testing.assert_array_equal(_logits(direct.output_dir), _logits(twice.output_dir))
    default = moepass.partition(gguf, None, "8G", target="layers", calibrate=False)  # no -o: beside the file
    assert default.output_dir == gguf.parent / f"{gguf.stem}-placed"


def test_a_gguf_is_lowered_once_whatever_the_plan(make_gguf, converted, tmp_path, monkeypatch):
    """partition MODEL.gguf plans on one copy of the lowered model and writes another: the GGUF is
    lowered once, also where the plan keeps a layer on the CPU (the written copy lowered for fewer
    GPU nodes than the planned one), and the placed model is the one placing its conversion gives."""
    converting = importlib.import_module("moepass.pipeline.conversion")
    lowerings = []
    lower = converting.lower_gguf_file
    monkeypatch.setattr(converting, "lower_gguf_file", lambda *a, **k: lowerings.append(a[0]) or lower(*a, **k))
    gguf = make_gguf("q4_k_m")
    full = moepass.partition(converted("q4_k_m", expert_format="auto"), tmp_path / "full", "8G", target="layers",
                             calibrate=False)
    memory, last = full.plan.memory, full.plan.nodes[-1]
    one_layer = memory.non_expert_bytes + memory.kv_cache_bytes + memory.work_bytes + memory.reserve_bytes + \
        last.experts * last.bytes_per_expert + 1024
    lowerings.clear()
    direct = moepass.partition(gguf, tmp_path / "direct", one_layer, target="layers", calibrate=False)
    assert lowerings == [gguf]
    assert [n.device for n in direct.plan.nodes] == ["cpu", "gpu"]
    twice = moepass.partition(converted("q4_k_m", expert_format="auto"), tmp_path / "twice", one_layer,
                              target="layers", calibrate=False)
    np.testing.assert_array_equal(_logits(direct.output_dir), _logits(twice.output_dir))


def test_a_gguf_that_moved_or_changed_is_refused_naming_it(make_gguf, tmp_path):
    """A Q3_K model's int4/b16 has no CUDA kernel: its GPU form is packed from the GGUF's own
    blocks, found where moepass.json says, checked by its fingerprint; moved, or changed, partition
    refuses naming the file and the way out (--gguf)."""
    gguf = tmp_path / "q3.gguf"
    gguf.write_bytes(make_gguf("q8_0", types={"gate_up": GT.Q3_K, "down": GT.Q3_K}).read_bytes())
    model = moepass.convert(gguf, tmp_path / "onnx", expert_format="qmoe").output_dir
    placed = moepass.partition(model, tmp_path / "ok", "8G", target="layers", calibrate=False)
    assert all("q3.gguf's own blocks" in how for how in placed.plan.lowering.reformed.values())
    gguf.rename(tmp_path / "moved.gguf")
    with pytest.raises(moepass.MoepassError, match="q3.gguf: the GGUF file .* is not there any more.*gguf=FILE"):
        moepass.partition(model, tmp_path / "gone", "8G", target="layers", calibrate=False)
    found = moepass.partition(model, tmp_path / "found", "8G", target="layers", calibrate=False,
                              gguf=tmp_path / "moved.gguf")
    assert found.plan.active
    other = make_gguf("q8_0", types={"gate_up": GT.Q3_K, "down": GT.Q3_K}, seed=1)
    with pytest.raises(moepass.MoepassError, match="not the GGUF file .*it changed"):
        moepass.partition(model, tmp_path / "changed", "8G", target="layers", calibrate=False, gguf=other)
    assert not any((tmp_path / name).exists() for name in ("gone", "changed"))


def test_a_model_whose_layout_contradicts_its_label_is_refused_at_load(converted, tmp_path):
    """Row-major int4 codes labelled weights_prepacked=1 run silently wrong on ONNX Runtime (relative
    error 1.25): the runtime refuses them, naming the node, before a session exists."""
    import shutil

    source = converted("q4_0")
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    model = ir.load(bad / "model.onnx")
    node = moe_nodes(model.graph)[0].node
    node.attributes["weights_prepacked"] = ir.AttrInt64("weights_prepacked", 1)
    ir.save(model, bad / "model.onnx")
    with pytest.raises(moepass.MoepassError, match="blk.0.moe: fc1's codes .* row-major .* weights_prepacked=1"):
        load(bad)
    assert layout_problems(load_model(converted("q4_0", expert_format="offload"))) == []
