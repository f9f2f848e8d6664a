"""Per-quantization facts and the packers that move GGUF blocks into ONNX Runtime's block forms.

One table, `QUANT_TYPES`, says for every GGUF type moepass accepts how its values are stored:

- "blocks": values are `scale * code` with small integer codes sharing one float scale per block
  (Q8_0, Q4_0, Q6_K, Q5_0, and IQ4_NL and MXFP4 whose codebook values are integers, or integers
  times a power of two). Such a type moves *bit-exactly* into any `BlockForm` whose block divides
  the native block and whose integer range holds the codes; `exact_forms()` derives which.
- "float": F32/F16/BF16, kept as float unless the user asks for quantization.
- "dequantize": formats with fractional minimums or codebooks (Q4_K, ...): their values come from
  the gguf package's dequantizer and are requantized, with the error measured and reported.

A `BlockForm` (bits, block_size) is the layout shared by com.microsoft::QMoE and MatMulNBits:
per row, codes packed along K (for 4 bits element 2j in the low nibble, 2j+1 in the high nibble),
one float scale per block, value = (u - 2**(bits-1)) * scale with the default zero point.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT
from gguf import quants as gguf_quants

from moepass.core.errors import MoepassError


@dataclasses.dataclass(frozen=True, order=True)
class BlockForm:
    """An integer block form of ONNX Runtime's QMoE / MatMulNBits (block_size 0: one scale per row,
    QMoE without a block_size attribute)."""

    bits: int
    block_size: int

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def code_range(self) -> tuple[int, int]:
        """Centered codes (u - zero_point) this form can hold."""
        return -self.zero_point, self.zero_point - 1

    def packed_bytes(self, k: int) -> int:
        return k * self.bits // 8

    def __str__(self) -> str:
        return f"int{self.bits}/b{self.block_size}" if self.block_size else f"int{self.bits}/row"


# Forms the CPU EP runs: 4 and 8 bits; blocks are powers of two >= 16.
CANDIDATE_FORMS = tuple(BlockForm(bits, bs) for bits in (4, 8) for bs in (16, 32, 64, 128))
# Used when no form holds a tensor exactly: 8 bits keep the added error near 0.5 % (rel. RMS).
REQUANTIZE_FORM = BlockForm(8, 32)
# CPU time of one token through one QMoE layer of Qwen3-30B-A3B's sizes (hidden 2048, expert ffn 768,
# 128 experts, top-8), ONNX Runtime 1.32 CPU EP, 2 threads, int8 activations (accuracy_level 4;
# 8-bit forms quantize activations whatever the level); random codes, best of 20, 2026-11-30, a
# 2-core Xeon with AVX-512. The speed class the convert summary states for each form.
QMOE_CPU_DECODE_MS = {BlockForm(4, 16): 0.97, BlockForm(4, 32): 0.64, BlockForm(4, 64): 0.58,
                      BlockForm(4, 128): 0.53, BlockForm(8, 16): 1.22, BlockForm(8, 32): 1.05}


def parse_form(text: str) -> BlockForm | None:
    """BlockForm of its name ("int4/b32"); None for anything else ("float32")."""
    match = re.fullmatch(r"int(\d+)/b(\d+)", text)
    return BlockForm(int(match[1]), int(match[2])) if match else None


def speed_class(form: BlockForm) -> str:
    """The form's CPU decode time against int4 block 32's (the common exact form), in words."""
    ms = QMOE_CPU_DECODE_MS.get(form)
    if ms is None:
        return "CPU speed not measured"
    return f"CPU decode {ms / QMOE_CPU_DECODE_MS[BlockForm(4, 32)]:.1f}x the time of int4/b32"


def _blocks(raw: np.ndarray, ggml_type: GT) -> np.ndarray:
    """View raw rows `[..., row_bytes]` as `[..., n_blocks, type_size]`."""
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // type_size, type_size)


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """A block's fp16 field, as float16 values (a view where possible, no copy)."""
    field = blocks[..., start:start + 2]
    if field.strides[-1] != 1:
        field = np.ascontiguousarray(field)
    return field.view("<f2")[..., 0]


def decode_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0: fp16 d, 32 int8 codes; value = d * code."""
    b = _blocks(raw, GT.Q8_0)
    codes = b[..., 2:].view(np.int8)
    return codes.reshape(*raw.shape[:-1], -1), _fp16_field(b, 0)


def decode_q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0: fp16 d, 16 bytes; element j is the low nibble of byte j, element j+16 its high nibble."""
    b = _blocks(raw, GT.Q4_0)
    qs = b[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).view(np.int8) - np.int8(8)
    return codes.reshape(*raw.shape[:-1], -1), _fp16_field(b, 0)


