"""Per-quantization facts and the packers that move GGUF blocks into ONNX Runtime's block forms.

One table, `QUANT_TYPES`, says for every GGUF type moepass accepts how its values are stored:

- "blocks": values are `scale * code` with small integer codes sharing one float scale per block
  (Q8_0, Q4_0, Q6_K, Q5_0, and IQ4_NL and MXFP4 whose codebook values are integers, or integers
  times a power of two). Such a type moves *bit-exactly* into any `BlockForm` whose block divides
  the native block and whose integer range holds the codes; `exact_forms()` derives which.
- "float": F32/F16/BF16, kept as float unless the user asks for quantization.
- "dequantize": formats with fractional minimums or codebooks (Q4_K, ...): their values are
  dequantized (bit for bit as the gguf package does) and requantized, the error measured and reported.

A `BlockForm` (bits, block_size) is the layout shared by com.microsoft::QMoE and MatMulNBits:
per row, codes packed along K (for 4 bits element 2j in the low nibble, 2j+1 in the high nibble),
one float scale per block, value = (u - 2**(bits-1)) * scale with the default zero point. With
`offsets` (MatMulNBits only), a float offset per block is added to every value of the block, by a
second product of the input's block sums: Q4_K's and Q4_1's own codes, scales and minimums, exactly.

Which form each weight takes is decided here only (`expert_form`, `matrix_form`): the exact form
where one exists at blocks of 32 or more, else 8 bits at the largest block that divides the rows
(measured to keep llama.cpp's fidelity: docs/benchmarks.md), unless the user asks otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from gguf import quants as gguf_quants

from moepass.core.errors import MoepassError


@dataclasses.dataclass(frozen=True, order=True)
class BlockForm:
    """An integer block form of ONNX Runtime's QMoE / MatMulNBits (block_size 0: one scale per row,
    QMoE without a block_size attribute)."""

    bits: int
    block_size: int
    offsets: bool = False  # a float offset per block besides the scale (MatMulNBits + block sums)
    # QMoE fc1 only: levels of block-sum features (passes/lower/block_sums.py): the input widened by
    # the sums of each block of `block_size` inputs, once per level, and the rows by the file's
    # per-block offsets quantized in this form, the rest of each level quantized again by the next
    sums: int = 0

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def zero_byte(self) -> int:
        """A byte of packed codes whose every code is the zero point (value 0): two nibbles at 4 bits."""
        return self.zero_point * 0x11 if self.bits == 4 else self.zero_point

    @property
    def plain(self) -> BlockForm:
        """The form without block offsets or block-sum features: the node's bits and block size."""
        return BlockForm(self.bits, self.block_size)

    def feature_stride(self, k: int) -> int:
        """Columns of one level of block-sum features for K inputs: K / block_size, padded to a
        multiple of 64 (ONNX Runtime's CUDA QMoE tiles K by 64; the SM80 layout packs 64 rows)."""
        return -(-(k // self.block_size) // 64) * 64

    def width(self, k: int) -> int:
        """Inputs a matrix of K columns takes in this form: K, plus its block-sum features."""
        return k + self.sums * self.feature_stride(k) if self.sums else k

    def unwidened(self, width: int) -> int:
        """The K whose `width` this is (a widened node's model width)."""
        if not self.sums:
            return width
        k = next((k for k in range(width, 0, -self.block_size) if self.width(k) == width), None)
        if k is None:
            raise ValueError(f"{width} columns are no {self}'s width")
        return k

    @property
    def code_range(self) -> tuple[int, int]:
        """Centered codes (u - zero_point) this form can hold."""
        return -self.zero_point, self.zero_point - 1

    def packed_bytes(self, k: int) -> int:
        return k * self.bits // 8

    def __str__(self) -> str:
        text = f"int{self.bits}/b{self.block_size}" if self.block_size else f"int{self.bits}/row"
        return text + ("+offsets" if self.offsets else "") + (f"+sums x{self.sums}" if self.sums else "")


# Forms the CPU EP runs: 4 and 8 bits; blocks are powers of two >= 16.
CANDIDATE_FORMS = tuple(BlockForm(bits, bs) for bits in (4, 8) for bs in (16, 32, 64, 128))
# Requantized blocks: the largest of these that divides the rows, up to what the type allows
# (QuantType.requantize; 8 bits at block 128 runs fastest of the 8-bit forms on AVX2 and AVX-512
# alike); 4 bits stay at blocks of 32 or 16, where their error is the least.
REQUANTIZE_BLOCKS = {8: (128, 64, 32, 16), 4: (32, 16)}
# ms of one token through one QMoE layer of Qwen3-30B-A3B's sizes on ONNX Runtime's CPU EP, per
# form: (AVX-512/VNNI kernels, AVX2 kernels), as docs/benchmarks.md's operator table records them
# (benchmarks/kernels.py, with the machine and date). The speed class the convert summary states.
QMOE_CPU_DECODE_MS = {
    BlockForm(4, 16): (0.73, 0.86),
    BlockForm(4, 32): (0.56, 0.59),
    BlockForm(4, 64): (0.47, 0.58),
    BlockForm(4, 128): (0.43, 0.56),
    BlockForm(8, 16): (1.06, 1.03),
    BlockForm(8, 32): (0.88, 0.87),
    BlockForm(8, 64): (0.80, 0.80),
    BlockForm(8, 128): (0.75, 0.75),
}


# What ONNX Runtime 1.32's CPU EP holds in anonymous memory once it has prepacked a QMoE node's
# experts, over the bytes the model stores for them (codes and scales), per form and scale type:
# (int8 activations, accuracy_level 4; float activations). The int8 kernels keep a float32 scale
# and a float32 block sum beside every block's codes, and with float16 scales in the model also a
# float32 copy of every scale that they never read on x86: a model takes more memory to run than
# its file's size, and float16 scales more than float32 ones at blocks under 128 (scales_in_float16).
# Measured on the AVX-512 EPYC (2026-12-04): one 128-expert node of Qwen3-30B-A3B's sizes (external
# data) in a fresh process, anonymous memory (/proc/self/smaps_rollup) after the session against
# before; a single node, so the model's other weights and the runtime's own come on top.
QMOE_CPU_HELD = {
    (BlockForm(4, 16), "float16"): (2.01, 1.20),
    (BlockForm(4, 32), "float16"): (1.52, 1.08),
    (BlockForm(4, 64), "float16"): (1.30, 1.06),
    (BlockForm(4, 128), "float16"): (1.09, 0.97),
    (BlockForm(8, 16), "float16"): (1.56, 1.56),
    (BlockForm(8, 32), "float16"): (1.30, 1.30),
    (BlockForm(8, 64), "float16"): (1.15, 1.15),
    (BlockForm(8, 128), "float16"): (1.05, 1.05),
    (BlockForm(4, 16), "float32"): (1.29, 0.62),
    (BlockForm(4, 32), "float32"): (1.17, 0.77),
    (BlockForm(4, 64), "float32"): (1.11, 0.89),
    (BlockForm(4, 128), "float32"): (1.06, 0.94),
    (BlockForm(8, 16), "float32"): (1.17, 1.17),
    (BlockForm(8, 32), "float32"): (1.09, 1.09),
    (BlockForm(8, 64), "float32"): (1.06, 1.06),
    (BlockForm(8, 128), "float32"): (1.03, 1.03),
}


def parse_form(text: str) -> BlockForm | None:
    """BlockForm of its name ("int4/b32", "int4/b32+offsets", "int4/b32+sums x2"); None for anything
    else ("float32")."""
    match = re.fullmatch(r"int(\d+)/b(\d+)(\+offsets)?(?:\+sums x(\d+))?", text)
    return BlockForm(int(match[1]), int(match[2]), bool(match[3]), int(match[4] or 0)) if match else None


def speed_class(form: BlockForm) -> str:
    """The form's CPU decode time against int4 block 32's (the fastest QMoE form), in words."""
    ms = QMOE_CPU_DECODE_MS.get(form.plain)
    if ms is None:
        return "CPU speed not measured"
    base = QMOE_CPU_DECODE_MS[BlockForm(4, 32)]
    text = (
        "the fastest expert form on the CPU"
        if form.plain == BlockForm(4, 32)
        else f"CPU decode {ms[0] / base[0]:.1f}x (AVX-512) / {ms[1] / base[1]:.1f}x (AVX2) the time of int4/b32"
    )
    if form.sums:
        text += f"; gate and up read {form.sums} level{'s' if form.sums > 1 else ''} of block sums besides"
    return text


def _blocks(raw: np.ndarray, ggml_type: GT) -> np.ndarray:
    """View raw rows `[..., row_bytes]` as `[..., n_blocks, type_size]`."""
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // type_size, type_size)


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """A block's fp16 field, as float16 values (a view where possible, no copy)."""
    field = blocks[..., start : start + 2]
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
    high = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [..., n_blocks, 1]
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [..., n_blocks, 32]
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


def decode_iq4_xs(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS: 256-element super-blocks: fp16 d, 6-bit sub-block scales (low 4 bits in scales_l's
    nibbles, high 2 in scales_h), 8 sub-blocks of 32 codebook indices laid out as Q4_0's nibbles;
    value = d * (ls - 32) * kvalues[i]. Both products are exact in float32 (17 and 24 significant
    bits), so the values move exactly into int8 codes with scale d * (ls - 32)."""
    b = _blocks(raw, GT.IQ4_XS)
    lead = b.shape[:-1]
    high = np.ascontiguousarray(b[..., 2:4]).view("<u2")  # [..., 1]
    low = b[..., 4:8]
    ls = (np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*lead, 8)) | (
        (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)) << 4
    )
    scales = _fp16_field(b, 0).astype(np.float32)[..., None] * (ls.view(np.int8) - np.int8(32)).astype(np.float32)
    qs = b[..., 8:].reshape(*lead, 8, 16)
    codes = IQ4_NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
    return codes.reshape(*raw.shape[:-1], -1), scales.reshape(*raw.shape[:-1], -1)


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


def decode_q3_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K: 16-element sub-blocks, value = d * (sc - 32) * q with q in -4..3 (2 low bits and an
    inverted high bit), symmetric: exact in any form of block 16 (compiled: quant_kernels.q3_k_codes)."""
    from moepass.core import quant_kernels

    return quant_kernels.q3_k_codes(raw)


_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(2, 2, 1)


def decode_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: 256-element super-blocks of 16 sub-blocks; value = d * sc[j] * (q - 32), q 6-bit.

    Per half of 128 elements, element nib*64 + part*32 + l takes its low 4 bits from
    ql[part*32 + l] (low nibble if nib == 0 else high) and its high 2 bits from qh[l] at shift
    4*nib + 2*part.
    """
    b = _blocks(raw, GT.Q6_K)
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 2, 32)  # half, -, part, l
    qh = b[..., 128:192].reshape(*lead, 2, 1, 1, 32)  # half, -, -, l
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-3)  # half, nib, part, l
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
    u = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [..., 4 chunks, 2, 32]
    return (
        u.reshape(*raw.shape[:-1], -1),
        (d[..., None] * sc).reshape(*raw.shape[:-1], -1),
        (dmin[..., None] * mins).reshape(*raw.shape[:-1], -1),
    )


def _q4_k_offsets(raw: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> tuple[float, float]:
    from moepass.core import quant_kernels

    return quant_kernels.q4_k_offsets(raw, codes, scales, offsets)


def direct_q8_0_int8(raw: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 codes straight into int8 form bytes: c + 128 is the code with its sign bit flipped."""
    blocks = _blocks(raw, GT.Q8_0)
    np.bitwise_xor(blocks[..., 2:], np.uint8(0x80), out=out.reshape(blocks.shape[:-1] + (32,)))


def direct_q4_0_int4(raw: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 nibbles straight into int4 form bytes (same zero point 8), without unpacking them
    (compiled: quant_kernels.q4_0_int4)."""
    from moepass.core import quant_kernels

    blocks = _blocks(raw, GT.Q4_0)
    target = out.reshape(blocks.shape[:-1] + (16,))
    if not np.may_share_memory(target, out):
        raise ValueError("the int4 codes must be a view that reshapes into blocks")
    quant_kernels.q4_0_int4(blocks, target)


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
    # The type's own 4-bit codes with a scale and an offset per 32 elements, (raw rows) -> (u, scale,
    # offset) with value = scale * u - offset: MatMulNBits carries them exactly as int4 block 32 with
    # block offsets (pack_with_offsets).
    own_codes: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    # The same packing compiled (moepass.core.quant_kernels): (raw rows, codes, scales, offsets) ->
    # (error_sq, reference_sq), the same bits as pack_with_offsets' numpy path, in one pass.
    own_codes_kernel: Callable[..., tuple[float, float]] | None = None
    # Whether every block scale is a float16 value: float16 scales then keep an exact form exact.
    fp16_scales: bool = False
    # Affine types: values scale * u - minimum per sub-block of `affine_block` elements, u codes of
    # `affine_bits` bits (quant_kernels.affine_codes). An expert's gate and up (fc1) keep the codes in
    # any form of as many bits whose block divides the sub-block, the minimums through block-sum
    # features (pack_with_sums).
    affine_bits: int = 0
    affine_block: int = 0
    # How the type's expert values are requantized where they move into no form exactly (or where its
    # exact form is slow, Q6_K's): the fewest bits and the largest 8-bit block that keep llama.cpp's
    # fidelity, measured by KL divergence from the unquantized model on two trained models beside
    # llama.cpp on the same file (benchmarks/agreement.py; table in docs/benchmarks.md): mean KLD
    # within 1.1x llama.cpp's on both. 4 bits (block 32) where the type's own error dwarfs int4's
    # (Q2_K, IQ2_XXS, IQ2_XS, IQ1_*: both models <= 1.06x, their 90 % intervals <= 1.1x); 8 bits at
    # block 32 for 5-bit types with minimums and Q4_1 (at block 128 they reached 1.06-1.16x: a block
    # of 128 mixes four sub-blocks' scales); else 8 bits at block 128.
    requantize_bits: int = 8
    int8_block: int = 128
    # Byte offsets of the fp16 scales (d, dmin) in each block, from ggml's block structs: where a
    # NaN or Inf would make every value of the block non-finite. None: no fp16 scale to check
    # (float types are checked whole; MXFP4's e8m0 scale and IQ1_M's split scale are special cases).
    scales: tuple[int, ...] | None = (0,)
    # Where moepass.cpu_ops has a kernel over this type's own blocks (--expert-format native): the
    # segments of a block its row groups lay out, in their order, as (offset, bytes, unit): float16
    # scales a unit of 2, packed sub-block scales of 1, codes of 4 (moepass.core.row_groups); ()
    # where it has none. The C side's table, cpu_ops/dispatch.c, is held to this one by
    # tests/test_cpu_ops.py.
    cpu_segments: tuple[tuple[int, int, int], ...] = ()

    @property
    def cpu_kernel(self) -> bool:
        return bool(self.cpu_segments)

    @property
    def name(self) -> str:
        return self.ggml_type.name

    @property
    def bits_per_weight(self) -> float:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return type_size * 8 / block

    def row_elements(self, row_bytes: int) -> int:
        """The elements a row of `row_bytes` bytes of this type's blocks holds."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return row_bytes // type_size * block

    def exact_forms(self) -> tuple[BlockForm, ...]:
        """Forms that hold this type's values bit-exactly."""
        if self.storage != "blocks":
            return ()
        lo, hi = self.code_range
        return tuple(
            f
            for f in CANDIDATE_FORMS
            if self.native_block % f.block_size == 0 and f.code_range[0] <= lo and hi <= f.code_range[1]
        )

    def takes_sums(self, form: BlockForm) -> bool:
        """Whether fc1 can hold this type's own codes in `form` (its bits and block; any levels),
        the minimums through block-sum features."""
        return (
            self.affine_bits > 0
            and form.block_size > 0
            and self.affine_block % form.block_size == 0
            and self.affine_bits <= form.bits
        )

    def keeps_codes(self, form: BlockForm) -> bool:
        """Whether `form` holds this type's values bit-exactly: one of its exact forms, or int4
        block 32 with block offsets for a type with its own codes (MatMulNBits only)."""
        return form in self.exact_forms() or (form.offsets and self.own_codes is not None)


QUANT_TYPES: dict[GT, QuantType] = {
    t.ggml_type: t
    for t in [
        QuantType(GT.F32, "float", scales=None),
        QuantType(GT.F16, "float", scales=None),
        QuantType(GT.BF16, "float", scales=None),
        QuantType(
            GT.Q8_0,
            "blocks",
            32,
            (-128, 127),
            decode_q8_0,
            {8: direct_q8_0_int8},
            fp16_scales=True,
            int8_block=32,
            cpu_segments=((0, 2, 2), (2, 32, 4)),
        ),
        QuantType(
            GT.Q4_0,
            "blocks",
            32,
            (-8, 7),
            decode_q4_0,
            {4: direct_q4_0_int4},
            fp16_scales=True,
            int8_block=32,
            cpu_segments=((0, 2, 2), (2, 16, 4)),
        ),
        QuantType(
            GT.Q6_K,
            "blocks",
            16,
            (-32, 31),
            decode_q6_k,
            scales=(208,),
            # the codes in the order the kernels read them (cpu_ops/dispatch.c): for each half and part
            # of a half, the low nibbles of two 16-element runs, then their high pairs
            cpu_segments=((208, 2, 2), (192, 16, 1))
            + tuple(
                segment
                for half in (0, 1)
                for part in (0, 1)
                for segment in (
                    (64 * half + 16 * part, 16, 4),
                    (64 * half + 32 + 16 * part, 16, 4),
                    (128 + 32 * half + 16 * part, 16, 4),
                )
            ),
        ),
        QuantType(
            GT.Q5_0,
            "blocks",
            32,
            (-16, 15),
            decode_q5_0,
            fp16_scales=True,
            int8_block=32,
            cpu_segments=((0, 2, 2), (2, 4, 4), (6, 16, 4)),
        ),
        QuantType(
            GT.IQ4_NL,
            "blocks",
            32,
            (-127, 113),
            decode_iq4_nl,
            fp16_scales=True,
            int8_block=32,
            cpu_segments=((0, 2, 2), (2, 16, 4)),
        ),
        QuantType(
            GT.IQ4_XS,
            "blocks",
            32,
            (-127, 113),
            decode_iq4_xs,
            int8_block=32,
            cpu_segments=((0, 2, 2), (2, 2, 2), (4, 4, 1), (8, 128, 4)),
        ),
        # e8m0 scales are powers of two: float16 holds 2**-24 .. 2**15, what real weights use
        QuantType(
            GT.MXFP4,
            "blocks",
            32,
            (-12, 12),
            decode_mxfp4,
            scales=None,
            fp16_scales=True,
            int8_block=32,
            cpu_segments=((0, 1, 1), (1, 16, 4)),
        ),
        # Fractional minimums or non-integer codebooks: requantized from their values, the added error
        # measured and reported (Q4_1 and Q4_K non-expert matrices keep their codes with block offsets).
        QuantType(
            GT.Q4_1,
            "dequantize",
            own_codes=own_codes_q4_1,
            scales=(0, 2),
            fp16_scales=True,
            int8_block=32,
            affine_bits=4,
            affine_block=32,
            cpu_segments=((0, 2, 2), (2, 2, 2), (4, 16, 4)),
        ),
        QuantType(
            GT.Q4_K,
            "dequantize",
            own_codes=own_codes_q4_k,
            own_codes_kernel=_q4_k_offsets,
            scales=(0, 2),
            affine_bits=4,
            affine_block=32,
            cpu_segments=((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),
        ),
        QuantType(
            GT.Q5_1,
            "dequantize",
            scales=(0, 2),
            int8_block=32,
            affine_bits=5,
            affine_block=32,
            cpu_segments=((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)),
        ),
        QuantType(
            GT.Q5_K,
            "dequantize",
            scales=(0, 2),
            int8_block=32,
            affine_bits=5,
            affine_block=32,
            cpu_segments=((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 4), (48, 128, 4)),
        ),
        QuantType(
            GT.Q2_K,
            "dequantize",
            scales=(80, 82),
            requantize_bits=4,
            affine_bits=2,
            affine_block=16,
            cpu_segments=((80, 2, 2), (82, 2, 2), (0, 16, 1), (16, 64, 4)),
        ),
        # Q3_K is symmetric: its codes move exactly into any form of block 16
        QuantType(
            GT.Q3_K,
            "blocks",
            16,
            (-4, 3),
            decode_q3_k,
            scales=(108,),
            cpu_segments=((108, 2, 2), (96, 12, 1), (0, 32, 4), (32, 64, 4)),
        ),
        QuantType(GT.IQ1_M, "dequantize", scales=None, requantize_bits=4),
        QuantType(GT.IQ1_S, "dequantize", requantize_bits=4),
        QuantType(GT.IQ2_XXS, "dequantize", requantize_bits=4),
        QuantType(GT.IQ2_XS, "dequantize", requantize_bits=4),
        *(QuantType(t, "dequantize") for t in (GT.IQ3_XXS, GT.IQ3_S, GT.IQ2_S)),
    ]
}


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
    from moepass.core import quant_kernels

    return quant_kernels.any_non_finite_fp16(blocks, qt.scales)


# the types moepass.cpu_ops's kernels take, by name
NATIVE_TYPES = tuple(t.name for t in QUANT_TYPES.values() if t.cpu_kernel)


def quant_type(ggml_type: GT, tensor_name: str, file: object = None) -> QuantType:
    """The table entry for a tensor's type, or a clear error naming the tensor (and its file)."""
    qt = QUANT_TYPES.get(ggml_type)
    if qt is None:
        supported = ", ".join(t.name for t in QUANT_TYPES)
        where = f"{file}: " if file is not None else ""
        raise MoepassError(
            f"{where}tensor '{tensor_name}' has type {ggml_type.name}, which moepass cannot convert "
            f"yet (supported: {supported})"
        )
    return qt


def dequantize(raw: np.ndarray, ggml_type: GT, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 values of raw rows `[..., row_bytes]`, bit-identical to the gguf package's own
    dequantizers: compiled per type (moepass.core.quant_kernels, several hundred MB/s per thread),
    gguf's for BF16; written into `out` when given."""
    if ggml_type == GT.F32:
        values = raw.view(np.float32)
    elif ggml_type == GT.F16:
        values = raw.view(np.float16).astype(np.float32)
    else:
        from moepass.core import quant_kernels  # numba: loaded only when blocks are dequantized

        if ggml_type in quant_kernels.KERNELS:
            return quant_kernels.dequantize(raw, ggml_type, out)
        values = gguf_quants.dequantize(raw, ggml_type).astype(np.float32, copy=False)
    if out is None:
        return values
    out[...] = values
    return out


@dataclasses.dataclass
class Packed:
    """Codes and scales of a stack of matrices in one BlockForm.

    `weights`: uint8 `[..., N, K*bits/8]`; `scales`: float32 `[..., N, K/block_size]`; `offsets`
    (forms with offsets): float32 `[..., N, K/block_size]`, added to every value of its block.
    For a requantization, `error_sq` = ||W' - W||^2 and `reference_sq` = ||W||^2 against the GGUF
    values (sums, so that chunks of one tensor add up); both stay 0 for an exact repack.
    """

    form: BlockForm
    weights: np.ndarray
    scales: np.ndarray
    exact: bool
    error_sq: float = 0.0
    reference_sq: float = 0.0
    offsets: np.ndarray | None = None

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


def unpack_values(
    weights: np.ndarray,
    scales: np.ndarray,
    form: BlockForm,
    zero_points: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """Float32 values of a packed stack: (u - zero_point) * scale (+ the block's offset);
    `zero_points` packed as stored (as ONNX Runtime's MatMulNBits quantizer writes them)."""
    codes = unpack_codes(weights, form).astype(np.float32)
    block = form.block_size or codes.shape[-1]
    if zero_points is not None:
        zp = unpack_codes(zero_points, form)[..., : scales.shape[-1]].astype(np.float32) + form.zero_point
        codes = codes + form.zero_point - np.repeat(zp, block, axis=-1)
    values = codes * np.repeat(scales.astype(np.float32), block, axis=-1)
    if offsets is not None:
        values += np.repeat(offsets, block, axis=-1)
    return values


def repack_exact(raw: np.ndarray, qt: QuantType, form: BlockForm, codes: np.ndarray, scales: np.ndarray) -> None:
    """Move GGUF blocks into `form` without changing a single value (form must be in exact_forms).

    Writes into `codes` [..., K*bits/8] and `scales` [..., K/block_size], which may be strided views.
    """
    repeat = qt.native_block // form.block_size
    if form.bits in qt.direct:
        qt.direct[form.bits](raw, codes)
        native_scales = _fp16_field(_blocks(raw, qt.ggml_type), 0)
    elif qt.decode is not None:
        centered, native_scales = qt.decode(raw)
        codes[...] = pack_codes(centered, form)
    else:
        raise ValueError(f"{qt.name} has no exact {form}")
    np.copyto(scales.reshape(native_scales.shape + (repeat,)), native_scales[..., None])


def quantize_values(
    values: np.ndarray, form: BlockForm, importance: np.ndarray | None = None, half_scales: bool = False
) -> Packed:
    """Symmetric block quantization of float values `[..., K]` into `form` (no zero points; block
    size 0: one scale per row), compiled (moepass.core.quant_kernels): 8 bits from the absmax
    scale, then the least-squares scale for its codes; 4 bits by a search over nine scales per block
    (rounded, refitted, re-rounded), keeping the least error. `importance` ([K], or [..., K] like
    `values`, e.g. from an imatrix) weights each input column's error in that choice; the error
    recorded is the unweighted ||W' - W||^2. `half_scales`: scales float16 holds exactly, for a
    model that stores them so (the error measured with them)."""
    from moepass.core import quant_kernels

    codes, scales, error_sq, reference_sq = quant_kernels.quantize_rows(
        values, form.bits, form.block_size, importance, half_scales
    )
    return Packed(form, codes, scales, False, error_sq, reference_sq)


def pack_with_offsets(
    raw: np.ndarray, qt: QuantType, form: BlockForm, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray
) -> Packed:
    """Q4_1 / Q4_K rows (value = s u - o, per 32 elements) into int4 block 32 with block offsets,
    keeping the file's own codes u, scales s and minimums: stored u with scale s is s (u - 8) at
    the default zero point, and the offset 8 s - o makes it s u - o. Only the float32 rounding of
    the offset and of the sum can differ from the gguf package's values: measured, and recorded."""
    if qt.own_codes is None:
        raise ValueError(f"{qt.name} has no codes of its own to keep")
    if qt.own_codes_kernel is not None:
        error_sq, reference_sq = qt.own_codes_kernel(raw, codes, scales, offsets)
        return Packed(form, codes, scales, error_sq == 0.0, error_sq, reference_sq, offsets)
    u, scale, offset = qt.own_codes(raw)
    codes[...] = _pack_unsigned(u.astype(np.uint8, copy=False), form)
    scales[...] = scale
    offsets[...] = np.float32(8) * scale - offset
    ours = unpack_values(codes, scales, form, offsets=offsets)
    reference = dequantize(raw, qt.ggml_type)
    error_sq = float(np.sum(np.square(ours - reference), dtype=np.float64))
    return Packed(
        form, codes, scales, error_sq == 0.0, error_sq, float(np.sum(np.square(reference), dtype=np.float64)), offsets
    )


# Levels of block-sum features tried at most; a level's correction rests on the last one's remainder
MAX_SUM_LEVELS = 4
# The block-sum features' remainder is held below the file's own rounding: its squared error at most
# this share of the squared rounding error the file's codes carry (a step s per element, s^2 / 12),
# so the form adds at most 1/256 to the file's error variance (its error within 1/16 of the file's
# rounding); --exact: below float16's precision (2^-11 of the weights' RMS) or MAX_SUM_LEVELS
SUMS_SHARE_OF_OWN = 1 / 256
SUMS_EXACT_RMS = 2.0**-11


@dataclasses.dataclass
class SumsFit:
    """What block-sum features of 0..MAX_SUM_LEVELS levels leave of a tensor's values (sums over
    its rows, so that chunks add up): `errors[L]` = ||W' - W||^2 with L levels; `reference` =
    ||W||^2; `own` = the squared rounding error the file's own codes carry (scale^2 / 12 each)."""

    errors: list[float]
    reference: float
    own: float

    def __iadd__(self, other: SumsFit) -> SumsFit:
        self.errors = [a + b for a, b in zip(self.errors, other.errors)]
        self.reference += other.reference
        self.own += other.own
        return self

    def levels(self, exact: bool = False) -> int:
        """The fewest levels (1 or more) whose remainder is within the target (see SUMS_SHARE_OF_OWN)."""
        target = self.reference * SUMS_EXACT_RMS**2 if exact else self.own * SUMS_SHARE_OF_OWN
        return next((n for n in range(1, len(self.errors)) if self.errors[n] <= target), len(self.errors) - 1)


def _sums_parts(
    raw: np.ndarray, qt: QuantType, form: BlockForm, half_scales: bool, levels: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]], SumsFit]:
    """The main codes (unsigned, unpacked [R, K]) and scales of `raw` (2-D rows of an affine type) in
    `form`, each level's (packed codes [R, stride * bits / 8], scales [R, stride / block]) and the fit."""
    from moepass.core import quant_kernels

    u, s, m = quant_kernels.affine_codes(raw, qt.ggml_type)
    block, k = form.block_size, u.shape[-1]
    codes, scales, rest, (within, reference, own) = quant_kernels.sums_main(u, s, m, block, form.bits, half_scales)
    stride, blocks = form.feature_stride(k), k // block
    level_form = BlockForm(form.bits, block)
    parts, errors = [], [within + block * float(np.sum(np.square(rest)))]
    for _ in range(levels):
        padded = np.zeros((len(rest), stride), np.float64)
        padded[:, :blocks] = rest
        q, q_scales = _level_codes(padded, level_form, half_scales)
        rest = rest - unpack_values(q, q_scales, level_form)[:, :blocks]
        parts.append((q, q_scales))
        errors.append(within + block * float(np.sum(np.square(rest))))
    return codes, scales, parts, SumsFit(errors, reference, own)


def _level_codes(rest: np.ndarray, form: BlockForm, half_scales: bool) -> tuple[np.ndarray, np.ndarray]:
    """One level of corrections [R, stride] (float64) in `form`: per block the absmax scale, rounded
    up to float16 for `half_scales` (so no code is clipped), codes rounded to nearest: every
    correction within half a step of its value (the bound tests hold the levels to)."""
    blocks = rest.reshape(len(rest), -1, form.block_size)
    top = float(form.zero_point - 1)
    scale = (np.abs(blocks).max(axis=-1) / top).astype(np.float32)
    scale = np.where(scale.astype(np.float64) * top < np.abs(blocks).max(axis=-1), np.nextafter(scale, np.inf), scale)
    if half_scales:
        half = scale.astype(np.float16)
        half = np.where(half.astype(np.float32) < scale, np.nextafter(half, np.float16(np.inf)), half)
        scale = half.astype(np.float32)
    inverse = np.divide(1.0, scale.astype(np.float64), out=np.zeros(scale.shape), where=scale > 0)
    centered = np.clip(np.rint(blocks * inverse[..., None]), -top, top).astype(np.int8).reshape(rest.shape)
    return pack_codes(centered, form), scale


def sums_fit(raw: np.ndarray, qt: QuantType, form: BlockForm, half_scales: bool) -> SumsFit:
    """How 0..MAX_SUM_LEVELS levels of block-sum features hold rows `raw` [R, row bytes] of an affine
    type in `form` (its bits and block): what `SumsFit.levels` chooses the levels of a tensor by."""
    return _sums_parts(raw.reshape(-1, raw.shape[-1]), qt, form, half_scales, MAX_SUM_LEVELS)[3]


def pack_with_sums(
    raw: np.ndarray, qt: QuantType, form: BlockForm, codes: np.ndarray, scales: np.ndarray, half_scales: bool
) -> Packed:
    """Rows of an affine type (value = s u - m per sub-block) into a form with block-sum features:
    the file's own codes u, shifted by an integer t per block into the form's range, with the scale
    s (rounded to float16 for `half_scales`), which QMoE computes as s (u - t); the rest, m' = s t - m
    per block (plus the block's mean of the float16 rounding of s), multiplies the sum of the
    block's inputs: `form.sums` levels of correction columns, each quantized in the form, the next
    holding what the last left. codes [R, width * bits / 8] and scales [R, width / block] (views
    allowed) get the main part first, then each level's columns; the error is measured against the
    gguf package's values."""
    flat = raw.reshape(-1, raw.shape[-1])
    main, main_scales, parts, fit = _sums_parts(flat, qt, form, half_scales, form.sums)
    k, block = main.shape[-1], form.block_size
    codes[..., : form.packed_bytes(k)] = _pack_unsigned(main, form).reshape(*raw.shape[:-1], -1)
    scales[..., : k // block] = main_scales.reshape(*raw.shape[:-1], -1)
    at, scale_at = form.packed_bytes(k), k // block
    for level_codes, level_scales in parts:
        width, blocks = level_codes.shape[-1], level_scales.shape[-1]
        codes[..., at : at + width] = level_codes.reshape(*raw.shape[:-1], -1)
        scales[..., scale_at : scale_at + blocks] = level_scales.reshape(*raw.shape[:-1], -1)
        at, scale_at = at + width, scale_at + blocks
    return Packed(form, codes, scales, fit.errors[form.sums] == 0.0, fit.errors[form.sums], fit.reference)


def _without_features(
    raw: np.ndarray,
    qt: QuantType,
    form: BlockForm,
    codes: np.ndarray,
    scales: np.ndarray,
    importance: np.ndarray | None,
    half_scales: bool,
) -> Packed:
    """A source without codes of its own beside affine ones in a tensor of block-sum features (a
    Q4_0 gate beside a Q4_K up, say): its values in the plain form (exact where they are), its
    correction columns zero."""
    k = qt.row_elements(raw.shape[-1])
    plain = form.plain
    main = pack(raw, qt, plain, importance=importance, half_scales=half_scales)
    codes[..., : plain.packed_bytes(k)] = main.weights
    codes[..., plain.packed_bytes(k) :] = np.uint8(plain.zero_byte)
    scales[..., : k // form.block_size] = main.scales
    scales[..., k // form.block_size :] = 0.0
    return Packed(form, codes, scales, main.exact, main.error_sq, main.reference_sq)


# Values requantized per step of pack (float32 weights: 1 MiB, about a core's L2 cache)
REQUANTIZE_SLICE = 1 << 18


def pack(
    raw: np.ndarray,
    qt: QuantType,
    form: BlockForm,
    codes: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    importance: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
    half_scales: bool = False,
) -> Packed:
    """Raw GGUF rows -> `form`: exact where the formats allow, else requantized with the error measured.

    `codes`, `scales` and (for forms with offsets) `offsets` are where to write (allocated when not
    given; they may be strided views); `importance` weighs a requantization's error per input column
    (see quantize_values); `half_scales`: a requantization's scales are chosen among float16 values.
    """
    k = qt.row_elements(raw.shape[-1])
    k_blocks = form.width(k) // (form.block_size or k)
    if codes is None:
        codes = np.empty(raw.shape[:-1] + (form.packed_bytes(form.width(k)),), dtype=np.uint8)
    if scales is None:
        scales = np.empty(raw.shape[:-1] + (k_blocks,), dtype=np.float32)
    if form.sums:
        if qt.takes_sums(form):
            return pack_with_sums(raw, qt, form, codes, scales, half_scales)
        return _without_features(raw, qt, form, codes, scales, importance, half_scales)
    if form in qt.exact_forms():
        repack_exact(raw, qt, form, codes, scales)
        return Packed(form, codes, scales, True)
    if form.offsets:
        if offsets is None:
            offsets = np.empty(raw.shape[:-1] + (k_blocks,), dtype=np.float32)
        return pack_with_offsets(raw, qt, form, codes, scales, offsets)
    if raw.ndim != 2:  # (strided views of more dimensions would not reshape in place)
        done = quantize_values(dequantize(raw, qt.ggml_type), form, importance, half_scales)
        codes[...], scales[...] = done.weights, done.scales
        return Packed(form, codes, scales, False, done.error_sq, done.reference_sq)
    # A few rows at a time, dequantized into a buffer that stays in the CPU's cache for the quantizer
    # (a whole chunk's float32 values went out to memory and back: a third of the time)
    step = max(1, REQUANTIZE_SLICE // k)
    values = np.empty((min(step, len(raw)), k), np.float32)
    error_sq = reference_sq = 0.0
    for a in range(0, len(raw), step):
        b = min(a + step, len(raw))
        part = dequantize(raw[a:b], qt.ggml_type, out=values[: b - a])
        weights = importance[a:b] if importance is not None and importance.ndim == 2 else importance
        done = quantize_values(part, form, weights, half_scales)
        codes[a:b], scales[a:b] = done.weights, done.scales
        error_sq += done.error_sq
        reference_sq += done.reference_sq
    return Packed(form, codes, scales, False, error_sq, reference_sq)


# ---- form policy: which ONNX Runtime block form each weight takes ---------------------------------
# The integer group sizes ONNX Runtime's CUDA QMoE kernel takes (contrib_ops/cuda/moe/moe_quantization.cc
# and its design notes: 32, 64, 128 on every SM; no evidence for 16), besides one scale per row
CUDA_QMOE_BLOCKS = (32, 64, 128)
# What ONNX Runtime 1.32's expert offload backend requires (see runtime.providers.offload_violations).
OFFLOAD_FORM = BlockForm(4, 32)
# Exact forms are kept from blocks of this size up; Q6_K's only exact form, 8 bits at block 16, costs
# 10 bits a weight and 1.4x the time of block 128 (float32 scales), so it is requantized unless the
# user asks for every exact form (exact=True).
EXACT_MIN_BLOCK = 32


def requantize_form(bits: int, ks: list[int], largest: int = 128) -> BlockForm:
    """The form a tensor (all matrices of a MoE node: QMoE takes one block size) is requantized into:
    `bits` at the largest block of REQUANTIZE_BLOCKS up to `largest` that divides every K, else one
    scale per row (block_size 0: ONNX Runtime's per-row QMoE, no block_size attribute), whatever K is."""
    return BlockForm(
        bits, next((b for b in REQUANTIZE_BLOCKS[bits] if b <= largest and all(k % b == 0 for k in ks)), 0)
    )


def requantized_form(types: list[QuantType], ks: list[int], bits: int | None = None) -> BlockForm:
    """Where a layer's types are requantized (QuantType.requantize_bits, int8_block): the most bits
    any of them needs (or `bits`, when given), 8 bits at the smallest int8_block among them."""
    need = bits or max(qt.requantize_bits for qt in types)
    return requantize_form(need, ks, min(qt.int8_block for qt in types) if need == 8 else 128)


def common_exact_form(types: list[QuantType], bits: int | None = None, exact: bool = False) -> BlockForm | None:
    """The form (of `bits` bits, when given) that holds every type's values bit-exactly, at blocks of
    EXACT_MIN_BLOCK or more unless `exact`: the fewest bits, then the largest block; None if none."""
    least = 16 if exact else EXACT_MIN_BLOCK
    shared = set.intersection(*(set(qt.exact_forms()) for qt in types)) if types else set()
    forms = [f for f in shared if f.block_size >= least and (bits is None or f.bits == bits)]
    return min(forms, key=lambda f: (f.bits, -f.block_size)) if forms else None


@dataclasses.dataclass(frozen=True)
class ExpertForms:
    """How one MoE layer's experts are stored: the node's bit width and block size (ONNX Runtime
    1.32's CPU QMoE takes one for fc1 and fc2), and whether fc1 (gate and up) keeps affine codes
    through block-sum features (their levels are measured on the tensors: SumsFit.levels)."""

    node: BlockForm
    sums: bool = False

    def fc1(self, levels: int) -> BlockForm:
        return dataclasses.replace(self.node, sums=levels if self.sums else 0)

    def __str__(self) -> str:
        return f"{self.node}+sums" if self.sums else str(self.node)


# How a tensor's values fare in a form, best first: moved bit for bit; its own codes with block-sum
# features (fc1); requantized with error far below the file's own (8 bits, or 4 for types under 3
# bits a weight); requantized into 4 bits with error of the file's own order
QUALITY = ("exact", "sums", "near", "lossy")
# Candidates within this share of the fewest bytes are ranked by how many of their weights are inexact
BYTES_SLACK = 0.02
# A down projection may be requantized into 4 bits beside gate and up held exactly in fewer bits a
# weight than this (docs/benchmarks.md, the Q4_K_M and Q3_K_M rows)
LOSSY_DOWN_BESIDE = 4.0


def role_quality(qt: QuantType, form: BlockForm, fc1: bool) -> str:
    """The QUALITY of a tensor of type `qt` in a layer stored in `form` (fc1: gate or up; else down)."""
    if form in qt.exact_forms():
        return "exact"
    if fc1 and qt.takes_sums(form):
        return "sums"
    near_bits = form.bits == 8 or qt.requantize_bits == 4
    if near_bits and 0 < form.block_size <= (qt.int8_block if form.bits == 8 else 32):
        return "near"
    return "lossy"


def _form_bits(qt: QuantType, form: BlockForm, quality: str, exact: bool) -> float:
    """Bits a weight of `qt` takes in `form` (the scales' share included; block-sum features apart)."""
    wide = quality == "exact" and not qt.fp16_scales or quality == "sums" and exact
    return form.bits + (32 if wide else 16) / (form.block_size or 4096)


def expert_form(types: list[QuantType], ks: list[int], choice: str = "auto", exact: bool = False) -> ExpertForms:
    """The QMoE form of one layer's experts, `types` those of gate, up and down and `ks` the K of fc1
    and fc2, by --expert-format `choice`:

    - "auto": the fewest bytes among forms in which gate and up are exact, kept through block-sum
      features or near (QUALITY), and down exact or near, or lossy beside gate and up held exactly
      in fewer than LOSSY_DOWN_BESIDE bits a weight; within BYTES_SLACK of the fewest bytes, the form
      with the fewest inexact weights. Q4_0 int4/b32, Q8_0 int8/b32 (exact); Q4_K_M int8/b128; Q5_K
      int8/b32 with features; Q3_K int4/b16 (exact), beside a Q4_K down too; Q2_K with a Q3_K down
      int4/b16 with features.
    - "int4" / "int8": forms of that width, the fewest lossy weights, then bytes.
    - "offload": OFFLOAD_FORM (ONNX Runtime's expert offload takes no other), features where gate
      and up have affine codes.
    - "cuda": as "auto", at the blocks ONNX Runtime's CUDA QMoE kernel takes (CUDA_QMOE_BLOCKS).
    `exact`: the fewest inexact weights first (Q6_K's int8/b16, features' levels below float16's
    precision with float32 scales). Blocks divide both K; where none does, one scale per row."""
    gate, up, down = types
    # 4 bits at blocks of 16 or 32 only (no type is exact at larger ones; requantized there, error grows)
    blocked = [
        f
        for f in CANDIDATE_FORMS
        if all(k % f.block_size == 0 for k in ks) and f.block_size <= max(REQUANTIZE_BLOCKS[f.bits])
    ]
    candidates = blocked or [BlockForm(4, 0), BlockForm(8, 0)]
    if choice == "offload":
        candidates = [OFFLOAD_FORM]
    elif choice == "cuda":  # what ONNX Runtime's CUDA QMoE kernel takes (capabilities.CUDA_KERNELS)
        candidates = [f for f in candidates if f.block_size in CUDA_QMOE_BLOCKS] or [BlockForm(8, 0)]
    elif choice in ("int4", "int8"):
        candidates = [f for f in candidates if f.bits == int(choice[3:])]
    k1, k2 = ks
    scored = []
    for form in candidates:
        roles = [(gate, True, k1), (up, True, k1), (down, False, k2)]
        quality = [role_quality(qt, form, fc1) for qt, fc1, _ in roles]
        features = any(q == "sums" for q in quality[:2])
        bits = sum(_form_bits(qt, form, q, exact) * k for (qt, _, k), q in zip(roles, quality))
        if features:  # the features' columns on fc1 (about 2 levels of int4, 1 of int8) and fc2's padding
            levels = 2 if form.bits == 4 else 1
            bits += levels * form.feature_stride(k1) * (form.bits + 16 / 32)
        inexact = sum(k for (_, _, k), q in zip(roles, quality) if q in ("near", "lossy"))
        lossy = sum(k for (_, _, k), q in zip(roles, quality) if q == "lossy")
        if choice in ("auto", "cuda") and not exact:
            fc1_ok = all(q != "lossy" for q in quality[:2])
            beside_exact = all(q in ("exact", "sums") for q in quality[:2])
            # a 4-bit down beside gate and up of fewer bits a weight than that, held exactly: their own
            # rounding dwarfs its requantization (Q3_K_M: 1.01-1.02x llama.cpp's KLD at 0.66x the bytes
            # of int8; Q4_K_M's Q4_K downs at 4 bits cost 1.37-1.44x on the markov model)
            fc2_ok = quality[2] != "lossy" or (
                form.bits == 4 and beside_exact and max(gate.bits_per_weight, up.bits_per_weight) < LOSSY_DOWN_BESIDE
            )
            if not (fc1_ok and fc2_ok):
                continue
        scored.append((form, features, bits, inexact, lossy))
    if not scored:  # auto, and nothing keeps llama.cpp's fidelity: 8 bits, requantized
        return ExpertForms(requantized_form(types, ks))
    if choice not in ("auto", "cuda") or exact:
        best = min(scored, key=lambda c: (c[4], c[3], c[2]) if exact else (c[4], c[2], c[3]))
    else:
        fewest = min(c[2] for c in scored)
        close = [c for c in scored if c[2] <= fewest * (1 + BYTES_SLACK)]
        best = min(close, key=lambda c: (c[3], c[2], -c[0].block_size, c[0].bits))
    return ExpertForms(best[0], best[1])


def matrix_form(qt: QuantType, k: int, exact: bool = False, offsets: bool = True) -> BlockForm | None:
    """The MatMulNBits (or GatherBlockQuantized) form of a non-expert matrix with rows of K: its exact
    form where one exists (see common_exact_form); Q4_1 / Q4_K keep their codes in int4 block 32
    with block offsets where the operator takes them (`offsets`); else 8 bits at the largest block
    dividing K. None: the matrix stays float."""
    if qt.storage == "float":
        return None
    form = common_exact_form([qt], exact=exact)
    if form is not None:
        return form
    if offsets and qt.own_codes is not None and k % 32 == 0:
        return BlockForm(4, 32, offsets=True)
    return requantized_form([qt], [k], bits=8)  # never 4 bits: measured 1.2-2x llama.cpp's KLD


def qmoe_takes(form: BlockForm | None, ks: list[int]) -> bool:
    """Whether QMoE's CPU kernel runs `form` for matrices of these K (the bit widths and block sizes
    of CANDIDATE_FORMS, the block dividing every K), so that blocks already in it move unchanged."""
    return form in CANDIDATE_FORMS and all(k % form.block_size == 0 for k in ks)


def scales_in_float16(types: list[QuantType], form: BlockForm) -> bool:
    """Whether weights of these types in `form` store float16 scales in a float32 graph: at blocks
    of 128 and up, but for a form that keeps the file's codes where float16 would round its scales
    (Q6_K's d * sc, IQ4_XS's d * (ls - 32), Q4_K's d * sc beside its block offsets). Below 128,
    float32 scales: ONNX Runtime's CPU kernels take float32 scales for float32 activations, and hold
    float16 ones twice, as stored and widened (QMoE's prepacked copy, QMOE_CPU_HELD; the Cast that
    MatMulNBits and GatherBlockQuantized need, folded at load onto the heap), so the smaller file
    would take more memory to run (int4/b32: 1.30x the float16 form's bytes against 1.52x); at 128
    the two hold the same and float16 is the smaller file."""
    return form.block_size >= 128 and (
        not all(qt.keeps_codes(form) for qt in types) or all(qt.fp16_scales for qt in types)
    )
