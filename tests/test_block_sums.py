"""Block-sum features (passes/lower/block_sums.py, quants.pack_with_sums): gate and up of an affine
GGUF type (value = s u - m per block) kept in a symmetric QMoE form, the minimums through the block
sums of the node's input.

The bound is the arithmetic's own: the file's codes with their own scale carry every value exactly
but for the block's correction, which the levels hold to within half the last level's step (codes
rounded to nearest at an absmax scale rounded up, so none is clipped); the rest is the float32
rounding of the file's own value (one unit in the last place of the largest value of the block),
which the least-squares correction spreads over the block."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize

import make_fixtures
import moepass
from moepass.core.quants import QUANT_TYPES, BlockForm, pack, sums_fit, unpack_values
from support.stored import stored_matrices, with_block_sums

# (type, node bits, node block): the types with affine codes in each form they take
CASES = [(GT.Q4_K, 4, 32), (GT.Q4_K, 4, 16), (GT.Q4_K, 8, 32), (GT.Q4_1, 4, 32), (GT.Q4_1, 8, 32), (GT.Q2_K, 4, 16),
         (GT.Q5_K, 8, 32), (GT.Q5_1, 8, 32)]


def _raw(ggml_type: GT, rows: int = 24, k: int = 1024, seed: int = 0) -> np.ndarray:
    return make_fixtures._tensor_data(np.random.default_rng(seed), (rows, k), ggml_type, std=0.05)[0]


@pytest.mark.parametrize("ggml_type,bits,block", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_features_hold_the_files_values_within_the_last_levels_half_step(ggml_type, bits, block):
    qt, raw = QUANT_TYPES[ggml_type], _raw(ggml_type)
    reference = gguf_dequantize(raw, ggml_type).astype(np.float32)
    k = reference.shape[-1]
    fit = sums_fit(raw, qt, BlockForm(bits, block), half_scales=False)
    levels = fit.levels()
    form = BlockForm(bits, block, sums=levels)
    packed = pack(raw, qt, form)
    assert packed.weights.shape == (len(raw), form.width(k) * bits // 8)
    values = with_block_sums(unpack_values(packed.weights, packed.scales, form.plain).astype(np.float64), form)
    error = np.abs(values - reference.astype(np.float64))
    stride = form.feature_stride(k) // block  # scale blocks a level takes; feature j is in block j // block
    first = k // block + (levels - 1) * stride
    last = np.repeat(packed.scales[:, first: first + stride], block, axis=-1)[:, : k // block]
    spacing = np.spacing(np.abs(reference)).reshape(len(raw), -1, block).max(axis=-1)
    bound = 0.5 * last.astype(np.float64) + spacing
    assert (error.reshape(len(raw), -1, block).max(axis=-1) <= bound).all()
    # what the report records is what the stored values give, and the levels meet their target
    assert packed.error_sq == pytest.approx(float(np.sum(np.square(values - reference))), rel=1e-6)
    assert fit.errors[levels] <= fit.own / 256 or levels == len(fit.errors) - 1
    assert all(a >= b for a, b in zip(fit.errors, fit.errors[1:]))  # each level holds what the last left


def test_float16_scales_add_only_their_rounding():
    """With float16 scales (every QMoE of a float16 graph) the file's scale is rounded; the block's
    mean of that rounding moves into its correction, so what is left is (s - fp16(s)) (u - mean u)
    per element, within the same levels' bound."""
    qt, raw = QUANT_TYPES[GT.Q4_K], _raw(GT.Q4_K, seed=1)
    reference = gguf_dequantize(raw, GT.Q4_K).astype(np.float64)
    fit = sums_fit(raw, qt, BlockForm(4, 32), half_scales=True)
    form = BlockForm(4, 32, sums=fit.levels())
    packed = pack(raw, qt, form, half_scales=True)
    assert (packed.scales.astype(np.float16).astype(np.float32) == packed.scales).all()
    values = with_block_sums(unpack_values(packed.weights, packed.scales, form.plain).astype(np.float64), form)
    rel = np.sqrt(np.sum(np.square(values - reference)) / np.sum(np.square(reference)))
    assert rel == pytest.approx(packed.rel_rms_error, rel=1e-6) and rel < 2 ** -10


def test_a_source_without_affine_codes_beside_affine_ones():
    """A Q4_0 gate beside a Q4_K up: its own exact codes, its correction columns zero."""
    qt, raw = QUANT_TYPES[GT.Q4_0], _raw(GT.Q4_0)
    form = BlockForm(4, 32, sums=2)
    packed = pack(raw, qt, form)
    k = gguf_dequantize(raw, GT.Q4_0).shape[-1]
    assert packed.exact and (packed.scales[:, k // 32:] == 0).all()
    values = with_block_sums(unpack_values(packed.weights, packed.scales, form.plain), form)
    np.testing.assert_array_equal(values, gguf_dequantize(raw, GT.Q4_0).astype(np.float32))


def test_a_converted_layer_computes_the_weights_it_stores(make_gguf, tmp_path):
    """A Q4_K gate and up beside an exact Q4_0 down, every expert 4 bits (int4/b32 with block-sum
    features): the stored gate and up are the file's within the levels' remainder, the down bit for
    bit; ONNX Runtime's QMoE over the widened input, then the Slice, computes what a float64 forward
    of those stored weights does (tests/support/reference_forward.py, float activations), as closely
    as a model whose every expert moves exactly (Q4_0) agrees with its own file."""
    from gguf import GGUFReader

    from moepass.core.moe_nodes import moe_nodes
    from support.reference_forward import Qwen3MoeReference

    ids = np.random.default_rng(7).integers(0, 250, 24)

    def agreement(gguf, out, **options):
        result = moepass.convert(gguf, out, activations="float", **options)
        stored = {name: values for values, name in stored_matrices(out)}
        reference = Qwen3MoeReference(make_fixtures.rewrite_gguf(gguf, out.with_suffix(".gguf"), stored)).logits(ids)
        decoder = moepass.load(out)
        ours = decoder.forward(ids[None], decoder.empty_cache())[0][0].astype(np.float64)
        return result, stored, np.abs(ours - reference).max() / np.abs(reference).max()

    gguf = make_gguf("q8_0", types={"gate_up": GT.Q4_K, "down": GT.Q4_0})
    result, stored, error = agreement(gguf, tmp_path / "sums", expert_format="int4")
    assert {m["form"][:15] for m in result.moe_layers} == {"int4/b32+sums x"}
    source = {t.name: gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
              for t in GGUFReader(gguf).tensors}
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
        rel = np.linalg.norm(stored[name] - source[name]) / np.linalg.norm(source[name])
        assert 0 < rel < 2 ** -10, (name, rel)
    np.testing.assert_array_equal(stored["blk.0.ffn_down_exps.weight"], source["blk.0.ffn_down_exps.weight"])
    moe = moe_nodes(__import__("onnx_ir").load(tmp_path / "sums" / "model.onnx").graph)[0]
    assert moe.hidden == 256 and moe.width > moe.hidden  # the fixture's hidden; widened by the features
    _, _, exact_error = agreement(make_gguf("q8_0", types={"gate_up": GT.Q4_0, "down": GT.Q4_0}), tmp_path / "exact")
    assert error <= 4 * exact_error, (error, exact_error)
