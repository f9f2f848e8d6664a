"""Row groups: the layout of the GGUF blocks that moepass's CPU kernels (moepass.cpu_ops) take.

A matrix's rows go in groups of ROW_GROUP; the rows after the last whole group stay as GGML writes
them. A group holds its rows' blocks block by block: for each block, the group's rows' headers (the
block's leading `QuantType.cpu_header` bytes: its scales) one after another, then their codes
GROUP_CHUNK bytes at a time, row by row. The same bytes as the file's, in an order where one vector
load holds four codes of each of 16 rows (cpu_ops/kernels.h), so that a kernel multiplies 16 rows at
once with no sum across a register. Laid out at convert time: the weights are held once.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from moepass.core.quants import QuantType

ROW_GROUP = 16  # cpu_ops/kernels.h's ROW_GROUP
GROUP_CHUNK = 4  # bytes of one row's codes before the next row's


def _geometry(qt: QuantType, row_bytes: int) -> tuple[int, int, int]:
    """(blocks a row, header bytes, code bytes) of one block of `qt`."""
    if not qt.cpu_header:
        raise ValueError(f"{qt.name}: moepass's CPU kernels do not take this type")
    block_size = GGML_QUANT_SIZES[qt.ggml_type][1]
    if row_bytes % block_size:
        raise ValueError(f"{qt.name}: rows of {row_bytes} bytes are no whole blocks of {block_size}")
    return row_bytes // block_size, qt.cpu_header, block_size - qt.cpu_header


def group(rows: np.ndarray, qt: QuantType) -> np.ndarray:
    """GGUF rows [..., rows, row bytes] (uint8; each matrix in the last two axes) in row groups."""
    *lead, n, row_bytes = rows.shape
    blocks, header, codes = _geometry(qt, row_bytes)
    whole = n // ROW_GROUP * ROW_GROUP
    g = rows[..., :whole, :].reshape(*lead, whole // ROW_GROUP, ROW_GROUP, blocks, header + codes)
    heads = np.swapaxes(g[..., :header], -3, -2)  # [.., groups, blocks, rows, header]
    chunks = g[..., header:].reshape(*g.shape[:-1], codes // GROUP_CHUNK, GROUP_CHUNK)
    chunks = np.moveaxis(chunks, -4, -2)  # [.., groups, blocks, chunks, rows, 4]
    out = np.empty_like(rows)
    grouped = out[..., :whole, :].reshape(*lead, whole // ROW_GROUP, blocks, ROW_GROUP * (header + codes))
    grouped[..., : ROW_GROUP * header] = heads.reshape(*heads.shape[:-2], ROW_GROUP * header)
    grouped[..., ROW_GROUP * header :] = chunks.reshape(*chunks.shape[:-3], ROW_GROUP * codes)
    out[..., whole:, :] = rows[..., whole:, :]
    return out


def ungroup(rows: np.ndarray, qt: QuantType) -> np.ndarray:
    """The GGUF rows of `group`'s output: the inverse layout."""
    *lead, n, row_bytes = rows.shape
    blocks, header, codes = _geometry(qt, row_bytes)
    whole = n // ROW_GROUP * ROW_GROUP
    grouped = rows[..., :whole, :].reshape(*lead, whole // ROW_GROUP, blocks, ROW_GROUP * (header + codes))
    heads = grouped[..., : ROW_GROUP * header].reshape(*grouped.shape[:-1], ROW_GROUP, header)
    chunks = grouped[..., ROW_GROUP * header :].reshape(
        *grouped.shape[:-1], codes // GROUP_CHUNK, ROW_GROUP, GROUP_CHUNK
    )
    out = np.empty_like(rows)
    g = out[..., :whole, :].reshape(*lead, whole // ROW_GROUP, ROW_GROUP, blocks, header + codes)
    g[..., :header] = np.swapaxes(heads, -3, -2)
    g[..., header:] = np.moveaxis(chunks, -2, -4).reshape(*g.shape[:-1], codes)
    out[..., whole:, :] = rows[..., whole:, :]
    return out