def decode_q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0: fp16 d, 32 high bits, 16 nibble bytes; element j = low nibble of byte j (j < 16) or high
    nibble of byte j-16, plus high bit j at 16; value = d * (q - 16)."""
    b = _blocks(raw, GT.Q5_0)
    high = np.ascontiguousarray(b[..., 2:6]).view("<u4")                    # [..., n_blocks, 1]
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)   # [..., n_blocks, 32]
    qs = b[..., 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    codes = (low | (bits << 4)).view(np.int8) - np.int8(16)
    return codes.reshape(*raw.shape[:-1], -1), _fp16_field(b, 0)


# IQ4_NL's non-linear 4-bit codebook: integer values, so d * kvalue moves exactly into int8 codes.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def decode_iq4_nl(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL: fp16 d, 16 bytes of codebook indices laid out as Q4_0's nibbles; value = d * kvalues[i]."""
    b = _blocks(raw, GT.IQ4_NL)
    qs = b[..., 2:]
    codes = IQ4_NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
    return codes.reshape(*raw.shape[:-1], -1), _fp16_field(b, 0)


# MXFP4 (gpt-oss): E2M1 codes as llama.cpp's kvalues_mxfp4, doubled into integers, with a shared
# E8M0 exponent e per 32 values: value = kvalue * 2**(e - 128) (ggml's E8M0_TO_FP32_HALF).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def decode_mxfp4(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4: exponent byte e, 16 bytes of E2M1 codes laid out as Q4_0's nibbles; value =
    MXFP4_VALUES[code] * 2**(e - 128). Every such scale is a float32 (2**-128 as a subnormal)."""
    b = _blocks(raw, GT.MXFP4)
    qs = b[..., 1:]
    codes = MXFP4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
    scales = np.ldexp(np.float32(1), b[..., 0].astype(np.int32) - 128).astype(np.float32)
    return codes.reshape(*raw.shape[:-1], -1), scales


_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(2, 2, 1)


def decode_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: 256-element super-blocks of 16 sub-blocks; value = d * sc[j] * (q - 32), q 6-bit.

    Per half of 128 elements, element nib*64 + part*32 + l takes its low 4 bits from
    ql[part*32 + l] (low nibble if nib == 0 else high) and its high 2 bits from qh[l] at shift
    4*nib + 2*part.
    """
    b = _blocks(raw, GT.Q6_K)
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 2, 32)        # half, -, part, l
    qh = b[..., 128:192].reshape(*lead, 2, 1, 1, 32)      # half, -, -, l
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-3)   # half, nib, part, l
    high = (qh >> _Q6_K_SHIFTS) & 0x03
    codes = (low | (high << 4)).view(np.int8) - np.int8(32)
    sub_scales = b[..., 192:208].view(np.int8).astype(np.float32)
    scales = _fp16_field(b, 208).astype(np.float32)[..., None] * sub_scales
    return codes.reshape(*raw.shape[:-1], -1), scales.reshape(*raw.shape[:-1], -1)


