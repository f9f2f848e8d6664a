"""Architecture table entries beyond qwen3moe: legacy Mixtral files, metadata checks, inspect.

(Agreement with llama.cpp for every architecture is in test_llama_oracle.py.)
"""

from __future__ import annotations

import filecmp
import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_ir import tape as ir_tape
import make_fixtures

import moepass
from moepass.core.architectures import ARCHITECTURES
from moepass.core.rope import Rope
from moepass.core.model_io import load_model
from moepass.core.ir_values import folded


def test_legacy_per_expert_mixtral_converts_like_stacked(make_gguf, converted, tmp_path):
    legacy = make_gguf("q4_0", arch="llama", legacy_experts=True)
    out = moepass.convert(legacy, tmp_path / "legacy", expert_format="qmoe")
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


@pytest.mark.parametrize("extra,message", [
    # LongRoPE (rope_factors_long/short, rope.scaling.type "longrope") is converted: tests/test_longrope.py
    ({"metadata": {"phimoe.rope.scaling.type": "su"}}, "'phimoe.rope.scaling.type' is 'su'"),
    ({"tensors": {"rope_freqs.weight": np.ones(32, np.float32)}}, "tensor 'rope_freqs.weight'"),
    ({"metadata": {"phimoe.rope.dimension_count": 32}}, "partial rotary embedding"),
])
def test_unsupported_rope_variants_are_refused(extra, message, make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="phimoe", extra_metadata=extra.get("metadata", {}),
                    extra_tensors=extra.get("tensors", {}))
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.convert(bad, tmp_path / "out")


# ---- gpt-oss ------------------------------------------------------------------------------------

def test_gpt_oss_graph_has_sinks_windows_clamped_swiglu_and_biases(make_gguf, converted):
    from gguf import GGUFReader

    out = converted("mxfp4", arch="gpt-oss")
    model = onnx.load(out / "model.onnx")
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1) for n in attention]
    assert windows == [5, -1, 5, -1]  # sliding, full, sliding, full
    assert all(n.input[11] == f"blk.{i}.attn_sinks.weight" for i, n in enumerate(attention))
    moe = [n for n in model.graph.node if n.op_type == "QMoE"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in moe[0].attribute}
    assert attrs["swiglu_limit"] == 7.0 and attrs["activation_beta"] == 1.0
    assert abs(attrs["activation_alpha"] - 1.702) < 1e-6 and attrs["normalize_routing_weights"] == 1
    assert (attrs["expert_weight_bits"], attrs["block_size"]) == (8, 32)
    # fc1 bias: gate and up interleaved like fc1's rows; fc2 bias as is
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    gguf = {t.name: np.asarray(t.data) for t in GGUFReader(make_gguf("mxfp4", arch="gpt-oss")).tensors}
    fc1_bias = inits[moe[1].input[4]]
    np.testing.assert_array_equal(fc1_bias[:, 0::2], gguf["blk.1.ffn_gate_exps.bias"])
    np.testing.assert_array_equal(fc1_bias[:, 1::2], gguf["blk.1.ffn_up_exps.bias"])
    np.testing.assert_array_equal(inits[moe[1].input[7]], gguf["blk.1.ffn_down_exps.bias"])
    report = __import__("json").loads((out / "moepass.json").read_text())
    experts = [w for w in report["weights"] if ".ffn_experts.fc" in w["onnx_name"] and "bias" not in w["onnx_name"]]
    assert experts and all(w["source_types"][0] == "MXFP4" and all(w["exact"]) for w in experts)
    info = moepass.inspect(make_gguf("mxfp4", arch="gpt-oss"))["features"]
    assert info["sliding_window"] == "5 tokens on layers 0,2"
    assert info["rope_scaling"] == "YaRN x32 (original context 4096)"
    assert info["routing"] == "top-2, softmax over the selected" and "attention_sinks" in info


def test_gpt_oss_sliding_window_pattern_key_is_followed_like_llama_cpp(make_gguf, converted):
    """A period of 3 (layers 0, 1 and 3 slide): moepass and llama.cpp read the key alike."""
    from moepass.runtime import load
    from support.oracle import PROMPT, llama_logits

    kwargs = {"arch": "gpt-oss", "extra_metadata": {"gpt-oss.attention.sliding_window_pattern": 3}}
    out = converted("f32", **kwargs)
    assert moepass.inspect(out)["metadata"]["moepass.features"].count("layers 0,1,3") == 1
    decoder = load(out)
    ours, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    assert np.abs(ours[0] - llama_logits(make_gguf("f32", **kwargs))).max() <= 1e-4


