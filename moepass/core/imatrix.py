"""llama.cpp importance matrices: per weight tensor, how much each input column matters.

Two file formats, as llama.cpp's imatrix tool writes them:
- GGUF (`general.type` = "imatrix"): for each weight, `<name>.in_sum2` (F32 [n_mat, K]: summed
  squared activations per input column, one row per expert) and `<name>.counts` ([n_mat]);
  importance = in_sum2 / counts, and 1 for an expert no token reached (counts 0).
- legacy `.dat`: int32 entry count, then per entry int32 name length, name, int32 ncall, int32 nval,
  float32[nval] (each expert's mean scaled by ncall, 1 x ncall for an expert never reached); a
  trailer follows that moepass ignores. importance = values / ncall.
`load_imatrix` returns {weight name: float32 [n_mat, K]}, the same from either file of one run, as
llama-quantize reads them (tests/test_imatrix.py holds both to a file llama.cpp's llama-imatrix
wrote); requantization weighs each column's error by it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from moepass.core.errors import MoepassError, no_such_path
from moepass.core.gguf_reader import GGUFModel, is_gguf
from moepass.core.quants import dequantize


def load_imatrix(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise no_such_path(path, "the importance matrix")
    if not path.is_file():
        raise MoepassError(f"{path}: not an importance matrix file (not a file)")
    return _from_gguf(path) if is_gguf(path) else _from_dat(path)


def _from_gguf(path: Path) -> dict[str, np.ndarray]:
    gguf = GGUFModel(path)
    if gguf.typed("general.type", str, None) != "imatrix":
        raise MoepassError(
            f"{path}: a GGUF file but not an importance matrix (general.type is {gguf.get('general.type')!r})"
        )
    result = {}
    for name, tensor in gguf.tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        weight = name[: -len(".in_sum2")]
        counts_name = weight + ".counts"
        if counts_name not in gguf.tensors:
            raise MoepassError(f"{path}: tensor '{name}' has no '{counts_name}' beside it")
        sums = dequantize(tensor.read_raw(), tensor.ggml_type).reshape(tensor.shape).reshape(-1, tensor.shape[-1])
        counts_t = gguf.tensors[counts_name]
        counts = dequantize(counts_t.read_raw(), counts_t.ggml_type).reshape(-1)
        if len(counts) != len(sums):
            raise MoepassError(f"{path}: '{counts_name}' has {len(counts)} entries for {len(sums)} matrices")
        if (counts < 0).any() or (sums < 0).any():
            raise MoepassError(f"{path}: tensor '{name}' or '{counts_name}' holds negative values")
        reached = counts[:, None] > 0
        result[weight] = np.where(reached, sums / np.where(reached, counts[:, None], 1), 1.0).astype(np.float32)
    return result


def _from_dat(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    position = 0

    def take(fmt: str):
        nonlocal position
        size = struct.calcsize(fmt)
        if position + size > len(data):
            raise MoepassError(f"{path}: truncated importance matrix (at byte {position})")
        values = struct.unpack_from(fmt, data, position)
        position += size
        return values

    (n_entries,) = take("<i")
    if not 0 < n_entries < 1 << 20:
        raise MoepassError(f"{path}: not an importance matrix (neither GGUF nor llama.cpp's .dat: {n_entries} entries)")
    result = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        if not 0 < length < 4096:
            raise MoepassError(f"{path}: malformed entry name length {length} at byte {position - 4}")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", errors="replace")
        ncall, nval = take("<ii")
        if not 0 < nval <= (len(data) - position) // 4:
            raise MoepassError(
                f"{path}: truncated importance matrix: entry '{name}' announces {nval} values, more than the file holds"
            )
        values = np.array(take(f"<{nval}f"), dtype=np.float32)
        if not np.isfinite(values).all() or (values < 0).any():
            raise MoepassError(f"{path}: entry '{name}' holds negative or non-finite importances")
        result[name] = (values / ncall if ncall > 0 else values).reshape(1, -1)
    return result


def importance_rows(imatrix: np.ndarray, source_shape: tuple[int, ...], first: int, count: int) -> np.ndarray:
    """Importance for flattened rows [first, first+count) of a tensor [..., N, K]: each expert's own
    row of the matrix (n_mat = experts), or the single row for all (n_mat = 1)."""
    k = source_shape[-1]
    n_mat = imatrix.size // k
    matrix = imatrix.reshape(n_mat, k)
    if n_mat == 1:
        return np.broadcast_to(matrix[0], (count, k))
    rows_per_mat = int(np.prod(source_shape[:-1])) // n_mat
    return matrix[(first + np.arange(count)) // rows_per_mat]
