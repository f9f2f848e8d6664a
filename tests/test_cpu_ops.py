"""moepass.cpu_ops, moepass's own CPU kernels inside ONNX Runtime (--expert-format native).

The kernels against a numpy integer reference written from the definition (cpu_ops/kernels.h:
activations quantized per row as llama.cpp's Q8_0, each block's integer dot product, the blocks of a
row summed in order as fma(d_w * d_x, sumi, acc)), bit for bit, on every instruction set this CPU
has (run again with AVX-512 hidden by .ci/run); the MoE operator against the same products composed
in numpy, alone and in a batch; the converted fixtures against llama.cpp on the same files.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize as gguf_quantize
from onnx import TensorProto, helper
from support.oracle import PROMPT, check_against_exact, dequantized_copy, llama_logits, routing_near_ties, three_ways

import moepass
import moepass.cpu_ops as cpu_ops
from moepass.core import row_groups
from moepass.core.model_io import load_model
from moepass.core.moe_nodes import is_native, moe_nodes
from moepass.core.quants import NATIVE_TYPES, QUANT_TYPES
from moepass.core.row_groups import ROW_GROUP
from moepass.runtime import KVCache, load

pytestmark = pytest.mark.skipif(cpu_ops.unavailable() is not None, reason=f"{cpu_ops.unavailable()}")

TYPES = [GT[name] for name in NATIVE_TYPES]


def _here(isa: str) -> bool:
    try:
        cpu_ops.matmul(isa, GT.Q8_0, np.zeros((1, 34), np.uint8), np.zeros((1, 32), np.float32))
    except ValueError:
        return False
    return True


ISAS = [isa for isa in cpu_ops.ISAS if _here(isa)]


def reference_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's Q8_0 activations of one row (its AVX2 quantizer's arithmetic): per 32 values
    d = amax / 127 stored as float16, codes round-half-even(x * 127 / amax), and their sums."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        factor = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * factor[:, None]).astype(np.int8)
    return codes.reshape(-1), d, codes.astype(np.int32).sum(axis=1)


def reference_activations_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's Q8_K activations of one row (quantize_row_q8_K_ref, which x86 runs): per 256 values,
    `max` the first of largest magnitude, iscale = -127 / max in float32, codes
    round-half-even(iscale * x) capped at 127, d = 1 / iscale; the sums of each 16 codes."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    codes = np.zeros(blocks.shape, np.int8)
    d = np.zeros(len(blocks), np.float32)
    for b, row in enumerate(blocks):
        top = row[np.argmax(np.abs(row))]
        if top == 0:
            continue
        iscale = np.float32(-127) / top
        codes[b] = np.minimum(np.rint(iscale * row), 127).astype(np.int8)
        d[b] = np.float32(1) / iscale
    return codes.reshape(-1), d, codes.astype(np.int32).reshape(-1, 16).sum(axis=1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _fma(scale: np.ndarray, value: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """fma(scale, value, acc) in float32 (scale, value, acc float32): the product is exact in float64,
    and the sum rounded once there, then to float32."""
    return (scale.astype(np.float32).astype(np.float64) * value.astype(np.float32) + acc.astype(np.float64)).astype(
        np.float32
    )


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
Q8_K_TYPES = (GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_XS)  # the types llama.cpp multiplies with Q8_K activations


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """GGML's 4-bit runs: bytes [.., n] -> codes [.., 2n], the low nibbles first."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1).astype(np.int64)