def test_yarn_tables_match_the_yarn_formula():
    """cos/sin tables (ggml's angle mixing in float32) against YaRN as published (mixed inverse
    frequencies, float64): gpt-oss-20b's parameters, every position up to 2048."""
    from moepass.core.rope import Rope
    from moepass.passes.lower.rope import rope_cache

    d, base, factor, orig = 64, 150000.0, 32.0, 4096
    rope = Rope(base=base, freq_scale=1 / factor, ext_factor=1.0, attn_factor=1.0, n_ctx_orig=orig)
    cos, sin = rope_cache(2048, d, rope)

    def correction_dim(rotations):
        return d * np.log(orig / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low, high = max(np.floor(correction_dim(32)), 0), min(np.ceil(correction_dim(1)), d - 1)
    extrapolation = base ** (-np.arange(0, d, 2) / d)
    keep = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)  # 1: original frequency
    inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep
    angles = np.arange(2048)[:, None] * inv_freq[None, :]
    magnitude = 0.1 * np.log(factor) + 1
    np.testing.assert_allclose(cos, np.cos(angles) * magnitude, rtol=0, atol=2e-4)
    np.testing.assert_allclose(sin, np.sin(angles) * magnitude, rtol=0, atol=2e-4)
    assert 0 < low < high < d // 2  # the ramp is exercised


@pytest.mark.parametrize("rope, head, factors, act", [
    (Rope(base=1000000.0), 128, None, ir.DataType.FLOAT),  # Qwen3
    (Rope(base=10000.0, freq_scale=0.25), 64, None, ir.DataType.FLOAT),  # linear scaling
    (Rope(base=150000.0, freq_scale=1 / 32, ext_factor=1.0, attn_factor=1.0, n_ctx_orig=4096), 64, None,
     ir.DataType.FLOAT),  # gpt-oss's YaRN
    (Rope(base=10000.0, attn_factor=1.5), 96, np.linspace(1.0, 40.0, 48, dtype=np.float32), ir.DataType.FLOAT),
    (Rope(base=150000.0, freq_scale=1 / 32, ext_factor=1.0, attn_factor=1.0, n_ctx_orig=4096), 64, None,
     ir.DataType.FLOAT16),  # the offload format's tables
])
def test_rope_tables_in_the_graph_are_rope_caches_to_the_bit(rope, head, factors, act):
    """The RoPE tables a converted model computes from constants (folded by ONNX Runtime when the
    session loads) are rope_cache's, every value of 4,096 positions, bit for bit."""
    from moepass.passes.lower.rope import rope_cache, rope_tables

    builder = types.SimpleNamespace(tape=ir_tape.Tape(), act=act, const=lambda key, array: builder.tape.initializer(
        ir.Tensor(array, name=key), name=key), ints=lambda *v: builder.tape.initializer(
        ir.Tensor(np.array(v, np.int64), name="ints"), name="ints"))
    cos, sin = rope_tables(builder, 4096, head, rope, factors)
    ir.Graph([], [cos, sin], nodes=builder.tape.nodes, initializers=builder.tape.initializers,
             opset_imports={"": 21})
    expected = rope_cache(4096, head, rope, factors)
    dtype = np.float16 if act == ir.DataType.FLOAT16 else np.float32
    for ours, theirs in zip((cos, sin), expected):
        np.testing.assert_array_equal(folded(ours), theirs.astype(dtype))
    assert {n.op_type for n in builder.tape.nodes} >= {"Range", "Mul", "Concat", "Cos", "Sin"}


