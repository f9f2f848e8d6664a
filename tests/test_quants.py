"""Every exact repack, bit for bit against the gguf package's dequantization; the requantizer against
an independent numpy statement of its algorithm; the form policy."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

import cpu_family
import make_fixtures
from moepass.core.errors import MoepassError
from moepass.core.quants import (QMOE_CPU_HELD, QUANT_TYPES, BlockForm, expert_form, matrix_form, pack, pack_codes,
                                 quant_type, quantize_values, scales_in_float16, unpack_codes, unpack_values)

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
    assert forms["Q3_K"] == {"int4/b16", "int8/b16"}  # symmetric codes -4..3 in blocks of 16
    assert forms["Q5_0"] == {"int8/b32", "int8/b16"}
    assert forms["IQ4_NL"] == {"int8/b32", "int8/b16"}
    assert forms["IQ4_XS"] == {"int8/b32", "int8/b16"}
    assert forms["MXFP4"] == {"int8/b32", "int8/b16"}


def test_pack_codes_layout():
    codes = np.array([[-8, 7, 0, -1]], dtype=np.int8)
    packed = pack_codes(codes, BlockForm(4, 16))
    # element 2j in the low nibble, 2j+1 in the high nibble, zero point 8
    assert packed.tolist() == [[0 | (15 << 4), 8 | (7 << 4)]]
    np.testing.assert_array_equal(unpack_codes(packed, BlockForm(4, 16)), codes)
    assert pack_codes(codes, BlockForm(8, 16)).tolist() == [[120, 135, 128, 127]]


@pytest.mark.parametrize("ggml_type,form,bound", [(GT.Q4_K, BlockForm(8, 128), 0.02), (GT.Q4_K, BlockForm(8, 32), 0.01),
                                                   (GT.Q2_K, BlockForm(8, 128), 0.02), (GT.Q6_K, BlockForm(4, 32), 0.12),
                                                   (GT.F32, BlockForm(4, 32), 0.12), (GT.F32, BlockForm(8, 0), 0.02)])
def test_requantization_error_is_measured(ggml_type, form, bound):
    rng = np.random.default_rng(1)
    if ggml_type == GT.F32:
        raw = rng.standard_normal((4, 256)).astype(np.float32).view(np.uint8)
    else:
        raw = make_fixtures._tensor_data(rng, (4, 256), ggml_type, std=0.05)[0]
    qt = QUANT_TYPES[ggml_type]
    packed = pack(raw, qt, form)
    assert not packed.exact
    reference = gguf_dequantize(raw, ggml_type).astype(np.float64)
    restored = unpack_values(packed.weights, packed.scales, form)
    measured = np.linalg.norm(restored - reference) / np.linalg.norm(reference)
    assert packed.rel_rms_error == pytest.approx(measured, rel=1e-5)
    assert 0 < packed.rel_rms_error < bound


def _numpy_symmetric(x: np.ndarray, bits: int, block: int, weights: np.ndarray | None = None) -> tuple:
    """The requantizer's algorithm stated in numpy, block by block (float64 sums): 8 bits: codes of
    the absmax scale / 127 and the least-squares scale for them; 4 bits: for each scale max / -(8 + d),
    d in -0.8 .. 0.8 by 0.2 (max the block's value of largest magnitude), round, refit, re-round,
    refit, keep the least weighted error (the first of equals)."""
    blocks = x.reshape(-1, block).astype(np.float32)
    w = np.ones_like(blocks) if weights is None else np.broadcast_to(weights, x.shape).reshape(-1, block)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes, scales = np.zeros(blocks.shape, np.int64), np.zeros(len(blocks), np.float32)

    def fit(b, scale):
        inverse = np.float32(0) if scale == 0 else np.float32(1) / np.float32(scale)
        q = np.clip(np.rint(blocks[b] * inverse), lo, hi)
        xq, qq = np.sum(w[b] * blocks[b].astype(np.float64) * q), np.sum(w[b] * q.astype(np.float64) * q)
        return (np.float32(xq / qq) if qq > 0 else np.float32(0)), q, xq, qq

    for b in range(len(blocks)):
        extreme = blocks[b][np.argmax(np.abs(blocks[b]))]
        if bits == 8:
            scales[b], codes[b], _, _ = fit(b, np.abs(extreme) / np.float32(127))
            continue
        best = np.inf
        for d in np.arange(-4, 5, dtype=np.float32) * np.float32(0.2):
            s, _, _, _ = fit(b, extreme / -(np.float32(8) + d))
            s, q, xq, qq = fit(b, s)
            e = np.sum(w[b] * blocks[b].astype(np.float64) ** 2) - 2.0 * s * xq + np.float64(s) * s * qq
            if e < best:
                best, scales[b], codes[b] = e, s, q
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("bits,block", [(4, 32), (4, 16), (8, 128), (8, 32)])
@pytest.mark.parametrize("weighted", [False, True])
def test_requantizer_is_its_algorithm(bits, block, weighted):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((12, 256)) * np.exp(rng.uniform(-3, 3, (12, 1)))).astype(np.float32)
    x[0, :block] = 0.0                                      # an all-zero block: scale 0, codes 0
    weights = rng.uniform(0.1, 2.0, 256).astype(np.float32) if weighted else None
    form = BlockForm(bits, block)
    packed = quantize_values(x, form, weights)
    codes, scales = _numpy_symmetric(x, bits, block, weights)
    np.testing.assert_array_equal(unpack_codes(packed.weights, form), codes)
    np.testing.assert_array_equal(packed.scales, scales)
    assert packed.scales[0, 0] == 0 and (unpack_codes(packed.weights, form)[0, :block] == 0).all()


@pytest.mark.parametrize("block", [32, 16])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_search_keeps_its_bits_whatever_blocks_it_is_given_together(block, weighted):
    """The 4-bit search runs blocks in groups (quant_kernels.GROUP): 7 rows of 96 values (21 or 42
    blocks, a group's tail in each call) quantized whole, row by row and 5 rows at a time give the
    algorithm's codes and scales and the same error sums, in any grouping."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((7, 96)) * np.exp(rng.uniform(-3, 3, (7, 1)))).astype(np.float32)
    weights = rng.uniform(0.1, 2.0, 96).astype(np.float32) if weighted else None
    form = BlockForm(4, block)
    whole = quantize_values(x, form, weights)
    codes, scales = _numpy_symmetric(x, 4, block, weights)
    np.testing.assert_array_equal(unpack_codes(whole.weights, form), codes)
    np.testing.assert_array_equal(whole.scales, scales)
    for step in (1, 5):
        parts = [quantize_values(x[r:r + step], form, weights) for r in range(0, 7, step)]
        np.testing.assert_array_equal(np.concatenate([p.weights for p in parts]), whole.weights)
        np.testing.assert_array_equal(np.concatenate([p.scales for p in parts]), whole.scales)
        restored = codes * np.repeat(scales.astype(np.float64), block, axis=-1)  # as the kernel measures
        assert sum(p.error_sq for p in parts) == pytest.approx(np.sum((restored - x) ** 2), rel=1e-12)


def test_scale_search_beats_the_absmax_scale_and_importance_moves_the_error():
    """Gaussian weights at int4 block 32: the search lowers the error below that of the gguf
    package's Q4_0 quantizer (the absmax scale; measured 0.943x); an importance matrix lowers the
    weighted error at the cost of the plain one."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    form = BlockForm(4, 32)
    searched = quantize_values(x, form)
    absmax = gguf_dequantize(gguf_quantize(x, GT.Q4_0), GT.Q4_0)
    assert searched.rel_rms_error < 0.96 * np.linalg.norm(absmax - x) / np.linalg.norm(x)
    importance = np.where(np.arange(512) % 7 == 0, 100.0, 1.0).astype(np.float32)
    weighted = quantize_values(x, form, importance)

    def weighted_error(p):
        return float(np.sum(importance * (unpack_values(p.weights, p.scales, form) - x) ** 2))
    assert weighted_error(weighted) < 0.9 * weighted_error(searched)
    assert weighted.rel_rms_error > searched.rel_rms_error


_DIGEST = """
import hashlib, sys, numpy as np
from moepass.core.quants import BlockForm, quantize_values
x = (np.random.default_rng(6).standard_normal((256, 512)) * np.exp(np.random.default_rng(7).uniform(-8, 8, (256, 1)))
     ).astype(np.float32)
digest = hashlib.sha256()
for form in (BlockForm(4, 32), BlockForm(8, 128), BlockForm(8, 32)):
    p = quantize_values(x, form)
    digest.update(p.weights.tobytes()); digest.update(p.scales.tobytes())
print(digest.hexdigest())
"""


def test_requantized_bytes_do_not_depend_on_the_cpu(tmp_path):
    """The compiled requantizer adds its sums in SIMD order only where every term is exact, so the
    bytes are the same whichever vector instructions the CPU has: natively and with AVX-512 hidden
    (tests/cpu_family.py), in fresh interpreters (numba compiles for the CPU it sees)."""
    library, why = cpu_family.avx2_only_preload()
    if library is None:
        pytest.skip(f"no AVX2-only run here: {why}")
    runs = [subprocess.run([sys.executable, "-c", _DIGEST], capture_output=True, text=True, env=env, cwd=tmp_path)
            for env in (None, cpu_family.avx2_only_env())]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout


def test_expert_form_choice():
    q80, q40, q6k, q4k, iq4xs, q2k, q3k, q5k, q41 = (
        QUANT_TYPES[t] for t in (GT.Q8_0, GT.Q4_0, GT.Q6_K, GT.Q4_K, GT.IQ4_XS, GT.Q2_K, GT.Q3_K, GT.Q5_K, GT.Q4_1))
    ks = [2048, 768]

    def form(types, *args, **kwargs):
        return str(expert_form(types, *args, **kwargs))

    assert form([q40, q40, q40], ks) == "int4/b32"                 # exact
    assert form([q80, q80, q80], ks) == "int8/b32"                 # exact
    assert form([q40, q40, q80], ks) == "int8/b32"                 # Q4_0 fits int8 exactly too
    assert form([iq4xs] * 3, ks) == "int8/b32"                     # exact: codebook values x d (ls - 32)
    assert form([q4k, q4k, q4k], ks) == "int8/b128"                # a 4-bit Q4_K down costs KLD: 8 bits
    assert form([q4k, q4k, q6k], ks) == "int8/b128"                # Q4_K_M's Q6_K-down layers too
    assert form([q3k, q3k, q4k], ks) == "int4/b16"                 # beside 3.4-bit gate and up, a 4-bit down
    assert form([q6k] * 3, ks) == "int8/b128"                      # Q6_K's exact form is block 16 ...
    assert form([q6k] * 3, ks, exact=True) == "int8/b16"           # ... kept when asked
    assert form([q3k] * 3, ks) == "int4/b16"                       # Q3_K: symmetric, exact at block 16
    assert form([q2k, q2k, q3k], ks) == "int4/b16+sums"            # Q2_K: its codes and minimums kept, Q3_K exact
    assert form([q3k] * 3, [256, 40]) == "int8/row"                # no block divides both K: one scale per row
    assert form([q5k] * 3, ks) == "int8/b32+sums"                  # 5-bit codes with minimums: kept at 8 bits
    assert form([q41] * 3, ks) == "int8/b32+sums"
    assert form([q4k, q4k, q6k], ks, "int4") == "int4/b32+sums"    # every expert 4 bits
    assert form([q6k] * 3, ks, "int4") == "int4/b32"               # 4-bit requantization at block 32, not 128
    assert form([q40] * 3, ks, "int8") == "int8/b32"
    assert form([q80] * 3, ks, "offload") == "int4/b32"
    assert form([q4k, q4k, q6k], ks, "offload") == "int4/b32+sums"


def test_matrix_form_choice():
    q4k, q41, q6k, q80, q5k, f16 = (QUANT_TYPES[t] for t in (GT.Q4_K, GT.Q4_1, GT.Q6_K, GT.Q8_0, GT.Q5_K, GT.F16))
    assert matrix_form(q4k, 2048) == matrix_form(q41, 2048) == BlockForm(4, 32, offsets=True)
    assert matrix_form(q4k, 2048, offsets=False) == BlockForm(8, 128)    # GatherBlockQuantized: no offsets
    assert matrix_form(q6k, 2048) == BlockForm(8, 128) and matrix_form(q6k, 2048, exact=True) == BlockForm(8, 16)
    assert matrix_form(q80, 2048) == BlockForm(8, 32) and matrix_form(q5k, 768) == BlockForm(8, 32)
    assert matrix_form(f16, 2048) is None
    assert str(BlockForm(4, 32, offsets=True)) == "int4/b32+offsets"


def test_float16_scales_where_they_hold_no_more_and_keep_exact_forms_exact():
    q80, q6k, q4k, iq4xs = (QUANT_TYPES[t] for t in (GT.Q8_0, GT.Q6_K, GT.Q4_K, GT.IQ4_XS))
    assert not scales_in_float16([q80] * 3, BlockForm(8, 32))       # exact either way, held twice at 32
    assert not scales_in_float16([q6k] * 3, BlockForm(8, 16))       # d * sc would round
    assert not scales_in_float16([iq4xs] * 3, BlockForm(8, 32))     # d * (ls - 32) would round
    assert scales_in_float16([q4k, q4k, q6k], BlockForm(8, 128))    # requantized anyway, block 128
    assert not scales_in_float16([q4k, q4k, q6k], BlockForm(4, 32))
    assert scales_in_float16([q80] * 3, BlockForm(4, 128))


@pytest.mark.parametrize("form", sorted({f for f, _ in QMOE_CPU_HELD}, key=str))
def test_float16_scales_only_where_onnx_runtime_holds_no_more_for_them(form):
    """The rule agrees with what ONNX Runtime's CPU QMoE was measured to hold (QMOE_CPU_HELD), at
    both accuracy levels: float16 scales where they take no more memory than float32 ones (within
    the table's 1 %: a tie goes to the smaller file), float32 where float16 would take more."""
    requantized = [QUANT_TYPES[GT.Q4_K]] * 3  # no exact form: the memory alone decides
    half_bytes = form.bits * form.block_size / 8 + 2
    full_bytes = form.bits * form.block_size / 8 + 4
    for level in (0, 1):
        half = QMOE_CPU_HELD[(form, "float16")][level] * half_bytes
        full = QMOE_CPU_HELD[(form, "float32")][level] * full_bytes
        assert scales_in_float16(requantized, form) == (half <= 1.01 * full), (form, level, half, full)


@pytest.mark.parametrize("ggml_type", [GT.Q4_K, GT.Q4_1])
def test_block_offsets_keep_the_files_values(ggml_type):
    """Q4_K / Q4_1 with block offsets: the file's codes, scales and minimums, the values bit for bit
    (blocks as a quantizer makes them: gguf's own for Q4_1, random valid ones for Q4_K)."""
    rng = np.random.default_rng(3)
    if ggml_type == GT.Q4_1:
        raw = gguf_quantize(rng.standard_normal((6, 512)).astype(np.float32), ggml_type)
    else:
        raw = make_fixtures.random_blocks(rng, ggml_type, (6, 512), std=0.05)
    qt, form = QUANT_TYPES[ggml_type], BlockForm(4, 32, offsets=True)
    packed = pack(raw, qt, form)
    own, _, _ = qt.own_codes(raw)
    np.testing.assert_array_equal(unpack_codes(packed.weights, form) + form.zero_point, own)   # codes kept
    values = unpack_values(packed.weights, packed.scales, form, offsets=packed.offsets)
    np.testing.assert_array_equal(_bits(values), _bits(gguf_dequantize(raw, ggml_type)))
    assert packed.exact and packed.error_sq == 0


@pytest.mark.parametrize("exponents", [(-12, -4), (-24, -14), (-4, 8)], ids=["typical", "subnormal", "large"])
def test_compiled_q4_k_offsets_equal_the_numpy_definition(exponents):
    """The compiled Q4_K packer (quant_kernels.q4_k_offsets) writes the bits of pack_with_offsets'
    numpy path into strided destinations, with its exact verdict and error sums. d and dmin are
    drawn per block over a range of binary exponents, so that for some blocks s (u - 8) + 8 s - m
    rounds differently from s u - m (inexact blocks: the error is compared too)."""
    import dataclasses

    rng = np.random.default_rng(11)
    raw = make_fixtures.random_blocks(rng, GT.Q4_K, (24, 1024), std=0.05)
    blocks = raw.reshape(-1, 144)
    for field in (0, 2):
        values = np.ldexp(rng.uniform(0.5, 1.0, len(blocks)), rng.integers(*exponents, len(blocks)))
        blocks[:, field : field + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    qt, form = QUANT_TYPES[GT.Q4_K], BlockForm(4, 32, offsets=True)
    results = []
    for table in (qt, dataclasses.replace(qt, own_codes_kernel=None)):
        codes = np.zeros((24, 2, 512), np.uint8)
        scales, offsets = np.zeros((24, 2, 32), np.float32), np.zeros((24, 2, 32), np.float32)
        packed = pack(raw, table, form, codes[:, 1], scales[:, 1], offsets=offsets[:, 1])
        assert not codes[:, 0].any() and not scales[:, 0].any() and not offsets[:, 0].any()
        results.append((codes, scales, offsets, packed))
    (c1, s1, o1, p1), (c2, s2, o2, p2) = results
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(s1.view(np.uint32), s2.view(np.uint32))
    np.testing.assert_array_equal(o1.view(np.uint32), o2.view(np.uint32))
    assert p1.exact == p2.exact
    assert p1.error_sq == pytest.approx(p2.error_sq, rel=1e-9, abs=0)
    assert p1.reference_sq == pytest.approx(p2.reference_sq, rel=1e-6)


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