def own_codes_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 as (codes u 0..15 [..., K], scale, offset [..., K/32]): value = scale * u - offset
    (fp16 d and m: value = d * q + m; byte j holds element j low, j + 16 high)."""
    blocks = _blocks(raw, GT.Q4_1)
    d, m = _fp16_field(blocks, 0).astype(np.float32), _fp16_field(blocks, 2).astype(np.float32)
    qs = blocks[..., 4:]
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return u.reshape(*raw.shape[:-1], -1), d, -m


def own_codes_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K as (codes u 0..15 [..., K], scale, offset [..., K/32]) per 32-element sub-block: value
    = (d * sc) * u - dmin * m, the gguf package's own arithmetic (its 6-bit scale/min unpacking);
    each 64-element chunk holds sub-block 2c in the low nibbles, 2c + 1 in the high ones."""
    from gguf.quants import Q4_K

    blocks = _blocks(raw, GT.Q4_K)
    lead = blocks.shape[:-1]
    d, dmin = _fp16_field(blocks, 0).astype(np.float32), _fp16_field(blocks, 2).astype(np.float32)
    sc, mins = (a.reshape(*lead, 8).astype(np.float32) for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    qs = blocks[..., 16:].reshape(*lead, 4, 1, 32)
    u = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F            # [..., 4 chunks, 2, 32]
    return (u.reshape(*raw.shape[:-1], -1), (d[..., None] * sc).reshape(*raw.shape[:-1], -1),
            (dmin[..., None] * mins).reshape(*raw.shape[:-1], -1))


def direct_q8_0_int8(raw: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 codes straight into int8 form bytes: c + 128 is the code with its sign bit flipped."""
    blocks = _blocks(raw, GT.Q8_0)
    np.bitwise_xor(blocks[..., 2:], np.uint8(0x80), out=out.reshape(blocks.shape[:-1] + (32,)))


def _q4_0_pair_table() -> np.ndarray:
    """Two Q4_0 bytes (q[2j], q[2j+1]) as a little-endian uint16 -> the int4 form's bytes j (low
    byte of the result) and 8+j (high byte)."""
    pair = np.arange(1 << 16, dtype=np.uint32)
    first, second = pair & 0xFF, pair >> 8
    low = (first & 0x0F) | ((second & 0x0F) << 4)
    high = (first >> 4) | (second & 0xF0)
    return (low | (high << 8)).astype(np.uint16)


_Q4_0_PAIRS = _q4_0_pair_table()


def direct_q4_0_int4(raw: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 nibbles straight into int4 form bytes (same zero point 8), without unpacking them.

    Q4_0 byte i holds elements i (low) and i+16 (high); the int4 form's byte j holds elements 2j
    (low) and 2j+1 (high). So for j < 8 byte j = low(q[2j]) | low(q[2j+1]) << 4, and byte 8+j =
    high(q[2j]) | high(q[2j+1]) << 4: one table look-up per pair of bytes gives both.
    """
    blocks = _blocks(raw, GT.Q4_0)
    pairs = _Q4_0_PAIRS[blocks[..., 2:].view("<u2")]                 # [..., n_blocks, 8]
    shuffled = pairs.view(np.uint8).reshape(pairs.shape + (2,))       # [..., n_blocks, j, low/high]
    np.copyto(out.reshape(blocks.shape[:-1] + (2, 8)), np.swapaxes(shuffled, -1, -2))


@dataclasses.dataclass(frozen=True)
class QuantType:
    """What moepass knows about one GGUF tensor type."""

    ggml_type: GT
    storage: str  # "blocks", "float" or "dequantize"
    native_block: int = 0
    code_range: tuple[int, int] = (0, 0)
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
    # Byte-level shortcuts for the common exact repacks, by target bit width: (raw rows, out) writes
    # the packed codes into out (the same bytes `pack_codes(decode(raw)[0])` gives, several times
    # faster). Only for types whose blocks start with their fp16 scale.
    direct: dict[int, Callable[[np.ndarray, np.ndarray], None]] = dataclasses.field(default_factory=dict)
    # Requantized into int4 block 32 (with zero points), experts of this type keep llama.cpp's
    # fidelity: measured on a trained model through llama.cpp's own quantizer, >= 99 % the same
    # argmax as llama.cpp and at most 2x its distance from the exact computation (the auto rows of
    # benchmarks/agreement.py --trained; how each type was decided: docs/benchmarks.md). What
    # --expert-format auto takes for a layer that is requantized anyway (see passes.lower).
    int4_agrees: bool = False
    # The type's own 4-bit codes with a scale and an offset per 32 elements, (raw rows) -> (u, scale,
    # offset) with value = scale * u - offset: int4 block 32 with zero points keeps the codes and
    # rounds only offset / scale to the integer zero point (exact where it is one), instead of
    # requantizing from floats (see pack_own_codes).
    own_codes: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    # Byte offsets of the fp16 scales (d, dmin) in each block, from ggml's block structs: where a
    # NaN or Inf would make every value of the block non-finite. None: no fp16 scale to check
    # (float types are checked whole; MXFP4's e8m0 scale and IQ1_M's split scale are special cases).
    scales: tuple[int, ...] | None = (0,)

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def exact_forms(self) -> tuple[BlockForm, ...]:
        """Forms that hold this type's values bit-exactly."""
        if self.storage != "blocks":
            return ()
        lo, hi = self.code_range
        return tuple(f for f in CANDIDATE_FORMS
                     if self.native_block % f.block_size == 0
                     and f.code_range[0] <= lo and hi <= f.code_range[1])


QUANT_TYPES: dict[GT, QuantType] = {t.ggml_type: t for t in [
    QuantType(GT.F32, "float", scales=None),
    QuantType(GT.F16, "float", scales=None),
    QuantType(GT.BF16, "float", scales=None),
    QuantType(GT.Q8_0, "blocks", 32, (-128, 127), decode_q8_0, {8: direct_q8_0_int8}, int4_agrees=True),
    QuantType(GT.Q4_0, "blocks", 32, (-8, 7), decode_q4_0, {4: direct_q4_0_int4}, int4_agrees=True),
    QuantType(GT.Q6_K, "blocks", 16, (-32, 31), decode_q6_k, int4_agrees=True, scales=(208,)),
    QuantType(GT.Q5_0, "blocks", 32, (-16, 15), decode_q5_0),
    QuantType(GT.IQ4_NL, "blocks", 32, (-127, 113), decode_iq4_nl, int4_agrees=True),
    QuantType(GT.MXFP4, "blocks", 32, (-12, 12), decode_mxfp4, scales=None),
    # Fractional minimums or non-integer codebooks: requantized from the gguf
    # package's dequantization, the added error measured and reported.
    QuantType(GT.Q4_1, "dequantize", int4_agrees=True, own_codes=own_codes_q4_1, scales=(0, 2)),
    QuantType(GT.Q4_K, "dequantize", int4_agrees=True, own_codes=own_codes_q4_k, scales=(0, 2)),
    QuantType(GT.Q5_1, "dequantize", int4_agrees=True, scales=(0, 2)),
    QuantType(GT.Q5_K, "dequantize", int4_agrees=True, scales=(0, 2)),
    QuantType(GT.IQ4_XS, "dequantize", int4_agrees=True),
    QuantType(GT.Q2_K, "dequantize", scales=(80, 82)),
    QuantType(GT.Q3_K, "dequantize", scales=(108,)),
    QuantType(GT.IQ1_M, "dequantize", scales=None),
    # int4 measured beyond 2x llama.cpp's distance from exact (Q3_K at 2.1-2.2x), or not measured (IQ1_*)
    *(QuantType(t, "dequantize") for t in (
        GT.IQ3_XXS, GT.IQ3_S, GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ1_S)),
]}


def has_non_finite(raw: np.ndarray, ggml_type: GT) -> bool:
    """Whether raw GGUF rows (uint8) hold a NaN or Inf: a float value, or a block scale (which
    makes its whole block non-finite). Reads only the scales of quantized blocks."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if ggml_type == GT.F32:
        return not np.isfinite(flat.view(np.float32)).all()
    if ggml_type in (GT.F16, GT.BF16):
        bits = flat.view(np.uint16)
        exponent = 0x7C00 if ggml_type == GT.F16 else 0x7F80
        return bool(((bits & exponent) == exponent).any())
    qt = QUANT_TYPES.get(ggml_type)
    if qt is None:
        return False  # not convertible: refused by name before its values matter
    blocks = flat.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])
    if ggml_type == GT.MXFP4:
        return bool((blocks[:, 0] == 0xFF).any())  # e8m0 0xFF is NaN
    if qt.scales is None:  # IQ1_M: the fp16 scale is spread over the block's scale nibbles
        return not np.isfinite(dequantize(blocks, ggml_type)).all()
    return any(not np.isfinite(_fp16_field(blocks, offset)).all() for offset in qt.scales)


def quant_type(ggml_type: GT, tensor_name: str, file: object = None) -> QuantType:
    """The table entry for a tensor's type, or a clear error naming the tensor (and its file)."""
    qt = QUANT_TYPES.get(ggml_type)
    if qt is None:
        supported = ", ".join(t.name for t in QUANT_TYPES)
        where = f"{file}: " if file is not None else ""
        raise MoepassError(f"{where}tensor '{tensor_name}' has type {ggml_type.name}, which moepass cannot convert "
                           f"yet (supported: {supported})")
    return qt


def dequantize(raw: np.ndarray, ggml_type: GT) -> np.ndarray:
    """Float32 values of raw rows `[..., row_bytes]`, by the gguf package's own dequantizers."""
    if ggml_type == GT.F32:
        return raw.view(np.float32)
    if ggml_type == GT.F16:
        return raw.view(np.float16).astype(np.float32)
    return gguf_quants.dequantize(raw, ggml_type).astype(np.float32, copy=False)


@dataclasses.dataclass
class Packed:
    """Codes and scales of a stack of matrices in one BlockForm.

    `weights`: uint8 `[..., N, K*bits/8]`; `scales`: float32 `[..., N, K/block_size]`;
    `zero_points`: uint8 `[..., N, K/block_size]` (unpacked), or None for the default zero point.
    For a requantization, `error_sq` = ||W' - W||^2 and `reference_sq` = ||W||^2 against the GGUF
    values (sums, so that chunks of one tensor add up); both stay 0 for an exact repack.
    """

    form: BlockForm
    weights: np.ndarray
    scales: np.ndarray
    exact: bool
    error_sq: float = 0.0
    reference_sq: float = 0.0
    zero_points: np.ndarray | None = None

    @property
    def rel_rms_error(self) -> float:
        return rel_rms(self.error_sq, self.reference_sq)


def rel_rms(error_sq: float, reference_sq: float) -> float:
    """||W' - W|| / ||W|| from the two sums of squares (0.0 for an all-zero W)."""
    return float(np.sqrt(error_sq / reference_sq)) if reference_sq else 0.0


def _pack_unsigned(u: np.ndarray, form: BlockForm) -> np.ndarray:
    """Unsigned codes uint8 `[..., K]` -> packed bytes `[..., K*bits/8]` (4 bits: element 2j low)."""
    if form.bits == 8:
        return u
    return u[..., 0::2] | (u[..., 1::2] << 4)


def pack_codes(centered: np.ndarray, form: BlockForm) -> np.ndarray:
    """Centered int8 codes `[..., K]` -> packed uint8 `[..., K*bits/8]` with the default zero point."""
    return _pack_unsigned(centered.view(np.uint8) + np.uint8(form.zero_point), form)  # wraps mod 256: c + zp


def unpack_codes(packed: np.ndarray, form: BlockForm) -> np.ndarray:
    """Inverse of `pack_codes`: centered int16 codes `[..., K]`."""
    if form.bits == 8:
        u = packed
    else:
        u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return u.astype(np.int16) - form.zero_point


def pack_zero_points(zero_points: np.ndarray, form: BlockForm) -> np.ndarray:
    """Per-block zero points `[..., k_blocks]` packed like the codes (two 4-bit values per byte)."""
    z = zero_points.astype(np.uint8)
    if form.bits < 8 and z.shape[-1] % 2:
        z = np.concatenate([z, np.full(z.shape[:-1] + (1,), form.zero_point, np.uint8)], axis=-1)
    return _pack_unsigned(z, form)


def unpack_values(weights: np.ndarray, scales: np.ndarray, form: BlockForm,
                  zero_points: np.ndarray | None = None) -> np.ndarray:
    """Float32 values of a packed stack: (u - zero_point) * scale; `zero_points` packed as stored."""
    codes = unpack_codes(weights, form).astype(np.float32)
    if zero_points is not None:
        zp = unpack_codes(zero_points, form)[..., : scales.shape[-1]].astype(np.float32) + form.zero_point
        codes = codes + form.zero_point - np.repeat(zp, form.block_size, axis=-1)
    return codes * np.repeat(scales, form.block_size, axis=-1)


def repack_exact(raw: np.ndarray, qt: QuantType, form: BlockForm, codes: np.ndarray, scales: np.ndarray) -> None:
    """Move GGUF blocks into `form` without changing a single value (form must be in exact_forms).

    Writes into `codes` [..., K*bits/8] and `scales` [..., K/block_size], which may be strided views.
    """
    repeat = qt.native_block // form.block_size
    if form.bits in qt.direct:
        qt.direct[form.bits](raw, codes)
        native_scales = _fp16_field(_blocks(raw, qt.ggml_type), 0)
    else:
        centered, native_scales = qt.decode(raw)
        codes[...] = pack_codes(centered, form)
    np.copyto(scales.reshape(native_scales.shape + (repeat,)), native_scales[..., None])


def _block_absmax(x: np.ndarray) -> np.ndarray:
    """max |x| over the last axis. Non-negative float32 values order like their int32 bit patterns,
    and an integer reduction over a short axis runs about twice as fast as a float one."""
    return (x.view(np.int32) & np.int32(0x7FFFFFFF)).max(axis=-1).view(np.float32)


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    """int32 keys that order like the float32 values (negative patterns mirrored); self-inverse."""
    i = x.view(np.int32)
    return i ^ ((i >> 31) & np.int32(0x7FFFFFFF))


def _block_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min and max over the last axis, by integer reductions of the ordered bit patterns."""
    keys = _ordered_bits(x)
    return (_ordered_bits(keys.min(axis=-1)).view(np.float32),
            _ordered_bits(keys.max(axis=-1)).view(np.float32))


def _block_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-block sum of a * b (einsum: several times faster than multiply-and-sum over 16-128)."""
    return np.einsum("...i,...i->...", a, b)


def _blocked(values: np.ndarray, form: BlockForm,
             importance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Values `[..., K]` as float32 blocks `[..., K/block, block]`, and the importance weights in the
    same shape (broadcast from `[K]` for every row, or one row of importance per row of values)."""
    k = values.shape[-1]
    shape = (*values.shape[:-1], k // form.block_size, form.block_size)
    x = values.reshape(shape).astype(np.float32, copy=False)
    if importance is None:
        return x, None
    imp = np.asarray(importance, np.float32)
    return x, imp.reshape((1,) * (len(shape) - 2) + shape[-2:]) if imp.ndim == 1 else imp.reshape(shape)


def quantize_values_asymmetric(values: np.ndarray, form: BlockForm, importance: np.ndarray | None = None) -> Packed:
    """Block quantization with a zero point per block: the block's [min, max] onto all 2**bits codes,
    then the least-squares scale for those codes around that zero point (never worse)."""
    x, w = _blocked(values, form, importance)
    levels = (1 << form.bits) - 1
    x_min, x_max = _block_min_max(x)
    lo, hi = np.minimum(x_min, 0), np.maximum(x_max, 0)
    scale = ((hi - lo) / levels).astype(np.float32)
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
    zero = np.clip(np.rint(-lo * inverse), 0, levels)
    u = np.clip(np.rint(x * inverse[..., None]) + zero[..., None], 0, levels)
    c = u - zero[..., None]
    if w is None:
        xc, cc = _block_dot(x, c), _block_dot(c, c)
    else:
        xc, cc = _block_dot(w * x, c), _block_dot(w * c, c)
    scale = np.divide(xc, cc, out=scale.copy(), where=cc > 0).astype(np.float32)
    residual = c * scale[..., None] - x
    packed = _pack_unsigned(u.astype(np.uint8).reshape(values.shape), form)
    return Packed(form, packed, scale, False,
                  error_sq=float(np.sum(_block_dot(residual, residual), dtype=np.float64)),
                  reference_sq=float(np.sum(_block_dot(x, x), dtype=np.float64)),
                  zero_points=zero.astype(np.uint8))


def quantize_values(values: np.ndarray, form: BlockForm, importance: np.ndarray | None = None) -> Packed:
    """Symmetric block quantization of float values `[..., K]` into `form`, minimizing the (weighted)
    squared error per block.

    Codes from the absmax scale (for 4 bits the block's largest magnitude on the code range's most
    negative end, as GGUF's Q4_0 does; for 8 bits on +-127), then the least-squares scale for those
    codes (never worse). For 4 bits a second candidate too: the codes re-rounded with that scale
    and refitted (the refinement llama.cpp's quantizers do), kept where it is better. `importance`
    ([K] or [..., K] like `values`, e.g. from an imatrix) weights each input column's error.
    Candidates are compared through per-block sums (sum w x^2 - 2 s sum w x q + s^2 sum w q^2); the
    reported error is computed from the residuals of the codes kept.
    """
    x, w = _blocked(values, form, importance)
    wx = x if w is None else w * x
    lo, hi = form.code_range

    def codes_for(scale: np.ndarray, clip: bool = True) -> np.ndarray:
        inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
        q = x * inverse[..., None]
        np.rint(q, out=q)
        return np.clip(q, lo, hi, out=q) if clip else q

    def moments(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """sum w x q and sum w q^2 per block."""
        return _block_dot(wx, q), _block_dot(q, q if w is None else w * q)

    if form.bits <= 4:  # few levels: map the signed extreme onto the most negative code, as Q4_0 does
        x_min, x_max = _block_min_max(x)
        extreme = np.where(-x_min > x_max, x_min, x_max)
        scale_a = (extreme / -form.zero_point).astype(np.float32)
        codes_a = codes_for(scale_a)
    else:  # |x| / (absmax / 127) rounds to at most 127: no clipping needed
        scale_a = (_block_absmax(x) / (form.zero_point - 1)).astype(np.float32)
        codes_a = codes_for(scale_a, clip=False)
    xq_a, qq_a = moments(codes_a)
    refit_a = np.divide(xq_a, qq_a, out=np.zeros_like(xq_a), where=qq_a > 0)  # least squares for these codes
    if form.bits > 4:
        # 256 levels: re-rounding rarely pays; the refitted scale alone is never worse than absmax
        scales, codes = refit_a.astype(np.float32), codes_a
    else:
        codes_b = codes_for(refit_a)
        xq_b, qq_b = moments(codes_b)
        scale_b = np.divide(xq_b, qq_b, out=np.zeros_like(xq_b), where=qq_b > 0)
        # error difference of the two candidates (the common sum w x^2 cancels)
        better = (scale_b * scale_b * qq_b - 2 * scale_b * xq_b) < (refit_a * refit_a * qq_a - 2 * refit_a * xq_a)
        scales = np.where(better, scale_b, refit_a).astype(np.float32)
        codes = np.where(better[..., None], codes_b, codes_a)
    packed = pack_codes(codes.astype(np.int8).reshape(values.shape), form)
    xx = _block_dot(x, x)
    if form.bits > 4 and w is None:
        # the kept codes are codes_a with the least-squares scale: per block the error is
        # sum x^2 - 2 s sum x q + s^2 sum q^2 from moments already at hand (in float64), no residual pass
        s64, xq64, qq64 = (a.astype(np.float64) for a in (scales, xq_a, qq_a))
        error = np.maximum(xx.astype(np.float64) - 2 * s64 * xq64 + s64 * s64 * qq64, 0)
        return Packed(form, packed, scales, False, error_sq=float(np.sum(error)),
                      reference_sq=float(np.sum(xx, dtype=np.float64)))
    residual = np.multiply(codes, scales[..., None], out=codes)  # codes are packed: reuse their memory
    np.subtract(residual, x, out=residual)
    return Packed(form, packed, scales, False,
                  error_sq=float(np.sum(_block_dot(residual, residual), dtype=np.float64)),
                  reference_sq=float(np.sum(xx, dtype=np.float64)))


def pack(raw: np.ndarray, qt: QuantType, form: BlockForm, codes: np.ndarray | None = None,
         scales: np.ndarray | None = None, importance: np.ndarray | None = None,
         zero_points: np.ndarray | None = None) -> Packed:
    """Raw GGUF rows -> `form`: exact where the formats allow, else requantized with the error measured.

    `codes` and `scales` are where to write (allocated when not given; they may be strided views);
    `importance` weighs a requantization's error per input column (see quantize_values). With
    `zero_points` (uint8 [..., k_blocks] to write into), a requantization uses a zero point per block
    (quantize_values_asymmetric) and an exact repack writes the default one.
    """
    k = raw.shape[-1] // GGML_QUANT_SIZES[qt.ggml_type][1] * GGML_QUANT_SIZES[qt.ggml_type][0]
    if codes is None:
        codes = np.empty(raw.shape[:-1] + (form.packed_bytes(k),), dtype=np.uint8)
    if scales is None:
        scales = np.empty(raw.shape[:-1] + (k // form.block_size,), dtype=np.float32)
    if form in qt.exact_forms():
        repack_exact(raw, qt, form, codes, scales)
        if zero_points is not None:
            zero_points[...] = form.zero_point
        return Packed(form, codes, scales, True, zero_points=zero_points)
    if zero_points is not None and qt.own_codes is not None and form == OWN_CODES_FORM:
        return _pack_keeping_codes(raw, qt, codes, scales, zero_points, importance)
    values = dequantize(raw, qt.ggml_type)
    requantized = quantize_values(values, form, importance)
    if zero_points is not None:  # the better of symmetric (default zero point) and asymmetric codes
        asymmetric = quantize_values_asymmetric(values, form, importance)
        if asymmetric.error_sq < requantized.error_sq:
            requantized = asymmetric
            zero_points[...] = asymmetric.zero_points
        else:
            zero_points[...] = form.zero_point
    codes[...] = requantized.weights
    scales[...] = requantized.scales
    return Packed(form, codes, scales, False, requantized.error_sq, requantized.reference_sq, zero_points)


OWN_CODES_FORM = BlockForm(4, 32)


def own_zero_points(scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """offset / scale per block: the zero point that keeps a block's own codes exactly."""
    return np.divide(offset, scale, out=np.zeros_like(scale), where=scale != 0)


def pack_own_codes(u: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                   importance: np.ndarray | None = None) -> Packed:
    """4-bit codes that carry a scale and an offset per 32 elements (value = scale * u - offset:
    Q4_1, Q4_K) into int4 block 32 with zero points, keeping the codes: the zero point is offset /
    scale rounded to an integer (exact where it is one), then the least-squares scale for those
    codes (never worse than the file's own; weighted by `importance` when given). A block whose
    scale is 0 holds the constant -offset: codes 0 and zero point 15.

    Every sum the fit and the reported error need follows from the blocks' code moments (sum u,
    sum u^2, weighted where asked), so the cost is about one pass over the codes."""
    form = OWN_CODES_FORM
    levels = (1 << form.bits) - 1
    flat = scale == 0
    if flat.any():  # only the offset is left: s * (0 - 15) = -offset
        u = np.where(np.repeat(flat, form.block_size, axis=-1), np.uint8(0), u)
        scale = np.where(flat, offset / levels, scale)
    z = np.clip(np.rint(own_zero_points(scale, offset)), 0, levels)
    z = np.where(flat, levels, z)
    uf = u.reshape(*scale.shape, form.block_size).astype(np.float32)

    def moments(w: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """sum w, sum w u, sum w u^2 per block, in float64."""
        if w is None:
            return (np.float64(form.block_size), uf.sum(-1, dtype=np.float64),
                    _block_dot(uf, uf).astype(np.float64))
        wu = w * uf
        return (np.broadcast_to(w.sum(-1, dtype=np.float64), scale.shape), wu.sum(-1, dtype=np.float64),
                _block_dot(wu, uf).astype(np.float64))

    s64, o64, z64 = scale.astype(np.float64), offset.astype(np.float64), z.astype(np.float64)

    def sums(m0, m1, m2):
        """sum x c, sum c c, sum x x for x = s u - o (the GGUF values), c = u - z (the codes kept)."""
        return (s64 * m2 - (s64 * z64 + o64) * m1 + o64 * z64 * m0, m2 - 2 * z64 * m1 + z64 * z64 * m0,
                s64 * s64 * m2 - 2 * s64 * o64 * m1 + o64 * o64 * m0)

    plain = sums(*moments(None))
    weights = None if importance is None else _blocked(uf.reshape(u.shape), form, importance)[1]
    xc, cc, _ = plain if weights is None else sums(*moments(weights))
    fitted = np.divide(xc, cc, out=s64.copy(), where=cc > 0)
    xc, cc, xx = plain
    error = np.maximum(xx - 2 * fitted * xc + fitted * fitted * cc, 0)
    return Packed(form, _pack_unsigned(u.astype(np.uint8, copy=False), form), fitted.astype(np.float32), False,
                  error_sq=float(np.sum(error)), reference_sq=float(np.sum(xx)), zero_points=z.astype(np.uint8))


def _pack_keeping_codes(raw: np.ndarray, qt: QuantType, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                        importance: np.ndarray | None) -> Packed:
    """pack() for a type with its own 4-bit codes into int4 block 32 with zero points: the codes are
    kept (pack_own_codes) in every row whose blocks' zero points lie in the code range, as the
    quantizers that write these types make them; a row with a zero point outside (the error of
    clipping it would be large) is requantized from its values instead."""
    u, scale, offset = qt.own_codes(raw)
    fraction = own_zero_points(scale, offset)
    levels = (1 << OWN_CODES_FORM.bits) - 1
    outside = ((fraction < -0.5) | (fraction > levels + 0.5)).any(-1)
    per_row_importance = importance is not None and np.ndim(importance) > 1
    error_sq = reference_sq = 0.0
    for rows, keep in ((~outside, True), (outside, False)):
        if not rows.any():
            continue
        imp = importance[rows] if per_row_importance else importance
        if keep:
            part = pack_own_codes(u[rows], scale[rows], offset[rows], imp)
        else:
            z = np.empty(zero_points[rows].shape, np.uint8)
            part = pack(raw[rows], dataclasses.replace(qt, own_codes=None), OWN_CODES_FORM, importance=imp,
                        zero_points=z)
        codes[rows], scales[rows], zero_points[rows] = part.weights, part.scales, part.zero_points
        error_sq, reference_sq = error_sq + part.error_sq, reference_sq + part.reference_sq
    return Packed(OWN_CODES_FORM, codes, scales, False, error_sq, reference_sq, zero_points)


def requantize_form(bits: int, ks: list[int]) -> BlockForm:
    """The form experts are requantized into: `bits` with blocks of 32, else 16, when the block
    divides every matrix's K (QMoE takes one block size for fc1 and fc2); else one scale per output
    row (block_size 0: ONNX Runtime's per-row QMoE, no block_size attribute), whatever K is."""
    return BlockForm(bits, next((b for b in (32, 16) if all(k % b == 0 for k in ks)), 0))


def best_exact_form(qt: QuantType) -> BlockForm | None:
    """The smallest exact form: fewest bits, then the largest block (fewest scales)."""
    forms = sorted(qt.exact_forms(), key=lambda f: (f.bits, -f.block_size))
    return forms[0] if forms else None


def choose_expert_form(types: list[QuantType], bits: int | None = None) -> BlockForm:
    """One form for all expert matrices of a layer (QMoE takes one bit width and block size).

    Picks the candidate (of `bits` bits, when given) that holds the most of the tensors exactly, then
    the fewest bits, then the largest block; falls back to block 32 (8 bits unless `bits` says
    otherwise) when none is exact.
    """
    candidates = {f for qt in types for f in qt.exact_forms() if bits is None or f.bits == bits}
    if not candidates:
        return BlockForm(bits, 32) if bits else REQUANTIZE_FORM
    return min(candidates, key=lambda f: (-sum(f in qt.exact_forms() for qt in types), f.bits, -f.block_size))


# ---- form policy: which ONNX Runtime block form each weight takes ---------------------------------
# What ONNX Runtime 1.32's expert offload backend requires (see runtime.providers.offload_violations).
OFFLOAD_FORM = BlockForm(4, 32)


def qmoe_takes(form: BlockForm | None, ks: list[int]) -> bool:
    """Whether QMoE's CPU kernel runs `form` for matrices of these K (the bit widths and block sizes
    of CANDIDATE_FORMS, the block dividing every K), so that blocks already in it move unchanged."""
    return form in CANDIDATE_FORMS and all(k % form.block_size == 0 for k in ks)


def expert_form(types: list[QuantType], choice: str = "auto") -> BlockForm:
    """The QMoE form of one layer's experts, by --expert-format `choice`. auto: the exact form when
    every expert matrix moves bit-exactly (Q8_0, Q4_0, Q6_K, ...); else, since the layer is
    requantized anyway, int4 block 32 when every type's int4 requantization was measured to keep
    llama.cpp's fidelity (QuantType.int4_agrees: a Q4_K_M layer, Q4_K gate/up and Q6_K down), else
    the form holding the most matrices exactly (int8 block 32 when none does). "int4" / "int8": that
    width; "offload": OFFLOAD_FORM."""
    if choice == "offload":
        return OFFLOAD_FORM
    if choice in ("int4", "int8"):
        return choose_expert_form(types, bits=int(choice[3]))
    exact = choose_expert_form(types)
    if all(exact in qt.exact_forms() for qt in types):  # everything moves bit-exactly: keep it so
        return exact
    # requantized anyway: the fast form, where it was measured to keep llama.cpp's fidelity
    if all(qt.int4_agrees for qt in types):
        return choose_expert_form(types, bits=4)
    return exact


def matrix_form(qt: QuantType, choice: str = "auto", requantize_bits: int | None = None) -> BlockForm | None:
    """The form of a non-expert matrix: its exact form when its blocks move exactly; else
    requantized into `requantize_bits` (default: 8, or 4 for --expert-format int4/offload) block 32;
    None: it stays float."""
    if qt.storage == "blocks":
        return best_exact_form(qt)
    if qt.storage == "dequantize":
        return BlockForm(requantize_bits or (4 if choice in ("int4", "offload") else 8), 32)
    return None


def takes_zero_points(form: BlockForm | None, types: list[QuantType]) -> bool:
    """Whether 4-bit requantization into `form` gets a zero point per block (the better of it and
    none, block by block); exact forms and 8 bits keep the symmetric codes."""
    return form is not None and form.bits == 4 and any(form not in qt.exact_forms() for qt in types)
