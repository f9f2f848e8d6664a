"""ONNX Runtime CPU kernel forms for Q4_K_M GGUF files, timed and checked on both x86 kernel families.

    python benchmarks/kernels.py                          # both families, every case (~25 min on 2 cores)
    python benchmarks/kernels.py --family both --quick    # decode subset, ~1.5 min per family
    python benchmarks/kernels.py --family avx2 --cases mnb --matrices lm_head
    python benchmarks/kernels.py --family native --cases q4k,qmoe,aug,f16,overhead

On a shared machine run it under the CPU lock (flock /tmp/moepass-cpu.lock ...); a whole family is
about 13 minutes on 2 cores, so to keep each locked command short, split it by --cases/--matrices as
in the last three lines (mnb on q_proj,kv_proj,o_proj ~4 min, on lm_head ~2.5 min, the rest ~7.5 min).

Which com.microsoft block forms should a conversion emit so that decode keeps up with llama.cpp on
AVX2-only CPUs (AMD EPYC Zen 2/3) and on AVX-512/VNNI ones? Each case is a tiny ONNX model (opset
21 + com.microsoft 1, made with onnx.helper) with random but valid weights (fixed seed) at
Qwen3-30B-A3B's sizes (hidden 2048, 128 experts, top-8, expert ffn 768; q_proj 4096 x 2048, k/v_proj
512 x 2048, o_proj 2048 x 4096, LM head 151936 x 2048), run by ONNX Runtime's CPU EP with
intra_op_num_threads = --threads (inputs and a preallocated output bound once, IOBinding). After a
warm-up, each case is run at least 50 times and for at least --min-time s (slow cases: at least 1 s
and 3 runs) and reports the median time per run, the weight bytes it reads (initializer bytes as
stored in the ONNX file: codes, scales, zero points, correction matrices; for QMoE only the experts
the routing selects), GB/s of those bytes, and the max relative error of its output,
max|y - y_ref| / max|y_ref|, against a float64 numpy computation over the same dequantized weights
(so the form's arithmetic is checked, not only timed). With accuracy_level 4 ONNX Runtime quantizes
the activations to int8 (expect ~1e-2); with accuracy_level 0 and 4 bits, ~1e-6.

Cases (--cases, comma-separated; default all):
  mnb       MatMulNBits: bits 4/8/2, blocks 16/32/64/128, accuracy_level 0/4, 4-bit without zero points,
            with packed uint8 ones and with float ones; q_proj, o_proj, LM head; M=1, and M=128 for
            q_proj/o_proj (the LM head only ever sees the last position); k/v_proj: the main forms
            (int4 b32/b16, int4 b32 with uint8 zero points, int8 b32/b16 at accuracy_level 4), M=1.
  q4k       Q4_K-exact for non-expert matrices: y = MatMulNBits(int4 b32 symmetric)(x) +
            MatMul(blocksums(x), C) with C [K/32, N] float32, or with the correction as 8-bit
            MatMulNBits (K' = K/32, block 32); the whole small graph is timed. W = s*q - m per
            32-block (Q4_K's d*sc*q - dmin*m); C = 8s - m.
  qmoe      QMoE: bits 4/8, blocks 16/32/64/128, with/without zero points, accuracy_level 0/4,
            T=1 and T=128 (random router logits), and fc1 4-bit + fc2 8-bit (expected NOT_IMPLEMENTED).
  aug       QMoE with fc1's input widened to H' = H + 128 by a Concat (in the graph), int4 b32
            symmetric, against plain H.
  f16       float16 scales with float32 activations (MatMulNBits, QMoE); the float16 graph (Cast in,
            float16 scales, Cast out) timed and checked.
  overhead  the fixed cost of a node: Identity, one MatMulNBits 64 x 64, a chain of 16.
  stream    decode's kernels with their weights coming from DRAM, as in a model of many layers: one
            model of several nodes of distinct weights (QMoE int4/b32, 5 nodes; MatMulNBits int4/b32
            at q_proj's shape, 24 nodes; float32 scales, as moepass stores them at block 32), M=1,
            accuracy_level 0 and 4; per node the time, the bytes as stored and as ONNX Runtime holds
            them after prepacking (the session's anonymous memory, measured), and each one's floor
            at the copy bandwidth.
  peak      the machine's dense rates, what MLAS's own GEMMs reach on it (M = N = K = 2048):
            MatMulInteger u8 x s8 (int8 dot products: VNNI where the CPU has it) and float32 MatMul,
            GMAC/s; the ceiling against which the block-quantized kernels above are read.
  native    moepass::MoEPacked, moepass's own kernels (moepass.cpu_ops, --expert-format native) over
            GGUF blocks in row groups, one type for gate, up and down (Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K,
            IQ4_XS), T=1
            and T=128, beside QMoE int4/b32 at accuracy_level 4 in the same run: GB/s of the
            experts read and GMAC/s (their exactness is tests/test_cpu_ops.py's).

`--family both` (the default) runs itself twice, natively and under tests/cpu_family.py's AVX2-only
shim (CPUID hides AVX-512/AVX-VNNI/AMX, so MLAS takes its AVX2 kernels), and prints one set of
tables per family, each headed by the measuring process's CPU line and the date, then checks that
the two families' accuracy_level 4 outputs differ (proof the shim took effect).

Outside `stream`, the weights stay in cache between runs (a 4096 x 2048 int4 matrix is 4 MiB); at
decode a model's weights come from DRAM, so the GB/s there are an upper bound for the small matrices.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import cpu_family  # noqa: E402

H, E, TOP_K, I_FFN = 2048, 128, 8, 768
SHAPES = {"q_proj": (4096, 2048), "kv_proj": (512, 2048), "o_proj": (2048, 4096), "lm_head": (151936, 2048)}  # (N, K)
PREFILL = 128
ort.set_default_logger_severity(4)  # refusals are reported in the tables, not logged
CASES = ("mnb", "q4k", "qmoe", "aug", "f16", "overhead", "stream", "peak", "native")
FINGERPRINT = "FINGERPRINT "  # a line a child prints for the parent of --family both


# ---------------------------------------------------------------- graphs and sessions

def tensor(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def value(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape))


def weights_blob(arrays: dict[str, np.ndarray]) -> bytes:
    """Initializers serialized once as a ModelProto fragment (graph.initializer only): protobuf merges
    concatenated messages, so `model_bytes(..., blob)` appends them without copying them into a graph."""
    fragment = onnx.ModelProto()
    for name, array in arrays.items():
        fragment.graph.initializer.append(tensor(name, array))
    return fragment.SerializeToString()


def model_bytes(nodes, inputs, outputs, initializers, blob: bytes = b"") -> bytes:
    graph = helper.make_graph(nodes, "kernel", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model.SerializeToString() + blob


class Refused(Exception):
    """ONNX Runtime would not build or run the case: its message, one line."""


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:220] + ("..." if len(text) > 220 else "")


@dataclasses.dataclass
class Timing:
    ms: float
    runs: int
    output: np.ndarray


def session(model: bytes | str, threads: int, native: bool = False) -> ort.InferenceSession:
    """A CPU session of the model (bytes, or a path: external data is mapped from beside it); `native`:
    with moepass's own kernels registered."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    if native:
        import moepass.cpu_ops as cpu_ops

        cpu_ops.register(options)
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own exception types
        raise Refused(f"load: {one_line(e)}") from None


