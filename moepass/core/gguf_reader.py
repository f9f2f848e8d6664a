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
import hashlib
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from moepass.core.errors import MoepassError, no_such_path, wording
from moepass.core.quants import has_non_finite

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
# No tensor of a real model comes near 2**40 elements (a 1 TiB F8 tensor); larger is corruption.
MAX_ELEMENTS = 1 << 40
# More tensors or keys than any model has (DeepSeek-V3: ~1,100 tensors; tokenizer arrays are one key each)
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_ALIGNMENT = 1 << 16
MAX_ARRAY = 1 << 23  # metadata array items (the largest vocabularies and merge lists are well under a million)
_INTEGERS = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
_FLOATS = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_VALUE_TYPES = {int(t) for t in GGUFValueType}
_KIND_WORDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
_MISSING = object()
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
    # refuse rows holding NaN or Inf (a float value or a block scale) as they are read
    check_finite: bool = True

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
        view = out.data.cast("B")
        position = self.offset + first * self.row_bytes
        done = 0
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            while done < out.nbytes:
                n = os.preadv(fd, [view[done:]], position + done)
                if n <= 0:
                    raise MoepassError(f"{self.path}: tensor '{self.name}' ends past the end of the file")
                done += n
        if self.check_finite and has_non_finite(out, self.ggml_type):
            raise MoepassError(
                f"{self.path}: tensor '{self.name}' holds non-finite values (NaN or Inf"
                f"{'' if self.ggml_type.name in ('F32', 'F16', 'BF16') else ' block scales'}); the "
                f"model would compute NaN; {wording().option('--allow-non-finite')} converts it anyway"
            )
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


# a tensor to read: one of the file's, or equal ones stacked (legacy per-expert tensors)
SourceTensor = GGUFTensor | StackedTensor


class _CheckedReader(GGUFReader):
    """GGUFReader that validates the alignment and each tensor's name, type, shape, extent and
    placement (aligned, inside the file, overlapping no other tensor) before indexing it."""

    def _build_tensor_info(self, offs: int, count: int):
        if count > MAX_TENSORS:
            raise MoepassError(f"the header announces {count} tensors (corrupt tensor count)")
        alignment = self.fields.get("general.alignment")
        if alignment is not None:
            value = alignment.contents()
            if alignment.types != [GGUFValueType.UINT32] or not _power_of_two(value):
                raise MoepassError(
                    f"metadata key 'general.alignment' is {value!r}; it must be a uint32 power of two "
                    f"up to {MAX_ALIGNMENT}"
                )
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == GGUFValueType.ARRAY and orig_offs + 12 <= len(self.data):
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            # the smallest an item can be: a string is at least its 8-byte length, an array 12 bytes
            smallest: int = {int(GGUFValueType.STRING): 8, int(GGUFValueType.ARRAY): 12}.get(item_type, 1)
            if count > MAX_ARRAY or count * smallest > len(self.data) - orig_offs - 12:
                raise MoepassError(
                    f"a metadata array at byte {orig_offs} announces {count:,} items, more than the "
                    "file holds (corrupt array length)"
                )
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type)) if item_type in _VALUE_TYPES else None
            if scalar is not None:  # numbers in one read, not one array object per item (the gguf reader's way)
                values = self._get(orig_offs + 12, scalar, count)
                parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64), values]
                return 12 + int(values.nbytes), parts, [2], [GGUFValueType.ARRAY, GGUFValueType(item_type)]
            if item_type == GGUFValueType.STRING and self.byte_order == "I":
                return self._string_array(orig_offs, count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs: int, count: int):
        """An array of strings as the gguf reader parts it ([type, count, len0, bytes0, len1, ...]),
        its lengths read with struct and its parts sliced from a plain ndarray view of the file: the
        gguf reader's item-by-item memmap slicing takes seconds for a 150,000-token vocabulary."""
        plain = self.data.view(np.ndarray)
        view, size = plain.data, len(plain)
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        for _ in range(count):
            length = struct.unpack_from("=Q", view, offs)[0] if offs + 8 <= size else None
            if length is None or length > size - offs - 8:
                raise MoepassError(
                    f"a metadata string at byte {offs} runs past the end of the file (corrupt string length)"
                )
            parts.append(plain[offs : offs + 8].view(np.uint64))
            parts.append(plain[offs + 8 : offs + 8 + length])
            offs += 8 + length
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if count else [])
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types

    def _build_fields(self, offs: int, count: int) -> int:
        if count > MAX_KEYS:
            raise MoepassError(f"the header announces {count} metadata keys (corrupt key count)")
        return super()._build_fields(offs, count)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        extents, names = [], set()
        for field in fields:
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            try:
                name = bytes(name_data).decode("utf-8")
            except UnicodeDecodeError:
                raise MoepassError(f"a tensor name is not UTF-8 ({bytes(name_data)[:40]!r})") from None
            if name in names:
                raise MoepassError(f"tensor '{name}' appears twice")
            names.add(name)
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
                    f"tensor '{name}' ({ggml_type.name}) has row length {shape[0]}, not a multiple of its block {block}"
                )
            start = start_offs + int(rel_offset[0])
            if int(rel_offset[0]) % self.alignment:
                raise MoepassError(
                    f"tensor '{name}' data offset {int(rel_offset[0])} is not a multiple of the "
                    f"file's alignment {self.alignment}"
                )
            end = start + n_elements // block * type_size
            if end > size:
                raise MoepassError(f"tensor '{name}' data ends at byte {end}, past the end of the file ({size} bytes)")
            extents.append((start, end, name))
        extents.sort()
        for (_, end, name), (start, _, other) in zip(extents, extents[1:]):
            if start < end:
                raise MoepassError(f"tensors '{name}' and '{other}' overlap in the file (corrupt offset or type)")
        super()._build_tensors(start_offs, fields)


