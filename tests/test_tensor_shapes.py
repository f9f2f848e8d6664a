"""Tensor shapes as llama.cpp's loader accepts them (llama_model_loader::check_tensor_dims): the
dimensions create_tensor names, every other one of ggml's four 1. convert_hf_to_gguf.py writes
Qwen2-MoE's shared-expert gate 2-D (ne [n_embd, 1]), llama.cpp's quantizer 1-D; both are read.
(Files from the converter itself, every architecture and type: test_hf_converted.py.)
"""

from __future__ import annotations

import filecmp

import numpy as np
import onnx
import pytest
from gguf import GGUFReader

import moepass
from make_fixtures import finish, metadata_copy
from moepass.core.architectures import llama_cpp_accepts


@pytest.mark.parametrize("shape,expected,accepted", [
    ((1, 256), (256,), True),         # the converter's shared-expert gate
    ((256,), (1, 256), True),
    ((1, 1, 256), (256,), True),
    ((256,), (256,), True),
    ((256, 1), (256,), False),        # ne [1, 256]: the expected dimension is the inner one
    ((2, 128), (256,), False),        # as many elements, another shape: refused (no TENSOR_ALLOW_RESHAPE)
    ((1, 4, 8, 16), (4, 8, 16), True),
    ((1, 1, 4, 8, 16), (4, 8, 16), False),  # more dimensions than ggml has
])
def test_size_one_dimensions_are_no_dimensions(shape, expected, accepted):
    assert llama_cpp_accepts(shape, expected) is accepted


def _copy_with_shapes(source, destination, shapes: dict[str, tuple[int, ...]]):
    """A copy of a GGUF, every tensor's bytes as they are, the F32 tensors named in `shapes` given
    those (numpy-order) shapes."""
    reader = GGUFReader(str(source))
    writer = metadata_copy(reader, destination)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name in shapes:
            writer.add_tensor(tensor.name, data.reshape(shapes[tensor.name]))
        elif data.dtype == np.uint8:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
        else:
            writer.add_tensor(tensor.name, data)
    finish(writer)
    return destination


def _gates(gguf_path) -> dict[str, int]:
    return {t.name: int(t.n_elements) for t in GGUFReader(str(gguf_path)).tensors if "ffn_gate_inp_shexp" in t.name}


def test_two_dimensional_shared_expert_gate_converts_as_the_one_dimensional(make_gguf, converted, tmp_path):
    source = make_gguf("q4_0", arch="qwen2moe")
    gates = _gates(source)
    assert gates
    two_d = _copy_with_shapes(source, tmp_path / "2d.gguf", {name: (1, n) for name, n in gates.items()})
    assert all(t.shape.tolist() == [gates[t.name], 1] for t in GGUFReader(str(two_d)).tensors if t.name in gates)
    out = moepass.convert(two_d, tmp_path / "out", expert_format="qmoe").output_dir
    one_d = converted("q4_0", arch="qwen2moe")
    assert filecmp.cmp(out / "model.onnx.data", one_d / "model.onnx.data", shallow=False)
    graphs = [onnx.load(d / "model.onnx", load_external_data=False).graph for d in (out, one_d)]
    assert graphs[0].node == graphs[1].node and graphs[0].initializer == graphs[1].initializer


def test_shared_expert_gate_of_another_shape_is_refused(make_gguf, tmp_path):
    source = make_gguf("q4_0", arch="qwen2moe")
    name, n = next(iter(_gates(source).items()))
    bad = _copy_with_shapes(source, tmp_path / "bad.gguf", {name: (2, n // 2)})
    with pytest.raises(moepass.MoepassError, match=rf"tensor '{name}' has shape \[2, {n // 2}\], expected \[{n}\]"):
        moepass.convert(bad, tmp_path / "out")