def run_timed(model: bytes, feeds: dict[str, np.ndarray], out_shape, out_dtype, args, native: bool = False) -> Timing:
    """Median ms per run of the model's single output (IOBinding: inputs and output bound once)."""
    sess = session(model, args.threads, native)
    binding = sess.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array)))
    out = np.empty(out_shape, out_dtype)
    binding.bind_ortvalue_output(sess.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy(out))
    try:
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        first = time.perf_counter() - t0
    except Exception as e:
        try:  # the kernel's own message, where the preallocated output's shape check spoke first
            sess.run(None, feeds)
        except Exception as plain:
            e = plain
        raise Refused(f"run: {one_line(e)}") from None
    result = binding.get_outputs()[0].numpy().copy()
    return Timing(*median_ms(sess, binding, first, args), result)


def median_ms(sess: ort.InferenceSession, binding, first: float, args) -> tuple[float, int]:
    """(median ms per run, runs) after a warm-up of twice the first run's `first` seconds (at most
    0.2 s): at least 50 runs and --min-time, or 3 runs once a second has passed."""
    warm_until = time.perf_counter() + min(0.2, 2 * first)
    while time.perf_counter() < warm_until:
        sess.run_with_iobinding(binding)
    times = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        spent = t1 - start
        if (len(times) >= 50 and spent >= args.min_time) or (spent >= max(1.0, args.min_time) and len(times) >= 3):
            break
    return float(np.median(times)) * 1e3, len(times)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------- packing and references

