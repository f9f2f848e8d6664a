"""Every exact repack, bit for bit against the gguf package's dequantization; requantization bounds."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize

import make_fixtures
from moepass.core.errors import MoepassError
from moepass.core.quants import (QUANT_TYPES, _block_absmax, _block_min_max, REQUANTIZE_FORM, BlockForm, choose_expert_form, pack, pack_codes,
                                 pack_zero_points, quant_type, unpack_codes, unpack_values)

BLOCK_TYPES = [t for t, qt in QUANT_TYPES.items() if qt.storage == "blocks"]


def _random_raw(ggml_type: GT, rows: int = 6, row_blocks: int = 3, seed: int = 0) -> np.ndarray:
    """Random blocks with every code value present, including the extreme ones."""
    rng = np.random.default_rng(seed)
    k = GGML_QUANT_SIZES[ggml_type][0] * row_blocks
    raw = make_fixtures._tensor_data(rng, (rows, k), ggml_type, std=0.05)[0]
    if ggml_type == GT.Q8_0:
        raw.reshape(-1, 34)[0, 2:4] = [0x80, 0x7F]  # codes -128 and 127
    return raw


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_exact_forms_are_bit_exact(ggml_type):
    qt = QUANT_TYPES[ggml_type]
    raw = _random_raw(ggml_type)
    reference = gguf_dequantize(raw, ggml_type).astype(np.float32)
    assert qt.exact_forms(), f"{ggml_type.name} has no exact form"
    for form in qt.exact_forms():
        packed = pack(raw, qt, form)
        assert packed.exact and packed.rel_rms_error == 0.0
        assert packed.weights.dtype == np.uint8 and packed.scales.dtype == np.float32
        assert packed.weights.shape == (*raw.shape[:-1], reference.shape[-1] * form.bits // 8)
        np.testing.assert_array_equal(_bits(unpack_values(packed.weights, packed.scales, form)), _bits(reference),
                                      err_msg=f"{ggml_type.name} -> {form}")


def test_exact_form_table():
    forms = {t.name: {str(f) for f in QUANT_TYPES[t].exact_forms()} for t in BLOCK_TYPES}
    assert forms["Q8_0"] == {"int8/b32", "int8/b16"}
    assert forms["Q4_0"] == {"int4/b32", "int4/b16", "int8/b32", "int8/b16"}
    assert forms["Q6_K"] == {"int8/b16"}
    assert forms["Q5_0"] == {"int8/b32", "int8/b16"}
    assert forms["IQ4_NL"] == {"int8/b32", "int8/b16"}
    assert forms["MXFP4"] == {"int8/b32", "int8/b16"}


def test_pack_codes_layout():
    codes = np.array([[-8, 7, 0, -1]], dtype=np.int8)
    packed = pack_codes(codes, BlockForm(4, 16))
    # element 2j in the low nibble, 2j+1 in the high nibble, zero point 8
    assert packed.tolist() == [[0 | (15 << 4), 8 | (7 << 4)]]
    np.testing.assert_array_equal(unpack_codes(packed, BlockForm(4, 16)), codes)
    assert pack_codes(codes, BlockForm(8, 16)).tolist() == [[120, 135, 128, 127]]


@pytest.mark.parametrize("ggml_type,form,bound", [(GT.Q4_K, BlockForm(8, 32), 0.01), (GT.Q4_K, BlockForm(8, 16), 0.01),
                                                   (GT.Q6_K, BlockForm(4, 32), 0.12), (GT.F32, BlockForm(4, 32), 0.12)])
def test_requantization_error_is_measured(ggml_type, form, bound):
    rng = np.random.default_rng(1)
    if ggml_type == GT.F32:
        raw = rng.standard_normal((4, 256)).astype(np.float32).view(np.uint8)
    else:
        raw = make_fixtures.random_blocks(rng, ggml_type, (4, 256), std=0.05)
    qt = QUANT_TYPES[ggml_type]
    packed = pack(raw, qt, form)
    assert not packed.exact
    reference = gguf_dequantize(raw, ggml_type).astype(np.float64)
    restored = unpack_values(packed.weights, packed.scales, form)
    measured = np.linalg.norm(restored - reference) / np.linalg.norm(reference)
    # 8-bit forms take the error per block from the float32 moments (sum x^2 - 2 s sum xq + s^2 sum q^2),
    # which carries the moments' rounding: measured 2e-5 - 7e-5 relative; 4-bit forms sum the residuals
    assert packed.rel_rms_error == pytest.approx(measured, rel=2e-4 if form.bits == 8 else 1e-5)
    assert 0 < packed.rel_rms_error < bound


def test_expert_form_choice():
    q80, q40, q6k, q4k = (QUANT_TYPES[t] for t in (GT.Q8_0, GT.Q4_0, GT.Q6_K, GT.Q4_K))
    assert choose_expert_form([q40, q40, q40]) == BlockForm(4, 32)
    assert choose_expert_form([q80, q80, q80]) == BlockForm(8, 32)
    assert choose_expert_form([q40, q40, q80]) == BlockForm(8, 32)      # Q4_0 fits int8 exactly too
    assert choose_expert_form([q4k, q4k, q6k]) == BlockForm(8, 16)      # Q4_K_M: keep Q6_K exact
    assert choose_expert_form([q80, q80, q6k]) == BlockForm(8, 16)      # Q8_0 splits into 16-blocks exactly
    assert choose_expert_form([q4k, q4k, q4k]) == REQUANTIZE_FORM


def test_unsupported_type_names_the_tensor():
    with pytest.raises(MoepassError, match=r"tensor 'blk.0.ffn_up_exps.weight' has type TQ1_0"):
        quant_type(GT.TQ1_0, "blk.0.ffn_up_exps.weight")


@pytest.mark.parametrize("ggml_type", [t for t in BLOCK_TYPES if QUANT_TYPES[t].direct], ids=lambda t: t.name)
def test_direct_repacks_equal_the_generic_path(ggml_type):
    qt = QUANT_TYPES[ggml_type]
    raw = _random_raw(ggml_type, rows=16, row_blocks=8, seed=3)
    for bits, direct in qt.direct.items():
        form = BlockForm(bits, qt.native_block)
        expected = pack_codes(qt.decode(raw)[0], form)
        out = np.zeros((raw.shape[0], 2, expected.shape[-1]), dtype=np.uint8)  # a strided destination
        direct(raw, out[:, 1])
        np.testing.assert_array_equal(out[:, 1], expected)
        assert not out[:, 0].any()


@pytest.mark.parametrize("ggml_type", [GT.Q4_K, GT.Q5_K, GT.Q2_K], ids=lambda t: t.name)
def test_zero_points_lower_the_int4_error_and_are_reported_truly(ggml_type):
    rng = np.random.default_rng(2)
    raw = make_fixtures._tensor_data(rng, (64, 512), ggml_type, std=0.05)[0]
    qt, form = QUANT_TYPES[ggml_type], BlockForm(4, 32)
    symmetric = pack(raw, qt, form)
    zeros = np.empty((64, 16), np.uint8)
    with_zero_points = pack(raw, qt, form, zero_points=zeros)
    assert with_zero_points.rel_rms_error < 0.8 * symmetric.rel_rms_error
    restored = unpack_values(with_zero_points.weights, with_zero_points.scales, form, pack_zero_points(zeros, form))
    reference = gguf_dequantize(raw, ggml_type).astype(np.float64)
    measured = np.linalg.norm(restored - reference) / np.linalg.norm(reference)
    assert with_zero_points.rel_rms_error == pytest.approx(measured, rel=1e-4)


def test_block_extremes_by_integer_reduction_equal_numpy():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((50, 8, 32)) * np.exp(rng.uniform(-20, 20, (50, 8, 1)))).astype(np.float32)
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[0, 2, :] = -np.abs(x[0, 2])                      # all negative
    x[0, 3, 5], x[0, 4, 7] = np.inf, -np.inf
    x[0, 5, 9] = np.float32(1e-45)                    # subnormals
    x[0, 6, :] = -np.float32(1e-45)
    lo, hi = _block_min_max(x)
    assert np.array_equal(lo, x.min(axis=-1)) and np.array_equal(hi, x.max(axis=-1))
    assert np.array_equal(_block_absmax(x), np.abs(x).max(axis=-1))


def _q4_k_blocks(rng, n_blocks: int, zero_points: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks whose 8 sub-blocks have zero point dmin * m / (d * sc) = zero_points exactly
    (dmin = d, m = sc * z), random codes; the 6-bit scales/mins packed as ggml's get_scale_min reads them."""
    sc = rng.integers(1, 7, (n_blocks, 8)).astype(np.uint8)
    mins = (sc * zero_points.reshape(n_blocks, 8)).astype(np.uint8)
    d = np.full((n_blocks, 1), 0.01, np.float16).view(np.uint8).reshape(n_blocks, 2)
    packed = np.empty((n_blocks, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    qs = rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)
    return np.concatenate([d, d, packed, qs], axis=1)


@pytest.mark.parametrize("ggml_type", [GT.Q4_K, GT.Q4_1])
def test_int4_keeps_the_files_own_codes(ggml_type):
    """Q4_K / Q4_1 into int4 block 32 with zero points: the file's 4-bit codes are kept, the zero point
    is offset / scale rounded; where that is an integer the values come out exact (to float32
    rounding of the scale products), and the reported error is the error of the stored values."""
    from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

    rng = np.random.default_rng(3)
    rows, k = 6, 512
    if ggml_type == GT.Q4_K:
        raw = _q4_k_blocks(rng, rows * k // 256, rng.integers(0, 10, rows * k // 32)).reshape(rows, -1)
    else:  # gguf's own Q4_1 quantizer: m = block min, d = range / 15, so the zero point -m/d is in range
        raw = gguf_quantize(rng.standard_normal((rows, k)).astype(np.float32), ggml_type)
    qt, form = QUANT_TYPES[ggml_type], BlockForm(4, 32)
    values = gguf_dequantize(raw, ggml_type).reshape(rows, k)
    zero_points = np.empty((rows, k // 32), np.uint8)
    packed = pack(raw, qt, form, zero_points=zero_points)
    own, _, _ = qt.own_codes(raw)
    np.testing.assert_array_equal(unpack_codes(packed.weights, form) + form.zero_point, own)   # codes kept
    stored = unpack_values(packed.weights, packed.scales, form, pack_zero_points(zero_points, form))
    error = np.linalg.norm(stored - values) / np.linalg.norm(values)
    assert packed.rel_rms_error == pytest.approx(error, rel=1e-3, abs=1e-7)
    if ggml_type == GT.Q4_K:
        assert error < 1e-6
    else:
        assert error < 0.08   # the zero point's rounding: at most half a step per block
