"""Block-sum features: a QMoE node whose gate and up keep a GGUF file's affine codes (Q4_K, Q4_1,
Q5_K, Q5_1, Q2_K: value = s u - m per block) in a symmetric form.

QMoE computes s (c - zero point) from the stored codes; with the file's codes u stored (shifted by
an integer t per block into the form's range) that is s (u - t), and the rest of each value, m' = s
t - m, is one number per block and output row. So x . w = QMoE(x) + sum_b m'[b] X_b, X_b the sum of
x over block b: the node's input is widened by the block sums of the hidden state (`widen`: Reshape,
ReduceSum, Pad, Concat) and fc1 by correction columns holding m' (quantized in the node's form; the
rest of one level quantized again by the next: `quants.pack_with_sums`). QMoE's output is as wide as
its input, so fc2 gets zero rows for the features (`fc2_padding`) and a Slice keeps the first H
columns (`narrow`). The levels are chosen by the error measured on a sample of the tensor's rows
(`measured_levels`, `quants.SumsFit.levels`); conversion and partition's GPU form build the node
through these functions, in whatever type the graph computes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from moepass.core.gguf_reader import SourceTensor
from moepass.core.moe_nodes import MakeOp
from moepass.core.quants import BlockForm, QuantType, SumsFit, sums_fit

# (name, array) -> a constant initializer the graph shares (GraphBuilder.const, or a pass's own)
MakeConst = Callable[[str, np.ndarray], ir.Value]
# Rows of each of a few experts that the levels are measured on
SAMPLE_ROWS = 128
SAMPLE_EXPERTS = 4


def _ints(const: MakeConst, *values: int) -> ir.Value:
    return const("const.i64." + "_".join(str(v).replace("-", "m") for v in values), np.array(values, np.int64))


def block_sums(op: MakeOp, const: MakeConst, x: ir.Value, k: int, block: int, name: str, rank: int = 2) -> ir.Value:
    """x's sums over each block of `block` of its K inputs: [..., K] -> [..., K / block] (x of `rank`
    dimensions), in x's type: a Reshape and a ReduceSum."""
    blocks = op("Reshape", [x, _ints(const, *([0] * (rank - 1)), k // block, block)], name=f"{name}.blocks")
    return op("ReduceSum", [blocks, _ints(const, -1)], {"keepdims": 0}, name=name)


def widen(op: MakeOp, const: MakeConst, x2d: ir.Value, k: int, form: BlockForm, name: str) -> ir.Value:
    """A QMoE node's input [T, K] widened to [T, form.width(K)]: x, then its block sums padded to the
    form's feature stride, once per level."""
    sums = block_sums(op, const, x2d, k, form.block_size, f"{name}.block_sums")
    stride, blocks = form.feature_stride(k), k // form.block_size
    if stride > blocks:
        sums = op("Pad", [sums, _ints(const, 0, 0, 0, stride - blocks)], name=f"{name}.block_sums.pad")
    return op("Concat", [x2d] + [sums] * form.sums, {"axis": -1}, name=f"{name}.widen")


def narrow(op: MakeOp, const: MakeConst, y: ir.Value, k: int, name: str) -> ir.Value:
    """The first K columns of a widened node's output [T, width]."""
    return op("Slice", [y, _ints(const, 0), _ints(const, k), _ints(const, -1)], name=f"{name}.narrow")


def fc2_padding(fc1: BlockForm, hidden: int) -> int:
    """Zero rows fc2 takes after its own H: its output is as wide as the widened input."""
    return fc1.width(hidden) - hidden


def sample_spans(src: SourceTensor) -> list[tuple[int, int]]:
    """(first row, rows) of the sample a tensor's levels are measured on: the first SAMPLE_ROWS rows
    of SAMPLE_EXPERTS experts spread over the stack (of the one matrix, for a 2-D tensor)."""
    experts, rows = (src.shape[0], src.shape[1]) if len(src.shape) == 3 else (1, src.shape[0])
    chosen = sorted({round(i * (experts - 1) / max(1, SAMPLE_EXPERTS - 1)) for i in range(SAMPLE_EXPERTS)})
    return [(e * rows, min(rows, SAMPLE_ROWS)) for e in chosen]


def measured_levels(
    sources: Sequence[tuple[SourceTensor, QuantType]], form: BlockForm, half_scales: bool, exact: bool = False
) -> int:
    """The levels of block-sum features fc1 takes in `form` (its bits and block): the fewest whose
    measured remainder on a sample of each affine source's rows is within SumsFit.levels' target
    (sources without affine codes take none of the features' columns)."""
    total: SumsFit | None = None
    for src, qt in sources:
        if not qt.takes_sums(form):
            continue
        for first, count in sample_spans(src):
            fit = sums_fit(src.read_rows(first, count), qt, form, half_scales)
            if total is None:
                total = fit
            else:
                total += fit
    return total.levels(exact) if total is not None else 0
