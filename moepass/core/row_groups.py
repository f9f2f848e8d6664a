"""Row groups: the layout of the GGUF blocks that moepass's CPU kernels (moepass.cpu_ops) take.

A matrix's rows go in groups of ROW_GROUP; the rows after the last whole group stay as GGML writes
them. A group holds its rows' blocks block by block. Each block is cut into the segments its type's
`QuantType.cpu_segments` names, (offset, bytes, unit): its float16 scales, its packed sub-block
scales, its codes; for each segment in that order, the group's rows' bytes of it `unit` bytes at a
time, row by row. So one vector load holds the float16 scale of each of 16 rows, or one scale byte of
each, or four codes of each (cpu_ops/kernels.h): a kernel multiplies 16 rows at once, a row a lane,
with no sum across a register. The same bytes as the file's, reordered; laid out at convert time, so
the weights are held once.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from moepass.core.quants import QuantType

ROW_GROUP = 16  # cpu_ops/kernels.h's ROW_GROUP


def _check(qt: QuantType, row_bytes: int) -> int:
    """The blocks a row of `row_bytes` holds."""
    if not qt.cpu_segments:
        raise ValueError(f"{qt.name}: moepass's CPU kernels do not take this type")
    block_size = GGML_QUANT_SIZES[qt.ggml_type][1]
    if row_bytes % block_size:
        raise ValueError(f"{qt.name}: rows of {row_bytes} bytes are no whole blocks of {block_size}")
    return row_bytes // block_size


def group(rows: np.ndarray, qt: QuantType) -> np.ndarray:
    """GGUF rows [..., rows, row bytes] (uint8; each matrix in the last two axes) in row groups."""
    *lead, n, row_bytes = rows.shape
    blocks, whole = _check(qt, row_bytes), n // ROW_GROUP * ROW_GROUP
    g = rows[..., :whole, :].reshape(*lead, whole // ROW_GROUP, ROW_GROUP, blocks, row_bytes // blocks)
    out = np.empty_like(rows)
    grouped = out[..., :whole, :].reshape(*lead, whole // ROW_GROUP, blocks, row_bytes // blocks * ROW_GROUP)
    at = 0
    for offset, size, unit in qt.cpu_segments:
        part = g[..., offset : offset + size].reshape(*g.shape[:-1], size // unit, unit)
        part = np.moveaxis(part, -4, -2)  # [.., groups, blocks, units, rows, unit]
        grouped[..., at : at + ROW_GROUP * size] = part.reshape(*part.shape[:-3], ROW_GROUP * size)
        at += ROW_GROUP * size
    out[..., whole:, :] = rows[..., whole:, :]
    return out


def ungroup(rows: np.ndarray, qt: QuantType) -> np.ndarray:
    """The GGUF rows of `group`'s output: the inverse layout."""
    *lead, n, row_bytes = rows.shape
    blocks, whole = _check(qt, row_bytes), n // ROW_GROUP * ROW_GROUP
    grouped = rows[..., :whole, :].reshape(*lead, whole // ROW_GROUP, blocks, row_bytes // blocks * ROW_GROUP)
    out = np.empty_like(rows)
    g = out[..., :whole, :].reshape(*lead, whole // ROW_GROUP, ROW_GROUP, blocks, row_bytes // blocks)
    at = 0
    for offset, size, unit in qt.cpu_segments:
        part = grouped[..., at : at + ROW_GROUP * size].reshape(*grouped.shape[:-1], size // unit, ROW_GROUP, unit)
        g[..., offset : offset + size] = np.moveaxis(part, -2, -4).reshape(*g.shape[:-1], size)
        at += ROW_GROUP * size
    out[..., whole:, :] = rows[..., whole:, :]
    return out
