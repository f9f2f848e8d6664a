"""LongRoPE (Phi-3.5-MoE: rope_factors_short / rope_factors_long) against llama.cpp.

llama.cpp picks one factor set per llama_context, by its size: the long factors at every position
when n_ctx_seq = GGML_PAD(n_ctx, 256) exceeds rope.scaling.original_context_length, else the short
ones (llama_model::get_rope_factors; moepass.core.architectures.Rope.long_factors). Its smallest
context is therefore 256 and the fixture's original context 300: moepass converts at --context
256 (short factors), 280 (long: llama.cpp pads 280 to 512, which is above 300) and 384 (long, over
a prompt with positions on both sides of 300), each compared with llama.cpp at n_ctx = the same
context on the same F32 file: max |logit difference| <= 1e-4, as tests/test_llama_oracle.py holds
every F32 fixture. Measured 2026-12-01: 3.8e-6 (256, 280) and 4.5e-6 (384), prefill and chunked
prefill alike, against 1.4 between the short- and the long-factor models at the same positions, 1.4
for --context 280 built with the short factors (no padding), and 1.3 without the attention factor:
a wrong choice cannot pass.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import make_fixtures
import moepass
from moepass.core.rope import Rope, llama_context_size
from moepass.runtime import load
from support.oracle import F32_TOLERANCE, llama_cpp_module  # test_llama_oracle.py's F32 bound

ORIGINAL = 300
HALF = make_fixtures.TEST_DIMS.head_dim // 2
# Phi-3.5-MoE's context_length (131072) over its original 4096 is 32; here 4096 over 300: the
# converter's attention factor sqrt(1 + ln(s) / ln(original)) = 1.2076
DIMS = dataclasses.replace(make_fixtures.TEST_DIMS, context_length=4096)
_i = np.arange(HALF, dtype=np.float32)
SHORT = (1 + 0.5 * _i / HALF).astype(np.float32)         # 1 .. 1.5, as Phi-3.5's short factors stay near 1
LONG = (16 ** (_i / (HALF - 1))).astype(np.float32)      # 1 .. 16, growing along the dimensions like its long ones
PROMPT = np.random.default_rng(7).integers(0, 300, 384).tolist()


def _gguf(path, short=SHORT, long=LONG, arch="phimoe", preset="f32", **kwargs):
    return make_fixtures.write_moe_gguf(path, preset, DIMS, arch=arch,
                                        longrope=make_fixtures.LongRope(ORIGINAL, short, long, **kwargs))


@pytest.fixture(scope="module")
def longrope_gguf(tmp_path_factory):
    return _gguf(tmp_path_factory.mktemp("longrope") / "phimoe-longrope-f32.gguf")


def _llama_logits(gguf, ids, n_ctx):
    """llama.cpp's logits for one prefill of `ids` in a context of n_ctx (F32 KV cache)."""
    llama_cpp = llama_cpp_module()
    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, type_k=0, type_v=0,
                          n_threads=2, verbose=False)
    try:
        assert llm.n_ctx() == llama_context_size(n_ctx)  # the padding Rope.long_factors assumes
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def _ours(model_dir, ids, split):
    """The converted model's logits for `ids`: one prefill, and a prefill in two chunks at `split`."""
    decoder = load(model_dir)
    whole, _ = decoder.forward(np.array([ids]), decoder.empty_cache())
    first, cache = decoder.forward(np.array([ids[:split]]), decoder.empty_cache())
    rest, _ = decoder.forward(np.array([ids[split:]]), cache)
    return {"prefill": whole[0], "chunked prefill": np.concatenate([first[0], rest[0]])}


@pytest.mark.llama
def test_longrope_matches_llama_cpp_below_and_above_the_original_context(longrope_gguf, tmp_path):
    ours_by_context = {}
    for context, long in ((256, False), (280, True), (384, True)):
        ids = PROMPT[:context]
        result = moepass.convert(longrope_gguf, tmp_path / f"ctx{context}", context=context)
        info = moepass.inspect(result.output_dir)
        scaling = json.loads(info["metadata"]["moepass.features"])["rope_scaling"]
        assert scaling.startswith(f"LongRoPE {'long' if long else 'short'} factors at every position"), scaling
        assert "attention factor 1.2076" in scaling, scaling
        theirs = _llama_logits(longrope_gguf, ids, context)
        for what, ours in _ours(result.output_dir, ids, split=min(context - 8, ORIGINAL - 10)).items():
            diff = float(np.abs(ours - theirs).max())
            assert diff <= F32_TOLERANCE, f"--context {context} {what}: max |logit diff| {diff}"
        ours_by_context[context] = ours
    assert len(PROMPT) > ORIGINAL  # the last comparison had positions on both sides of the original context
    # the two factor sets give different models: a wrong choice could not pass the comparisons
    assert np.abs(ours_by_context[256] - ours_by_context[280][:256]).max() > 100 * F32_TOLERANCE
    # and the long factors hold below the original context too (llama.cpp does not switch per position)
    assert np.abs(ours_by_context[280] - ours_by_context[384][:280]).max() <= F32_TOLERANCE


