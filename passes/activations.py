"""quantize-activations: int8 activations inside the quantized matrix products, as llama.cpp does.

llama.cpp never multiplies its quantized weights with float activations: each dot product first
quantizes the activation row to 8 bits per block (Q8_0, or Q8_K for K-quants) and works in
integers. ONNX Runtime's CPU kernels do the same for a MatMulNBits or QMoE node whose
`accuracy_level` is 4 (MLAS's CompInt8 path), and run several times faster for it than with float
activations (int8 QMoE experts with float activations are the slowest case of all).

Mode "int8" (the default of `moepass convert`) sets accuracy_level 4 on every MatMulNBits and QMoE
node: the speed and the fidelity llama.cpp users already have. Mode "float" removes the attribute:
float activations, exact arithmetic on the weights' exact values (what the bit-exactness tests ask
for). The mode is recorded in the model's metadata (`moepass.activations`), so `inspect` and the
runtime can say what a model was built for. Float matrix products (MatMul on float weights, the
float MoE node) are left as they are in both modes.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from moepass.core import keys
from moepass.core.choices import ACTIVATION_MODES, one_of
from moepass.core.ort import operator


class QuantizeActivationsPass(InPlacePass):
    """Set (mode "int8") or clear (mode "float") accuracy_level on every quantized matrix product."""

    def __init__(self, mode: str = "int8") -> None:
        super().__init__()
        one_of(mode, ACTIVATION_MODES, "activations")
        self.mode = mode

    def call(self, model: ir.Model) -> PassResult:
        level = ACTIVATION_MODES[self.mode]
        modified = False
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            op = operator(node)
            if op is None or not op.quantized_matmul:
                continue
            current = node.attributes.get_int("accuracy_level", None)
            if current == level:
                continue
            if level is None:
                node.attributes.pop("accuracy_level")
            else:
                node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
            modified = True
        if model.metadata_props.get(keys.ACTIVATIONS) != self.mode:
            model.metadata_props[keys.ACTIVATIONS] = self.mode
            modified = True
        return PassResult(model, modified)
