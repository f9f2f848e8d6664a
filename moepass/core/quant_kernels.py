"""Compiled dequantizers for the quantized GGUF types moepass converts.

The gguf package's dequantizers are numpy expressions over whole arrays of blocks: every block is
split, shifted, gathered and multiplied through a dozen temporaries, a few MB/s of GGUF input for
the K-quants and IQ types. Requantized types (Q4_1, Q5_1, the K-quants, the IQ types) pass all
their blocks through them, so they bound a conversion's speed. Here each type has one small numba
kernel that walks its blocks once and writes float32 values, several hundred MB/s per thread; the
kernels release the GIL (`nogil=True`), so moepass's worker threads run them in parallel.

`dequantize(raw, ggml_type)` is bit-identical to `gguf.quants.dequantize(raw, ggml_type)
.astype(np.float32)`: each kernel repeats gguf's arithmetic in float32 and in gguf's order of
operations (`(d * sc) * q - dmin * m`, not `d * (sc * q)`; fp16 scales widened to float32 before
any product), and every codebook comes from the gguf classes themselves (their grids, `ksigns`,
`kvalues`, `delta`, the e8m0 scale function), read once at import; signs are multiplied in as
float32 +-1 from a table, as gguf does (a product keeps a NaN as it is, a negation would not).
Kernels get these tables as arguments rather than as frozen globals, which keeps compilation
short and the cache small. Loops run over each block's bytes in llama.cpp's order (one code byte,
all the values it holds) where that lets LLVM vectorize them; numba emits no FMA contraction, so
`a * b - c` rounds twice as numpy does.

Large outputs are bound by memory writes (a fresh array's page faults cost about as much as the
kernel): callers that dequantize chunk after chunk should pass a reused `out=`.

Numba compiles a type's kernel on its first call (cached on disk with `cache=True`, so later runs
only load it). Input blocks are always passed as read-only arrays, so each kernel has exactly one
specialization whatever the caller's array (a read-only memory map or a writable buffer).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["dequantize", "KERNELS", "quantize_rows", "any_non_finite_fp16", "q4_k_offsets"]


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _grid(cls) -> np.ndarray:
    """A gguf IQ class's codebook as float32 [entries, values per entry]."""
    cls.init_grid()
    return _readonly(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32))


# Every fp16 bit pattern as numpy widens it (gguf does `view(np.float16).astype(np.float32)`).
F16 = _readonly(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32))
# MXFP4's e8m0 exponent byte -> float32 scale, by gguf's own function (ggml's E8M0_TO_FP32_HALF).
E8M0 = _readonly(np.ascontiguousarray(gq.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)), dtype=np.float32))
Q4_0_VALUES = _readonly(np.arange(-8, 8, dtype=np.float32))
MXFP4_VALUES = _readonly(np.array(gq.MXFP4.kvalues, dtype=np.float32))
IQ4_VALUES = _readonly(np.array(gq.IQ4_NL.kvalues, dtype=np.float32))
# Signs as gguf multiplies them, np.where(bit == 0, 1, -1) in float32: SIGNS[byte, j] for bit j of a
# sign byte; KSIGNS for the 7-bit indices into gguf's ksigns table (IQ2_XXS, IQ2_XS, IQ3_XXS).
SIGNS = _readonly(np.where((np.arange(256)[:, None] >> np.arange(8)) & 1 == 0, np.float32(1), np.float32(-1)))
KSIGNS = _readonly(np.ascontiguousarray(SIGNS[np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)]))
assert SIGNS.dtype == KSIGNS.dtype == np.float32 and KSIGNS.shape == (128, 8)
IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID = _grid(gq.IQ2_XXS), _grid(gq.IQ2_XS), _grid(gq.IQ2_S)
IQ3XXS_GRID, IQ3S_GRID, IQ1S_GRID = _grid(gq.IQ3_XXS), _grid(gq.IQ3_S), _grid(gq.IQ1_S)
assert gq.IQ1_M.grid_hex == gq.IQ1_S.grid_hex and gq.IQ1_M.delta == gq.IQ1_S.delta

# float32 constants (numba freezes these globals with their float32 type; a bare 0.5 would be float64)
_F0_25, _F0_5 = np.float32(0.25), np.float32(0.5)
_IQ1_DELTA = np.float32(gq.IQ1_S.delta)


# ---- shared helpers ------------------------------------------------------------------------------


@njit
def _u16(b, i, o):
    return np.int64(b[i, o]) | (np.int64(b[i, o + 1]) << 8)


@njit
def _u32(b, i, o):
    return _u16(b, i, o) | (_u16(b, i, o + 2) << 16)


@njit
def _f16(f16, b, i, o):
    """The fp16 field at byte o of block i, widened to float32."""
    return f16[_u16(b, i, o)]


@njit
def _plus(v, m):
    """gguf's v + m, where a NaN v stays as it is even if m is a NaN too (x86 keeps the first NaN
    operand; LLVM may swap the operands of an addition)."""
    return v if v != v else v + m


@njit
def _k_scale_min(b, i, o, s):
    """Q4_K / Q5_K: 6-bit scale and min of sub-block s from the 12 bytes at o (gguf's get_scale_min)."""
    if s < 4:
        return b[i, o + s] & 0x3F, b[i, o + 4 + s] & 0x3F
    j = s - 4
    sc = (b[i, o + 8 + j] & 0x0F) | ((b[i, o + j] >> 2) & 0x30)
    m = (b[i, o + 8 + j] >> 4) | ((b[i, o + 4 + j] >> 2) & 0x30)
    return sc, m


# ---- 32-element blocks ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _q8_0(b, out, f16):
    """fp16 d, 32 int8 codes: x * d."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for j in range(32):
            out[i, j] = np.float32((np.int32(b[i, 2 + j]) ^ 0x80) - 0x80) * d


@njit(cache=True, nogil=True)
def _fp16_nibbles(b, out, f16, values):
    """fp16 d, 16 bytes: element j low nibble of byte j, j + 16 its high nibble; d * values[q]: Q4_0
    (values: q - 8, read from a table, faster than converting) and IQ4_NL (its codebook)."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for j in range(16):
            out[i, j] = d * values[b[i, 2 + j] & 0x0F]
        for j in range(16):
            out[i, 16 + j] = d * values[b[i, 2 + j] >> 4]


@njit(cache=True, nogil=True)
def _q4_1(b, out, f16):
    """fp16 d and m, nibbles as Q4_0: d * q + m."""
    for i in range(b.shape[0]):
        d, m = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for j in range(16):
            out[i, j] = _plus(d * np.float32(b[i, 4 + j] & 0x0F), m)
        for j in range(16):
            out[i, 16 + j] = _plus(d * np.float32(b[i, 4 + j] >> 4), m)