@pytest.mark.llama
def test_missing_factor_tensor_applies_none_as_llama_cpp(tmp_path):
    """Both tensors are optional in llama.cpp: at a short context, a file with only the long factors
    rotates by plain RoPE (still scaled by the attention factor)."""
    gguf = _gguf(tmp_path / "long-only.gguf", short=None)
    ids = PROMPT[:256]
    result = moepass.convert(gguf, tmp_path / "out", context=256)
    theirs = _llama_logits(gguf, ids, 256)
    diff = float(np.abs(_ours(result.output_dir, ids, split=200)["prefill"] - theirs).max())
    assert diff <= F32_TOLERANCE, f"max |logit diff| {diff}"
    hp = moepass.inspect(gguf)["hparams"]["rope"]
    assert hp["factors_short"] is None and hp["factors_long"] == pytest.approx(LONG.tolist())


def test_long_or_short_by_the_context_as_llama_cpp_sizes_it():
    rope = Rope(base=10000.0, n_ctx_orig=4096, factors_short=(1.0,) * 4, factors_long=(2.0,) * 4)
    assert [llama_context_size(n) for n in (1, 256, 257, 4000, 4096, 4097)] == [256, 256, 512, 4096, 4096, 4352]
    assert not rope.long_factors(4096) and not rope.long_factors(3900) and rope.long_factors(4097)
    assert rope.freq_factors(131072).tolist() == [2.0] * 4 and rope.freq_factors(4096).tolist() == [1.0] * 4
    odd = dataclasses.replace(rope, n_ctx_orig=4000)  # 3900 runs as 4096 > 4000 in llama.cpp
    assert odd.long_factors(3900) and "context 3900, 4096 in llama.cpp, > original 4000" in odd.describe(3900)
    assert rope.describe(8192).startswith("LongRoPE long factors at every position (context 8192 > original 4096")


def test_rope_cache_divides_each_pair_by_its_factor():
    from moepass.passes.lower.rope import rope_cache

    d, factors = 8, np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    rope = Rope(base=10000.0, attn_factor=1.5)
    cos, sin = rope_cache(64, d, rope, factors)
    theta = np.arange(64)[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d) / factors
    np.testing.assert_allclose(cos, 1.5 * np.cos(theta), atol=2e-6)
    np.testing.assert_allclose(sin, 1.5 * np.sin(theta), atol=2e-6)


def test_size_one_dimensions_are_accepted_as_llama_cpp_does(tmp_path):
    """llama.cpp's loader reads a [1, n] tensor where it expects [n] (check_tensor_dims)."""
    gguf = _gguf(tmp_path / "2d.gguf", short=SHORT.reshape(1, HALF), preset="q4_0")
    rope = moepass.inspect(gguf)["hparams"]["rope"]
    assert rope["factors_short"] == pytest.approx(SHORT.tolist())


def _with(index, value):
    bad = SHORT.copy()
    bad[index] = value
    return bad


@pytest.mark.parametrize("short,message", [
    (SHORT[:-1], r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) has shape \[31\], expected \[32\]"),
    (np.stack([SHORT, SHORT]), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) has shape \[2, 32\]"),
    (SHORT.astype(np.float16), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) is F16"),
    (_with(3, 0.0), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) holds 0.0 at index 3"),
    (_with(5, -1.0), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) holds -1.0 at index 5"),
    (_with(0, np.nan), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) holds nan at index 0"),
    (_with(31, np.inf), r"tensor 'rope_factors_short.weight' \(LongRoPE factors\) holds inf at index 31"),
])
def test_malformed_factors_are_refused(short, message, tmp_path):
    bad = _gguf(tmp_path / "bad.gguf", short=short, preset="q4_0")
    for call in (lambda: moepass.inspect(bad), lambda: moepass.convert(bad, tmp_path / "out")):
        with pytest.raises(moepass.MoepassError, match=message):
            call()
    assert not (tmp_path / "out").exists()


def test_malformed_long_factors_are_refused_even_when_the_short_ones_apply(tmp_path):
    bad = _gguf(tmp_path / "bad.gguf", long=LONG[:16], preset="q4_0")
    with pytest.raises(moepass.MoepassError, match=r"tensor 'rope_factors_long.weight' .* has shape \[16\]"):
        moepass.convert(bad, tmp_path / "out", context=256)


def test_longrope_scaling_type_reads_as_llama_cpp_does(tmp_path):
    """llama.cpp knows rope.scaling.type "longrope" (LLAMA_ROPE_SCALING_TYPE_LONGROPE); the phi3 graph
    phimoe uses applies it as "linear": the same model as without the key."""
    plain = moepass.inspect(_gguf(tmp_path / "plain.gguf", preset="q4_0"))["hparams"]["rope"]
    typed = make_fixtures.write_moe_gguf(tmp_path / "typed.gguf", "q4_0", DIMS, arch="phimoe",
                                         extra_metadata={"phimoe.rope.scaling.type": "longrope"},
                                         longrope=make_fixtures.LongRope(ORIGINAL, SHORT, LONG))
    assert moepass.inspect(typed)["hparams"]["rope"] == plain


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_longrope_factors_are_refused_for_other_architectures(arch, tmp_path):
    """llama.cpp's qwen3moe does not load the factors (its loader refuses the extra tensors) and its
    llama (Mixtral) only with rope.scaling.type "longrope", which moepass does not convert there."""
    bad = _gguf(tmp_path / "bad.gguf", arch=arch, preset="q4_0")
    refusal = rf"tensor 'rope_factors_short\.weight' holds LongRoPE frequency factors, which moepass converts " \
        rf"for phimoe only \(not for {arch}\)"
    with pytest.raises(moepass.MoepassError, match=refusal):
        moepass.convert(bad, tmp_path / "out")
