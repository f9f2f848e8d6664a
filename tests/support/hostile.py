"""Ways to damage a GGUF file, for the hostile-input corpus and the fuzz test.

`remake` rewrites a GGUF through the gguf package with some metadata replaced (any GGUF value
type), keys or tensors dropped, or tensor bytes edited; the `*_offset` helpers find where a field
sits in the file so tests can patch single bytes the writer would never produce.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

V = GGUFValueType


def remake(source: Path, destination: Path, *, set_kv: dict[str, tuple[Any, GGUFValueType]] | None = None,
           drop_kv: tuple[str, ...] = (), tensors: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None,
           alignment: int | None = None) -> Path:
    """A copy of `source` with metadata `set_kv` ({key: (value, type)}; an ARRAY value is
    (list, V.ARRAY, item type)), keys `drop_kv` left out and tensor bytes passed through `tensors`
    ({name: f(raw uint8 array) -> raw uint8 array of the same size})."""
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(destination), str(reader.fields["general.architecture"].contents()))
    set_kv = dict(set_kv or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_kv or key in set_kv:
            continue
        if key == "general.alignment" and alignment is not None:
            continue
        sub_type = field.types[-1] if field.types[0] == V.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for key, spec in set_kv.items():
        value, value_type, *sub = spec
        writer.add_key_value(key, value, value_type, sub[0] if sub else None)
    if alignment is not None:
        writer.data_alignment = alignment
        writer.add_uint32("general.alignment", alignment)
    for t in reader.tensors:
        raw = np.array(t.data, copy=True).view(np.uint8).reshape(-1)
        if tensors and t.name in tensors:
            raw = tensors[t.name](raw)
        shape = tuple(reversed([int(d) for d in t.shape]))
        ggml_type = GGMLQuantizationType(t.tensor_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        writer.add_tensor(t.name, raw.reshape(byte_shape), raw_shape=byte_shape, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


def _offset(reader: GGUFReader, part: np.ndarray) -> int:
    return int(part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0])


def tensor_info_offset(path: Path, name: str, part: str) -> tuple[int, int]:
    """(byte offset in the file, byte size) of one field of a tensor's info record:
    part is "name", "n_dims", "dims", "type" or "offset"."""
    reader = GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    index = {"name": 1, "n_dims": 2, "dims": 3, "type": 4, "offset": 5}[part]
    array = t.field.parts[index]
    return _offset(reader, array), array.nbytes


def value_offset(path: Path, key: str) -> tuple[int, int]:
    """(byte offset, size) of the value of a scalar metadata key."""
    reader = GGUFReader(str(path))
    field = reader.fields[key]
    array = field.parts[field.data[0]]
    return _offset(reader, array), array.nbytes


def tensor_data_offset(path: Path, name: str) -> int:
    reader = GGUFReader(str(path))
    return int(next(t for t in reader.tensors if t.name == name).data_offset)


def patch(path: Path, offset: int, data: bytes) -> Path:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    return path


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def f16(value: float) -> bytes:
    return np.float16(value).tobytes()


def f32(value: float) -> bytes:
    return np.float32(value).tobytes()
