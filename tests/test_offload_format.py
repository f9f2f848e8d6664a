"""--expert-format offload: int4 block 32 experts in ONNX Runtime's SM80 prepacked layout, float16 graph."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import pytest

import moepass
from moepass.cuda_ops.prepack import prepack_sm80
from moepass.runtime.providers import PLUGIN_EP, offload_violations, plan_session


# (N, K) of the experts the converter emits: the test fixture's and Qwen3-30B-A3B's gate/up and down,
# and both widened by block-sum features (fc1's K and fc2's N: the model width plus 64 a level)
PREPACKED_SHAPES = [(64, 64), (256, 128), (1536, 2048), (2048, 768), (512, 256 + 3 * 64), (256 + 3 * 64, 256),
                    (1536, 2048 + 2 * 64), (2048 + 2 * 64, 768)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", PREPACKED_SHAPES)
def test_prepacked_layout_is_onnxruntimes(bits, n, k):
    """Byte for byte against ONNX Runtime's own packer (onnxruntime.quantization.cuda_quantizer, torch)."""
    from onnxruntime.quantization.cuda_quantizer import _pack_weights_for_cuda_mixed_gemm

    codes = np.random.default_rng(n + k + bits).integers(0, 256, size=(n, k * bits // 8), dtype=np.uint8)
    theirs = np.asarray(_pack_weights_for_cuda_mixed_gemm(codes, n, k, bits, 80)).view(np.uint8)
    assert np.array_equal(prepack_sm80(codes, n, k, bits), theirs.reshape(k, n * bits // 8))


@pytest.fixture(scope="module")
def offload_pair(make_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    source = make_gguf("q4_0")
    return (moepass.convert(source, root / "offload", expert_format="offload"),
            moepass.convert(source, root / "int4", expert_format="int4"))


def test_offload_model_is_eligible_and_agrees_with_the_unpacked_one(offload_pair):
    offload, unpacked = offload_pair
    assert offload.offload == "eligible (int4 block 32 prepacked, float16)"
    assert unpacked.offload.startswith("not eligible: blk.0.moe: int4 experts need weights_prepacked=1")
    model = ir.load(offload.output_dir / "model.onnx")
    assert offload_violations(model) == []
    node = next(n for n in model.graph if n.op_type == "QMoE")
    assert node.attributes.get_int("weights_prepacked") == 1 and node.inputs[3].dtype == ir.DataType.FLOAT16
    a, b = moepass.load(offload.output_dir), moepass.load(unpacked.output_dir)
    ids = np.array([[5, 77, 200, 13, 99, 150, 7, 260]])
    la, cache_a = a.forward(ids, a.empty_cache())
    lb, cache_b = b.forward(ids, b.empty_cache())
    assert la.dtype == np.float16 and cache_a["past_key_values.0.key"].dtype == np.float16
    # the same int4 weights (Q4_0 moves exactly); float16 activations against float32
    assert np.abs(la.astype(np.float32) - lb).max() <= 0.01 * np.abs(lb).max()
    assert list(a.generate([5, 77, 200], 12, stop_ids=())) == list(b.generate([5, 77, 200], 12, stop_ids=()))


def test_offload_requantizes_other_types(make_gguf, tmp_path):
    result = moepass.convert(make_gguf("q8_0"), tmp_path / "out", expert_format="offload")
    experts = [w for w in result.weights if ".ffn_experts." in w["onnx_name"]]
    assert all(w["target"] == "int4/b32" and not any(w["exact"]) for w in experts)
    assert 0.03 < max(e for w in experts for e in w["rel_rms_error"]) < 0.1
    assert result.offload.startswith("eligible")
    assert "offload       eligible" in "\n".join(result.summary_lines())


def test_runtime_offload_checks_pass_for_the_offload_format(offload_pair, tmp_path, caplog):
    offload, _ = offload_pair
    model = ir.load(offload.output_dir / "model.onnx")
    library = tmp_path / "libplugin.so"
    library.write_bytes(b"")
    device = type("Device", (), {"ep_name": PLUGIN_EP})()
    ort = type("Ort", (), {"__version__": "1.32.0", "register_execution_provider_library": staticmethod(lambda *a: None),
                           "get_ep_devices": staticmethod(lambda: [device]),
                           "get_available_providers": staticmethod(lambda: ["CPUExecutionProvider"])})
    plan = plan_session(ort, model, {}, cuda_plugin=str(library), mode="required")
    assert plan.provider == PLUGIN_EP and plan.warnings == []
    with caplog.at_level(logging.WARNING, logger="moepass"):
        decoder = moepass.load(offload.output_dir, mode="auto")   # this machine: CPU only
    assert caplog.records[-1].getMessage() == "no CUDA plugin EP: all 2 MoE layers run on the CPU"
    assert decoder.plan.config_entries["session.moe.offload.mode"] == "auto"


def test_a_profile_applies_to_every_form_of_the_same_model(offload_pair, converted, tmp_path):
    """The shapes of a prepacked model are read as the raw one's (QMoE's scales, [E, N, blocks] in
    both layouts), so a profile measured on one conversion of a GGUF plans every other: the default,
    int4 and the offload form share one fingerprint, and inspect and the memory model see the same
    hidden and expert sizes."""
    from moepass.pipeline.placement import MemoryModel
    from moepass.pipeline.popularity import model_identity

    offload, unpacked = offload_pair
    default = converted("q4_0")
    shapes = {str(folder): [(n["hidden"], n["ffn"]) for n in moepass.inspect(folder)["moe_nodes"]]
              for folder in (default, offload.output_dir, unpacked.output_dir)}
    assert len({tuple(s) for s in shapes.values()}) == 1, shapes
    assert list(shapes.values())[0][0] == (256, 256)  # the test fixture's hidden and expert_ff
    identities = {model_identity(ir.load(folder / "model.onnx"))["fingerprint"]
                  for folder in (default, offload.output_dir, unpacked.output_dir)}
    assert len(identities) == 1
    # the working buffers come from those sizes (the offload graph's float16 activations halve some)
    work = [MemoryModel.of(ir.load(folder / "model.onnx")).work_bytes(4096, 1, 512)
            for folder in (offload.output_dir, unpacked.output_dir)]
    assert work[0] <= work[1]
    profile = moepass.profile(default, [[1, 2, 3, 4, 5]])
    placed = moepass.partition(offload.output_dir, tmp_path / "placed", "8G", profile=profile, target="offload")
    assert (placed.plan.inputs.profile or {})["tokens"] == 5
