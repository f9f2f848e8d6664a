"""moepass.core.ort's records against the installed ONNX Runtime: its operator schemas (the types each
output takes, the slots fixed to float32, accuracy_level) and, where the wheel registers CUDA kernels
(onnxruntime-gpu), the types each CUDA kernel is registered for. This file runs in both installs
(.ci/run runs it in the [gpu] venv too)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import onnx_ir as ir
import onnxruntime
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from moepass.core.ort import OPERATORS, Operator
from moepass.runtime.decoder import installed_onnxruntimes

RELEASE = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2])
# operators newer than a release moepass supports (capabilities.RELEASE_GAPS refuses their models there)
SINCE = {gap_op: (1, 32) for gap_op in (("com.microsoft", "MoEPacked"), ("com.microsoft", "MoEGroupRouter"))}


def _schemas() -> dict[tuple[str, str], object]:
    return {(s.domain, s.name): s for s in ort_state.get_all_operator_schema()}


def _allowed(schema, type_str: str) -> set[str]:
    """The types a formal parameter's type string allows: its constraint's, or the string itself."""
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return set(constraint.allowed_type_strs)
    return {type_str}


def _float_whatever_the_activations(schema, parameter) -> bool:
    """A slot that takes float32 and whose type is not tied to the activations' (input 0's): a
    float16 graph keeps it float32."""
    return "tensor(float)" in _allowed(schema, parameter.typeStr) and parameter.typeStr != schema.inputs[0].typeStr


def _present() -> list[Operator]:
    schemas = _schemas()
    missing = sorted(k for k in OPERATORS if k not in schemas)
    assert missing == sorted(k for k, since in SINCE.items() if RELEASE < since), (missing, onnxruntime.__version__)
    return [op for op in OPERATORS.values() if op.key in schemas]


def test_each_record_is_its_schemas():
    schemas = _schemas()
    for op in _present():
        schema = schemas[op.key]
        outputs, inputs = list(schema.outputs), list(schema.inputs)
        assert len(op.output_types) <= len(outputs), op.key
        for index, source in enumerate(op.output_types):
            if source is None:
                assert _float_whatever_the_activations(schema, outputs[index]), (op.key, index)
            else:
                assert outputs[index].typeStr == inputs[source].typeStr, (op.key, index, source)
        for index in op.float_inputs:
            assert _float_whatever_the_activations(schema, inputs[index]), (op.key, "input", index)
        for index in op.float_outputs:
            assert _float_whatever_the_activations(schema, outputs[index]), (op.key, "output", index)
        assert op.quantized_matmul == ("accuracy_level" in schema.attributes), op.key


def test_the_check_finds_a_wrong_record(monkeypatch):
    """A record that says an output takes the wrong input's type is caught."""
    wrong = Operator("com.microsoft", "GroupQueryAttention", (0, 0, 3, 0))
    monkeypatch.setitem(OPERATORS, wrong.key, wrong)
    with pytest.raises(AssertionError, match="GroupQueryAttention"):
        test_each_record_is_its_schemas()


# the CUDA kernels onnxruntime-gpu registers, listed in a child process: without an NVIDIA driver
# ONNX Runtime cannot load its CUDA provider, and listing the kernels then crashes the process
_CUDA_KERNELS = """
import json, onnxruntime
onnxruntime.preload_dlls()
from onnxruntime.capi import onnxruntime_pybind11_state as state
found = {}
for kernel in state.get_all_opkernel_def():
    if kernel.provider == "CUDAExecutionProvider":
        types = found.setdefault(f"{kernel.domain}/{kernel.op_name}", [])
        types += [t for name, allowed in kernel.type_constraints.items() if name in ("T", "T1") for t in allowed]
print(json.dumps(found))
"""


def test_the_cuda_kernels_are_registered_as_recorded():
    """In the GPU install on a machine with an NVIDIA driver, each record's CUDA types are among those
    its kernel is registered for, and an operator recorded without one has none; the CPU wheel
    registers no CUDA kernel at all."""
    if not any(found.startswith("onnxruntime-gpu ") for found in installed_onnxruntimes()):
        assert not any(k.provider == "CUDAExecutionProvider" for k in ort_state.get_all_opkernel_def())
        return
    if ctypes.util.find_library("cuda") is None and not Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists():
        pytest.skip("no NVIDIA driver (libcuda.so.1) here: onnxruntime-gpu cannot list its CUDA kernels")
    listed = subprocess.run([sys.executable, "-c", _CUDA_KERNELS], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    registered = {tuple(key.split("/", 1)): set(types) for key, types in json.loads(listed.stdout).items()}
    assert registered, "onnxruntime-gpu listed no CUDA kernel"
    for op in _present():
        if op.cuda_types is None:
            assert op.key not in registered, op.key
        else:
            names = {f"tensor({ir.DataType(t).name.lower()})" for t in op.cuda_types}
            assert op.key in registered and names <= registered[op.key], (op.key, registered.get(op.key))
