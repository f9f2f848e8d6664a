"""Read GGUF files (single or split) without loading the model into memory.

The `gguf` package's reader memory-maps the file and indexes its metadata and tensors. Tensor
payloads are then read on demand with positioned reads (`os.preadv`) instead of through the
map: pages touched through a map stay resident and count towards the process RSS, while a
positioned read leaves them in the page cache only. Converting a model therefore holds one
tensor at a time, whatever the size of the file.

Every structural problem is reported as a `MoepassError` naming the file and the tensor or key.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from moepass.errors import MoepassError

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
# No tensor of a real model comes near 2**40 elements (a 1 TiB F8 tensor); larger is corruption.
MAX_ELEMENTS = 1 << 40
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: where its bytes are and what they mean.

    `shape` is in numpy order (outermost first); for a weight matrix it is `[rows, row_length]`,
    with experts stacked in front: `[E, rows, row_length]`.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * type_size

    def read_rows(self, first: int = 0, count: int | None = None) -> np.ndarray:
        """The raw bytes of rows `[first, first+count)` of the flattened tensor, as uint8 `[count, row_bytes]`."""
        n_rows = self.nbytes // self.row_bytes
        count = n_rows - first if count is None else count
        out = np.empty((count, self.row_bytes), dtype=np.uint8)
        view = memoryview(out).cast("B")
        position = self.offset + first * self.row_bytes
        done = 0
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            while done < out.nbytes:
                n = os.preadv(fd, [view[done:]], position + done)
                if n <= 0:
                    raise MoepassError(f"{self.path}: tensor '{self.name}' ends past the end of the file")
                done += n
        return out

    def read_raw(self) -> np.ndarray:
        """All raw bytes, shaped `[*shape[:-1], row_bytes]` (uint8)."""
        return self.read_rows().reshape(*self.shape[:-1], self.row_bytes)


@dataclasses.dataclass(frozen=True)
class StackedTensor:
    """Equal GGUF tensors read as one stacked along a new first axis (legacy Mixtral files carry
    one tensor per expert, `blk.N.ffn_gate.E.weight`, where newer ones have `blk.N.ffn_gate_exps`).
    Reads like a GGUFTensor."""

    name: str
    parts: tuple[GGUFTensor, ...]

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return self.parts[0].ggml_type

    @property
    def type_name(self) -> str:
        return self.parts[0].type_name

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def path(self) -> Path:
        return self.parts[0].path

    @property
    def row_bytes(self) -> int:
        return self.parts[0].row_bytes

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def read_rows(self, first: int = 0, count: int | None = None) -> np.ndarray:
        per_part = self.parts[0].nbytes // self.row_bytes
        count = len(self.parts) * per_part - first if count is None else count
        chunks, row = [], first
        while row < first + count:
            part, offset = divmod(row, per_part)
            take = min(per_part - offset, first + count - row)
            chunks.append(self.parts[part].read_rows(offset, take))
            row += take
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def read_raw(self) -> np.ndarray:
        return self.read_rows().reshape(*self.shape[:-1], self.row_bytes)


class _CheckedReader(GGUFReader):
    """GGUFReader that validates each tensor's type, shape and extent before indexing it."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise MoepassError(f"tensor '{name}' has unknown ggml type {int(raw_type[0])}") from None
            shape = [int(d) for d in dims]
            if not 1 <= len(shape) <= MAX_DIMS or any(d < 1 for d in shape):
                raise MoepassError(f"tensor '{name}' has absurd dimensions {shape}")
            n_elements = 1
            for d in shape:
                n_elements *= d
            if n_elements > MAX_ELEMENTS:
                raise MoepassError(f"tensor '{name}' has absurd dimensions {shape} ({n_elements} elements)")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if shape[0] % block:
                raise MoepassError(
                    f"tensor '{name}' ({ggml_type.name}) has row length {shape[0]}, not a multiple of its block {block}")
            end = start_offs + int(rel_offset[0]) + n_elements // block * type_size
            if end > size:
                raise MoepassError(
                    f"tensor '{name}' data ends at byte {end}, past the end of the file ({size} bytes)")
        super()._build_tensors(start_offs, fields)


def _open_part(path: Path) -> _CheckedReader:
    if not path.is_file():
        raise MoepassError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise MoepassError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return _CheckedReader(path)
    except MoepassError as e:
        raise MoepassError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise MoepassError(f"{path}: truncated or malformed GGUF ({type(e).__name__}: {e})") from None


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF (`name-00001-of-0000N.gguf`), or just `path`."""
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFModel:
    """A GGUF model, possibly split over several files, read as one.

    `metadata` maps every key to its Python value; `tensors` maps names to `GGUFTensor`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.parts = split_parts(self.path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for part in self.parts:
            reader = _open_part(part)
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or (key in self.metadata and part != self.parts[0]):
                    continue
                try:
                    self.metadata[key] = field.contents()
                except (ValueError, IndexError, UnicodeDecodeError) as e:
                    raise MoepassError(f"{part}: metadata key '{key}' is unreadable ({e})") from None
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise MoepassError(f"{part}: tensor '{t.name}' appears twice")
                self.tensors[t.name] = GGUFTensor(
                    name=t.name,
                    ggml_type=GGMLQuantizationType(t.tensor_type),
                    shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                    path=part,
                    offset=int(t.data_offset),
                    nbytes=int(t.n_bytes),
                )
            # The reader's map is only needed for the index; payloads are read with preadv.
            del reader
        declared = self.metadata.get("split.count")
        if declared is not None and int(declared) != len(self.parts):
            raise MoepassError(
                f"{self.path}: metadata says split.count={declared} but the file name names {len(self.parts)} part(s)")

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise MoepassError(f"{self.path}: missing metadata key '{key}'")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise MoepassError(f"{self.path}: missing tensor '{name}'")
        return self.tensors[name]

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def stacked(self, name: str, part_names: list[str]) -> StackedTensor:
        """Tensors `part_names` (equal type and shape) read as one, named `name`."""
        parts = tuple(self.tensor(n) for n in part_names)
        for p in parts[1:]:
            if (p.ggml_type, p.shape) != (parts[0].ggml_type, parts[0].shape):
                raise MoepassError(f"{p.path}: tensor '{p.name}' is {p.type_name} {list(p.shape)}, but "
                                   f"'{parts[0].name}' is {parts[0].type_name} {list(parts[0].shape)}")
        return StackedTensor(name, parts)