def integer_form(blocks: np.ndarray, ggml_type: GT):
    """GGUF rows [N, bytes] as ggml's definitions read them: (d [N, B] float32, dmin [N, B] or None,
    sub-block scales [N, B, S] int, sub-block minimums [N, B, S] or None, signed codes [N, B, block]
    int), value = d * scale * code - dmin * minimum."""
    n = blocks.shape[0]
    size = GGML_QUANT_SIZES[ggml_type][1]
    by = blocks.reshape(n, -1, size)
    ones = np.ones(by.shape[:2] + (1,), np.int64)
    if ggml_type in (GT.Q4_0, GT.IQ4_NL, GT.Q8_0):
        if ggml_type == GT.Q8_0:
            codes = by[:, :, 2:].copy().view(np.int8).astype(np.int64)
        else:
            codes = _nibbles(by[:, :, 2:])
            codes = codes - 8 if ggml_type == GT.Q4_0 else IQ4_VALUES[codes]
        return _fp16(by[:, :, :2]), None, ones, None, codes
    if ggml_type in (GT.Q5_0, GT.Q4_1, GT.Q5_1):  # nibbles (and fifth bits: bit j of qh, element j)
        offset = 4 if ggml_type == GT.Q4_1 else 8 if ggml_type == GT.Q5_1 else 6
        codes = _nibbles(by[:, :, offset:])
        if ggml_type != GT.Q4_1:
            qh = by[:, :, offset - 4 : offset].copy().view("<u4").astype(np.int64)
            codes = codes + (((qh >> np.arange(32)) & 1) << 4)
        if ggml_type == GT.Q5_0:
            return _fp16(by[:, :, :2]), None, ones, None, codes - 16
        return _fp16(by[:, :, :2]), -_fp16(by[:, :, 2:4]), ones, ones, codes  # value d q + m: dmin = -m
    if ggml_type == GT.MXFP4:  # 2^(e - 128) times E2M1 values doubled into integers
        scale = np.ldexp(np.float64(1), by[:, :, 0].astype(np.int64) - 128).astype(np.float32)
        return scale, None, ones, None, MXFP4_VALUES[_nibbles(by[:, :, 1:])]
    if ggml_type in (GT.Q4_K, GT.Q5_K):
        q = by[:, :, 4:16].astype(np.int64)
        scales = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
        mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
        start = 16 if ggml_type == GT.Q4_K else 48
        codes = _nibbles(by[:, :, start:].reshape(n, -1, 4, 32)).reshape(n, -1, 256)
        if ggml_type == GT.Q5_K:
            qh = by[:, :, 16:48].astype(np.int64)  # bit j of qh[l]: element l of sub-block j
            codes += np.concatenate([((qh >> j) & 1) << 4 for j in range(8)], axis=-1)
        return _fp16(by[:, :, 0:2]), _fp16(by[:, :, 2:4]), scales, mins, codes
    if ggml_type == GT.Q6_K:
        ql, qh = by[:, :, :128].astype(np.int64), by[:, :, 128:192].astype(np.int64)
        parts = []
        for half in range(2):
            lo, hi = ql[..., 64 * half : 64 * half + 32], ql[..., 64 * half + 32 : 64 * half + 64]
            h = qh[..., 32 * half : 32 * half + 32]
            parts += [(lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4), (lo >> 4) | (((h >> 4) & 3) << 4),
                      (hi >> 4) | (((h >> 6) & 3) << 4)]
        scales = by[:, :, 192:208].copy().view(np.int8).astype(np.int64)
        return _fp16(by[:, :, 208:210]), None, scales, None, np.concatenate(parts, axis=-1) - 32
    if ggml_type in (GT.Q2_K, GT.Q3_K):  # element 128 n + 32 j + l: bits 2j.. of qs[32 n + l]
        qs = by[:, :, 16:80] if ggml_type == GT.Q2_K else by[:, :, 32:96]
        qs = qs.astype(np.int64).reshape(n, -1, 2, 1, 32)
        codes = (qs >> (2 * np.arange(4)[:, None])) & 3  # [N, B, n, j, l]
        if ggml_type == GT.Q2_K:
            sc = by[:, :, :16].astype(np.int64)
            return _fp16(by[:, :, 80:82]), _fp16(by[:, :, 82:84]), sc & 15, sc >> 4, codes.reshape(n, -1, 256)
        hmask = by[:, :, :32].astype(np.int64).reshape(n, -1, 1, 1, 32)
        high = (hmask >> (4 * np.arange(2)[:, None, None] + np.arange(4)[:, None])) & 1
        q = by[:, :, 96:108].astype(np.int64)
        scales = np.stack([((q[..., s] & 15) if s < 8 else (q[..., s - 8] >> 4)) | (((q[..., 8 + s % 4] >> 2 * (s // 4)) & 3) << 4)
                           for s in range(16)], axis=-1) - 32
        return _fp16(by[:, :, 108:110]), None, scales, None, (codes + 4 * high - 4).reshape(n, -1, 256)
    assert ggml_type == GT.IQ4_XS
    high = by[:, :, 2].astype(np.int64) | (by[:, :, 3].astype(np.int64) << 8)
    low = by[:, :, 4:8].astype(np.int64)
    scales = np.stack([((low[..., ib // 2] >> 4 * (ib % 2)) & 15) | (((high >> 2 * ib) & 3) << 4) for ib in range(8)],
                      axis=-1) - 32
    codes = IQ4_VALUES[_nibbles(by[:, :, 8:].reshape(n, -1, 8, 16)).reshape(n, -1, 256)]
    return _fp16(by[:, :, 0:2]), None, scales, None, codes


def reference_matmul(blocks: np.ndarray, ggml_type: GT, a: np.ndarray) -> np.ndarray:
    """The definition in numpy: exact integer block sums, each sub-block's times its scale, then per
    block in order acc = fma(d_w * d_x, sumi, acc) (and fma(-(dmin_w * d_x), summ, acc) after it for
    the types with minimums, summ the minimums times the sub-blocks' activation sums)."""
    d, dmin, scales, mins, codes = integer_form(blocks, ggml_type)
    n, n_blocks, subs = scales.shape
    out = np.empty((a.shape[0], n), np.float32)
    for t, row in enumerate(a):
        quantized = reference_activations_q8_k(row) if ggml_type in Q8_K_TYPES else reference_activations(row)
        qs, dx = quantized[0].reshape(n_blocks, subs, -1).astype(np.int64), quantized[1]
        dots = (codes.reshape(n, n_blocks, subs, -1) * qs).sum(-1)
        sumi = (scales * dots).sum(-1)
        summ = (mins * qs.sum(-1)).sum(-1) if mins is not None else None
        acc = np.zeros(n, np.float32)
        for b in range(n_blocks):
            acc = _fma(d[:, b] * dx[b], sumi[:, b], acc)
            if summ is not None:
                acc = _fma(-(dmin[:, b] * dx[b]), summ[:, b], acc)
        out[t] = acc
    return out


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_references_read_the_blocks_as_gguf_does(ggml_type):
    """integer_form's d * scale * code - dmin * minimum is gguf-py's dequantization of the same rows."""
    from gguf.quants import dequantize

    blocks = random_blocks(np.random.default_rng(int(ggml_type)), ggml_type, 16, 2 * GGML_QUANT_SIZES[ggml_type][0])
    d, dmin, scales, mins, codes = integer_form(blocks, ggml_type)
    per_sub = codes.shape[-1] // scales.shape[-1]
    values = d[..., None] * (np.repeat(scales, per_sub, axis=-1) * codes)
    if dmin is not None:
        values = values - dmin[..., None] * np.repeat(mins, per_sub, axis=-1)
    theirs = dequantize(blocks, ggml_type).reshape(values.shape)
    np.testing.assert_allclose(values, theirs, rtol=1e-6, atol=1e-6 * np.abs(theirs).max())


def random_blocks(rng, ggml_type: GT, n: int, k: int) -> np.ndarray:
    """Rows [n, k] of `ggml_type`: quantized by gguf where it can; K-quants random bytes (every scale
    byte, -128 too) with float16 scales of a sane spread."""
    if ggml_type in (GT.Q4_0, GT.Q8_0):
        return gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    if ggml_type == GT.MXFP4:  # exponents near real weights', and the two subnormal scales
        raw[:, 0] = rng.integers(118, 124, len(raw))
        raw[::7, 0], raw[3::7, 0] = 0, 1
    for offset in QUANT_TYPES[ggml_type].scales or ():
        raw[:, offset : offset + 2] = rng.uniform(1e-4, 1e-3, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def gather_model(table: np.ndarray, ggml_type: GT) -> bytes:
    """A moepass::GatherPacked node over a table of blocks [rows, row bytes] (the GGUF's own order)."""
    node = helper.make_node("GatherPacked", ["table", "ids"], ["y"], domain=cpu_ops.DOMAIN, packed_type=int(ggml_type))
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", None])],
                              [onnx.numpy_helper.from_array(table, "table")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(cpu_ops.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gathered_rows_are_the_blocks_values_bit_for_bit(ggml_type):
    """GatherPacked's rows (the token embedding of a native conversion) are gguf-py's dequantization
    of the same blocks, bit for bit, on hostile bytes too (every scale and code byte random), for any
    shape of indices; an index outside the table is an error naming it, not a read past the end."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(int(ggml_type))
    block = GGML_QUANT_SIZES[ggml_type][0]
    rows, k = 37, block * (3 if block == 256 else 5)
    table = random_blocks(rng, ggml_type, rows, k)
    hostile = rng.integers(0, 256, table.shape, dtype=np.uint8)  # any bytes, float16 NaNs and infinities too
    options = ort.SessionOptions()
    cpu_ops.register(options)
    for blocks in (table, hostile):
        session = ort.InferenceSession(gather_model(blocks, ggml_type), options, providers=["CPUExecutionProvider"])
        ids = np.array([[0, 36, 5, 5], [17, 1, 0, 36]], np.int64)
        ours = session.run(None, {"ids": ids})[0]
        with np.errstate(invalid="ignore", over="ignore"):  # gguf-py's arithmetic on the hostile bytes' NaNs
            theirs = dequantize(blocks, ggml_type).reshape(rows, k)[ids]
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
    with pytest.raises(Exception, match="index 37 is outside the table's 37 rows"):
        session.run(None, {"ids": np.array([[3, 37]], np.int64)})


def test_the_kernels_take_the_types_the_quant_table_says():
    """cpu_ops/dispatch.c's table and QuantType.cpu_kernel name the same types."""
    for ggml_type, qt in QUANT_TYPES.items():
        if qt.storage == "float":
            continue
        from gguf.constants import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[ggml_type]
        k = block * 2
        try:
            cpu_ops.matmul("scalar", int(ggml_type), np.zeros((1, 2 * size), np.uint8), np.zeros((1, k), np.float32))
            taken = True
        except ValueError:
            taken = k % 32 != 0  # the activations' blocks are of 32
        assert taken == qt.cpu_kernel, ggml_type.name
    assert set(NATIVE_TYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                 "IQ4_NL", "IQ4_XS", "MXFP4"}


@pytest.mark.parametrize("isa", ISAS)
def test_activations_are_quantized_as_llama_cpp_quantizes_them(isa):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(768) * rng.choice([1e-3, 1.0, 40.0], 768)).astype(np.float32)
    x[32:64] = 0.0  # an all-zero block: scale 0, codes 0
    x[64:96] = np.float32(0.5) * np.arange(-16, 16, dtype=np.float32)  # halves: ties round to even
    x[300], x[400] = -90.0, 90.0  # Q8_K: two of largest magnitude, the first sets the sign
    x[512:768] = 0.0  # an all-zero super-block
    for activation, reference in (("q8_0", reference_activations), ("q8_k", reference_activations_q8_k)):
        qs, d, sums = cpu_ops.quantize(isa, x, activation)
        want = reference(x)
        for got, expected, what in zip((qs, d, sums), want, ("codes", "scales", "sums")):
            np.testing.assert_array_equal(got, expected, err_msg=f"{activation} {what}")
    y = x.copy()
    y[200] = np.nan
    y[250] = np.inf
    qs, d, sums = cpu_ops.quantize(isa, y)
    assert np.isnan(d[[200 // 32, 250 // 32]]).all() and not qs[192:256].any(), "a non-finite block: NaN, no codes"
    qs, d, sums = cpu_ops.quantize(isa, y, "q8_k")
    assert np.isnan(d[0]) and not qs[:256].any() and not sums[:16].any(), "a non-finite super-block: NaN, no codes"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,blocks", [(77, 10), (4, 1), (3, 64), (130, 3), (48, 2)])
def test_each_kernel_equals_its_integer_reference(isa, ggml_type, n, blocks):
    """Bit for bit, at row counts the kernels' row groups of 16 do not divide (rows after the groups,
    or no group at all) and K of an odd number of blocks; 5 rows of A: a tile of 4 and one left."""
    k = blocks * GGML_QUANT_SIZES[ggml_type][0]
    rng = np.random.default_rng(n * 1000 + k)
    blocks = random_blocks(rng, ggml_type, n, k)
    a = (rng.standard_normal((5, k)) * 3).astype(np.float32)
    want = reference_matmul(blocks, ggml_type, a)
    np.testing.assert_array_equal(cpu_ops.matmul(isa, int(ggml_type), blocks, a), want)


def test_hostile_codes_are_computed_as_written():
    """Q8_0 codes of -128 (no quantizer writes them; a crafted file may) take the same path everywhere."""
    rng = np.random.default_rng(5)
    blocks = random_blocks(rng, GT.Q8_0, 9, 64).reshape(9, 2, 34)
    blocks[:, :, 2:] = np.uint8(0x80)
    blocks = blocks.reshape(9, -1)
    a = rng.standard_normal((2, 64)).astype(np.float32)
    want = reference_matmul(blocks, GT.Q8_0, a)
    for isa in ISAS:
        np.testing.assert_array_equal(cpu_ops.matmul(isa, int(GT.Q8_0), blocks, a), want, err_msg=isa)


def test_the_self_test_passes_on_the_best_kernels_here():
    assert cpu_ops.unavailable() is None
    assert cpu_ops.isa() in ISAS and cpu_ops.isa() == (cpu_ops.requested_isa() or ISAS[-1])


# ---- the MoE operator inside ONNX Runtime ---------------------------------------------------------------
H, FFN, E, K = 96, 160, 6, 2


def dims_of(types: tuple[GT, GT, GT]) -> tuple[int, int]:
    """(hidden, ffn): K-quants' rows hold super-blocks of 256"""
    return (256, 512) if any(GGML_QUANT_SIZES[t][0] == 256 for t in types) else (H, FFN)


GPT_OSS = {"activation_alpha": 1.702, "activation_beta": 1.0, "swiglu_limit": 7.0}  # its clamped SwiGLU


def moe_model(rng, types: tuple[GT, GT, GT], normalize: int = 1, gpt_oss: bool = False) -> tuple[bytes, list]:
    """A moepass::MoEPacked node over random blocks; `gpt_oss`: with expert biases and its SwiGLU.
    (model, [gate, up, down] GGUF rows, then the biases where there are some)"""
    hidden, ffn = dims_of(types)
    gate, up = (np.stack([random_blocks(rng, t, ffn, hidden) for _ in range(E)]) for t in types[:2])
    down = np.stack([random_blocks(rng, types[2], hidden, ffn) for _ in range(E)])
    names, extra, attributes = ["x", "logits", "gate", "up", "down"], [], {}
    if gpt_oss:
        extra = [rng.standard_normal((E, n)).astype(np.float32) for n in (ffn, ffn, hidden)]
        names += ["", "gate_bias", "up_bias", "down_bias"]
        attributes = GPT_OSS
    node = helper.make_node("MoEPacked", names, ["y"], domain=cpu_ops.DOMAIN,
                            k=K, activation_type="swiglu", gate_type=int(types[0]), up_type=int(types[1]),
                            down_type=int(types[2]), normalize_routing_weights=normalize, row_group=ROW_GROUP,
                            **attributes)
    grouped = [row_groups.group(b, QUANT_TYPES[t]) for b, t in zip((gate, up, down), types)]
    initializers = [onnx.numpy_helper.from_array(b, n) for b, n in zip(grouped, ("gate", "up", "down"))]
    initializers += [onnx.numpy_helper.from_array(b, n) for b, n in zip(extra, ("gate_bias", "up_bias", "down_bias"))]
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden]),
                        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])], initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(cpu_ops.DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return model.SerializeToString(), [gate, up, down, *extra]


def run_moe(model: bytes, x: np.ndarray, logits: np.ndarray, isa: str | None = None, threads: int = 2,
            monkeypatch=None) -> np.ndarray:
    if monkeypatch is not None:
        monkeypatch.setenv(cpu_ops.ISA_ENV, isa or "")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    cpu_ops.register(options)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "logits": logits})[0]


def reference_moe(blobs, types, x, logits, normalize=True) -> np.ndarray:
    """The MoE layer composed in numpy from reference_matmul; with biases (blobs[3:]), gpt-oss's
    SwiGLU: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)."""
    gate, up, down = blobs[:3]
    biases = blobs[3:]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:K]
        w = p[chosen] / p[chosen].sum() if normalize else p[chosen]
        for e, weight in zip(chosen, w):
            g = reference_matmul(gate[e], types[0], x[t : t + 1])[0]
            u = reference_matmul(up[e], types[1], x[t : t + 1])[0]
            if biases:
                limit = GPT_OSS["swiglu_limit"]
                g, u = np.minimum(g + biases[0][e], limit), np.clip(u + biases[1][e], -limit, limit)
                with np.errstate(over="ignore"):  # exp of a large negative gate: inf, the product -0
                    a = (g / (1 + np.exp(-GPT_OSS["activation_alpha"] * g)) * (u + 1)).astype(np.float32)
            else:
                a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            y = reference_matmul(down[e], types[2], a[None])[0]
            out[t] += weight * (y + biases[2][e] if biases else y)
    return out


MOE_TYPES = [(GT.Q4_0, GT.Q4_0, GT.Q4_0), (GT.Q4_0, GT.Q4_0, GT.Q8_0), (GT.Q8_0, GT.Q8_0, GT.Q8_0),
             (GT.Q4_K, GT.Q4_K, GT.Q6_K), (GT.Q6_K, GT.Q6_K, GT.Q4_K), (GT.Q5_K, GT.Q5_K, GT.Q6_K),
             (GT.IQ4_XS, GT.IQ4_XS, GT.IQ4_XS), (GT.IQ4_NL, GT.IQ4_NL, GT.Q8_0), (GT.Q2_K, GT.Q2_K, GT.Q3_K),
             (GT.Q3_K, GT.Q3_K, GT.Q4_K), (GT.MXFP4, GT.MXFP4, GT.MXFP4), (GT.Q5_0, GT.Q4_1, GT.Q5_1)]


@pytest.mark.parametrize("types", MOE_TYPES, ids=lambda t: "/".join(x.name for x in t))
@pytest.mark.parametrize("normalize", [1, 0])
def test_the_moe_operator_computes_the_definition_on_every_path(types, normalize, monkeypatch):
    """Every instruction set gives the same bits; they equal the products composed in numpy up to the
    float32 rounding of numpy's own exp and sums (routing weights, SiLU): 1e-5 of the output's scale."""
    rng = np.random.default_rng(11)
    model, blobs = moe_model(rng, types, normalize)
    x = rng.standard_normal((7, dims_of(types)[0])).astype(np.float32)
    logits = rng.standard_normal((7, E)).astype(np.float32)
    outs = {isa: run_moe(model, x, logits, isa, monkeypatch=monkeypatch) for isa in ISAS}
    for isa, y in outs.items():
        np.testing.assert_array_equal(y, outs["scalar"], err_msg=isa)
    want = reference_moe(blobs, types, x, logits, bool(normalize))
    assert np.abs(outs["scalar"] - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("types", [MOE_TYPES[1], (GT.MXFP4, GT.MXFP4, GT.MXFP4)],
                         ids=lambda t: "/".join(x.name for x in t))
def test_gpt_oss_biases_and_clamped_swiglu_on_every_path(types, monkeypatch):
    """Expert biases and gpt-oss's SwiGLU (alpha 1.702, limit 7, up + 1): every instruction set the
    same bits, the numpy composition within its own float32 rounding; a token alone as in a batch."""
    rng = np.random.default_rng(14)
    model, blobs = moe_model(rng, types, gpt_oss=True)
    x = (rng.standard_normal((9, dims_of(types)[0])) * 4).astype(np.float32)
    logits = rng.standard_normal((9, E)).astype(np.float32)
    outs = {isa: run_moe(model, x, logits, isa, monkeypatch=monkeypatch) for isa in ISAS}
    for isa, y in outs.items():
        np.testing.assert_array_equal(y, outs["scalar"], err_msg=isa)
    want = reference_moe(blobs, types, x, logits)
    assert np.abs(outs["scalar"] - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(run_moe(model, x[4:5], logits[4:5], threads=1, monkeypatch=monkeypatch)[0],
                                  outs["scalar"][4])


@pytest.mark.parametrize("types", [MOE_TYPES[1], MOE_TYPES[3]], ids=lambda t: "/".join(x.name for x in t))
def test_a_token_gives_the_same_bits_alone_as_in_any_batch(types, monkeypatch):
    """A row's result does not depend on the call: one token, a prefill of 300 (more than one token
    chunk: cpu_ops/moe.c's TOKEN_CHUNK), one thread or two."""
    rng = np.random.default_rng(12)
    model, _ = moe_model(rng, types)
    x = rng.standard_normal((300, dims_of(types)[0])).astype(np.float32)
    logits = rng.standard_normal((300, E)).astype(np.float32)
    batch = run_moe(model, x, logits, threads=2, monkeypatch=monkeypatch)
    for t in (0, 33, 255, 256, 299):
        alone = run_moe(model, x[t : t + 1], logits[t : t + 1], threads=1, monkeypatch=monkeypatch)
        np.testing.assert_array_equal(alone[0], batch[t])


def test_blobs_that_do_not_hold_the_rows_are_refused_in_one_line():
    rng = np.random.default_rng(13)
    model = onnx.load_from_string(moe_model(rng, (GT.Q4_0, GT.Q4_0, GT.Q4_0))[0])
    attributes = {a.name: a for a in model.graph.node[0].attribute}
    x, logits = np.zeros((1, H), np.float32), np.zeros((1, E), np.float32)
    attributes["gate_type"].i = int(GT.Q8_0)  # the blob holds Q4_0 rows
    with pytest.raises(Exception, match=r"moepass::MoEPacked: gate: rows of 54 bytes do not hold 96 Q8_0 elements"):
        run_moe(model.SerializeToString(), x, logits)
    attributes["gate_type"].i, attributes["k"].i = int(GT.Q4_0), E + 1
    with pytest.raises(Exception, match=r"moepass::MoEPacked: k 7: 1 to the 6 experts"):
        run_moe(model.SerializeToString(), x, logits)
    attributes["k"].i, attributes["down_type"].i = K, int(GT.IQ2_XXS)
    with pytest.raises(Exception, match=r"moepass::MoEPacked: down_type 16: a GGML type these kernels do not take"):
        run_moe(model.SerializeToString(), x, logits)
    attributes["down_type"].i, attributes["row_group"].i = int(GT.Q4_0), 8
    with pytest.raises(Exception, match=r"moepass::MoEPacked: row_group 8: these kernels take rows in groups of 16"):
        run_moe(model.SerializeToString(), x, logits)
    attributes["row_group"].i = ROW_GROUP
    model.graph.node[0].attribute.append(helper.make_attribute("swiglu_limit", -1.0))
    with pytest.raises(Exception, match=r"moepass::MoEPacked: swiglu_limit -1: a positive limit"):
        run_moe(model.SerializeToString(), x, logits)
    model.graph.node[0].attribute.pop()
    model.graph.node[0].attribute.remove(attributes["row_group"])  # a model of step 1's plain rows
    with pytest.raises(Exception, match=r"attribute row_group is required .*convert the model again"):
        run_moe(model.SerializeToString(), x, logits)


# ---- converted models -------------------------------------------------------------------------------------
NATIVE_ARCHITECTURES = ["qwen3moe", "llama", "qwen2moe", "olmoe", "granitemoe", "phimoe", "deepseek2", "gpt-oss"]
BLOCK_32_FILES = ("q4_0", "q8_0", "iq4_nl", "q5_0", "q4_1", "q5_1")  # deepseek2's fixture has rows no super-block of 256 divides
# gpt-oss's Q5_K fixture: llama.cpp itself is 4.5 logits from the exact computation (its Q8_K activations
# before the clamped SwiGLU), its argmax another token at a position the oracle calls decided; the
# native form gives llama.cpp's logits there, so the oracle has no yardstick for it
NO_YARDSTICK = {("gpt-oss", "q5_k")}


# the presets, and files whose experts and attention are of one more type the kernels take (the fixtures'
# calibrated random codes: llama.cpp reads them as it reads a quantizer's)
NATIVE_FILES = {name: (name, {}) for name in ("q4_0", "q8_0", "q4_k", "q4_k_m", "q6_k", "mxfp4")} | {
    t.name.lower(): ("q8_0", {"types": {role: t for role in ("attn", "gate_up", "down")}})
    for t in (GT.Q5_K, GT.IQ4_XS, GT.IQ4_NL, GT.Q2_K, GT.Q3_K, GT.Q5_0, GT.Q4_1, GT.Q5_1)
}


@pytest.mark.llama
@pytest.mark.parametrize("arch,file", [(arch, file) for arch in NATIVE_ARCHITECTURES for file in NATIVE_FILES
                                       if (arch != "deepseek2" or file in BLOCK_32_FILES)
                                       and (arch, file) not in NO_YARDSTICK])
def test_native_conversions_match_llama_cpp(arch, file, make_gguf, converted, tmp_path):
    """As close to the exact computation of the file's weights as llama.cpp is (support.oracle's
    bound), prefill, token-by-token decode and chunked prefill; every MoE node native."""
    preset, kwargs = NATIVE_FILES[file]
    gguf = make_gguf(preset, arch=arch, **kwargs)
    model = converted(preset, arch=arch, expert_format="native", **kwargs)
    graph = load_model(model).graph
    nodes = moe_nodes(graph)
    assert nodes and all(is_native(m.node) for m in nodes)
    dense = [n for n in graph if n.op_type == "MatMulPacked"]
    assert dense and all(n.domain == cpu_ops.DOMAIN for n in dense), "every matrix of a type the kernels take"
    assert not any(n.op_type == "MatMulNBits" and n.name.startswith("blk.") for n in graph)
    theirs = llama_logits(gguf, PROMPT)
    exact = llama_logits(dequantized_copy(gguf, tmp_path / "f32.gguf"), PROMPT)
    ties = routing_near_ties(model, PROMPT)
    for what, ours in three_ways(load(model)).items():
        check_against_exact(ours, exact, theirs, f"{arch} {file} native {what}", ties)


def test_native_is_refused_in_one_line_for_types_the_kernels_lack(make_gguf, tmp_path):
    gguf = make_gguf("q8_0", types={"gate_up": GT.IQ2_XXS})
    with pytest.raises(moepass.MoepassError, match=r"expert_format='native': moepass's CPU kernels take .*not IQ2_XXS"):
        moepass.convert(gguf, tmp_path / "out", expert_format="native")
    assert not (tmp_path / "out").exists()


def test_partition_keeps_cpu_layers_native_and_gives_the_gpu_qmoes_form(make_gguf, converted, tmp_path):
    """--target layers at a budget for one of two layers: the CPU layer's node stays moepass's, its
    blobs in row groups, the file's own bytes; the GPU layer's is the CUDA QMoE form packed from the
    blobs, passing the CUDA kernel table. With every layer on the GPU the placed model is, bit for
    bit in its logits, what the same file's qmoe conversion placed alike is. --target offload packs
    every expert from the row groups into the offload form, which computes what the native model
    does within convert's own offload form's distance."""
    from gguf import GGUFReader
    from support.gpu_form import gpu_nodes_are_taken

    gguf = make_gguf("q4_0")
    source = converted("q4_0", expert_format="native")
    full = moepass.partition(source, tmp_path / "full", "8G", target="layers", calibrate=False)
    memory, last = full.plan.memory, full.plan.nodes[-1]
    one_layer = memory.non_expert_bytes + memory.kv_cache_bytes + memory.work_bytes + memory.reserve_bytes + \
        last.experts * last.bytes_per_expert + 1024
    placed = moepass.partition(source, tmp_path / "one", one_layer, target="layers", calibrate=False)
    assert [n.device for n in placed.plan.nodes] == ["cpu", "gpu"]
    first, second = moe_nodes(load_model(placed.output_dir).graph)
    assert is_native(first.node) and first.node.attributes.get_int("row_group") == ROW_GROUP
    assert (second.node.domain, second.node.op_type) == ("com.microsoft", "QMoE")
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    for slot, role in zip((2, 3, 4), ("gate", "up", "down")):
        grouped = first.node.inputs[slot].const_value.numpy()
        qt = QUANT_TYPES[GT(first.node.attributes.get_int(f"{role}_type"))]
        theirs = np.asarray(tensors[f"blk.0.ffn_{role}_exps.weight"].data).reshape(grouped.shape)
        np.testing.assert_array_equal(row_groups.ungroup(grouped, qt), theirs, err_msg=role)
    gpu_nodes_are_taken(placed.output_dir, "layers")
    placed_graph = load_model(placed.output_dir).graph
    assert not any(n.domain == cpu_ops.DOMAIN and n.op_type == "MatMulPacked" for n in placed_graph)
    assert any(n.op_type == "MatMulNBits" for n in placed_graph), "the GPU's matrices: MatMulNBits"

    def logits(model_dir):
        decoder = load(model_dir)
        return decoder.forward(np.array([[5, 77, 200, 13]]), decoder.empty_cache())[0][0].astype(np.float64)

    qmoe_full = moepass.partition(converted("q4_0", expert_format="qmoe"), tmp_path / "qmoe", "8G", target="layers",
                                  calibrate=False)
    np.testing.assert_array_equal(logits(full.output_dir), logits(qmoe_full.output_dir))
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 32):
        return  # the offload form's SM80-prepacked experts run from ONNX Runtime 1.32 ([gpu]'s is 1.31.1)
    reference = logits(source)
    offload = moepass.partition(source, tmp_path / "offload", "8G", target="offload", calibrate=False)
    gpu_nodes_are_taken(offload.output_dir, "offload")
    converted_error = np.abs(logits(converted("q4_0", expert_format="offload")) - reference).max()
    assert np.abs(logits(offload.output_dir) - reference).max() <= 1.5 * converted_error + 1e-6


def test_a_native_model_where_the_kernels_cannot_run_is_refused_in_one_line(make_gguf, converted, monkeypatch,
                                                                           tmp_path):
    """The library did not build or load, or its self-test failed: loading says so, naming a node;
    converting still works (for another machine), its genai_config naming no library."""
    import json

    model = converted("q4_0", expert_format="native")
    monkeypatch.setattr(cpu_ops, "unavailable", lambda: "the kernel library was not built at install")
    elsewhere = moepass.convert(make_gguf("q4_0"), tmp_path / "elsewhere", expert_format="native").output_dir
    session = json.loads((elsewhere / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert "custom_ops_library" not in session
    with pytest.raises(moepass.MoepassError) as raised:
        load(model)
    message = str(raised.value)
    assert "\n" not in message and "moepass::" in message and "the kernel library was not built" in message
    assert "convert with expert_format='qmoe'" in message


def test_the_default_is_native_where_the_kernels_run_and_qmoe_elsewhere(make_gguf, monkeypatch, tmp_path):
    """convert's default (auto): moepass's own kernels for every type they take; where they cannot run
    here, ONNX Runtime's QMoE forms and one line saying why; with float activations (which the
    kernels do not compute) the QMoE forms too."""
    native = moepass.convert(make_gguf("q4_k_m"), tmp_path / "native", echo=lambda line: None)
    assert len(native.moe_layers) == 2 and all(m["form"].startswith("native Q4_K/Q4_K/") for m in native.moe_layers)
    graph = load_model(native.output_dir).graph
    assert any(n.domain == cpu_ops.DOMAIN and n.op_type == "MatMulPacked" for n in graph)
    exact = moepass.convert(make_gguf("q4_k_m"), tmp_path / "float", activations="float", echo=lambda line: None)
    assert not any(m["form"].startswith("native") for m in exact.moe_layers)
    monkeypatch.setattr(cpu_ops, "unavailable", lambda: "the kernel library was not built at install")
    said: list[str] = []
    elsewhere = moepass.convert(make_gguf("q4_k_m"), tmp_path / "elsewhere", echo=said.append)
    assert [m["form"] for m in elsewhere.moe_layers] == [m["form"] for m in exact.moe_layers]
    why = [line for line in said if "kernels cannot run here" in line]
    assert len(why) == 1 and "not built at install" in why[0] and "QMoE forms instead" in why[0], said
    assert not any(n.domain == cpu_ops.DOMAIN for n in load_model(elsewhere.output_dir).graph)
    load(elsewhere.output_dir)  # runs without the library


# ---- rows that do not depend on the batch, through the whole model --------------------------------------
def _batched_against_one_by_one(decoder, prompt: list[int], steps: int) -> tuple[float, float]:
    """(the largest difference between the logits of `steps` greedy positions verified in one call
    and the same positions decoded one step at a time, the largest logit's magnitude)."""
    from support.bounds import sequential_logits

    plain = list(decoder.generate(prompt, steps, stop_ids=()))
    tokens = [*prompt, *plain]
    one_by_one = sequential_logits(decoder, tokens, len(prompt))[: len(plain)]
    cache = KVCache(decoder, capacity=len(tokens))
    cache.extend(prompt[:-1])
    rows = cache.run_rows(tokens[len(prompt) - 1 : len(prompt) + len(plain) - 1], keep=len(plain))
    return float(np.abs(rows - one_by_one).max()), float(np.abs(one_by_one).max())


@pytest.mark.parametrize("preset", ["q4_0", "q4_k_m"])
@pytest.mark.parametrize("steps", [5, 16, 24])
def test_a_position_computes_the_same_in_a_batch_as_alone(converted, preset, steps):
    """Int8 activations: the native model's logits of positions verified in one call are those of one
    step at a time, but for float32 rounding in ONNX Runtime's own float operators (router, attention):
    within 2^-17 of the largest logit (a few units in the last place), at every batch size. (ONNX
    Runtime's int8 kernels order a row's sums by the row count: the default form of q4_k_m differs by
    2.5e-2 at 24 positions on the EPYC here.)"""
    prompt = [5, 17, 33, 2, 90, 41]
    difference, scale = _batched_against_one_by_one(
        load(converted(preset, expert_format="native"), threads=2), prompt, steps
    )
    assert difference <= scale * 2.0**-17, (difference, scale)


@pytest.mark.parametrize("preset", ["q4_0", "q4_k_m"])
def test_speculation_through_the_native_form_gives_plain_greedy_tokens(converted, preset):
    """Quantized activations, n-gram and draft-model speculation: the plain greedy tokens, token for
    token (support.bounds' rule: a first difference only at a margin within the batched rows'
    rounding, which the native form makes float32 rounding)."""
    from support.bounds import assert_same_greedy_tokens

    from moepass.runtime import Speculator

    decoder = load(converted(preset, expert_format="native"), threads=2)
    prompt = [5, 17, 33, 2, 90, 41, 5, 17, 33, 2, 90, 41, 5, 17]
    plain = list(decoder.generate(prompt, 32, stop_ids=()))
    for speculator in (Speculator("ngram", draft_tokens=4),
                       Speculator("draft", 4, load(converted(preset, expert_format="native"), threads=2))):
        decoder.speculate(speculator)
        ours = list(decoder.generate(prompt, 32, stop_ids=()))
        decoder.speculate(None)
        assert_same_greedy_tokens(decoder, prompt, plain, ours)
        assert speculator.drafted > 0


def test_onnxruntime_genai_runs_a_native_conversion(converted):
    """genai_config.json's session options name the kernel library (custom_ops_library):
    onnxruntime-genai loads the native model and generates moepass's greedy tokens."""
    import json

    og = pytest.importorskip("onnxruntime_genai")  # the [cpu] install's (moepass[cpu,chat])
    model = converted("q4_k_m", expert_format="native")
    session = json.loads((model / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert session["custom_ops_library"] == str(cpu_ops.library_path())
    generator_params = og.GeneratorParams(og_model := og.Model(str(model)))
    generator_params.set_search_options(max_length=3 + 20, do_sample=False)
    generator = og.Generator(og_model, generator_params)
    generator.append_tokens([5, 77, 200])
    theirs = []
    while not generator.is_done():
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    ours = list(load(model).generate([5, 77, 200], 20, stop_ids=()))
    stop = json.loads((model / "genai_config.json").read_text())["model"]["eos_token_id"]
    stop = set(stop if isinstance(stop, list) else [stop])
    assert theirs == ours[: len(theirs)] and (len(theirs) == 20 or theirs[-1] in stop), (theirs, ours)


def test_partition_gives_a_native_gpt_oss_layer_on_the_gpu_qmoe_with_its_biases(converted, tmp_path):
    """The CUDA MoEPacked carries no expert biases or clamped SwiGLU: a native gpt-oss layer placed on
    the GPU becomes the CUDA QMoE form packed from its blobs, its gate and up biases interleaved as
    fc1's rows are, the SwiGLU's attributes kept, int8 activations as converted; the dense matrices'
    biases go into their MatMulNBits. It computes what the same file's qmoe conversion, placed alike
    (the same blocks, the same form, biases from the GGUF), does, bit for bit (on the CPU EP here)."""
    native = converted("q4_0", arch="gpt-oss", expert_format="native")
    qmoe = converted("q4_0", arch="gpt-oss", expert_format="qmoe")
    placed = {
        name: moepass.partition(model, tmp_path / name, "8G", target="layers", calibrate=False).output_dir
        for name, model in (("native", native), ("qmoe", qmoe))
    }
    from support.gpu_form import gpu_nodes_are_taken

    gpu_nodes_are_taken(placed["native"], "layers")
    for moe in moe_nodes(load_model(placed["native"]).graph):
        node = moe.node
        assert (node.domain, node.op_type) == ("com.microsoft", "QMoE"), moe.name
        assert node.attributes.get_float("swiglu_limit") == 7.0 and node.inputs[4] is not None
    prompt = [5, 77, 200, 13]
    decoders = {name: load(folder, threads=1) for name, folder in placed.items()}
    logits = {name: d.forward(np.array([prompt]), d.empty_cache())[0][0].astype(np.float64)
              for name, d in decoders.items()}
    np.testing.assert_array_equal(logits["native"], logits["qmoe"])
    tokens = {name: list(d.generate(prompt, 8, stop_ids=())) for name, d in decoders.items()}
    assert tokens["native"] == tokens["qmoe"]