def test_folded_names_a_value_it_cannot_compute():
    """ir_values.folded on a value that reads a graph input, and on constants ONNX Runtime has no
    kernel for (a hostile model's): one MoepassError naming the value."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    reads_input = ir.node("Cos", [x], name="cos_of_input")
    ints = ir.Value(name="ints", const_value=ir.tensor(np.arange(3, dtype=np.int64), name="ints"))
    no_kernel = ir.node("Cos", [ints], name="cos_of_ints")
    reads_input.outputs[0].name, no_kernel.outputs[0].name = "a", "b"
    ir.Graph([x], [reads_input.outputs[0], no_kernel.outputs[0]], nodes=[reads_input, no_kernel],
             initializers=[ints], opset_imports={"": 21})
    with pytest.raises(moepass.MoepassError, match="value 'a' is not computed from at most 256 nodes on constants"):
        folded(reads_input.outputs[0])
    with pytest.raises(moepass.MoepassError, match="value 'b': ONNX Runtime cannot compute it from its constants"):
        folded(no_kernel.outputs[0])


@pytest.mark.parametrize("omit,message", [
    ({"tensors": ("blk.2.attn_sinks.weight",)}, "missing tensor 'blk.2.attn_sinks.weight'"),
    ({"tensors": ("blk.0.ffn_up_exps.bias",)}, "missing tensor 'blk.0.ffn_up_exps.bias'"),
    ({"keys": ("gpt-oss.attention.sliding_window",)}, "missing metadata key 'gpt-oss.attention.sliding_window'"),
])
def test_gpt_oss_missing_parts_are_named(omit, message, make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="gpt-oss", omit_tensors=omit.get("tensors", ()), omit_keys=omit.get("keys", ()))
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- deepseek2 ----------------------------------------------------------------------------------

def _ops(model, op_type):
    return [n for n in model.graph.node if n.op_type == op_type]


def test_deepseek2_graph_latent_cache_dense_block_and_routing(make_gguf, converted):
    # the graph only: the data file may be shared by a hard link with a model another test placed,
    # which onnx refuses to read (several links: its guard against a planted link)
    model = onnx.load(converted("q4_0", arch="deepseek2") / "model.onnx", load_external_data=False)
    # one QMoE per MoE block: block 0 is dense
    assert [n.name for n in _ops(model, "QMoE")] == ["blk.1.moe", "blk.2.moe"]
    # the compressed cache: one KV head of rank 64 + RoPE 32 per token
    past = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert past["past_key_values.0.key"] == ["batch_size", 1, "past_sequence_length", 96]
    attention = _ops(model, "GroupQueryAttention")[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["rotary_interleaved"]) == (4, 1, 1)
    mscale = 1 + 0.1 * 0.707 * np.log(40.0)  # YaRN x40, mscale_all_dim 0.707 (stored as 0.0707)
    assert attrs["scale"] == pytest.approx(mscale ** 2 / np.sqrt(64), rel=1e-5)
    gqa = next(n for n in load_model(converted("q4_0", arch="deepseek2")).graph if n.op_type == "GroupQueryAttention")
    assert folded(gqa.inputs[7]).shape == (512, 16)  # RoPE over 32 of the 96 head dims
    # sigmoid gating: ONNX Runtime's fused group router
    routers = _ops(model, "MoEGroupRouter")
    assert len(routers) == 2
    r = {a.name: onnx.helper.get_attribute_value(a) for a in routers[0].attribute}
    assert (r["n_group"], r["topk_group"], r["group_topk"], r["top_k"]) == (4, 2, 2, 2)
    assert routers[0].input[1] == "blk.1.exp_probs_b.bias"
    # softmax gating: ONNX ops, the weights not renormalized (the node's output times their sum)
    softmax = onnx.load(converted("q4_0", arch="deepseek2-softmax") / "model.onnx",
                      load_external_data=False)
    assert not _ops(softmax, "MoEGroupRouter") and len(_ops(softmax, "ScatterElements")) == 4
    assert any(n.name == "blk.1.moe.weights_unnormalize" for n in softmax.graph.node)
    features = moepass.inspect(make_gguf("q4_0", arch="deepseek2"))["features"]
    assert features["routing"] == "sigmoid, selection bias when present, best 2 of 4 groups, top-2, renormalized"
    assert features["attention"].startswith("multi-head latent attention: 4 heads, KV rank 64")
    assert features["dense_blocks"] == "the first 1 (ffn 512)"
    assert moepass.inspect(make_gguf("q4_0", arch="deepseek2"))["moe_layers"] == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"omit_tensors": ("blk.1.attn_k_b.weight",)}, "missing tensor 'blk.1.attn_k_b.weight'"),
    ({"omit_tensors": ("blk.0.ffn_up.weight",)}, "missing tensor 'blk.0.ffn_up.weight'"),
    ({"omit_keys": ("deepseek2.attention.kv_lora_rank",)}, "missing metadata key 'deepseek2.attention.kv_lora_rank'"),
    ({"extra_metadata": {"deepseek2.expert_gating_func": 3}}, "'deepseek2.expert_gating_func' is 3"),
    ({"extra_metadata": {"deepseek2.expert_group_count": 3}}, "8 experts in 3 groups"),
])
def test_deepseek2_bad_input_is_named(kwargs, message, make_gguf, tmp_path):
    bad = make_gguf("q4_0", arch="deepseek2", **kwargs)  # extra_metadata overwrites the fixture's value
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# For each Features field: an architecture that sets it, the file that exercises it (make_gguf's
# arguments) and the value it is flipped to. A file a switch needs: qwen2moe without its shared
# width key, sized by its ffn (shared_ff_fallback), per-expert tensors (legacy_experts), LongRoPE
# factors (longrope).
_HALF = make_fixtures.TEST_DIMS.head_dim // 2
SWITCH_CASES = {
    "rope": ("qwen3moe", {}, "norm"),
    "routing": ("qwen3moe", {}, "softmax_topk"),
    "qk_norm": ("olmoe", {}, "head"),
    "shared_expert": ("qwen2moe", {}, "plain"),
    "shared_ff_fallback": ("qwen2moe", {"omit_keys": ("qwen2moe.expert_shared_feed_forward_length",),
                                        "extra_metadata": {"qwen2moe.feed_forward_length": make_fixtures.SHARED_FF}},
                           None),
    "multipliers": ("granitemoe", {}, False),
    "legacy_experts": ("llama", {"legacy_experts": True}, False),
    "ffn_norm": ("gpt-oss", {}, "ffn_norm"),
    "attention_sinks": ("gpt-oss", {}, False),
    "sliding_window": ("gpt-oss", {}, 0),
    "activation": ("gpt-oss", {}, "swiglu"),
    "expert_biases": ("gpt-oss", {}, False),
    "mla": ("deepseek2", {}, False),
    "yarn_log_multiplier": ("deepseek2", {}, False),
    "longrope": ("phimoe", {"longrope": make_fixtures.LongRope(300, np.ones(_HALF, np.float32),
                                                              np.full(_HALF, 4.0, np.float32))}, False),
}


def _graph_signature(path, arch):
    """The lowered graph as text: nodes with their attributes and inputs, initializers with their
    shapes and, where small, values (metadata left out: it describes the switches itself)."""
    import hashlib

    from moepass.core.gguf_reader import GGUFModel
    from moepass.passes import lower_gguf

    graph = lower_gguf(GGUFModel(path), arch).model.graph
    parts = [f"{n.domain}:{n.op_type}({[v.name if v else '' for v in n.inputs]})"
             f"{sorted((k, repr(a.value)) for k, a in n.attributes.items())}" for n in graph]
    for name, value in sorted(graph.initializers.items()):
        tensor = value.const_value
        digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16] if tensor.size < 1 << 16 else ""
        parts.append(f"{name}{tuple(tensor.shape)}{tensor.dtype}{digest}")
    return "\n".join(parts)


@pytest.mark.parametrize("field", list(SWITCH_CASES))
def test_every_feature_switch_changes_the_conversion(field, make_gguf, monkeypatch):
    """A Features field no code reads is a dead switch (as phimoe's norm_bias was): flipping it on a
    file that exercises it changes the lowered graph, or makes the conversion refuse the file.
    (Checked by breaking it: with deepseek2's yarn_log_multiplier read whatever the switch says, this
    fails for yarn_log_multiplier alone.)"""
    import dataclasses

    arch_name, gguf_args, flipped = SWITCH_CASES[field]
    arch = ARCHITECTURES[arch_name]
    assert getattr(arch.features, field) != flipped, (field, "the case must change the value")
    path = make_gguf("q8_0" if arch_name in ("deepseek2",) else "q4_0", arch=arch_name, **gguf_args)
    before = _graph_signature(path, arch)
    changed = dataclasses.replace(arch, features=dataclasses.replace(arch.features, **{field: flipped}))
    try:
        after = _graph_signature(path, changed)
    except (moepass.MoepassError, ValueError, KeyError):
        return  # the switch decides what the file must hold: read
    assert after != before, f"Features.{field} changes nothing in the lowered graph of {arch_name}"


def test_every_feature_switch_has_a_case_and_is_set_somewhere():
    import dataclasses

    from moepass.core.architectures import Features

    assert set(SWITCH_CASES) == {f.name for f in dataclasses.fields(Features)}
    used = {name: {getattr(a.features, name) for a in ARCHITECTURES.values()} for name in SWITCH_CASES}
    assert all(len(values) > 1 for values in used.values()), used  # every switch is set by some architecture


def test_features_refuse_unknown_values():
    from moepass.core.architectures import Features

    with pytest.raises(ValueError, match="routing='softmax_top2'"):
        Features(rope="neox", routing="softmax_top2")
    with pytest.raises(TypeError):
        Features(rope="neox", routing="softmax_topk", norm_bias=True)  # a typo or a dead switch fails loudly
