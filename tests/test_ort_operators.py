"""moepass.core.ort's records against the installed ONNX Runtime: its operator schemas (the types each
output takes, the slots fixed to float32, accuracy_level) and, where the wheel registers CUDA kernels
(onnxruntime-gpu), the types each CUDA kernel is registered for. This file runs in both installs
(.ci/run runs it in the [gpu] venv too)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import onnx_ir as ir
import onnxruntime
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from moepass.core.ort import OPERATORS, Operator

RELEASE = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2])
# operators newer than a release moepass supports (capabilities.RELEASE_GAPS refuses their models there)
SINCE = {("com.microsoft", "MoEPacked"): (1, 32)}


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


def _distribution() -> str:
    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            version(name)
            return name
        except PackageNotFoundError:
            continue
    return "neither"


def test_the_cuda_kernels_are_registered_as_recorded():
    """Where the wheel carries CUDA kernels (onnxruntime-gpu), each record's CUDA types are those its
    kernel is registered for, and an operator recorded without one has none; the CPU wheel carries
    none (so this check cannot pass unexercised in the GPU install)."""
    kernels = [k for k in ort_state.get_all_opkernel_def() if k.provider == "CUDAExecutionProvider"]
    if not kernels:
        assert _distribution() == "onnxruntime", "onnxruntime-gpu registers no CUDA kernel here"
        return
    registered: dict[tuple[str, str], set[str]] = {}
    for kernel in kernels:
        types = registered.setdefault((kernel.domain, kernel.op_name), set())
        for name, allowed in kernel.type_constraints.items():
            if name in ("T", "T1"):
                types |= set(allowed)
    for op in _present():
        if op.cuda_types is None:
            assert op.key not in registered, op.key
        else:
            names = {f"tensor({ir.DataType(t).name.lower()})" for t in op.cuda_types}
            assert op.key in registered and names <= registered[op.key], (op.key, registered.get(op.key))