def random_bytes(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform random uint8: every packed 2/4/8-bit field uniform over its codes."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint8 [..., B] -> codes uint8 [..., B*8/bits], LSB-first (4 bits: element 2j low)."""
    if bits == 8:
        return packed
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return np.stack(parts, axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `unpack`; the last axis is padded with zeros to a whole byte."""
    if bits == 8:
        return codes.astype(np.uint8)
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), codes.dtype)], axis=-1)
    c = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, per)
    out = np.zeros(c.shape[:-1], np.uint8)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def scale_for(rng, shape, bits: int, k: int) -> np.ndarray:
    """Scales that keep y = x W^T of order 1 for x ~ N(0, 1)."""
    return (rng.uniform(0.5, 1.5, shape) / ((1 << (bits - 1)) * np.sqrt(k / 3))).astype(np.float32)


class Cache:
    """One remembered value per slot (the loops are ordered so that equal keys come together)."""

    def __init__(self) -> None:
        self.slots: dict[str, tuple] = {}

    def get(self, slot: str, key, make):
        hit = self.slots.get(slot)
        if hit is None or hit[0] != key:
            self.slots.pop(slot, None)
            self.slots[slot] = (key, make())
        return self.slots[slot][1]


CACHE = Cache()


def codes_for(n: int, k: int, bits: int) -> np.ndarray:
    """Random packed codes [N, K*bits/8] for a shape (the same bytes for every block size)."""
    return CACHE.get("codes", (n, k, bits), lambda: random_bytes(np.random.default_rng([n, k, bits]), (n, k * bits // 8)))


def activations(m: int, k: int) -> np.ndarray:
    return np.random.default_rng([7, m, k]).standard_normal((m, k)).astype(np.float32)


def block_dots(x: np.ndarray, packed: np.ndarray, bits: int, bs: int) -> np.ndarray:
    """P[b, m, n] = sum_j x[m, b*bs + j] * q[n, b*bs + j] in float64 (unsigned codes q), by row chunks."""
    m, k = x.shape
    n = packed.shape[0]
    kb = k // bs
    xb = x.astype(np.float64).reshape(m, kb, bs).transpose(1, 0, 2)  # [kb, m, bs]
    out = np.empty((kb, m, n))
    rows = max(1, (1 << 24) // k)
    for r in range(0, n, rows):
        q = unpack(packed[r:r + rows], bits).astype(np.float64).reshape(-1, kb, bs).transpose(1, 2, 0)  # [kb, bs, n]
        out[:, :, r:r + rows] = np.matmul(xb, q)
    return out


def mnb_reference(x, packed, bits, bs, scales, zeros) -> np.ndarray:
    """y = x W^T, W = (q - z) * s per block, in float64; zeros: float [N, kb] (unpacked)."""
    m, k = x.shape
    key = (packed.shape, bits, bs, hash(x.tobytes()), hash(packed[:, :64].tobytes()))
    p = CACHE.get("dots", key, lambda: block_dots(x, packed, bits, bs))
    xs = x.astype(np.float64).reshape(m, k // bs, bs).sum(-1)  # [m, kb]
    s = scales.astype(np.float64)
    y = np.einsum("bmn,nb->mn", p, s, optimize=True)
    return y - xs @ (zeros.astype(np.float64) * s).T


# ---------------------------------------------------------------- results

@dataclasses.dataclass
class Row:
    cells: list[str]


class Table:
    def __init__(self, title: str, columns: list[str]) -> None:
        self.title, self.columns, self.rows = title, columns, []
        print(f"\n#### {title}\n", flush=True)
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns), flush=True)

    def add(self, *cells) -> None:
        cells = [str(c) for c in cells]
        self.rows.append(cells)
        print("| " + " | ".join(cells) + " |", flush=True)


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def measured(timing: Timing, weight_bytes: int, ref: np.ndarray) -> list[str]:
    gbs = weight_bytes / (timing.ms * 1e-3) / 1e9
    return [fmt_ms(timing.ms), str(timing.runs), f"{weight_bytes / 1e6:.2f}", f"{gbs:.1f}",
            f"{rel_err(timing.output, ref):.1e}"]


def accuracy_levels(args) -> tuple[int, ...]:
    """accuracy_level values of the secondary cases: 4 alone (moepass's default) with --quick."""
    return (4,) if args.quick else (0, 4)


REFUSED = lambda why, n=5: [f"refused: {why}"] + [""] * (n - 1)  # noqa: E731


# ---------------------------------------------------------------- case 1: MatMulNBits

def mnb_node(name, a, out, n, k, bits, bs, acc, zp_name=None, inits=(), dtype=np.float32):
    ins = [a, f"{name}.B", f"{name}.scales"] + ([zp_name] if zp_name else [])
    return helper.make_node("MatMulNBits", ins, [out], domain="com.microsoft", name=name, K=k, N=n, bits=bits,
                            block_size=bs, accuracy_level=acc)


def mnb_form(n, k, bits, bs, zp_kind, seed=0):
    """(B [N, kb, blob], scales [N, kb], zero-point initializer or None, zeros as float [N, kb] for the reference)."""
    rng = np.random.default_rng([n, k, bits, bs, seed, len(zp_kind)])
    packed = codes_for(n, k, bits)
    kb = k // bs
    scales = scale_for(rng, (n, kb), bits, k)
    mid = 1 << (bits - 1)
    if zp_kind == "none":
        return packed, scales, None, np.full((n, kb), mid, np.float32)
    if zp_kind == "uint8":
        z = rng.integers(0, 1 << bits, size=(n, kb), dtype=np.uint8)
        return packed, scales, pack(z, bits), z.astype(np.float32)
    z = rng.uniform(0, (1 << bits) - 1, size=(n, kb)).astype(np.float32)
    return packed, scales, z, z


def mnb_blob(packed: np.ndarray, bits: int, bs: int) -> bytes:
    """w.B serialized once for every zero-point kind and accuracy level of a (matrix, bits, block)."""
    n = packed.shape[0]
    key = (packed.shape, bits, bs, hash(packed[:, :64].tobytes()))
    return CACHE.get("mnb_blob", key, lambda: weights_blob({"w.B": packed.reshape(n, -1, bs * bits // 8)}))


def mnb_model(n, k, m, bits, bs, acc, packed, scales, zp, dtype=np.float32):
    inits = [tensor("w.scales", scales.astype(dtype))]
    if zp is not None:
        inits.append(tensor("w.zp", zp.astype(dtype) if zp.dtype != np.uint8 else zp))
    node = mnb_node("w", "x", "y", n, k, bits, bs, acc, "w.zp" if zp is not None else None)
    return model_bytes([node], [value("x", dtype, (m, k))], [value("y", dtype, (m, n))], inits,
                       mnb_blob(packed, bits, bs))


def nbytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


def case_mnb(args) -> None:
    cols = ["matrix", "M", "bits", "block", "zero points", "acc", "ms/run", "runs", "weight MB", "GB/s", "max rel err"]
    table = Table("1. MatMulNBits (one node)", cols)
    shapes = args.matrices
    blocks = [32, 16] if args.quick else [16, 32, 64, 128]
    for shape in shapes:
        n, k = SHAPES[shape]
        main = args.quick or shape == "kv_proj"  # the main forms only (k/v_proj: like q_proj, smaller)
        for m in ([1] if main or shape == "lm_head" else [1, PREFILL]):
            x = activations(m, k)
            zp_kinds = {4: ["none", "uint8"] if main else ["none", "uint8", "float"], 8: ["none"], 2: ["none"]}
            for bits in (4, 8) if main else (4, 8, 2):
                for bs in [32, 16] if main else blocks:
                    if args.quick and shape == "lm_head" and bs != 32:
                        continue
                    for zp_kind, acc in [(z, a) for z in zp_kinds[bits] for a in (0, 4)]:
                        if main and (bits == 8 and acc == 0 or zp_kind != "none" and bs != 32):
                            continue
                        head = [shape, m, bits, bs, zp_kind, acc]
                        packed, scales, zp, zeros = mnb_form(n, k, bits, bs, zp_kind)
                        try:
                            timing = run_timed(mnb_model(n, k, m, bits, bs, acc, packed, scales, zp), {"x": x},
                                               (m, n), np.float32, args)
                        except Refused as why:
                            table.add(*head, *REFUSED(why))
                            continue
                        ref = mnb_reference(x, packed, bits, bs, scales, zeros)
                        table.add(*head, *measured(timing, nbytes(packed, scales, zp), ref))


# ---------------------------------------------------------------- case 2: Q4_K-exact

def case_q4k(args) -> None:
    cols = ["matrix", "M", "correction", "acc", "ms/run", "runs", "weight MB", "GB/s", "max rel err",
            "err vs exact Q4_K", "plain int4/b32 ms", "plain int8/b32 ms"]
    table = Table("2. Q4_K-exact: MatMulNBits int4/b32 symmetric + blocksums(x) @ C", cols)
    for shape in [s for s in args.matrices if s != "kv_proj" and (not args.quick or s != "o_proj")]:
        n, k = SHAPES[shape]
        kb = k // 32
        packed, scales, _, _ = mnb_form(n, k, 4, 32, "none")
        rng = np.random.default_rng([n, k, 42])
        mins = (scales * rng.uniform(0, 15, size=(n, kb))).astype(np.float32)  # Q4_K: w = s*q - m
        corr = (8 * scales.astype(np.float64) - mins).astype(np.float32)  # [n, kb]: W = s*(q-8) + corr
        c_float = np.ascontiguousarray(corr.T)  # [kb, N]
        # the correction as 8-bit MatMulNBits over K' = kb: symmetric absmax codes per 32 of K'
        cb = corr.reshape(n, kb // 32, 32).astype(np.float64)
        c_scale = (np.abs(cb).max(-1) / 127).astype(np.float32)
        c_codes = np.clip(np.rint(cb / np.maximum(c_scale[..., None], 1e-30)), -127, 127).astype(np.int16)
        c_u8 = (c_codes + 128).astype(np.uint8).reshape(n, kb)
        c_deq = ((c_u8.astype(np.float64) - 128).reshape(n, kb // 32, 32) * c_scale[..., None]).reshape(n, kb)
        for m in ([1] if args.quick or shape == "lm_head" else [1, PREFILL]):
            x = activations(m, k)
            base = mnb_reference(x, packed, 4, 32, scales, np.full((n, kb), 8, np.float32))
            xs = x.astype(np.float64).reshape(m, kb, 32).sum(-1)
            exact = base + xs @ corr.astype(np.float64).T
            plain = {}
            for bits in (4, 8):
                for acc in accuracy_levels(args):
                    pk, sc, _, _ = mnb_form(n, k, bits, 32, "none")
                    try:
                        plain[bits, acc] = fmt_ms(run_timed(mnb_model(n, k, m, bits, 32, acc, pk, sc, None), {"x": x},
                                                            (m, n), np.float32, args).ms)
                    except Refused:
                        plain[bits, acc] = "refused"
            for correction in ("MatMul f32", "MatMulNBits int8/b32"):
                for acc in accuracy_levels(args):
                    cacc = acc
                    nodes = [mnb_node("w", "x", "main", n, k, 4, 32, acc),
                             helper.make_node("Reshape", ["x", "shape3"], ["x3"]),
                             helper.make_node("ReduceSum", ["x3", "axes"], ["xs"], keepdims=0)]
                    inits = [tensor("w.B", packed.reshape(n, kb, 16)), tensor("w.scales", scales),
                             tensor("shape3", np.array([m, kb, 32], np.int64)), tensor("axes", np.array([-1], np.int64))]
                    if correction == "MatMul f32":
                        nodes.append(helper.make_node("MatMul", ["xs", "C"], ["corr"]))
                        inits.append(tensor("C", c_float))
                        extra_bytes = c_float.nbytes
                        ref = exact
                    else:
                        nodes.append(mnb_node("c", "xs", "corr", n, kb, 8, 32, cacc))
                        inits += [tensor("c.B", c_u8.reshape(n, kb // 32, 32)), tensor("c.scales", c_scale)]
                        extra_bytes = c_u8.nbytes + c_scale.nbytes
                        ref = base + xs @ c_deq.T
                    nodes.append(helper.make_node("Add", ["main", "corr"], ["y"]))
                    model = model_bytes(nodes, [value("x", np.float32, (m, k))], [value("y", np.float32, (m, n))], inits)
                    head = [shape, m, correction, acc]
                    try:
                        timing = run_timed(model, {"x": x}, (m, n), np.float32, args)
                    except Refused as why:
                        table.add(*head, *REFUSED(why), "", plain.get((4, acc), ""), plain.get((8, acc), ""))
                        continue
                    table.add(*head, *measured(timing, nbytes(packed, scales) + extra_bytes, ref),
                              f"{rel_err(timing.output, exact):.1e}", plain.get((4, acc), "-"),
                              plain.get((8, acc), "-"))


# ---------------------------------------------------------------- case 3: QMoE

@dataclasses.dataclass
class Experts:
    bits: int
    bs: int
    w: np.ndarray  # [E, N, K*bits/8]
    s: np.ndarray  # [E, N, K/bs] float32
    zp: np.ndarray | None  # packed uint8 [E, N, ceil(K/bs*bits/8)]

    @property
    def k(self) -> int:
        return self.w.shape[-1] * 8 // self.bits

    def dequant(self, e: int) -> np.ndarray:
        """float64 [N, K] of expert e."""
        q = unpack(self.w[e], self.bits).astype(np.float64)
        kb = self.k // self.bs
        z = unpack(self.zp[e], self.bits)[:, :kb].astype(np.float64) if self.zp is not None else (1 << (self.bits - 1))
        q = q.reshape(q.shape[0], kb, self.bs) - (z[..., None] if self.zp is not None else z)
        return (q * self.s[e].astype(np.float64)[..., None]).reshape(q.shape[0], -1)

    def expert_bytes(self) -> int:
        return (self.w[0].nbytes + self.s[0].nbytes + (self.zp[0].nbytes if self.zp is not None else 0))


def experts_for(n: int, k: int, bits: int, bs: int, zero_points: bool, tag: str) -> Experts:
    w = CACHE.get(f"experts.{tag}", (n, k, bits), lambda: random_bytes(np.random.default_rng([n, k, bits, 3]),
                                                                          (E, n, k * bits // 8)))
    rng = np.random.default_rng([n, k, bits, bs, int(zero_points), 5])
    s = scale_for(rng, (E, n, k // bs), bits, k)
    zp = pack(rng.integers(0, 1 << bits, size=(E, n, k // bs), dtype=np.uint8), bits) if zero_points else None
    return Experts(bits, bs, w, s, zp)


def routing(logits: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per token: (top-k expert ids, renormalized softmax weights), as QMoE with normalize_routing_weights=1."""
    out = []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:TOP_K]
        out.append((top, p[top] / p[top].sum()))
    return out


def qmoe_reference(x: np.ndarray, logits: np.ndarray, fc1: Experts, fc2: Experts, h_out: int) -> np.ndarray:
    x64 = x.astype(np.float64)
    y = np.zeros((x.shape[0], h_out))
    chosen: dict[int, list[tuple[int, float]]] = {}
    for t, (ids, weights) in enumerate(routing(logits)):
        for e, w in zip(ids, weights):
            chosen.setdefault(int(e), []).append((t, float(w)))
    for e, uses in chosen.items():
        tokens = np.array([t for t, _ in uses])
        weights = np.array([w for _, w in uses])
        h = x64[tokens] @ fc1.dequant(e).T  # [t, 2I], gate and up interleaved
        gate, up = h[:, 0::2], h[:, 1::2]
        act = gate / (1 + np.exp(-gate)) * up
        y[tokens] += weights[:, None] * (act @ fc2.dequant(e).T)
    return y


def used_experts(logits: np.ndarray) -> int:
    return len({int(e) for ids, _ in routing(logits) for e in ids})


def qmoe_attrs(bits: int, bs: int, acc: int) -> dict:
    """A QMoE node's attributes at these sizes: top-8 SwiGLU (interleaved), renormalized routing."""
    return dict(k=TOP_K, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                normalize_routing_weights=1, expert_weight_bits=bits, block_size=bs, accuracy_level=acc)


def qmoe_model(t, h_in, fc1: Experts, fc2: Experts, acc, *, dtype=np.float32, scale_dtype=None, h_out=None,
               extra_attrs=None, augmented=0, casts=False):
    """QMoE node (plus Concat / Cast around it where asked)."""
    scale_dtype = scale_dtype or dtype
    h_out = h_out or fc2.w.shape[1]
    inits = [tensor("fc1.s", fc1.s.astype(scale_dtype)), tensor("fc2.s", fc2.s.astype(scale_dtype))]
    blob = CACHE.get("blob", (fc1.w.shape, fc1.bits, fc2.w.shape, fc2.bits), lambda: weights_blob({"fc1.w": fc1.w, "fc2.w": fc2.w}))
    ins = ["x", "logits", "fc1.w", "fc1.s", "", "fc2.w", "fc2.s"]
    if fc1.zp is not None:
        ins += ["", "", "", "", "fc1.zp", "fc2.zp"]
        inits += [tensor("fc1.zp", fc1.zp), tensor("fc2.zp", fc2.zp)]
    attrs = {**qmoe_attrs(fc1.bits, fc1.bs, acc), **(extra_attrs or {})}
    nodes = []
    graph_in = [value("x_in", np.float32, (t, h_in - augmented)), value("logits_in", np.float32, (t, E))]
    if augmented:
        graph_in.append(value("extra", np.float32, (t, augmented)))
        nodes.append(helper.make_node("Concat", ["x_in", "extra"], ["x_cat"], axis=1))
        src = "x_cat"
    else:
        src = "x_in"
    if casts:
        nodes += [helper.make_node("Cast", [src, ], ["x"], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))),
                  helper.make_node("Cast", ["logits_in"], ["logits"], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))]
    else:
        nodes += [helper.make_node("Identity", [src], ["x"]), helper.make_node("Identity", ["logits_in"], ["logits"])]
    nodes.append(helper.make_node("QMoE", ins, ["moe"], domain="com.microsoft", name="moe", **attrs))
    out = "moe"
    if casts:
        nodes.append(helper.make_node("Cast", [out], ["moe32"], to=TensorProto.FLOAT))
        out = "moe32"
    final_width = h_out
    if augmented and h_out > H:
        inits += [tensor("starts", np.array([0], np.int64)), tensor("ends", np.array([H], np.int64)),
                  tensor("axes1", np.array([1], np.int64))]
        nodes.append(helper.make_node("Slice", [out, "starts", "ends", "axes1"], ["y"]))
        final_width = H
    else:
        nodes.append(helper.make_node("Identity", [out], ["y"]))
    return model_bytes(nodes, graph_in, [value("y", np.float32, (t, final_width))], inits, blob), final_width


def moe_inputs(t: int, h_in: int, augmented: int = 0):
    rng = np.random.default_rng([11, t])
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = rng.standard_normal((t, E)).astype(np.float32)
    feeds = {"x_in": x, "logits_in": logits}
    full = x
    if augmented:
        extra = rng.standard_normal((t, augmented)).astype(np.float32)
        feeds["extra"] = extra
        full = np.concatenate([x, extra], axis=1)
    return feeds, full, logits


def case_qmoe(args) -> None:
    cols = ["bits", "block", "zero points", "acc", "T", "ms/run", "runs", "weight MB read", "GB/s", "max rel err"]
    table = Table(f"3. QMoE (H {H}, {E} experts, top-{TOP_K}, ffn {I_FFN}, SwiGLU)", cols)
    blocks = [32, 16] if args.quick else [16, 32, 64, 128]
    tokens = [1] if args.quick else [1, PREFILL]
    for bits in (4, 8):
        for bs in blocks:
            for zero_points in (False, True):
                if args.quick and zero_points and (bits == 8 or bs != 32):
                    continue
                fc1 = experts_for(2 * I_FFN, H, bits, bs, zero_points, "fc1")
                fc2 = experts_for(H, I_FFN, bits, bs, zero_points, "fc2")
                for t in tokens:
                    feeds, x, logits = moe_inputs(t, H)
                    ref = None
                    for acc in (0, 4):
                        if args.quick and bits == 8 and acc == 0:
                            continue
                        head = [bits, bs, "uint8" if zero_points else "none", acc, t]
                        try:
                            model, _ = qmoe_model(t, H, fc1, fc2, acc)
                            timing = run_timed(model, feeds, (t, H), np.float32, args)
                        except Refused as why:
                            table.add(*head, *REFUSED(why))
                            continue
                        ref = ref if ref is not None else qmoe_reference(x, logits, fc1, fc2, H)
                        read = used_experts(logits) * (fc1.expert_bytes() + fc2.expert_bytes())
                        table.add(*head, *measured(timing, read, ref))
    # mixed widths: fc1 4-bit, fc2 8-bit
    mixed = Table("3b. QMoE with fc1_expert_weight_bits=4, fc2_expert_weight_bits=8 (block 32)",
                  ["acc", "T", "result", "ms/run", "max rel err"])
    fc1 = experts_for(2 * I_FFN, H, 4, 32, False, "fc1")
    fc2 = experts_for(H, I_FFN, 8, 32, False, "fc2")
    for acc in accuracy_levels(args):
        feeds, x, logits = moe_inputs(1, H)
        try:
            model, _ = qmoe_model(1, H, fc1, fc2, acc,
                                  extra_attrs=dict(expert_weight_bits=4, fc1_expert_weight_bits=4,
                                                   fc2_expert_weight_bits=8))
            timing = run_timed(model, feeds, (1, H), np.float32, args)
        except Refused as why:
            mixed.add(acc, 1, f"refused: {why}", "", "")
            continue
        mixed.add(acc, 1, "runs", fmt_ms(timing.ms), f"{rel_err(timing.output, qmoe_reference(x, logits, fc1, fc2, H)):.1e}")


# ---------------------------------------------------------------- case 4: augmented fc1 input

def case_aug(args) -> None:
    extra = 128
    cols = ["fc1 input", "fc2 rows", "acc", "T", "ms/run", "runs", "weight MB read", "GB/s", "max rel err", "vs plain H"]
    table = Table(f"4. QMoE int4/b32 symmetric with fc1's input widened to H' = H + {extra} (Concat in the graph)", cols)
    plain1 = experts_for(2 * I_FFN, H, 4, 32, False, "fc1")
    plain2 = experts_for(H, I_FFN, 4, 32, False, "fc2")
    wide1 = experts_for(2 * I_FFN, H + extra, 4, 32, False, "fc1wide")
    wide2 = experts_for(H + extra, I_FFN, 4, 32, False, "fc2wide")
    for t in ([1] if args.quick else [1, PREFILL]):
        for acc in accuracy_levels(args):
            base_ms = None
            for label, fc1, fc2, aug in ((f"H = {H}", plain1, plain2, 0),
                                         (f"H' = {H + extra}", wide1, plain2, extra),
                                         (f"H' = {H + extra}", wide1, wide2, extra)):
                rows = fc2.w.shape[1]
                head = [label, f"{rows}" + (" + Slice" if rows > H else ""), acc, t]
                feeds, x, logits = moe_inputs(t, H + aug, aug)
                try:
                    model, width = qmoe_model(t, H + aug, fc1, fc2, acc, augmented=aug)
                    timing = run_timed(model, feeds, (t, width), np.float32, args)
                except Refused as why:
                    table.add(*head, *REFUSED(why), "")
                    continue
                ref = qmoe_reference(x, logits, fc1, fc2, rows)[:, :width]
                read = used_experts(logits) * (fc1.expert_bytes() + fc2.expert_bytes())
                base_ms = base_ms or timing.ms
                table.add(*head, *measured(timing, read, ref), f"{timing.ms / base_ms:.2f}x")


# ---------------------------------------------------------------- case 5: float16 scales

def case_f16(args) -> None:
    accept = Table("5a. float16 scales with float32 activations", ["op", "acc", "result", "ms/run", "max rel err"])
    n, k = SHAPES["q_proj"]
    packed, scales, _, zeros = mnb_form(n, k, 4, 32, "none")
    s16 = scales.astype(np.float16)
    x = activations(1, k)
    ref16 = mnb_reference(x, packed, 4, 32, s16.astype(np.float32), zeros)
    for acc in accuracy_levels(args):
        inits = [tensor("w.B", packed.reshape(n, k // 32, 16)), tensor("w.scales", s16)]
        model = model_bytes([mnb_node("w", "x", "y", n, k, 4, 32, acc)], [value("x", np.float32, (1, k))],
                            [value("y", np.float32, (1, n))], inits)
        try:
            timing = run_timed(model, {"x": x}, (1, n), np.float32, args)
            accept.add("MatMulNBits q_proj int4/b32", acc, "runs", fmt_ms(timing.ms), f"{rel_err(timing.output, ref16):.1e}")
        except Refused as why:
            accept.add("MatMulNBits q_proj int4/b32", acc, f"refused: {why}", "", "")
    fc1 = experts_for(2 * I_FFN, H, 4, 32, False, "fc1")
    fc2 = experts_for(H, I_FFN, 4, 32, False, "fc2")
    fc1h = dataclasses.replace(fc1, s=fc1.s.astype(np.float16).astype(np.float32))
    fc2h = dataclasses.replace(fc2, s=fc2.s.astype(np.float16).astype(np.float32))
    feeds, xm, logits = moe_inputs(1, H)
    moe_ref = qmoe_reference(xm, logits, fc1h, fc2h, H)
    for acc in accuracy_levels(args):
        try:
            model, _ = qmoe_model(1, H, fc1, fc2, acc, scale_dtype=np.float16)
            timing = run_timed(model, feeds, (1, H), np.float32, args)
            accept.add("QMoE int4/b32", acc, "runs", fmt_ms(timing.ms), f"{rel_err(timing.output, moe_ref):.1e}")
        except Refused as why:
            accept.add("QMoE int4/b32", acc, f"refused: {why}", "", "")

    cols = ["graph", "M/T", "acc", "ms/run", "runs", "weight MB", "GB/s", "max rel err", "float32 graph ms"]
    table = Table("5b. float16 graph: Cast(x) -> float16 op with float16 scales -> Cast(y), int4/b32", cols)
    for m in ([1] if args.quick else [1, PREFILL]):
        x = activations(m, k)
        ref = mnb_reference(x, packed, 4, 32, s16.astype(np.float32), zeros)
        for acc in accuracy_levels(args):
            head = ["MatMulNBits q_proj", m, acc]
            f32 = fmt_ms(run_timed(mnb_model(n, k, m, 4, 32, acc, packed, scales, None), {"x": x}, (m, n),
                                   np.float32, args).ms)
            inits = [tensor("w.B", packed.reshape(n, k // 32, 16)), tensor("w.scales", s16)]
            nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
                     mnb_node("w", "x16", "y16", n, k, 4, 32, acc),
                     helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)]
            model = model_bytes(nodes, [value("x", np.float32, (m, k))], [value("y", np.float32, (m, n))], inits)
            try:
                timing = run_timed(model, {"x": x}, (m, n), np.float32, args)
            except Refused as why:
                table.add(*head, *REFUSED(why), f32)
                continue
            table.add(*head, *measured(timing, nbytes(packed, s16), ref), f32)
        feeds, xm, logits = moe_inputs(m, H)
        moe_ref = qmoe_reference(xm, logits, fc1h, fc2h, H)
        read = used_experts(logits) * (fc1.expert_bytes() + fc2.expert_bytes() - (fc1.s[0].nbytes + fc2.s[0].nbytes) // 2)
        for acc in accuracy_levels(args):
            head = ["QMoE", m, acc]
            model, _ = qmoe_model(m, H, fc1, fc2, acc)
            f32 = fmt_ms(run_timed(model, feeds, (m, H), np.float32, args).ms)
            try:
                model, _ = qmoe_model(m, H, fc1, fc2, acc, dtype=np.float16, casts=True)
                timing = run_timed(model, feeds, (m, H), np.float32, args)
            except Refused as why:
                table.add(*head, *REFUSED(why), f32)
                continue
            table.add(*head, *measured(timing, read, moe_ref), f32)


# ---------------------------------------------------------------- case 6: per-node overhead

def case_overhead(args) -> None:
    cols = ["graph", "acc", "us/run", "runs", "per MatMulNBits node (us)"]
    table = Table("6. Fixed cost per node call (M=1, int4/b32 MatMulNBits N = K = 64)", cols)
    d = 64
    ident = model_bytes([helper.make_node("Identity", ["x"], ["y"])], [value("x", np.float32, (1, d))],
                        [value("y", np.float32, (1, d))], [])
    x = activations(1, d)
    timing = run_timed(ident, {"x": x}, (1, d), np.float32, args)
    table.add("Identity (run_with_iobinding floor)", "-", f"{timing.ms * 1e3:.1f}", timing.runs, "")
    for acc in (0, 4):
        times = {}
        for chain in (1, 16):
            nodes, inits, src = [], [], "x"
            for i in range(chain):
                packed, scales, _, _ = mnb_form(d, d, 4, 32, "none", seed=i)
                out = "y" if i == chain - 1 else f"h{i}"
                nodes.append(mnb_node(f"w{i}", src, out, d, d, 4, 32, acc))
                inits += [tensor(f"w{i}.B", packed.reshape(d, 2, 16)), tensor(f"w{i}.scales", scales)]
                src = out
            model = model_bytes(nodes, [value("x", np.float32, (1, d))], [value("y", np.float32, (1, d))], inits)
            timing = run_timed(model, {"x": x}, (1, d), np.float32, args)
            times[chain] = timing.ms
            table.add(f"{chain} x MatMulNBits 64x64", acc, f"{timing.ms * 1e3:.1f}", timing.runs,
                      f"{(times[16] - times[1]) / 15 * 1e3:.1f} (marginal)" if chain == 16 else "")


# ---------------------------------------------------------------- case 7: weights from DRAM

def anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))


def stream_timed(model: bytes, feeds: dict[str, np.ndarray], args) -> tuple[float, int]:
    """(median ms per run over every output, anonymous bytes the session added when it loaded). The
    model is written with external data, as moepass writes models, so ONNX Runtime maps the weights
    from the file and the anonymous memory it adds is what it prepacks."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moepass-stream-") as tmp:
        path = Path(tmp) / "model.onnx"
        proto = onnx.load_from_string(model)
        del model
        onnx.save_model(proto, str(path), save_as_external_data=True, location="model.onnx.data",
                        size_threshold=1024)
        del proto
        before = anonymous_bytes()
        sess = session(str(path), args.threads)
        added = anonymous_bytes() - before
    binding = sess.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array)))
    for out in sess.get_outputs():
        binding.bind_output(out.name)
    t0 = time.perf_counter()
    sess.run_with_iobinding(binding)
    return median_ms(sess, binding, time.perf_counter() - t0, args)[0], added


def case_stream(args) -> None:
    bandwidth = copy_bandwidth() * 1e9
    cols = ["kernel", "acc", "nodes", "ms a node", "MB a node as stored", "MB as held after prepack",
            "GB/s of stored", "floor of stored", "floor of held"]
    table = Table("7. Decode kernels with weights from DRAM (distinct weights per node, M=1)", cols)
    rng = np.random.default_rng(7)
    # QMoE: top-8 of 128 experts per node; the same routing everywhere, distinct tensors per node
    layers = 5
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    inits, blobs = [], {}
    for i in range(layers):
        for fc, (n, k) in (("fc1", (2 * I_FFN, H)), ("fc2", (H, I_FFN))):
            blobs[f"{i}.{fc}.w"] = random_bytes(rng, (E, n, k // 2))
            inits.append(tensor(f"{i}.{fc}.s", scale_for(rng, (E, n, k // 32), 4, k).astype(np.float32)))
    blob = weights_blob(blobs)
    used = used_experts(logits)
    per_node = used * sum(blobs[f"0.{fc}.w"][0].nbytes + inits[j].dims[1] * inits[j].dims[2] * 4
                          for j, fc in ((0, "fc1"), (1, "fc2")))
    for acc in (0, 4):
        nodes = [helper.make_node("QMoE", ["x", "logits", f"{i}.fc1.w", f"{i}.fc1.s", "", f"{i}.fc2.w", f"{i}.fc2.s"],
                                  [f"y{i}"], domain="com.microsoft", name=f"moe{i}", **qmoe_attrs(4, 32, acc))
                 for i in range(layers)]
        model = model_bytes(nodes, [value("x", np.float32, (1, H)), value("logits", np.float32, (1, E))],
                            [value(f"y{i}", np.float32, (1, H)) for i in range(layers)], inits, blob)
        try:
            ms, added = stream_timed(model, {"x": x, "logits": logits}, args)
        except Refused as why:
            table.add("QMoE int4/b32", acc, layers, *REFUSED(why, 6))
            continue
        held = max(added / layers * used / E, per_node)  # the packed experts a node's routing reads
        table.add("QMoE int4/b32", acc, layers, fmt_ms(ms / layers), f"{per_node / 1e6:.1f}", f"{held / 1e6:.1f}",
                  f"{per_node / (ms / layers * 1e-3) / 1e9:.1f}", fmt_ms(per_node / bandwidth * 1e3),
                  fmt_ms(held / bandwidth * 1e3))
    del blob, blobs
    n, k = SHAPES["q_proj"]
    count = 24
    a = activations(1, k)
    for acc in (0, 4):
        nodes, inits, arrays = [], [], {}
        for i in range(count):
            nodes.append(mnb_node(f"w{i}", "x", f"y{i}", n, k, 4, 32, acc))
            arrays[f"w{i}.B"] = random_bytes(np.random.default_rng([n, k, i]), (n, k // 32, 16))
            inits.append(tensor(f"w{i}.scales", scale_for(np.random.default_rng([i]), (n, k // 32), 4, k)))
        stored = arrays["w0.B"].nbytes + inits[0].dims[0] * inits[0].dims[1] * 4
        model = model_bytes(nodes, [value("x", np.float32, (1, k))], [value(f"y{i}", np.float32, (1, n))
                                                                    for i in range(count)], inits, weights_blob(arrays))
        ms, added = stream_timed(model, {"x": a}, args)
        held = max(added / count, stored)  # at level 0 the float32 scales stay where they were
        table.add(f"MatMulNBits int4/b32 {n} x {k}", acc, count, fmt_ms(ms / count), f"{stored / 1e6:.2f}",
                  f"{held / 1e6:.2f}", f"{stored / (ms / count * 1e-3) / 1e9:.1f}",
                  fmt_ms(stored / bandwidth * 1e3), fmt_ms(held / bandwidth * 1e3))


# ---------------------------------------------------------------- driver

def copy_bandwidth() -> float:
    """GB/s of a 1 GiB numpy copy on one thread, read + write bytes (as STREAM counts them), best of 3."""
    src = np.ones(2**27)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def kernel_check(args) -> list[float]:
    """q_proj int4/b32 accuracy_level 4 output at M=1: differs between kernel families (int8 roundings)."""
    n, k = SHAPES["q_proj"]
    packed, scales, _, _ = mnb_form(n, k, 4, 32, "none")
    sess = session(mnb_model(n, k, 1, 4, 32, 4, packed, scales, None), args.threads)
    return sess.run(None, {"x": activations(1, k)})[0][0, :256].tolist()


# ---------------------------------------------------------------- case 8: the machine's dense rates

def case_peak(args) -> None:
    table = Table("8. Dense GEMMs of MLAS's own (M = N = K = 2048): the machine's rates", ["operator", "ms/run", "runs",
                                                                                        "GMAC/s"])
    d = 2048
    rng = np.random.default_rng(8)
    for label, op, out_type, a, b in (
            ("MatMulInteger (u8 x s8, int32 out)", "MatMulInteger", np.int32,
             rng.integers(0, 256, (d, d), dtype=np.uint8), rng.integers(-127, 128, (d, d), dtype=np.int8)),
            ("MatMul (float32)", "MatMul", np.float32,
             rng.standard_normal((d, d), dtype=np.float32), rng.standard_normal((d, d), dtype=np.float32))):
        model = model_bytes([helper.make_node(op, ["x", "w"], ["y"])], [value("x", a.dtype, (d, d))],
                            [value("y", out_type, (d, d))], [tensor("w", b)])
        timing = run_timed(model, {"x": a}, (d, d), out_type, args)
        table.add(label, fmt_ms(timing.ms), timing.runs, f"{d ** 3 / timing.ms / 1e6:.0f}")


# ---------------------------------------------------------------- case 9: moepass's own kernels

NATIVE_CASE_TYPES = ("Q4_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS")


def native_blobs(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of type `name`, [E, rows, row bytes] in row groups, float16 scales set to a
    sane spread (every other byte random: the kernels' speed does not depend on the codes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from moepass.core import row_groups
    from moepass.core.quants import QUANT_TYPES

    ggml_type = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(E, rows, k // block, size), dtype=np.uint8)
    for offset in QUANT_TYPES[ggml_type].scales or ():
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return row_groups.group(raw.reshape(E, rows, -1), QUANT_TYPES[ggml_type])


def native_model(t: int, name: str) -> tuple[bytes, int]:
    """(a moepass::MoEPacked node of `name` blocks at the layer's sizes, one expert's bytes)."""
    from gguf import GGMLQuantizationType

    import moepass.cpu_ops as cpu_ops
    from moepass.core.row_groups import ROW_GROUP

    gate, up, down = native_blobs(name, I_FFN, H, 1), native_blobs(name, I_FFN, H, 2), native_blobs(name, H, I_FFN, 3)
    ggml_type = int(GGMLQuantizationType[name])
    node = helper.make_node("MoEPacked", ["x_in", "logits_in", "gate", "up", "down"], ["y"], domain=cpu_ops.DOMAIN,
                            k=TOP_K, activation_type="swiglu", gate_type=ggml_type, up_type=ggml_type,
                            down_type=ggml_type, normalize_routing_weights=1, row_group=ROW_GROUP)
    graph = helper.make_graph([node], "native", [value("x_in", np.float32, (t, H)), value("logits_in", np.float32, (t, E))],
                              [value("y", np.float32, (t, H))],
                              [tensor("gate", gate), tensor("up", up), tensor("down", down)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString(), (gate.nbytes + up.nbytes + down.nbytes) // E


def case_native(args) -> None:
    import moepass.cpu_ops as cpu_ops

    cols = ["experts", "T", "ms/run", "runs", "weight MB read", "GB/s", "GMAC/s"]
    table = Table(f"9. moepass::MoEPacked on moepass's own kernels beside QMoE int4/b32 acc 4 (H {H}, {E} experts, "
                  f"top-{TOP_K}, ffn {I_FFN})", cols)
    why = cpu_ops.unavailable()
    if why is not None:
        table.add("native", "", f"unavailable: {why}", "", "", "", "")
        return
    qmoe = (experts_for(2 * I_FFN, H, 4, 32, False, "fc1"), experts_for(H, I_FFN, 4, 32, False, "fc2"))
    for t in ([1] if args.quick else [1, PREFILL]):
        feeds, _, logits = moe_inputs(t, H)
        macs = t * TOP_K * 3 * H * I_FFN
        for name in ("QMoE int4/b32", *(f"{n} ({cpu_ops.isa()})" for n in NATIVE_CASE_TYPES)):
            try:
                if name.startswith("QMoE"):
                    model, _ = qmoe_model(t, H, *qmoe, 4)
                    per_expert, native = qmoe[0].expert_bytes() + qmoe[1].expert_bytes(), False
                else:
                    model, per_expert = native_model(t, name.split()[0])
                    native = True
                timing = run_timed(model, feeds, (t, H), np.float32, args, native=native)
            except Refused as why:
                table.add(name, t, *REFUSED(why)[:5])
                continue
            read = used_experts(logits) * per_expert
            table.add(name, t, fmt_ms(timing.ms), timing.runs, f"{read / 1e6:.1f}", f"{read / timing.ms / 1e6:.1f}",
                      f"{macs / timing.ms / 1e6:.0f}")


def measure_family(args) -> None:
    check = kernel_check(args)
    digest = hashlib.sha1(np.array(check, np.float32).tobytes()).hexdigest()[:12]
    print(f"\n### {cpu_family.kernel_family()} kernels: {cpu_family.describe()}")
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, ONNX Runtime {ort.__version__} CPU EP, "
          f"intra_op_num_threads {args.threads}, numpy {np.__version__}{', --quick' if args.quick else ''}; "
          f"memory: {copy_bandwidth():.1f} GB/s (1 GiB numpy copy, 1 thread, read + write); "
          f"kernel check: q_proj int4/b32 accuracy_level 4 output digest {digest} (differs between families)",
          flush=True)
    start = time.perf_counter()
    for case in args.cases:
        case_start = time.perf_counter()
        globals()[f"case_{case}"](args)
        CACHE.slots.clear()
        print(f"\n({case}: {time.perf_counter() - case_start:.0f} s)", flush=True)
    print(f"\n({cpu_family.kernel_family()} family measured in {time.perf_counter() - start:.0f} s)", flush=True)
    print(FINGERPRINT + json.dumps({"kernel_check": check}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("native", "avx2", "both"), default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="decode only, blocks 32 and 16, the main forms")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--matrices", default=",".join(SHAPES),
                    help=f"comma-separated subset of {','.join(SHAPES)} for the mnb and q4k cases")
    ap.add_argument("--min-time", type=float, default=None, help="seconds of timed runs per case (default 1, quick 0.25)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}")
    args.matrices = [m for m in args.matrices.split(",") if m]
    if set(args.matrices) - set(SHAPES):
        ap.error(f"unknown matrices {', '.join(sorted(set(args.matrices) - set(SHAPES)))}; choose from {', '.join(SHAPES)}")
    if args.min_time is None:
        args.min_time = 0.25 if args.quick else 1.0
    if args.child:
        return measure_family(args)
    families = ["native", "avx2"] if args.family == "both" else [args.family]
    prints: dict[str, dict] = {}
    for family in families:
        if family == "avx2":
            try:
                env = cpu_family.avx2_only_env()
            except RuntimeError as why:
                print(f"\n### AVX2 kernels: not measured ({why})")
                continue
        else:
            env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "AVX2ONLY_VENDOR")}
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--cases", ",".join(args.cases),
               "--matrices", ",".join(args.matrices), "--min-time", str(args.min_time)] + (["--quick"] if args.quick else [])
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith(FINGERPRINT):
                prints[family] = json.loads(line[len(FINGERPRINT):])
            else:
                print(line, end="", flush=True)
        if proc.wait():
            raise SystemExit(f"{family} run failed (exit {proc.returncode})")
    if len(prints) == 2:
        for key in sorted(set(prints["native"]) & set(prints["avx2"])):
            a, b = np.array(prints["native"][key]), np.array(prints["avx2"][key])
            diff = float(np.max(np.abs(a - b)))
            print(f"\nkernel check (q_proj int4/b32 accuracy_level 4): native and AVX2-only outputs differ by up to {diff:.2e} "
                  f"({'different kernels, as expected' if diff else 'IDENTICAL: the shim may not have taken effect'})")


if __name__ == "__main__":
    main()
