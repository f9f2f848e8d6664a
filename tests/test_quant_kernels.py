"""The compiled dequantizers, bit for bit against the gguf package's, on random valid blocks."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize

from moepass.core import quant_kernels
from moepass.core.quants import QUANT_TYPES

# Byte offsets of each type's fp16 scales in its block (ggml's block structs). MXFP4 has an e8m0
# exponent byte at 0 instead; IQ1_M's fp16 scale is spread over the top nibbles of bytes 49..55.
FP16_FIELDS = {
    GT.Q8_0: (0,), GT.Q4_0: (0,), GT.Q5_0: (0,), GT.IQ4_NL: (0,), GT.MXFP4: (), GT.Q6_K: (208,),
    GT.Q4_1: (0, 2), GT.Q5_1: (0, 2), GT.Q4_K: (0, 2), GT.Q5_K: (0, 2), GT.Q2_K: (80, 82),
    GT.Q3_K: (108,), GT.IQ4_XS: (0,), GT.IQ3_XXS: (0,), GT.IQ3_S: (0,), GT.IQ2_XXS: (0,),
    GT.IQ2_XS: (0,), GT.IQ2_S: (0,), GT.IQ1_S: (0,), GT.IQ1_M: (),
}
TYPES = list(quant_kernels.KERNELS)
# zeros, subnormals (smallest, largest, negative), the largest finite values, 1.0
SPECIAL_FP16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8200, 0x7BFF, 0xFBFF, 0x7800, 0x3C00], np.uint16)


def random_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite fp16 bit patterns: random sign, exponent 0..30 and mantissa, with the special
    values above in every block of eight."""
    bits = (rng.integers(0, 2, n, dtype=np.uint16) << 15) | (rng.integers(0, 31, n, dtype=np.uint16) << 10) \
        | rng.integers(0, 1 << 10, n, dtype=np.uint16)
    special = rng.integers(0, 8, n) == 0
    bits[special] = rng.choice(SPECIAL_FP16, int(special.sum()))
    return bits


def random_blocks(ggml_type: GT, n_blocks: int, seed: int = 0, fp16: np.ndarray | None = None) -> np.ndarray:
    """uint8 [n_blocks, type_size]: random bytes with valid (finite, or the given) fp16 scales; for
    MXFP4 the exponent bytes run through 0..254 (0xFF is NaN in ggml)."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)

    def scale_bits() -> np.ndarray:
        return random_fp16(rng, n_blocks) if fp16 is None else rng.choice(fp16, n_blocks)

    for offset in FP16_FIELDS[ggml_type]:
        blocks[:, offset:offset + 2] = scale_bits().view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == GT.MXFP4:
        blocks[:, 0] = (np.arange(n_blocks) + rng.integers(0, 255)) % 255
    if ggml_type == GT.IQ1_M:
        d = scale_bits()
        for k in range(4):  # nibble k of d -> top nibble of the k-th uint16 (bytes 48 + 2k, 49 + 2k)
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | ((((d >> (4 * k)) & 0x0F) << 4).astype(np.uint8))
    return blocks


def reference(raw: np.ndarray, ggml_type: GT) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return gguf_dequantize(np.ascontiguousarray(raw), ggml_type).astype(np.float32)


def assert_bits_equal(ours: np.ndarray, ggml_type: GT, raw: np.ndarray) -> None:
    expected = reference(raw, ggml_type)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    mismatch = np.ascontiguousarray(ours).view(np.uint32) != expected.view(np.uint32)
    assert not mismatch.any(), f"{ggml_type.name}: {int(mismatch.sum())} values differ, first at {np.argwhere(mismatch)[0]}"


def test_covers_every_quantized_type():
    assert set(quant_kernels.KERNELS) == {t for t, qt in QUANT_TYPES.items() if qt.storage != "float"}


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_bit_identical_in_every_shape(ggml_type):
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    blocks = random_blocks(ggml_type, 2 * 3 * 8 + 300)
    big = blocks[:48].reshape(2, 3, 8 * type_size)
    cases = {
        "1-D row": blocks[:5].reshape(-1),
        "2-D": blocks[:48].reshape(6, 8 * type_size),
        "3-D experts": big,
        "non-contiguous": big[:, ::2, type_size:-type_size],
        "many blocks": blocks,  # enough for every MXFP4 exponent and each special scale
    }
    for name, raw in cases.items():
        ours = quant_kernels.dequantize(raw, ggml_type)
        assert_bits_equal(ours, ggml_type, raw)
    # out=: a given array, contiguous or not, receives the values
    raw = cases["non-contiguous"]
    for out in (np.empty(reference(raw, ggml_type).shape, np.float32),
                np.empty((2, 4, 6 * GGML_QUANT_SIZES[ggml_type][0] + 1), np.float32)[:, ::2, 1:]):
        assert quant_kernels.dequantize(raw, ggml_type, out=out) is out
        assert_bits_equal(out, ggml_type, raw)


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t != GT.MXFP4], ids=lambda t: t.name)
def test_bit_identical_with_non_finite_scales(ggml_type):
    """Inf and NaN scales too (a NaN's sign and payload included), though moepass refuses them."""
    fp16 = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x3C00, 0x0000], np.uint16)
    raw = random_blocks(ggml_type, 64, seed=1, fp16=fp16)
    assert_bits_equal(quant_kernels.dequantize(raw, ggml_type), ggml_type, raw)


def test_mxfp4_exponent_0xff():
    raw = random_blocks(GT.MXFP4, 16, seed=2)
    raw[:, 0] = 0xFF
    assert_bits_equal(quant_kernels.dequantize(raw, GT.MXFP4), GT.MXFP4, raw)


def test_threads():
    """Many threads at once (nogil kernels), each type on its own blocks: the same values as alone."""
    work = [(t, random_blocks(t, 64, seed=i)) for i, t in enumerate(TYPES * 3)]
    alone = [quant_kernels.dequantize(raw, t) for t, raw in work]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: quant_kernels.dequantize(job[1], job[0]), work))
    for (t, _), a, b in zip(work, alone, together):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), t.name


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        quant_kernels.dequantize(np.zeros(35, np.uint8), GT.Q8_0)
    with pytest.raises(ValueError):
        quant_kernels.dequantize(np.zeros(34, np.uint8), GT.Q8_0, out=np.empty(31, np.float32))
    with pytest.raises(NotImplementedError):
        quant_kernels.dequantize(np.zeros(4, np.uint8), GT.F32)


def test_to_half_is_numpys_float16_rounding():
    """quant_kernels._to_half, which chooses every float16 scale the requantizer stores, rounds as
    numpy's astype(float16) does: every float32 bit pattern of the binades where float16 turns
    subnormal (2**-15 to 2**-13), of [1, 2) and around its largest value (65,000 to 70,000, where
    it overflows to inf), both signs, and 2 million random patterns."""
    from numba import njit

    @njit
    def rounded(values):
        out = np.empty_like(values)
        for i in range(values.size):
            out[i] = quant_kernels._to_half(values[i])
        return out

    bounds = [(2.0**-15, 2.0**-13), (1.0, 2.0), (65000.0, 70000.0)]
    patterns = [np.arange(np.float32(a).view(np.uint32), np.float32(b).view(np.uint32), dtype=np.uint32) for a, b in bounds]
    patterns.append(np.random.default_rng(9).integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32))
    values = np.concatenate(patterns).view(np.float32)
    values = np.concatenate([values, -values])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow to inf, as intended
        expected = values.astype(np.float16).astype(np.float32)
    got = rounded(values)
    same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), values[~same][:5]
