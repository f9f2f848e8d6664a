"""Architecture table entries beyond qwen3moe: legacy Mixtral files, metadata checks, inspect.

(Agreement with llama.cpp for every architecture is in test_llama_oracle.py.)
"""

from __future__ import annotations

import filecmp

import numpy as np
import onnx
import pytest

import moepass
from moepass.architectures import ARCHITECTURES


def test_legacy_per_expert_mixtral_converts_like_stacked(make_gguf, converted, tmp_path):
    legacy = make_gguf("q4_0", arch="llama", legacy_experts=True)
    out = moepass.convert(legacy, tmp_path / "legacy")
    stacked = converted("q4_0", arch="llama")
    assert filecmp.cmp(out.output_dir / "model.onnx.data", stacked / "model.onnx.data", shallow=False)
    graphs = [onnx.load(d / "model.onnx", load_external_data=False).graph for d in (out.output_dir, stacked)]
    assert graphs[0].node == graphs[1].node and graphs[0].initializer == graphs[1].initializer
    info = moepass.inspect(legacy)
    assert info["features"]["experts"].startswith("legacy per-expert tensors")


@pytest.mark.parametrize("arch,key", [
    ("llama", "llama.feed_forward_length"),
    ("qwen2moe", "qwen2moe.expert_feed_forward_length"),
    ("olmoe", "olmoe.attention.layer_norm_rms_epsilon"),
    ("granitemoe", "granitemoe.logit_scale"),
    ("phimoe", "phimoe.expert_count"),
])
def test_missing_hyperparameter_is_named(arch, key, make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch=arch, omit_keys=(key,))
    with pytest.raises(moepass.MoepassError, match=f"missing metadata key '{key}'"):
        moepass.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_shared_expert_tensor_is_named(make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="qwen2moe", omit_tensors=("blk.1.ffn_gate_inp_shexp.weight",))
    with pytest.raises(moepass.MoepassError, match="missing tensor 'blk.1.ffn_gate_inp_shexp.weight'"):
        moepass.convert(bad, tmp_path / "out")


def test_dense_llama_is_refused(make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="llama", omit_keys=("llama.expert_count",))
    with pytest.raises(moepass.MoepassError, match="a dense llama model"):
        moepass.convert(bad, tmp_path / "out")


@pytest.mark.parametrize("arch,expected", [
    ("qwen2moe", {"routing": "softmax, top-2, not renormalized", "shared_expert": "ffn 512 with a sigmoid gate"}),
    ("olmoe", {"qk_norm": "RMSNorm over the full projection", "routing": "softmax, top-2, not renormalized"}),
    ("granitemoe", {"multipliers": {"embedding": 12.0, "residual": 0.22, "attention": 0.0078125, "logit": 8.0},
                    "shared_expert": "ffn 512", "rope": "interleaved pairs"}),
    ("phimoe", {"routing": "softmax, top-2, renormalized"}),
    ("llama", {"rope": "interleaved pairs"}),
])
def test_inspect_shows_architecture_parts(arch, expected, make_gguf, converted):
    for info in (moepass.inspect(make_gguf("q4_0", arch=arch)), moepass.inspect(converted("q4_0", arch=arch))):
        features = info["features"] if info["kind"] == "gguf" else \
            __import__("json").loads(info["metadata"]["moepass.features"])
        for key, value in expected.items():
            assert features[key] == (pytest.approx(value) if isinstance(value, dict) else value), (arch, key)


def test_readme_lists_every_architecture():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in ARCHITECTURES:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("extra,message", [
    ({"metadata": {"phimoe.rope.scaling.type": "longrope"}}, "'phimoe.rope.scaling.type' is 'longrope'"),
    ({"tensors": {"rope_factors_long.weight": np.ones(32, np.float32)}}, "tensor 'rope_factors_long.weight'"),
    ({"metadata": {"phimoe.rope.dimension_count": 32}}, "partial rotary embedding"),
])
def test_unsupported_rope_variants_are_refused(extra, message, make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="phimoe", extra_metadata=extra.get("metadata", {}),
                    extra_tensors=extra.get("tensors", {}))
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.convert(bad, tmp_path / "out")