def _power_of_two(value) -> bool:
    return isinstance(value, int) and 0 < value <= MAX_ALIGNMENT and not value & (value - 1)


# magic, version, tensor count, metadata key count: the least a GGUF file holds
GGUF_HEADER_BYTES = 24
# numpy's words when a memmapped field runs past the end of the file
_NUMPY_SHORT_READ = re.compile(
    r"^(buffer is smaller than requested size|index \d+ is out of bounds.*|"
    r"mmap length is greater than file size|cannot reshape array.*)$"
)


def _open_part(path: Path) -> _CheckedReader:
    if not path.exists():
        raise no_such_path(path)
    if not path.is_file():
        raise MoepassError(f"{path}: not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise MoepassError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return _CheckedReader(path)
    except MoepassError as e:
        raise MoepassError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        size = path.stat().st_size
        if size < GGUF_HEADER_BYTES:
            raise MoepassError(
                f"{path}: truncated: {size} bytes, shorter than a GGUF header ({GGUF_HEADER_BYTES})"
            ) from None
        words = _NUMPY_SHORT_READ.sub("a field runs past the end of the file", str(e))
        raise MoepassError(f"{path}: truncated or malformed GGUF ({size:,} bytes; {words})") from None


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a readable file that starts with the GGUF magic (the one sniffing rule)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF (`name-00001-of-0000N.gguf`), or just `path`."""
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


# A fingerprint reads at most this much of a part's header and of each tensor's data
FINGERPRINT_HEADER = 64 << 20
FINGERPRINT_SAMPLE = 4096


class GGUFModel:
    """A GGUF model, possibly split over several files, read as one.

    `metadata` maps every key to its Python value; `tensors` maps names to `GGUFTensor`.
    """

    def __init__(self, path: str | os.PathLike, allow_non_finite: bool = False):
        self.path = Path(path)
        self.parts = split_parts(self.path)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, list[GGUFValueType]] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for part in self.parts:
            reader = _open_part(part)
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or (key in self.metadata and part != self.parts[0]):
                    continue
                try:
                    self.metadata[key] = field.contents()
                    self.value_types[key] = list(field.types)
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
                    check_finite=not allow_non_finite,
                )
            # The reader's map is only needed for the index; payloads are read with preadv.
            del reader
        declared = self.typed("split.count", int, None)
        if declared is not None and declared != len(self.parts):
            raise MoepassError(
                f"{self.path}: metadata says split.count={declared} but the file name names {len(self.parts)} part(s)"
            )

    @property
    def architecture(self) -> str:
        return self.typed("general.architecture", str)

    def typed(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """The value of a scalar key, which must be stored with a GGUF type of `kind` (int, float, bool
        or str; a float key may hold an integer) and, for numbers, be finite. Absent: `default`, or
        an error when none is given."""
        if key not in self.metadata:
            if default is _MISSING:
                raise MoepassError(f"{self.path}: missing metadata key '{key}'")
            return default
        types = self.value_types.get(key, [])
        allowed = {int: _INTEGERS, float: _INTEGERS | _FLOATS, bool: {GGUFValueType.BOOL}, str: {GGUFValueType.STRING}}[
            kind
        ]
        if len(types) != 1 or types[0] not in allowed:
            stored = (
                "an array" if types and types[0] == GGUFValueType.ARRAY else (types[0].name if types else "unknown")
            )
            raise MoepassError(f"{self.path}: metadata key '{key}' is stored as {stored}, expected {_KIND_WORDS[kind]}")
        value = kind(self.metadata[key])
        if kind is float and not math.isfinite(value):
            raise MoepassError(f"{self.path}: metadata key '{key}' is {value}, not a finite number")
        return value

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def fingerprint(self) -> str:
        """A digest of what the model's weights are, cheap to take at any size: each part's size
        and header (metadata and tensor index), and the first FINGERPRINT_SAMPLE bytes of every
        tensor. A file re-quantized, re-written or cut short gives another; one copied or moved,
        the same."""
        digest = hashlib.sha256()
        for part in self.parts:
            tensors = sorted((t for t in self.tensors.values() if t.path == part), key=lambda t: t.offset)
            start = tensors[0].offset if tensors else part.stat().st_size
            digest.update(f"{part.stat().st_size}\n".encode())
            with open(part, "rb") as f:
                digest.update(f.read(min(start, FINGERPRINT_HEADER)))
                for t in tensors:
                    digest.update(t.name.encode() + os.pread(f.fileno(), min(t.nbytes, FINGERPRINT_SAMPLE), t.offset))
        return digest.hexdigest()

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
                raise MoepassError(
                    f"{p.path}: tensor '{p.name}' is {p.type_name} {list(p.shape)}, but "
                    f"'{parts[0].name}' is {parts[0].type_name} {list(parts[0].shape)}"
                )
        return StackedTensor(name, parts)