@njit(cache=True, nogil=True)
def _q5_0(b, out, f16):
    """fp16 d, 32 high bits (uint32), nibbles as Q4_0: d * (q - 16)."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        qh = _u32(b, i, 2)
        for j in range(16):
            q = b[i, 6 + j]
            lo = np.int32(q & 0x0F) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[i, j] = d * np.float32(lo - 16)
            out[i, 16 + j] = d * np.float32(hi - 16)


@njit(cache=True, nogil=True)
def _q5_1(b, out, f16):
    """fp16 d and m, 32 high bits, nibbles as Q4_0: d * q + m."""
    for i in range(b.shape[0]):
        d, m = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        qh = _u32(b, i, 4)
        for j in range(16):
            q = b[i, 8 + j]
            lo = np.int32(q & 0x0F) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[i, j] = _plus(d * np.float32(lo), m)
            out[i, 16 + j] = _plus(d * np.float32(hi), m)


@njit(cache=True, nogil=True)
def _mxfp4(b, out, e8m0, values):
    """e8m0 exponent byte, nibbles as Q4_0 indexing the doubled E2M1 values: scale * kvalues[q]."""
    for i in range(b.shape[0]):
        d = e8m0[b[i, 0]]
        for j in range(16):
            out[i, j] = d * values[b[i, 1 + j] & 0x0F]
        for j in range(16):
            out[i, 16 + j] = d * values[b[i, 1 + j] >> 4]


# ---- K-quants (256-element super-blocks) --------------------------------------------------------


@njit
def _q2_k_scale(d, dmin, byte):
    """Q2_K: a scale byte (4-bit scale, 4-bit min) -> (d * sc, dmin * m)."""
    return d * np.float32(byte & 0x0F), dmin * np.float32(byte >> 4)


@njit
def _q3_k_scale(d, b, i, g):
    """Q3_K: d * (sc - 32) of sub-block g, its 6 bits spread over the 12 scale bytes at 96."""
    low = (b[i, 96 + g % 8] >> (4 * (g // 8))) & 0x0F
    high = (b[i, 104 + g % 4] >> (2 * (g // 4))) & 0x03
    return d * np.float32(np.int32(low | (high << 4)) - 32)


@njit(cache=True, nogil=True)
def _q2_k(b, out, f16):
    """16 scale bytes (one per 16 elements), 64 bytes of 2-bit codes, fp16 d and dmin:
    (d * sc) * q - dmin * m. Byte 32h + l holds element 128h + 32s + l in bits 2s, 2s + 1."""
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 80), _f16(f16, b, i, 82)
        for h in range(2):
            for half in range(2):  # l in 16 half.. : sub-blocks 8h + 2s + half
                g = 8 * h + half
                dl0, ml0 = _q2_k_scale(d, dmin, b[i, g])
                dl1, ml1 = _q2_k_scale(d, dmin, b[i, g + 2])
                dl2, ml2 = _q2_k_scale(d, dmin, b[i, g + 4])
                dl3, ml3 = _q2_k_scale(d, dmin, b[i, g + 6])
                for l in range(16 * half, 16 * half + 16):
                    q, e = b[i, 16 + 32 * h + l], 128 * h + l
                    out[i, e] = dl0 * np.float32(q & 3) - ml0
                    out[i, e + 32] = dl1 * np.float32((q >> 2) & 3) - ml1
                    out[i, e + 64] = dl2 * np.float32((q >> 4) & 3) - ml2
                    out[i, e + 96] = dl3 * np.float32(q >> 6) - ml3


@njit(cache=True, nogil=True)
def _q3_k(b, out, f16):
    """32 bytes of high-bit mask, 64 bytes of 2-bit codes (laid out as Q2_K's), 12 bytes of 6-bit
    scales, fp16 d: (d * (sc - 32)) * (q - 4 * (1 - hbit)); element 32j + l: bit j of mask byte l."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 108)
        for h in range(2):
            for half in range(2):
                g = 8 * h + half
                dl0, dl1 = _q3_k_scale(d, b, i, g), _q3_k_scale(d, b, i, g + 2)
                dl2, dl3 = _q3_k_scale(d, b, i, g + 4), _q3_k_scale(d, b, i, g + 6)
                for l in range(16 * half, 16 * half + 16):
                    q, m, e = np.int32(b[i, 32 + 32 * h + l]), np.int32(b[i, l]) >> (4 * h), 128 * h + l
                    out[i, e] = dl0 * np.float32((q & 3) - (((m & 1) ^ 1) << 2))
                    out[i, e + 32] = dl1 * np.float32(((q >> 2) & 3) - ((((m >> 1) & 1) ^ 1) << 2))
                    out[i, e + 64] = dl2 * np.float32(((q >> 4) & 3) - ((((m >> 2) & 1) ^ 1) << 2))
                    out[i, e + 96] = dl3 * np.float32((q >> 6) - ((((m >> 3) & 1) ^ 1) << 2))


@njit(cache=True, nogil=True)
def _q4_k(b, out, f16):
    """fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (sub-block 2c in the
    low nibbles of bytes 32c.., 2c + 1 in their high nibbles): (d * sc) * q - dmin * m."""
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for c in range(4):
            sc, m = _k_scale_min(b, i, 4, 2 * c)
            dl0, ml0 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = _k_scale_min(b, i, 4, 2 * c + 1)
            dl1, ml1 = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                q = b[i, 16 + 32 * c + l]
                out[i, 64 * c + l] = dl0 * np.float32(q & 0x0F) - ml0
                out[i, 64 * c + 32 + l] = dl1 * np.float32(q >> 4) - ml1


@njit(cache=True, nogil=True)
def _q5_k(b, out, f16):
    """Q4_K's layout plus 32 bytes of fifth bits after the scales (sub-block s: bit s of byte l)."""
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for s in range(8):
            sc, m = _k_scale_min(b, i, 4, s)
            dl, ml = d * np.float32(sc), dmin * np.float32(m)
            base, shift = 48 + 32 * (s // 2), 4 * (s % 2)
            for l in range(32):
                q = ((b[i, base + l] >> shift) & 0x0F) | (((b[i, 16 + l] >> s) & 1) << 4)
                out[i, 32 * s + l] = dl * np.float32(q) - ml


@njit
def _q6_k_scale(d, b, i, g):
    return d * np.float32((np.int32(b[i, 192 + g]) ^ 0x80) - 0x80)


@njit(cache=True, nogil=True)
def _q6_k(b, out, f16):
    """128 bytes of low nibbles, 64 bytes of high 2 bits, 16 int8 scales, fp16 d: (d * sc) * (q - 32).
    Per half h, bytes 64h + l and 64h + 32 + l hold elements 128h + l, + 32 (low nibbles) and + 64,
    + 96 (high nibbles); byte 128 + 32h + l their high bits, 2 each from bit 0 up."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 208)
        for h in range(2):
            for half in range(2):
                g = 8 * h + half
                dl0, dl1 = _q6_k_scale(d, b, i, g), _q6_k_scale(d, b, i, g + 2)
                dl2, dl3 = _q6_k_scale(d, b, i, g + 4), _q6_k_scale(d, b, i, g + 6)
                for l in range(16 * half, 16 * half + 16):
                    q0, q1 = np.int32(b[i, 64 * h + l]), np.int32(b[i, 64 * h + 32 + l])
                    qh, e = np.int32(b[i, 128 + 32 * h + l]), 128 * h + l
                    out[i, e] = dl0 * np.float32(((q0 & 0x0F) | ((qh & 3) << 4)) - 32)
                    out[i, e + 32] = dl1 * np.float32(((q1 & 0x0F) | (((qh >> 2) & 3) << 4)) - 32)
                    out[i, e + 64] = dl2 * np.float32(((q0 >> 4) | (((qh >> 4) & 3) << 4)) - 32)
                    out[i, e + 96] = dl3 * np.float32(((q1 >> 4) | (((qh >> 6) & 3) << 4)) - 32)


@njit(cache=True, nogil=True)
def _iq4_xs(b, out, f16, values):
    """fp16 d, uint16 of scale high bits, 4 bytes of scale nibbles, 8 x 16 bytes of codebook
    nibbles: (d * (sc - 32)) * kvalues[q]; sub-block s: low nibbles of its 16 bytes, then high."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        scales_h = _u16(b, i, 2)
        for s in range(8):
            low = (b[i, 4 + s // 2] >> (4 * (s % 2))) & 0x0F
            high = (scales_h >> (2 * s)) & 0x03
            dl = d * np.float32(np.int32(low | (high << 4)) - 32)
            for j in range(16):
                out[i, 32 * s + j] = dl * values[b[i, 8 + 16 * s + j] & 0x0F]
            for j in range(16):
                out[i, 32 * s + 16 + j] = dl * values[b[i, 8 + 16 * s + j] >> 4]


# ---- IQ codebook types ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _iq2_xxs(b, out, f16, grid, ksigns):
    """fp16 d, 8 x (4 grid bytes, uint32 of 4 x 7-bit sign indices and a 4-bit scale):
    ((d * (0.5 + s)) * 0.25) * grid * sign."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for ib in range(8):
            aux = _u32(b, i, 6 + 8 * ib)
            db = d * (_F0_5 + np.float32(aux >> 28)) * _F0_25
            for k in range(4):
                row, signs = b[i, 2 + 8 * ib + k], (aux >> (7 * k)) & 0x7F
                for j in range(8):
                    out[i, 32 * ib + 8 * k + j] = db * grid[row, j] * ksigns[signs, j]


@njit(cache=True, nogil=True)
def _iq2_xs(b, out, f16, grid, ksigns):
    """fp16 d, 32 uint16 (9-bit grid index, 7-bit sign index), 8 bytes of 4-bit scales (one per
    16 elements): ((d * (0.5 + s)) * 0.25) * grid * sign."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for g in range(32):
            db = d * (_F0_5 + np.float32((b[i, 66 + g // 4] >> (4 * ((g // 2) % 2))) & 0x0F)) * _F0_25
            qs = _u16(b, i, 2 + 2 * g)
            row, signs = qs & 511, qs >> 9
            for j in range(8):
                out[i, 8 * g + j] = db * grid[row, j] * ksigns[signs, j]


@njit(cache=True, nogil=True)
def _iq2_s(b, out, f16, grid, signs):
    """fp16 d, 32 grid low bytes, 32 sign bytes, 8 bytes of grid high bits (2 per group), 8 bytes
    of 4-bit scales: ((d * (0.5 + s)) * 0.25) * grid * sign."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for g in range(32):
            db = d * (_F0_5 + np.float32((b[i, 74 + g // 4] >> (4 * ((g // 2) % 2))) & 0x0F)) * _F0_25
            row = np.int64(b[i, 2 + g]) | (np.int64((b[i, 66 + g // 4] >> (2 * (g % 4))) & 0x03) << 8)
            for j in range(8):
                out[i, 8 * g + j] = db * grid[row, j] * signs[b[i, 34 + g], j]


@njit(cache=True, nogil=True)
def _iq3_xxs(b, out, f16, grid, ksigns):
    """fp16 d, 64 grid bytes (4 values each), 8 uint32 of 4 x 7-bit sign indices and a 4-bit
    scale: ((d * (0.5 + s)) * 0.5) * grid * sign."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for ib in range(8):
            aux = _u32(b, i, 66 + 4 * ib)
            db = d * (_F0_5 + np.float32(aux >> 28)) * _F0_5
            for k in range(4):
                signs = (aux >> (7 * k)) & 0x7F
                for j in range(8):
                    row = b[i, 2 + 8 * ib + 2 * k + j // 4]
                    out[i, 32 * ib + 8 * k + j] = db * grid[row, j % 4] * ksigns[signs, j]


@njit(cache=True, nogil=True)
def _iq3_s(b, out, f16, grid, signs):
    """fp16 d, 64 grid low bytes, 8 bytes of grid ninth bits, 32 sign bytes, 4 bytes of 4-bit
    scales: (d * (1 + 2 s)) * grid * sign."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for ib in range(8):
            db = d * np.float32(1 + 2 * ((b[i, 106 + ib // 2] >> (4 * (ib % 2))) & 0x0F))
            for g in range(8 * ib, 8 * ib + 8):
                row = np.int64(b[i, 2 + g]) | (np.int64((b[i, 66 + g // 8] >> (g % 8)) & 1) << 8)
                sign_byte, first = b[i, 74 + g // 2], 4 * (g % 2)
                for j in range(4):
                    out[i, 4 * g + j] = db * grid[row, j] * signs[sign_byte, first + j]


@njit(cache=True, nogil=True)
def _iq1_s(b, out, f16, grid):
    """fp16 d, 32 grid low bytes, 8 uint16 (4 x 3 grid high bits, 3-bit scale, delta sign):
    (d * (2 s + 1)) * (grid + delta)."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 0)
        for ib in range(8):
            qh = _u16(b, i, 34 + 2 * ib)
            dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
            delta = -_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA
            for k in range(4):
                row = np.int64(b[i, 2 + 4 * ib + k]) | (((qh >> (3 * k)) & 7) << 8)
                for j in range(8):
                    out[i, 32 * ib + 8 * k + j] = dl * (grid[row, j] + delta)


@njit(cache=True, nogil=True)
def _iq1_m(b, out, f16, grid):
    """32 grid low bytes, 16 bytes of (3 grid high bits, delta sign) nibbles, 4 uint16 holding
    4 x 3-bit scales each and, in their top nibbles, the fp16 d: (d * (2 s + 1)) * (grid + delta)."""
    for i in range(b.shape[0]):
        sc = (_u16(b, i, 48), _u16(b, i, 50), _u16(b, i, 52), _u16(b, i, 54))
        d = f16[((sc[0] & 0xF000) >> 12) | ((sc[1] & 0xF000) >> 8) | ((sc[2] & 0xF000) >> 4) | (sc[3] & 0xF000)]
        for g in range(32):
            dl = d * np.float32(2 * ((sc[g // 8] >> (3 * ((g // 2) % 4))) & 7) + 1)
            qh = b[i, 32 + g // 2] >> (4 * (g % 2))
            delta = -_IQ1_DELTA if qh & 0x08 else _IQ1_DELTA
            row = np.int64(b[i, g]) | (np.int64(qh & 7) << 8)
            for j in range(8):
                out[i, 8 * g + j] = dl * (grid[row, j] + delta)


# Each type's kernel and the tables passed after (blocks, out).
KERNELS: dict[GT, tuple[Callable[..., None], tuple[np.ndarray, ...]]] = {
    GT.Q8_0: (_q8_0, (F16,)),
    GT.Q4_0: (_fp16_nibbles, (F16, Q4_0_VALUES)),
    GT.Q5_0: (_q5_0, (F16,)),
    GT.IQ4_NL: (_fp16_nibbles, (F16, IQ4_VALUES)),
    GT.MXFP4: (_mxfp4, (E8M0, MXFP4_VALUES)),
    GT.Q6_K: (_q6_k, (F16,)),
    GT.Q4_1: (_q4_1, (F16,)),
    GT.Q5_1: (_q5_1, (F16,)),
    GT.Q4_K: (_q4_k, (F16,)),
    GT.Q5_K: (_q5_k, (F16,)),
    GT.Q2_K: (_q2_k, (F16,)),
    GT.Q3_K: (_q3_k, (F16,)),
    GT.IQ4_XS: (_iq4_xs, (F16, IQ4_VALUES)),
    GT.IQ3_XXS: (_iq3_xxs, (F16, IQ3XXS_GRID, KSIGNS)),
    GT.IQ3_S: (_iq3_s, (F16, IQ3S_GRID, SIGNS)),
    GT.IQ2_XXS: (_iq2_xxs, (F16, IQ2XXS_GRID, KSIGNS)),
    GT.IQ2_XS: (_iq2_xs, (F16, IQ2XS_GRID, KSIGNS)),
    GT.IQ2_S: (_iq2_s, (F16, IQ2S_GRID, SIGNS)),
    GT.IQ1_S: (_iq1_s, (F16, IQ1S_GRID)),
    GT.IQ1_M: (_iq1_m, (F16, IQ1S_GRID)),
}


def dequantize(raw: np.ndarray, ggml_type: GT, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 values `[..., row_elements]` of raw GGUF rows, uint8 `[..., row_bytes]`, the same bits
    as the gguf package's dequantizer. `raw` may be any view (copied only if not C-contiguous);
    `out`, if given, is a float32 array of the result's shape that receives the values (and is
    returned)."""
    ggml_type = GT(ggml_type)
    if ggml_type not in KERNELS:
        raise NotImplementedError(f"no compiled dequantizer for {ggml_type.name}")
    kernel, tables = KERNELS[ggml_type]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim == 0 or raw.shape[-1] % type_size:
        raise ValueError(
            f"{ggml_type.name} rows must be uint8 [..., a multiple of {type_size} bytes], got {raw.dtype} {raw.shape}"
        )
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.dtype != np.float32 or out.shape != shape:
        raise ValueError(f"out must be float32 {shape}, got {out.dtype} {out.shape}")
    blocks = _readonly(np.ascontiguousarray(raw).reshape(-1, type_size))
    direct = out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
    values = out.reshape(-1, block_size) if direct else np.empty((blocks.shape[0], block_size), np.float32)
    if blocks.shape[0]:
        kernel(blocks, values, *tables)
    if not direct:
        out[...] = values.reshape(shape)
    return out


@njit(cache=True, nogil=True)
def _any_non_finite_fp16(blocks, fields):
    for b in range(blocks.shape[0]):
        for f in fields:
            if blocks[b, f + 1] & 0x7C == 0x7C:  # the high byte of a little-endian float16: all exponent bits
                return True
    return False


@njit(cache=True, nogil=True)
def _q4_0_int4(blocks, out):
    """Q4_0 blocks [R, B, 18] -> the int4 form's bytes [R, B, 16] (`out` may be a strided view)."""
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            for j in range(8):
                first, second = blocks[r, b, 2 + 2 * j], blocks[r, b, 3 + 2 * j]
                out[r, b, j] = (first & 0x0F) | ((second & 0x0F) << 4)
                out[r, b, 8 + j] = (first >> 4) | (second & 0xF0)


def q4_0_int4(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 blocks [..., B, 18] into the int4 form's bytes `out` [..., B, 16] in one pass: Q4_0 byte
    i holds elements i (low nibble) and i+16 (high), the form's byte j elements 2j and 2j+1, so
    byte j < 8 is low(q[2j]) | low(q[2j+1]) << 4 and byte 8+j high(q[2j]) | high(q[2j+1]) << 4."""
    if blocks.ndim == 2:
        blocks, out = blocks[None], out[None]
    for lead in np.ndindex(*blocks.shape[:-3]):
        _q4_0_int4(_readonly(blocks[lead]), out[lead])


@njit(cache=True, nogil=True)
def _offsets_terms(scale, minimum, offset, total, squares, errors):
    """One Q4_K sub-block as s (u - 8) + offset: its ||v||^2 from the codes' integer sums (float64:
    a relative error's denominator, not a bit to keep), each code value's squared error into
    `errors` (numpy's float32 steps), and whether every code value is exact."""
    s64, m64 = np.float64(scale), np.float64(minimum)
    exact = True
    for u in range(16):
        e = (np.float32(u - 8) * scale + offset) - (scale * np.float32(u) - minimum)
        errors[u] = np.float64(e * e)
        exact &= e == 0
    return s64 * s64 * squares - 2.0 * s64 * m64 * total + 32.0 * m64 * m64, exact


@njit(cache=True, nogil=True)
def _q4_k_offsets(b, codes, scales, offsets, f16, sums):
    """Q4_K blocks [n, 144] -> int4 block 32 with block offsets, the file's own codes u kept: codes
    [n, 128] (form byte j: elements 2j low, 2j + 1 high), scales s = d * sc and offsets 8 s - dmin
    * m [n, 8]; sums += (||s (u - 8) + offset - v||^2, ||v||^2), v the gguf package's value (d *
    sc) * u - dmin * m (quants.pack_with_offsets' definition). A sub-block's error depends only on
    which of its 16 code values are off, so the codes are looked at again only where one is."""
    error = 0.0
    reference = 0.0
    low_errors, high_errors = np.zeros(16), np.zeros(16)
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for c in range(4):  # bytes 16 + 32c ..: sub-block 2c in the low nibbles, 2c + 1 in the high
            base = 16 + 32 * c
            low_total = low_squares = high_total = high_squares = 0
            for l in range(32):
                q = np.int32(b[i, base + l])
                low_total += q & 0x0F
                low_squares += (q & 0x0F) * (q & 0x0F)
                high_total += q >> 4
                high_squares += (q >> 4) * (q >> 4)
            for j in range(16):
                first, second = b[i, base + 2 * j], b[i, base + 2 * j + 1]
                codes[i, 32 * c + j] = (first & 0x0F) | ((second & 0x0F) << 4)
                codes[i, 32 * c + 16 + j] = (first >> 4) | (second & 0xF0)
            sc, m = _k_scale_min(b, i, 4, 2 * c)
            scale, minimum = d * np.float32(sc), dmin * np.float32(m)
            offset = np.float32(8.0) * scale - minimum
            scales[i, 2 * c], offsets[i, 2 * c] = scale, offset
            low, low_exact = _offsets_terms(scale, minimum, offset, low_total, low_squares, low_errors)
            sc, m = _k_scale_min(b, i, 4, 2 * c + 1)
            scale, minimum = d * np.float32(sc), dmin * np.float32(m)
            offset = np.float32(8.0) * scale - minimum
            scales[i, 2 * c + 1], offsets[i, 2 * c + 1] = scale, offset
            high, high_exact = _offsets_terms(scale, minimum, offset, high_total, high_squares, high_errors)
            reference += low + high
            if not (low_exact and high_exact):
                for l in range(32):
                    error += low_errors[b[i, base + l] & 0x0F] + high_errors[b[i, base + l] >> 4]
    sums[0] += error
    sums[1] += reference


def q4_k_offsets(raw: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> tuple[float, float]:
    """Q4_K rows uint8 [R, row bytes] into int4 block 32 with block offsets in one pass (codes [R,
    K/2], scales and offsets float32 [R, K/32], any views): (||W' - W||^2, ||W||^2) against the
    gguf package's values. The same bits as quants.pack_with_offsets' numpy definition."""
    blocks = _readonly(np.ascontiguousarray(raw).reshape(-1, 144))
    n = blocks.shape[0]
    out_codes = np.empty((n, 128), np.uint8)
    out_scales, out_offsets = np.empty((n, 8), np.float32), np.empty((n, 8), np.float32)
    sums = np.zeros(2)
    if n:
        _q4_k_offsets(blocks, out_codes, out_scales, out_offsets, F16, sums)
    codes[...] = out_codes.reshape(codes.shape)
    scales[...] = out_scales.reshape(scales.shape)
    offsets[...] = out_offsets.reshape(offsets.shape)
    return float(sums[0]), float(sums[1])


def any_non_finite_fp16(blocks: np.ndarray, fields: tuple[int, ...]) -> bool:
    """Whether any float16 field at these byte offsets of the blocks (uint8 [n, block bytes]) is NaN
    or Inf, in one pass over the blocks."""
    return bool(blocks.shape[0]) and _any_non_finite_fp16(
        _readonly(np.ascontiguousarray(blocks)), np.asarray(fields, np.int64)
    )


# ---- symmetric block quantization -------------------------------------------------------------------
# The 4-bit scales tried per block: the block's largest magnitude mapped onto the most negative code
# (as Q4_0 does) and onto nearby levels, max / -(8 + d) for these d. Each is rounded, refitted by
# least squares, re-rounded and refitted again; the block keeps the one with the least (weighted)
# error. Nine candidates reach the error of a search over 21 (measured on the real-text fixture's
# Q4_K and Q6_K experts: rel. RMS 0.0714 against 0.0713; the absmax scale alone: 0.0754).
SCALE_SEARCH = np.arange(-4, 5, dtype=np.float32) * np.float32(0.2)


@intrinsic
def _f32_bits(typingctx, x):
    """A float32's bit pattern as int32 (LLVM's bitcast: numba has no scalar view)."""
    if x != types.float32:
        return None
    return types.int32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], llvm_ir.IntType(32))


@intrinsic
def _f32_from_bits(typingctx, b):
    """The float32 of an int32 bit pattern."""
    if b != types.int32:
        return None
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], llvm_ir.FloatType())


@njit(cache=True, nogil=True, error_model="numpy")
def _to_half(s):
    """The float16 nearest float32 `s` (ties to even, as numpy's astype(float16)), as float32;
    beyond float16's range, inf. float16 keeps 11 significant bits down to 2**-14 (rounded on the
    bit pattern: add half of the 13 bits dropped, less one unless the kept last bit is odd, and
    clear them; a carry moves into the exponent as it should), then steps of 2**-24."""
    a = abs(s)
    if a == 0 or not np.isfinite(a):
        return s
    if a < np.float32(2.0**-14):
        return np.float32(np.rint(np.float64(s) * 2.0**24) * 2.0**-24)
    bits = _f32_bits(s)
    r = _f32_from_bits(np.int32((bits + np.int32(0x0FFF) + ((bits >> np.int32(13)) & np.int32(1))) & np.int32(-0x2000)))
    return np.float32(np.inf) if r > np.float32(65504.0) else np.float32(-np.inf) if r < np.float32(-65504.0) else r


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="never")
def _codes_moments(xb, inverse, lo, hi, q):
    """q = clip(rint(xb * inverse), lo, hi); returns (sum xb q, sum q q) in float64. Each term (a
    float32 times an integer of at most 8 bits) is exact in float64 and so is their sum for any
    block whose values span less than 2**20, whatever the order: reassociating the sum (SIMD)
    gives the same bits on every CPU."""
    xq = 0.0
    qq = 0.0
    for i in range(xb.shape[0]):
        c = min(max(np.rint(xb[i] * inverse), lo), hi)
        q[i] = c
        xq += np.float64(xb[i]) * np.float64(c)
        qq += np.float64(c) * np.float64(c)
    return xq, qq


@njit(cache=True, nogil=True, error_model="numpy", inline="never")
def _codes_moments_weighted(xb, wb, inverse, lo, hi, q):
    """_codes_moments with importance weights: sum w x q and sum w q q, added in order (products of
    two floats are not exact, so the order is kept)."""
    xq = 0.0
    qq = 0.0
    for i in range(xb.shape[0]):
        c = min(max(np.rint(xb[i] * inverse), lo), hi)
        q[i] = c
        xq += np.float64(wb[i]) * np.float64(xb[i]) * np.float64(c)
        qq += np.float64(wb[i]) * np.float64(c) * np.float64(c)
    return xq, qq


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="never")
def _block_moments(xb, xi, scratch):
    """(max |x|, sum x^2 in float64) of a block; `xi` is the block's int32 view, `scratch` a 1-element
    int32 array. The maximum is taken over the bit patterns with the sign cleared (for floats this
    is the order of magnitudes, and an integer maximum vectorizes): exact on every CPU. The sum is
    reassociated (SIMD), so its last bits depend on the CPU's vector width; it only enters the
    error and reference sums that are reported, never a code or a scale."""
    m = np.int32(0)
    total = 0.0
    for i in range(xb.shape[0]):
        v = xi[i] & np.int32(0x7FFFFFFF)
        m = v if v > m else m
        total += np.float64(xb[i]) * np.float64(xb[i])
    scratch[0] = m
    return scratch.view(np.float32)[0], total


@njit(cache=True, nogil=True, error_model="numpy")
def _fit(xb, wb, weighted, scale, lo, hi, q):
    """The codes of `scale` into q, and (their least-squares scale, sum w x q, sum w q q)."""
    inverse = np.float32(0.0) if scale == 0 else np.float32(1.0) / scale
    if weighted:
        xq, qq = _codes_moments_weighted(xb, wb, inverse, lo, hi, q)
    else:
        xq, qq = _codes_moments(xb, inverse, lo, hi, q)
    return (np.float32(xq / qq) if qq > 0 else np.float32(0.0)), xq, qq


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="never")
def _codes8(xb, inverse, out, clamp):
    """_codes_moments for the absmax scale's 8-bit codes, the stored codes (c + 128) written
    straight into `out`. With a normal scale |x| / scale is at most 127 (plus three roundings of
    2**-24), so the codes need no clamp, and the loop vectorizes; `clamp` for a block so small that
    its scale is subnormal (and inexact)."""
    xq = 0.0
    qq = 0.0
    if clamp:
        for i in range(xb.shape[0]):
            c = min(max(np.rint(xb[i] * inverse), np.float32(-128.0)), np.float32(127.0))
            out[i] = np.uint8(np.int32(c) + 128)
            xq += np.float64(xb[i]) * np.float64(c)
            qq += np.float64(c) * np.float64(c)
        return xq, qq
    for i in range(xb.shape[0]):
        c = np.rint(xb[i] * inverse)
        out[i] = np.uint8(np.int32(c) + 128)
        xq += np.float64(xb[i]) * np.float64(c)
        qq += np.float64(c) * np.float64(c)
    return xq, qq


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_blocks8(x, half, codes, scales, sums):
    """Symmetric 8-bit quantization of float32 blocks x [n_blocks, block]: stored codes c + 128 into
    `codes` [n_blocks, block], scales into `scales` [n_blocks] (float16 values when `half`, the
    error measured with the rounded scale); sums[0] += ||s c - x||^2, sums[1] += ||x||^2. Two passes
    over each block: the absmax scale's codes, written as they are made, then their least-squares
    scale."""
    error = 0.0
    reference = 0.0
    bits = x.view(np.int32)
    scratch = np.empty(1, np.int32)
    for b in range(x.shape[0]):
        xb = x[b]
        largest, xx = _block_moments(xb, bits[b], scratch)
        scale = largest / np.float32(127.0)
        inverse = np.float32(0.0) if scale == 0 else np.float32(1.0) / scale
        xq, qq = _codes8(xb, inverse, codes[b], not scale >= np.float32(2.0**-126))
        chosen = np.float32(xq / qq) if qq > 0 else np.float32(0.0)
        if half:
            chosen = _to_half(chosen)
        error += max(xx - 2.0 * chosen * xq + np.float64(chosen) * chosen * qq, 0.0)
        reference += xx
        scales[b] = chosen
    sums[0] += error
    sums[1] += reference


# Blocks searched together, one to a lane: a group's blocks are laid side by side (element i of
# block j at [i, j]), so that each fit's loop runs over the lanes, which vectorizes without
# reassociating a block's sums: each is added in element order, whatever the CPU's vector width.
GROUP = 16


@njit(cache=True, nogil=True, error_model="numpy")
def _lane_fits(xt, inverse, lo, hi, xq, qq):
    """For every lane j of xt [n, GROUP]: (sum x q, sum q q) over its block for q = clip(rint(x *
    inverse[j]), lo, hi), into xq[j], qq[j] (the sums of _codes_moments without storing q)."""
    for j in range(GROUP):
        xq[j] = 0.0
        qq[j] = 0.0
    for i in range(xt.shape[0]):
        for j in range(GROUP):
            c = np.float64(min(max(np.rint(xt[i, j] * inverse[j]), lo), hi))
            xq[j] += np.float64(xt[i, j]) * c
            qq[j] += c * c


@njit(cache=True, nogil=True, error_model="numpy")
def _lane_fits_weighted(xt, wt, inverse, lo, hi, xq, qq):
    """_lane_fits with the weights wt [n, GROUP] of each lane's block (_codes_moments_weighted's sums)."""
    for j in range(GROUP):
        xq[j] = 0.0
        qq[j] = 0.0
    for i in range(xt.shape[0]):
        for j in range(GROUP):
            c = min(max(np.rint(xt[i, j] * inverse[j]), lo), hi)
            xq[j] += np.float64(wt[i, j]) * np.float64(xt[i, j]) * np.float64(c)
            qq[j] += np.float64(wt[i, j]) * np.float64(c) * np.float64(c)


@njit(cache=True, nogil=True, error_model="numpy")
def _lane_fit(xt, wt, weighted, inverse, lo, hi, xq, qq):
    """_lane_fits, or _lane_fits_weighted when `weighted`."""
    if weighted:
        _lane_fits_weighted(xt, wt, inverse, lo, hi, xq, qq)
    else:
        _lane_fits(xt, inverse, lo, hi, xq, qq)


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _kept_codes(x, b, inverse, s, lo, hi, q):
    """The codes of block b at `inverse` into q, and their error ||s q - x[b]||^2 (unweighted; the
    sum reassociated, like _block_moments': it is reported, and never chooses a code or a scale)."""
    error = 0.0
    for i in range(x.shape[1]):
        c = min(max(np.rint(x[b, i] * inverse), lo), hi)
        q[i] = c
        d = np.float64(s) * c - x[b, i]
        error += d * d
    return error


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _block_extreme(x, bits, b):
    """(the signed value of largest magnitude, the first such; sum x^2) of block b, as
    _block_moments finds them (the maximum over sign-cleared bit patterns, exact on every CPU; for a
    NaN block that maximum, sign cleared), in two passes that vectorize; rows indexed, not sliced."""
    n = x.shape[1]
    m = np.int32(0)
    total = 0.0
    for i in range(n):
        m = max(m, np.int32(bits[b, i] & np.int32(0x7FFFFFFF)))
        total += np.float64(x[b, i]) * np.float64(x[b, i])
    first = n
    for i in range(n):
        first = min(first, i if np.int32(bits[b, i] & np.int32(0x7FFFFFFF)) == m else n)
    extreme = x[b, first]
    return (extreme if extreme == extreme else abs(extreme)), total


@njit(cache=True, nogil=True, error_model="numpy")
def _search4(x, w, weighted, search, half, codes, scales, sums):
    """Symmetric 4-bit quantization of float32 blocks x [n_blocks, block] (weighted by w[b % len(w)]
    when `weighted`) by SCALE_SEARCH: packed codes u = c + 8 into `codes` [n_blocks, block / 2]
    (element 2i in the low nibble), scales into `scales`, sums as _quantize_blocks8's. Each block's
    arithmetic is its own whatever the grouping (a group's unused lanes hold zeros and are not
    read), so the bytes do not depend on it or on the CPU; the codes kept are made again from the
    kept candidate's inverse scale."""
    n_blocks, n = x.shape
    lo, hi = np.float32(-8.0), np.float32(7.0)
    extreme = np.zeros(GROUP, np.float32)
    inverse = np.zeros(GROUP, np.float32)
    xq = np.zeros(GROUP)
    qq = np.zeros(GROUP)
    least = np.zeros(GROUP)
    chosen = np.zeros(GROUP, np.float32)
    kept = np.zeros(GROUP, np.float32)  # the inverse scale whose codes a block keeps
    xt = np.zeros((n, GROUP), np.float32)  # the group's blocks side by side
    wt = np.ones((n, GROUP), np.float32)  # and their weights
    q = np.empty(n, np.float32)
    error = 0.0
    reference = 0.0
    bits_of = x.view(np.int32)
    for g in range(0, n_blocks, GROUP):
        lanes = min(GROUP, n_blocks - g)
        for j in range(GROUP):
            extreme[j], least[j], chosen[j], kept[j] = 0.0, np.inf, 0.0, 0.0
            for i in range(n):
                xt[i, j] = x[g + j, i] if j < lanes else np.float32(0.0)
            if weighted and j < lanes:
                r = (g + j) % w.shape[0]
                for i in range(n):
                    wt[i, j] = w[r, i]
        for j in range(lanes):
            extreme[j], xx = _block_extreme(x, bits_of, g + j)
            reference += xx
        for d in search:
            for j in range(GROUP):
                scale = extreme[j] / -(np.float32(8.0) + d)
                inverse[j] = np.float32(0.0) if scale == 0 else np.float32(1.0) / scale
            _lane_fit(xt, wt, weighted, inverse, lo, hi, xq, qq)
            for j in range(GROUP):  # rounded once, refitted: round again
                first = np.float32(xq[j] / qq[j]) if qq[j] > 0 else np.float32(0.0)
                inverse[j] = np.float32(0.0) if first == 0 else np.float32(1.0) / first
            _lane_fit(xt, wt, weighted, inverse, lo, hi, xq, qq)
            for j in range(lanes):
                s = np.float32(xq[j] / qq[j]) if qq[j] > 0 else np.float32(0.0)
                # the (weighted) error less sum w x^2, the same for every candidate: only exact
                # terms (or, weighted, sums in order), so the choice is the same on every CPU
                e = np.float64(s) * s * qq[j] - 2.0 * s * xq[j]
                if e < least[j]:
                    least[j] = e
                    chosen[j] = s
                    kept[j] = inverse[j]
        for j in range(lanes):
            b = g + j
            s = _to_half(chosen[j]) if half else chosen[j]
            scales[b] = s
            error += _kept_codes(x, b, kept[j], s, lo, hi, q)
            for i in range(0, n, 2):
                codes[b, i // 2] = np.uint8((np.int32(q[i]) + 8) | ((np.int32(q[i + 1]) + 8) << 4))
    sums[0] += error
    sums[1] += reference


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_blocks8_weighted(x, w, half, codes, scales, sums):
    """_quantize_blocks8 with importance weights w[b % len(w)]: the absmax scale's codes and their
    weighted least-squares scale; the error recorded unweighted."""
    n = x.shape[1]
    lo, hi = np.float32(-128.0), np.float32(127.0)
    best = np.empty(n, np.float32)
    error = 0.0
    reference = 0.0
    bits_of = x.view(np.int32)
    scratch = np.empty(1, np.int32)
    for b in range(x.shape[0]):
        xb = x[b]
        largest, xx = _block_moments(xb, bits_of[b], scratch)
        chosen, _, _ = _fit(xb, w[b % w.shape[0]], True, largest / np.float32(127.0), lo, hi, best)
        if half:
            chosen = _to_half(chosen)
        least = 0.0
        for i in range(n):
            d_i = np.float64(chosen) * best[i] - xb[i]
            least += d_i * d_i
        error += least
        reference += xx
        scales[b] = chosen
        for i in range(n):
            codes[b, i] = np.uint8(np.int32(best[i]) + 128)
    sums[0] += error
    sums[1] += reference


def quantize_rows(
    values: np.ndarray, bits: int, block: int, importance: np.ndarray | None = None, half_scales: bool = False
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Symmetric `bits`-bit (4 or 8) block quantization of float32 rows [..., K] (block 0: one block
    per row): (packed codes uint8 [..., K * bits / 8], scales float32 [..., K / block], ||W' - W||^2,
    ||W||^2). `importance` [K] (every row) or [..., K] (per row) weights each column's error in the
    choice of scales. `half_scales`: scales that float16 holds exactly (inf beyond its range), for
    a model that stores them as float16, the error measured with them."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    lead, k = x.shape[:-1], x.shape[-1]
    block = block or k
    blocks = x.reshape(-1, block)
    if importance is None:
        w, weighted = np.ones((1, block), np.float32), False
    else:
        imp = np.asarray(importance, np.float32)
        w = np.ascontiguousarray(imp if imp.ndim == 1 else np.broadcast_to(imp, x.shape)).reshape(-1, block)
        weighted = True
    codes = np.empty((blocks.shape[0], block * bits // 8), np.uint8)
    scales = np.empty(blocks.shape[0], np.float32)
    sums = np.zeros(2)
    if blocks.size:
        if bits == 4:
            _search4(blocks, w, weighted, SCALE_SEARCH, half_scales, codes, scales, sums)
        elif weighted:
            _quantize_blocks8_weighted(blocks, w, half_scales, codes, scales, sums)
        else:
            _quantize_blocks8(blocks, half_scales, codes, scales, sums)
    return codes.reshape(*lead, -1), scales.reshape(*lead, -1), float(sums[0]), float(sums[1])


# ---- affine codes and block-sum corrections --------------------------------------------------------
# Types whose values are an integer code times a scale less a minimum per sub-block (scale * u -
# minimum, u >= 0): Q4_K, Q5_K, Q2_K, Q4_1, Q5_1. Each kernel gives the file's own codes u [n,
# elements], scales and minimums [n, sub-blocks] (float32, gguf's products: d * sc, dmin * m; Q4_1 and
# Q5_1's "+ m" as "- (-m)", the same float32 value), so that scale * u - minimum is gguf's value.


@njit(cache=True, nogil=True)
def _affine_q4_k(b, u, s, m, f16):
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for sub in range(8):
            sc, mn = _k_scale_min(b, i, 4, sub)
            s[i, sub], m[i, sub] = d * np.float32(sc), dmin * np.float32(mn)
            base, shift = 16 + 32 * (sub // 2), 4 * (sub % 2)
            for l in range(32):
                u[i, 32 * sub + l] = (b[i, base + l] >> shift) & 0x0F


@njit(cache=True, nogil=True)
def _affine_q5_k(b, u, s, m, f16):
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 0), _f16(f16, b, i, 2)
        for sub in range(8):
            sc, mn = _k_scale_min(b, i, 4, sub)
            s[i, sub], m[i, sub] = d * np.float32(sc), dmin * np.float32(mn)
            base, shift = 48 + 32 * (sub // 2), 4 * (sub % 2)
            for l in range(32):
                u[i, 32 * sub + l] = ((b[i, base + l] >> shift) & 0x0F) | (((b[i, 16 + l] >> sub) & 1) << 4)


@njit(cache=True, nogil=True)
def _affine_q2_k(b, u, s, m, f16):
    for i in range(b.shape[0]):
        d, dmin = _f16(f16, b, i, 80), _f16(f16, b, i, 82)
        for g in range(16):  # element e belongs to sub-block e // 16 (_q2_k's layout)
            s[i, g], m[i, g] = _q2_k_scale(d, dmin, b[i, g])
        for h in range(2):
            for l in range(32):
                q = b[i, 16 + 32 * h + l]
                for j in range(4):
                    u[i, 128 * h + 32 * j + l] = (q >> (2 * j)) & 3


@njit(cache=True, nogil=True)
def _affine_q4_1(b, u, s, m, f16):
    for i in range(b.shape[0]):
        s[i, 0], m[i, 0] = _f16(f16, b, i, 0), -_f16(f16, b, i, 2)
        for j in range(16):
            u[i, j], u[i, 16 + j] = b[i, 4 + j] & 0x0F, b[i, 4 + j] >> 4


@njit(cache=True, nogil=True)
def _affine_q5_1(b, u, s, m, f16):
    for i in range(b.shape[0]):
        s[i, 0], m[i, 0] = _f16(f16, b, i, 0), -_f16(f16, b, i, 2)
        qh = _u32(b, i, 4)
        for j in range(16):
            q = b[i, 8 + j]
            u[i, j] = (q & 0x0F) | ((qh >> j) & 1) << 4
            u[i, 16 + j] = (q >> 4) | ((qh >> (j + 16)) & 1) << 4


# type -> (kernel, elements per sub-block)
AFFINE: dict[GT, tuple[Callable[..., None], int]] = {
    GT.Q4_K: (_affine_q4_k, 32),
    GT.Q5_K: (_affine_q5_k, 32),
    GT.Q2_K: (_affine_q2_k, 16),
    GT.Q4_1: (_affine_q4_1, 32),
    GT.Q5_1: (_affine_q5_1, 32),
}


def affine_codes(raw: np.ndarray, ggml_type: GT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw rows uint8 [..., row bytes] of an affine type -> (codes u uint8 [..., K], scales float32
    [..., K / sub-block], minimums float32 [..., K / sub-block]): value = scale * u - minimum."""
    kernel, sub = AFFINE[GT(ggml_type)]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = _readonly(np.ascontiguousarray(raw).reshape(-1, type_size))
    n = blocks.shape[0]
    u = np.empty((n, block_size), np.uint8)
    s = np.empty((n, block_size // sub), np.float32)
    m = np.empty((n, block_size // sub), np.float32)
    if n:
        kernel(blocks, u, s, m, F16)
    lead = raw.shape[:-1]
    k = raw.shape[-1] // type_size * block_size
    return u.reshape(*lead, k), s.reshape(*lead, k // sub), m.reshape(*lead, k // sub)


@njit(cache=True, nogil=True, error_model="numpy")
def _sums_main(u, s, m, geometry, half, out, sums):
    """The main part of a block-sum form, `geometry` (sub, block, zp, top): per form block j (of
    `block` elements, inside type sub-block j * block // sub), the file's codes shifted by an integer
    t into the form's range (code c = u + zp - t in 0..top, t the nearest to minimum / scale that
    keeps it there), stored into `codes` [n, K] unpacked; the scale (rounded to float16 when `half`)
    into `scales` [n, K / block]; the block's constant correction C (the mean of value - scale' (u -
    t): least squares, so that the rest has no bias) into `corrections` [n, K / block] (float64),
    `out` being (codes, scales, corrections). sums += (||rest||^2 with C exact, ||value||^2, the
    file's own rounding: scale^2 / 12 per element), the values gguf's float32 scale * u - minimum."""
    sub, block, zp, top = geometry
    codes, scales, corrections = out
    within = 0.0
    reference = 0.0
    own = 0.0
    n, k = u.shape
    for r in range(n):
        for j in range(k // block):
            t_sub = j * block // sub
            scale, minimum = s[r, t_sub], m[r, t_sub]
            lo, hi = 255, 0
            for i in range(j * block, (j + 1) * block):
                lo = min(lo, np.int64(u[r, i]))
                hi = max(hi, np.int64(u[r, i]))
            t_low, t_high = hi + zp - top, lo + zp
            t = np.int64(np.rint(minimum / scale)) if scale != 0 else np.int64(0)
            t = min(max(t, t_low), t_high)
            stored = _to_half(scale) if half else scale
            total = 0.0
            for i in range(j * block, (j + 1) * block):
                value = scale * np.float32(u[r, i]) - minimum
                codes[r, i] = np.uint8(np.int64(u[r, i]) + zp - t)
                total += np.float64(value) - np.float64(stored) * np.float64(np.int64(u[r, i]) - t)
                reference += np.float64(value) * np.float64(value)
            c = total / block
            for i in range(j * block, (j + 1) * block):
                value = scale * np.float32(u[r, i]) - minimum
                rest = np.float64(value) - np.float64(stored) * np.float64(np.int64(u[r, i]) - t) - c
                within += rest * rest
            scales[r, j] = stored
            corrections[r, j] = c
            own += block * np.float64(scale) * np.float64(scale) / 12.0
    sums[0] += within
    sums[1] += reference
    sums[2] += own


def sums_main(
    u: np.ndarray, s: np.ndarray, m: np.ndarray, block: int, bits: int, half: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Rows of affine codes (u [R, K], s and m [R, K / sub]) in a `bits`-bit form of `block`
    (dividing the type's sub-block): (unsigned codes uint8 [R, K], scales float32 [R, K / block],
    corrections float64 [R, K / block], (rest^2, value^2, own rounding^2)); see _sums_main."""
    r, k = u.shape
    sub = k // s.shape[1]
    codes = np.empty((r, k), np.uint8)
    scales = np.empty((r, k // block), np.float32)
    corrections = np.empty((r, k // block), np.float64)
    sums = np.zeros(3)
    if r:
        _sums_main(
            _readonly(np.ascontiguousarray(u)),
            _readonly(np.ascontiguousarray(s)),
            _readonly(np.ascontiguousarray(m)),
            (sub, block, 1 << (bits - 1), (1 << bits) - 1),
            half,
            (codes, scales, corrections),
            sums,
        )
    return codes, scales, corrections, (float(sums[0]), float(sums[1]), float(sums[2]))


@njit(cache=True, nogil=True)
def _q3_k_codes(b, codes, scales, f16):
    """Q3_K as symmetric blocks of 16: codes q - 4 * (1 - hbit) in -4..3 [n, 256] and scales d * (sc
    - 32) [n, 16] (_q3_k's value is their float32 product)."""
    for i in range(b.shape[0]):
        d = _f16(f16, b, i, 108)
        for g in range(16):
            scales[i, g] = _q3_k_scale(d, b, i, g)
        for h in range(2):
            for l in range(32):
                q, mask = np.int32(b[i, 32 + 32 * h + l]), np.int32(b[i, l]) >> (4 * h)
                for j in range(4):
                    codes[i, 128 * h + 32 * j + l] = ((q >> (2 * j)) & 3) - ((((mask >> j) & 1) ^ 1) << 2)


def q3_k_codes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K rows uint8 [..., row bytes] -> (codes int8 [..., K], scales float32 [..., K / 16])."""
    blocks = _readonly(np.ascontiguousarray(raw).reshape(-1, 110))
    n = blocks.shape[0]
    codes = np.empty((n, 256), np.int8)
    scales = np.empty((n, 16), np.float32)
    if n:
        _q3_k_codes(blocks, codes, scales, F16)
    k = raw.shape[-1] // 110 * 256
    return codes.reshape(*raw.shape[:-1], k), scales.reshape(*raw.shape[:-1], k // 16)
