"""ONNX Runtime on the converted model against an independent numpy forward pass
(tests/support/reference_forward.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moepass.runtime import load
from support.reference_forward import Qwen3MoeReference

PROMPT = [3, 17, 250, 64, 9, 300, 120, 45]


# Q4_0 experts and matrices converted with --activations float run in float32 on ONNX Runtime's CPU
# kernels (int4 QMoE and MatMulNBits dequantize without touching the activations), so they meet the
# float tolerance too.
@pytest.mark.parametrize("preset,kwargs", [("f32", {}), ("f32", {"tied_output": True}), ("q4_0", {})],
                         ids=["f32", "f32-tied-output", "q4_0"])
def test_matches_numpy_reference(preset, kwargs, make_gguf, converted):
    ref = Qwen3MoeReference(make_gguf(preset, **kwargs)).logits(PROMPT)
    decoder = load(converted(preset, activations="float", **kwargs))
    logits, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    assert np.abs(logits[0] - ref).max() <= 1e-4
