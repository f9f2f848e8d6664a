"""moepass.cpu_ops: moepass's own CPU kernels inside ONNX Runtime, over the GGUF's own blocks.

A custom-operator library (C, built at install from this folder: README.md) that ONNX Runtime loads
with `SessionOptions.register_custom_ops_library`. It adds the domain "moepass" with `MoEPacked`
(com.microsoft::MoEPacked's inputs and attributes, float32 activations) and `MatMulPacked`.

`register(options)` registers the library for a session after a self-test (one MatMulPacked node with
a known integer answer, once a process); `unavailable()` says why it cannot be used here (not built,
not loadable, a failed self-test), None where it can. `matmul` and `quantize` run the kernels alone,
on a chosen instruction set, for tests.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from moepass.core import row_groups
from moepass.core.moe_nodes import NATIVE_DOMAIN as DOMAIN
from moepass.core.quants import QUANT_TYPES
from moepass.core.row_groups import ROW_GROUP

# the instruction sets the kernels have, by the library's own numbering
ISAS = ("scalar", "avx2", "avx512")
ISA_ENV = "MOEPASS_CPU_ISA"  # run the kernels of this instruction set (never one the CPU lacks)
HERE = Path(__file__).resolve().parent


def library_path() -> Path | None:
    """The built library beside this file, or None where the install did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise OSError(f"{HERE}: the kernel library was not built at install (a C compiler is needed; see README.md)")
    library = ctypes.CDLL(str(path))
    library.moepass_cpu_isa.restype = ctypes.c_char_p
    library.moepass_matmul.restype = ctypes.c_int
    library.moepass_matmul.argtypes = [
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    library.moepass_quantize.restype = ctypes.c_int
    library.moepass_quantize.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return library


def isa() -> str:
    """The instruction set the kernels run in this process (MOEPASS_CPU_ISA, else the best the CPU has),
    or why none can run."""
    return _library().moepass_cpu_isa().decode()


def matmul(isa_name: str, ggml_type: int, blocks: np.ndarray, a: np.ndarray) -> np.ndarray:
    """a [rows, K] float32 times the transpose of `blocks` [N, row bytes] (GGML type `ggml_type`, rows as
    the GGUF holds them), on the kernels of `isa_name`, as MatMulPacked computes it: the rows laid out in
    row groups as the converter writes them, the rows of `a` one tile."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    qt = QUANT_TYPES.get(GGMLQuantizationType(ggml_type))
    if qt is not None and qt.cpu_kernel and blocks.ndim == 2:
        blocks = row_groups.group(blocks, qt)
    a = np.ascontiguousarray(a, dtype=np.float32)
    y = np.empty((a.shape[0], blocks.shape[0]), dtype=np.float32)
    failed = _library().moepass_matmul(
        ISAS.index(isa_name),
        int(ggml_type),
        blocks.ctypes.data,
        blocks.shape[0],
        blocks.shape[1],
        a.ctypes.data,
        a.shape[0],
        a.shape[1],
        y.ctypes.data,
    )
    if failed:
        raise ValueError(f"the {isa_name} kernels cannot multiply GGML type {ggml_type} [{blocks.shape}] by {a.shape}")
    return y


# the activation formats, by the library's numbering: (name, codes a scale, codes a sum)
ACTIVATIONS = {"q8_0": (0, 32, 32), "q8_k": (1, 256, 16)}


def quantize(isa_name: str, x: np.ndarray, activation: str = "q8_0") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of activations quantized as the kernels quantize it for a type's dot product (llama.cpp's
    Q8_0 or Q8_K blocks): (codes int8 [K], scales float32 [K / block], sums int32 [K / sum block])."""
    index, block, sum_block = ACTIVATIONS[activation]
    x = np.ascontiguousarray(x, dtype=np.float32)
    qs, d, sums = (
        np.empty(x.size, np.int8),
        np.empty(x.size // block, np.float32),
        np.empty(x.size // sum_block, np.int32),
    )
    if _library().moepass_quantize(
        ISAS.index(isa_name), index, x.ctypes.data, x.size, qs.ctypes.data, d.ctypes.data, sums.ctypes.data
    ):
        raise ValueError(f"the {isa_name} kernels cannot quantize {x.size} values to {activation}")
    return qs, d, sums


def _self_test_model() -> tuple[bytes, np.ndarray, np.ndarray]:
    """(model, input, its exact answer): one MatMulPacked node over Q4_0 blocks whose every value,
    and every quantized activation, is an integer, so the answer is exact in any arithmetic."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    n, k = 37, 96  # two row groups and five rows after them, three blocks
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    blocks = np.zeros((n, k // 32, 18), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    grouped = codes.reshape(n, k // 32, 32)
    blocks[:, :, 2:] = grouped[:, :, :16] | (grouped[:, :, 16:] << 4)
    a = rng.integers(-127, 128, size=(3, k)).astype(np.float32)
    a[:, ::32] = 127  # each block's largest magnitude 127: its scale 1, its codes the values themselves
    answer = (a.astype(np.int64) @ (codes.astype(np.int64) - 8).T).astype(np.float32)
    blocks = row_groups.group(blocks.reshape(n, -1), QUANT_TYPES[GGMLQuantizationType.Q4_0])
    node = helper.make_node("MatMulPacked", ["a", "b"], ["y"], domain=DOMAIN, packed_type=2, row_group=ROW_GROUP)
    graph = helper.make_graph(
        [node],
        "moepass_cpu_ops_self_test",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        [onnx.numpy_helper.from_array(blocks, "b")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)], ir_version=8
    )
    return model.SerializeToString(), a, answer


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run in ONNX Runtime here (None: they can): the library is not built, does
    not load, or its self-test gives another answer. Checked once a process."""
    path = library_path()
    if path is None:
        return f"{HERE}: the kernel library was not built at install (it needs a C compiler: cc, gcc or clang)"
    try:
        import onnxruntime as ort

        name = isa()
        if name not in ISAS:
            return f"{path}: {name}"
        model, a, answer = _self_test_model()
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(path))
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        (y,) = session.run(None, {"a": a})
    except Exception as e:  # noqa: BLE001 - ctypes, ONNX Runtime: any failure means the kernels cannot be used
        return f"{path}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
    if not np.array_equal(y, answer):
        wrong = int(np.count_nonzero(y != answer))
        return f"{path}: the self-test's MatMulPacked gave {wrong} of {answer.size} values wrong on the {name} kernels"
    return None


def register(options) -> None:
    """Register the kernels with an onnxruntime.SessionOptions; OSError saying why where they cannot run."""
    why = unavailable()
    if why is not None:
        raise OSError(why)
    options.register_custom_ops_library(str(library_path()))


def requested_isa() -> str | None:
    """The instruction set MOEPASS_CPU_ISA asks for, if any."""
    return os.environ.get(ISA_ENV) or None
