"""The quantized expert tensors of one MoE node in its ExpertForms, from any RowSources (a GGUF's
tensors, or a model's own stored experts): fc1 (gate and up interleaved, block-sum features'
correction columns where the form has them), fc2 (zero rows for those features), in the SM80 layout
for expert offload. The GGUF lowering (passes/lower/ffn.py) and partition's GPU form
(passes/gpu_form.py) both build their QMoE nodes' weights here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from moepass.core.errors import MoepassError
from moepass.core.quants import BlockForm
from moepass.cuda_ops.prepack import prepack_problem
from moepass.passes.lower.block_sums import fc2_padding
from moepass.passes.weights.packing import PackedGroup, PackOptions
from moepass.passes.weights.report import WeightReport
from moepass.passes.weights.sources import RowSource


@dataclasses.dataclass
class ExpertTensors:
    """fc1 and fc2 codes and scales of a node, the forms they are in, and fc2's zero rows."""

    fc1: PackedGroup
    fc2: PackedGroup
    fc1_form: BlockForm  # the node's bits and block, with block-sum features' levels
    pad: int  # fc2's zero rows (the features' columns of the widened output)
    prepacked: bool


def expert_tensors(
    node: str,
    prefix: str,
    fc1_rows: Sequence[RowSource],
    fc2_rows: Sequence[RowSource],
    fc1_form: BlockForm,
    report: WeightReport,
    options: PackOptions,
) -> ExpertTensors:
    """Codes and scales of node `node`'s experts: fc1 from `fc1_rows` (gate, up) in `fc1_form`, fc2
    from `fc2_rows` (down) in its plain form with the features' zero rows; both stored as `options`
    say (its scale type, threads and layout: `options.prepack`, the SM80 layout, is refused, naming
    the projection, where the shapes cannot take it)."""
    hidden = fc1_rows[0].shape[-1]
    pad = fc2_padding(fc1_form, hidden) if fc1_form.sums else 0
    if options.prepack:
        for label, (n, k) in (
            ("fc1 (gate and up)", (len(fc1_rows) * fc1_rows[0].shape[-2], fc1_form.width(hidden))),
            ("fc2 (down)", (fc2_rows[0].shape[-2] + pad, fc2_rows[0].shape[-1])),
        ):
            problem = prepack_problem(n, k, fc1_form.bits)
            if problem:
                raise MoepassError(f"{node}: {label} cannot take the prepacked layout expert offload needs: {problem}")
    fc1 = PackedGroup(fc1_rows, fc1_form, f"{prefix}.fc1", report, options)
    fc2 = PackedGroup(fc2_rows, fc1_form.plain, f"{prefix}.fc2", report, dataclasses.replace(options, pad_rows=pad))
    return ExpertTensors(fc1, fc2, fc1_form, pad, options.prepack)
