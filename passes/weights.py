"""How GGUF tensors become ONNX initializers: streamed, chunk by chunk, with a conversion record.

Each initializer is a `StreamedTensor`: when onnx-ir's writer saves the model it calls
`tofile()`, which reads a few MiB of source rows, converts them (repack, requantize or
dequantize) and writes them, then the next few. No tensor is ever whole in memory, so peak
memory is set by CHUNK_BYTES, not by the size of the model or of its largest tensor.

Every group of initializers made from GGUF tensors gets a `WeightRecord` in the `WeightReport`:
sources, their types, the target form, bytes, and (once written) whether each source moved
bit-exactly and its relative RMS error against the gguf package's dequantization.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir
from gguf import GGMLQuantizationType

from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import SourceTensor
from moepass.core.imatrix import importance_rows
from moepass.core.ir_values import read_rows, tensor_dims
from moepass.core.quants import BlockForm, Packed, QuantType, dequantize, pack, quantize_values, rel_rms, unpack_values
from moepass.cuda_ops.prepack import prepack_sm80

# Source bytes read and converted at a time. Small enough that temporaries are reused by the
# allocator instead of being faulted in afresh for every tensor.
CHUNK_BYTES = 8 << 20


def default_workers() -> int:
    """Worker threads of a conversion unless the user says (convert --threads): every core this
    process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass
class WeightRecord:
    """How one group of ONNX initializers was made from GGUF tensors."""

    onnx_name: str
    sources: list[str]
    source_types: list[str]
    target: str
    bytes: int
    bits_per_weight: float
    # Per source, known once written: bit-exact?, and the relative RMS error ||W' - W|| / ||W||
    # against the gguf package's dequantization (0.0 when exact).
    exact: list[bool] | None = None
    rel_rms_error: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class WeightReport:
    """The WeightRecords of a conversion, filled in by the writer threads as tensors are written."""

    def __init__(self) -> None:
        self.records: dict[str, WeightRecord] = {}
        self._lock = threading.Lock()

    def add(self, record: WeightRecord) -> WeightRecord:
        if record.onnx_name in self.records:
            raise ValueError(f"two weight groups named {record.onnx_name!r}")
        self.records[record.onnx_name] = record
        return record

    def measured(self, name: str, exact: list[bool], error: list[float]) -> None:
        with self._lock:
            self.records[name].exact = exact
            self.records[name].rel_rms_error = error


def merged_records(records: list[dict[str, Any]], newer: WeightReport) -> list[dict[str, Any]]:
    """A report's weight records (as_dict) with `newer`'s records of the same names in their place
    (a rewrite's: partition's GPU form), and its others after them."""
    new = {r.onnx_name: r.as_dict() for r in newer.records.values()}
    return [new.pop(r["onnx_name"], r) for r in records] + list(new.values())


class StreamedTensor(ir.LazyTensor):
    """A lazy tensor produced as a sequence of C-ordered chunks along its first axes.

    `tofile` writes the chunks as they come; `numpy()`/`tobytes()` (used by tests and small
    consumers) concatenate them.
    """

    __slots__ = ("_chunks", "in_expert_order")

    def __init__(
        self,
        chunks: Callable[[], Iterator[np.ndarray]],
        dtype: ir.DataType,
        shape: tuple[int, ...],
        name: str,
        in_expert_order: Callable[[list[int]], Callable[[], Iterator[np.ndarray]]] | None = None,
    ):
        self._chunks = chunks
        # for an expert stack [E, ...]: its chunks with the experts in another order (slot i holds
        # expert order[i]) at the cost of streaming it once (a PackedGroup packs its sources in that
        # order: reorder-experts on a model lowered in this run); None: read whole to reorder
        self.in_expert_order = in_expert_order

        def whole() -> ir.TensorProtocol:
            parts = [np.ascontiguousarray(c).reshape(-1) for c in chunks()]
            return ir.Tensor(np.concatenate(parts).reshape(shape), name=name)

        super().__init__(whole, dtype=dtype, shape=ir.Shape(shape), name=name)

    def tofile(self, file) -> None:
        sink = DirectSink.open(file, self.nbytes)
        with sink or contextlib.nullcontext():
            write = file.write if sink is None else sink.write
            for chunk in self._chunks():
                write(np.ascontiguousarray(chunk).data.cast("B"))


# Tensors of at least this many bytes are written past the page cache (DirectSink)
DIRECT_MIN_BYTES = 64 << 20
_PAGE = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a multiple of every block size in use)
_STAGING_BYTES = 16 << 20
_staging = threading.local()


class DirectSink:
    """A large tensor's bytes written with O_DIRECT: staged in two reused, page-aligned buffers, one
    filled while a thread writes the other straight to the disk, not copied into the page cache. A
    model many GB larger than the file it came from would otherwise pass through the page cache
    whole: a kernel copy and a fresh page of memory for every 4 KiB written (on a VM whose host
    backs fresh pages lazily, most of a conversion's time), evicting what the user had cached. The
    unaligned head and tail (under 4 KiB each) go through the ordinary file; where the file system
    refuses O_DIRECT (tmpfs: the open; or the writes, EINVAL) the whole tensor or its rest does.
    `open` returns None for small tensors, or where there is no path to open."""

    def __init__(self, file, direct_fd: int, position: int):
        self.file, self.fd, self.direct_fd = file, file.fileno(), direct_fd
        buffers = getattr(_staging, "buffers", None)
        if buffers is None or len(buffers[0]) != _STAGING_BYTES:  # anonymous maps: page-aligned
            buffers = _staging.buffers = tuple(memoryview(mmap.mmap(-1, _STAGING_BYTES)) for _ in range(2))
        self.buffers, self.current, self.staged = buffers, 0, 0
        self.position = position  # where the bytes staged next go
        self.head = -position % _PAGE  # bytes the ordinary file takes before the first aligned offset
        self.disk = ThreadPoolExecutor(1)
        self.pending: Future | None = None

    @classmethod
    def open(cls, file, nbytes: int) -> DirectSink | None:
        name = getattr(file, "name", None)
        if nbytes < DIRECT_MIN_BYTES or not hasattr(os, "O_DIRECT") or not isinstance(name, (str, bytes, os.PathLike)):
            return None
        try:
            direct_fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            return None
        file.flush()  # what the ordinary file holds goes first
        return cls(file, direct_fd, file.tell())

    def write(self, data: memoryview) -> None:
        if self.head:
            taken = min(self.head, len(data))
            self._plain(data[:taken], self.position)
            data, self.head, self.position = data[taken:], self.head - taken, self.position + taken
        while len(data):
            staging = self.buffers[self.current]
            taken = min(len(data), _STAGING_BYTES - self.staged)
            staging[self.staged : self.staged + taken] = data[:taken]
            self.staged += taken
            data = data[taken:]
            if self.staged == _STAGING_BYTES:  # to the disk while the other buffer fills
                self._wait()
                self.pending = self.disk.submit(self._direct, staging, self.position)
                self.position += _STAGING_BYTES
                self.current, self.staged = 1 - self.current, 0

    def __enter__(self) -> DirectSink:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._wait()  # also after an error: no thread may still be reading a staging buffer
            if exc[0] is None:
                staging, aligned = self.buffers[self.current], self.staged - self.staged % _PAGE
                self._direct(staging[:aligned], self.position)
                self._plain(staging[aligned : self.staged], self.position + aligned)
                self.position += self.staged
                self.file.seek(self.position)
        finally:
            self.disk.shutdown()
            if self.direct_fd >= 0:
                os.close(self.direct_fd)

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _direct(self, data: memoryview, position: int) -> None:
        """data (a multiple of _PAGE bytes, page-aligned) to the disk at position."""
        try:
            while len(data) and self.direct_fd >= 0:
                written = os.pwrite(self.direct_fd, data, position)
                data, position = data[written:], position + written
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.close(self.direct_fd)  # the file system takes O_DIRECT opens but not these writes
            self.direct_fd = -1
        self._plain(data, position)

    def _plain(self, data: memoryview, position: int) -> None:
        """data through the ordinary file (and the page cache) at position."""
        while len(data):
            written = os.pwrite(self.fd, data, position)
            data, position = data[written:], position + written


def row_spans(src: SourceTensor, multiple: int = 1) -> Iterator[tuple[int, int]]:
    """(first row, rows) over a tensor's flattened rows, about CHUNK_BYTES at a time, in multiples
    of `multiple` rows (whole experts, for layouts packed per expert)."""
    n_rows = src.nbytes // src.row_bytes
    step = max(1, CHUNK_BYTES // (src.row_bytes * multiple)) * multiple
    for first in range(0, n_rows, step):
        yield first, min(step, n_rows - first)


def row_chunks(src: SourceTensor, multiple: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, raw rows) over the spans of row_spans, read in order."""
    for first, count in row_spans(src, multiple):
        yield first, src.read_rows(first, count)


def _ordered_map(fn: Callable[[Any], Any], items: Iterator[Any], workers: int | None) -> Iterator[Any]:
    """fn over items on `workers` threads (default_workers(); numpy and the compiled kernels release
    the GIL), results in order, a few ahead of the consumer, which meanwhile writes the previous
    result."""
    cores = default_workers()
    workers = min(workers or cores, cores)  # more threads than cores: no faster
    with ThreadPoolExecutor(workers) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _rounding_sums(values: np.ndarray, cast: np.ndarray) -> tuple[float, float]:
    """Squared error of a narrowing cast of `values`, and the squared values (sums, float64)."""
    return (
        float(np.sum(np.square(cast.astype(np.float32) - values), dtype=np.float64)),
        float(np.sum(np.square(values), dtype=np.float64)),
    )


FLOAT_TYPES = {ir.DataType.FLOAT: (np.float32, "float32", 32.0), ir.DataType.FLOAT16: (np.float16, "float16", 16.0)}


def float_tensor(
    src: SourceTensor,
    qt: QuantType,
    name: str,
    report: WeightReport,
    transpose: bool = False,
    dtype: ir.DataType = ir.DataType.FLOAT,
) -> ir.TensorProtocol:
    """A GGUF tensor as float32 (its values exactly as the gguf package dequantizes them) or float16."""
    np_type, label, bits = FLOAT_TYPES[dtype]
    shape = src.shape[::-1] if transpose else src.shape
    lossless = dtype == ir.DataType.FLOAT or qt.ggml_type == GGMLQuantizationType.F16
    report.add(
        WeightRecord(
            name,
            [src.name],
            [qt.name],
            label,
            int(np.prod(shape)) * int(bits) // 8,
            bits,
            exact=[True] if lossless else None,
            rel_rms_error=[0.0] if lossless else None,
        )
    )
    if not transpose:

        def chunks() -> Iterator[np.ndarray]:
            err, ref = 0.0, 0.0
            for _, raw in row_chunks(src):
                values = dequantize(raw, qt.ggml_type)
                if lossless:
                    yield values.astype(np_type, copy=False)
                    continue
                cast = values.astype(np_type)
                chunk_err, chunk_ref = _rounding_sums(values, cast)
                err, ref = err + chunk_err, ref + chunk_ref
                yield cast
            if not lossless:
                report.measured(name, [err == 0.0], [rel_rms(err, ref)])

        return StreamedTensor(chunks, dtype, shape, name)

    def whole() -> ir.TensorProtocol:
        # A transposed matrix needs all source rows for each output row: built whole. Only
        # non-expert float matrices take this path.
        out = np.empty(shape, dtype=np.float32)
        for first, raw in row_chunks(src):
            out.T[first : first + len(raw)] = dequantize(raw, qt.ggml_type)
        if not lossless:
            cast = out.astype(np_type)
            err, ref = _rounding_sums(out, cast)
            report.measured(name, [err == 0.0], [rel_rms(err, ref)])
            return ir.Tensor(cast, name=name)
        return ir.Tensor(out.astype(np_type, copy=False), name=name)  # an F16 file's values in a float16 graph

    return ir.LazyTensor(whole, dtype=dtype, shape=ir.Shape(shape), name=name)


@dataclasses.dataclass
class Slots:
    """Where a RowSource packs one span: strided views into the interleaved chunk of its group."""

    codes: np.ndarray
    scales: np.ndarray  # float32, holding values of `scale_type` (rounded to them when it is narrower)
    extra: np.ndarray | None  # block offsets or zero points, when the group has them
    scale_type: type
    offsets_type: type = np.float32  # what block offsets are stored in (rounded to it when narrower)


class RowSource(Protocol):
    """The rows of one matrix of a PackedGroup ([.., N, K]: gate, up or down of every expert, or one
    matrix, or of a float expert stack), and how a span of them is packed into a BlockForm (`pack`)
    or read as float32 values (`values`).

    `parts` names what the rows come from, (name, type) each, for the WeightRecord: one GGUF tensor,
    or one ONNX matrix per expert. A span lies within one part (`part_of`), and `pack` writes it into
    the Slots it is given and says whether it is exact, and its error sums."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def parts(self) -> list[tuple[str, str]]: ...

    def spans(self, multiple: int) -> Iterator[tuple[int, int]]: ...

    def part_of(self, first: int) -> int: ...

    def pack(self, span: tuple[int, int], form: BlockForm, out: Slots) -> Packed: ...

    def values(self, span: tuple[int, int]) -> np.ndarray: ...


class GgufRows:
    """A GGUF tensor as a RowSource: read on the worker thread that packs it (with the check for
    non-finite values that comes with the read), exact where the formats allow, else requantized
    (weighed by its importance matrix entry, when given). Scales bound for float16 are rounded here,
    the rounding added to the error; a scale beyond float16's range is refused, naming the tensor."""

    def __init__(self, src: SourceTensor, qt: QuantType, importance: np.ndarray | None = None):
        self.src, self.qt, self.importance = src, qt, importance

    @property
    def shape(self) -> tuple[int, ...]:
        return self.src.shape

    @property
    def parts(self) -> list[tuple[str, str]]:
        return [(self.src.name, self.qt.name)]

    def spans(self, multiple: int) -> Iterator[tuple[int, int]]:
        return row_spans(self.src, multiple)

    def part_of(self, first: int) -> int:
        return 0

    def pack(self, span: tuple[int, int], form: BlockForm, out: Slots) -> Packed:
        first, rows = span
        raw = self.src.read_rows(first, rows)
        weights = None if self.importance is None else importance_rows(self.importance, self.src.shape, first, rows)
        half = out.scale_type == np.float16
        packed = pack(raw, self.qt, form, out.codes, out.scales, weights, out.extra, half_scales=half)
        if out.scale_type != np.float32:
            self._narrow(out.scales, packed, raw, out.scale_type)
        if packed.offsets is not None and out.offsets_type != np.float32:  # the offsets' rounding counted
            self._narrow_offsets(packed, raw, out.offsets_type)
        return packed

    def values(self, span: tuple[int, int]) -> np.ndarray:
        """The span's rows as float32, exactly as the gguf package dequantizes them."""
        return dequantize(self.src.read_rows(*span), self.qt.ggml_type)

    def _narrow_offsets(self, packed: Packed, raw: np.ndarray, scale_type: type) -> None:
        """Block offsets rounded to `scale_type`, each block's rounding added to the error."""
        offsets = packed.offsets
        if offsets is None:
            return
        narrow = offsets.astype(scale_type).astype(np.float32)
        shift = narrow - offsets
        if shift.any():
            packed.exact = False
            packed.error_sq += float(np.sum(np.square(shift), dtype=np.float64)) * packed.form.block_size
            if not packed.reference_sq:
                packed.reference_sq = float(np.sum(np.square(dequantize(raw, self.qt.ggml_type)), dtype=np.float64))
        offsets[...] = narrow

    def _narrow(self, scales: np.ndarray, packed: Packed, raw: np.ndarray, scale_type: type) -> None:
        narrow_scales(
            scales,
            packed,
            scale_type,
            lambda: dequantize(raw, self.qt.ggml_type),
            f"{self.src.path}: tensor '{self.src.name}'",
        )


def narrow_scales(
    scales: np.ndarray, packed: Packed, scale_type: type, values: Callable[[], np.ndarray], what: str
) -> None:
    """Packed scales rounded to `scale_type` (float16) in place, the rounding's error added to the
    packing's (`values()`: the source's values, for the reference sum where the packing has none);
    a scale beyond float16's range is refused, naming `what`."""
    narrow: np.ndarray = scales.astype(scale_type)
    if not np.isfinite(narrow).all():
        raise MoepassError(
            f"{what} has a block scale of {float(np.abs(scales).max()):.3g}, beyond float16's range (65504): "
            "its weights are too large for any real model"
        )
    shift = narrow.astype(np.float32) - scales
    if shift.any():
        codes = unpack_values(packed.weights, np.ones_like(scales), packed.form.plain)
        packed.exact = False
        block = packed.form.block_size or codes.shape[-1]
        packed.error_sq += float(np.sum(np.square(codes * np.repeat(shift, block, axis=-1)), dtype=np.float64))
        if not packed.reference_sq:
            packed.reference_sq = float(np.sum(np.square(values()), dtype=np.float64))
    scales[...] = narrow


class StoredRows:
    """A QMoE node's stored expert matrix as a RowSource: gate or up (`part` of `parts` interleaved
    fc1 rows) or down, [E, N, K], from its codes and scales in `form` (zero points where it has them;
    a widened fc1's block-sum corrections added, the down's zero rows dropped). Into its own form it
    moves unchanged (exact, but for a narrower scale type, whose rounding is measured); into another
    it is requantized from its values, the error measured against them. For models without the GGUF
    they came from (fuse-moe's), or whose form holds on the GPU as it is."""

    def __init__(
        self,
        name: str,
        codes: ir.TensorProtocol,
        scales: ir.TensorProtocol,
        form: BlockForm,
        shape: tuple[int, int, int],
        part: int = 0,
        parts: int = 1,
        zero_points: ir.TensorProtocol | None = None,
    ):
        self.name, self.codes, self.scales, self.form = name, codes, scales, form
        self._shape, self.part, self.n_parts, self.zero_points = shape, part, parts, zero_points

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def parts(self) -> list[tuple[str, str]]:
        return [(self.name, str(self.form))]

    def spans(self, multiple: int) -> Iterator[tuple[int, int]]:
        """Whole experts at a time (a multiple of any `multiple` a group asks: 1, or an expert's rows)."""
        e, n, k = self._shape
        step = max(1, CHUNK_BYTES // max(1, n * self.form.packed_bytes(self.form.width(k)))) * n
        for first in range(0, e * n, step):
            yield first, min(step, e * n - first)

    def part_of(self, first: int) -> int:
        return 0

    def _stored(self, span: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes, scales, zero points) of the span's rows as stored: rows of the stored tensor."""
        e, n, _ = self._shape
        first, rows = span
        if first % n or rows % n:
            raise ValueError(f"{self.name}: stored rows are read whole experts at a time")
        experts = slice(first // n, (first + rows) // n)
        stored_rows = tensor_dims(self.codes)[1]
        pick = slice(self.part, n * self.n_parts, self.n_parts) if self.n_parts > 1 else slice(0, n)

        def rows_of(tensor: ir.TensorProtocol) -> np.ndarray:
            chunk = read_rows(tensor, experts.start, experts.stop - experts.start)
            return chunk.reshape(-1, stored_rows, *chunk.shape[2:])[:, pick].reshape(rows, *chunk.shape[2:])

        zero_points = None if self.zero_points is None else rows_of(self.zero_points)
        return rows_of(self.codes), rows_of(self.scales).astype(np.float32), zero_points

    def values(self, span: tuple[int, int]) -> np.ndarray:
        codes, scales, zero_points = self._stored(span)
        values = unpack_values(codes, scales.reshape(len(codes), -1), self.form.plain, zero_points)
        k = self._shape[2]
        if self.form.sums:
            stride, blocks = self.form.feature_stride(k), k // self.form.block_size
            corrections = sum(values[:, k + i * stride : k + i * stride + blocks] for i in range(self.form.sums))
            values = values[:, :k] + np.repeat(corrections, self.form.block_size, axis=-1)
        return values[:, :k]

    def pack(self, span: tuple[int, int], form: BlockForm, out: Slots) -> Packed:
        if form == self.form and self.zero_points is None:
            codes, scales, _ = self._stored(span)
            out.codes[...], out.scales[...] = codes, scales.reshape(out.scales.shape)
            packed = Packed(form, out.codes, out.scales, True)
        else:
            if form.sums or form.offsets:
                raise ValueError(f"{self.name}: stored values have no codes of their own to keep in {form}")
            done = quantize_values(self.values(span), form, half_scales=out.scale_type == np.float16)
            out.codes[...], out.scales[...] = done.weights, done.scales
            packed = Packed(form, out.codes, out.scales, False, done.error_sq, done.reference_sq)
        if out.scale_type != np.float32:
            narrow_scales(out.scales, packed, out.scale_type, lambda: self.values(span), f"tensor '{self.name}'")
        return packed


class ExpertOrder:
    """A RowSource of an expert stack [E, N, K] with its experts in `order` (slot i holds expert
    order[i]): spans of one expert, each packed from that expert's own rows of `source`, so a stack
    is packed in another order in one pass (reorder-experts on a model lowered in this run)."""

    def __init__(self, source: RowSource, order: Sequence[int]):
        e = source.shape[0]
        if len(source.shape) != 3 or sorted(order) != list(range(e)):
            raise ValueError(f"{source.parts[0][0]}: the expert order is not a permutation of its {e} experts")
        self.source, self.order = source, list(order)
        self.n = source.shape[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def parts(self) -> list[tuple[str, str]]:
        return self.source.parts

    def spans(self, multiple: int) -> Iterator[tuple[int, int]]:
        if self.n % multiple:
            raise ValueError(f"{self.parts[0][0]}: experts of {self.n} rows packed {multiple} rows at a time")
        return ((slot * self.n, self.n) for slot in range(len(self.order)))

    def _source_span(self, span: tuple[int, int]) -> tuple[int, int]:
        first, rows = span
        slot, offset = divmod(first, self.n)
        if offset + rows > self.n:
            raise ValueError(f"{self.parts[0][0]}: a span of experts in another order crosses an expert")
        return self.order[slot] * self.n + offset, rows

    def part_of(self, first: int) -> int:
        return self.source.part_of(self._source_span((first, 1))[0])

    def pack(self, span: tuple[int, int], form: BlockForm, out: Slots) -> Packed:
        return self.source.pack(self._source_span(span), form, out)

    def values(self, span: tuple[int, int]) -> np.ndarray:
        return self.source.values(self._source_span(span))


def float_expert_stack(
    sources: Sequence[RowSource],
    name: str,
    report: WeightReport,
    dtype: ir.DataType = ir.DataType.FLOAT,
    workers: int | None = None,
) -> ir.TensorProtocol:
    """Float expert stacks [E, N, K] as [E, N * len(sources), K] float32 (or float16; gate/up rows
    interleaved), from RowSources' values; float16's rounding is measured per part."""
    np_type, label, bits = FLOAT_TYPES[dtype]
    e, n, k = sources[0].shape
    shape = (e, n * len(sources), k)
    exact = dtype == ir.DataType.FLOAT
    parts = PartRecord(sources)
    report.add(
        WeightRecord(
            name,
            parts.names(),
            parts.types(),
            label,
            int(np.prod(shape)) * int(bits) // 8,
            bits,
            exact=[True] * len(parts.order) if exact else None,
            rel_rms_error=[0.0] * len(parts.order) if exact else None,
        )
    )

    def dequantize_chunk(span: tuple[int, int]) -> tuple[int, np.ndarray, np.ndarray]:
        out = np.empty((span[1], len(sources), k), dtype=np_type)  # row 2i gate_i, 2i+1 up_i
        sums = np.zeros((len(sources), 2))  # per source: squared rounding error, squared values
        for j, src in enumerate(sources):
            values = src.values(span)
            out[:, j] = values
            if not exact:
                sums[j] = _rounding_sums(values, out[:, j])
        return span[0], out, sums

    def chunks() -> Iterator[np.ndarray]:
        record = PartRecord(sources)
        for first, out, sums in _ordered_map(dequantize_chunk, sources[0].spans(1), workers):
            for j, (error_sq, reference_sq) in enumerate(sums):
                record.add(first, j, not error_sq, float(error_sq), float(reference_sq))
            yield out
        if not exact:
            record.measured(report, name)

    return StreamedTensor(chunks, dtype, shape, name)


class PartRecord:
    """A group's record per (part, source), part by part as the WeightRecord lists them (gate_0,
    up_0, gate_1, up_1, ...): the names and types, and whether each is exact and its error sums,
    added up chunk by chunk as the group is written."""

    def __init__(self, sources: Sequence[RowSource]):
        self.sources = sources
        self.order = [(p, j) for p in range(len(sources[0].parts)) for j in range(len(sources))]
        self.stats: dict[tuple[int, int], list[Any]] = {o: [True, 0.0, 0.0] for o in self.order}  # exact, e², r²

    def names(self) -> list[str]:
        return [self.sources[j].parts[p][0] for p, j in self.order]

    def types(self) -> list[str]:
        return [self.sources[j].parts[p][1] for p, j in self.order]

    def add(self, first: int, source: int, exact: bool, error_sq: float, reference_sq: float) -> None:
        """A chunk of `source` starting at row `first`."""
        stat = self.stats[self.sources[source].part_of(first), source]
        stat[0] &= exact
        stat[1] += error_sq
        stat[2] += reference_sq

    def measured(self, report: WeightReport, name: str) -> None:
        report.measured(name, [self.stats[o][0] for o in self.order], [rel_rms(*self.stats[o][1:]) for o in self.order])


class PackOnce:
    """Several initializers from one packing pass, streamed without packing twice.

    `pack()` yields per chunk of rows (codes, (extra_0, extra_1, ...)): the codes are streamed as
    they come, and the extras (scales, zero points: 4-8x smaller) are kept for their own
    initializers, which the writer saves next (the model is saved in initializer order). An extra
    asked for before the codes, or again, is packed anew. Safe from several writer threads."""

    def __init__(self, pack: Callable[[], Iterator[tuple[np.ndarray, tuple[Any, ...]]]], extras: int):
        self._pack, self._extras = pack, extras
        self._lock = threading.Lock()
        self._kept: list[tuple[Any, ...]] | None = None
        self._waiting: set[int] = set()  # extras still to be streamed from what is kept

    def codes(self) -> Iterator[np.ndarray]:
        kept = []
        for codes, extras in self._pack():
            kept.append(extras)
            yield codes
        with self._lock:
            self._kept, self._waiting = kept, set(range(self._extras))

    def extra(self, which: int) -> Iterator[np.ndarray]:
        with self._lock:
            kept = self._kept if which in self._waiting else None
            self._waiting.discard(which)
            if not self._waiting:
                self._kept = None
        for extras in kept if kept is not None else (extras for _, extras in self._pack()):
            yield extras[which]


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How a PackedGroup stores its initializers: codes shaped for MatMulNBits (`blob_layout`) or in
    ONNX Runtime's SM80 layout per expert (`prepack`), the scales' type (`scale_dtype`), uint8 zero
    points beside them (`zero_points`), `pad_rows` zero rows after each matrix's own, the type of
    block offsets (`offsets_dtype`), the codes' name suffix (`codes_name`), and the packing threads
    (`workers`: None, every core)."""

    blob_layout: bool = False
    scale_dtype: ir.DataType = ir.DataType.FLOAT
    prepack: bool = False
    zero_points: bool = False
    workers: int | None = None
    codes_name: str = "q"
    pad_rows: int = 0
    offsets_dtype: ir.DataType = ir.DataType.FLOAT


class PackedGroup:
    """Codes and scales (and block offsets or zero points) initializers of matrices [.., N, K] in one
    BlockForm, from RowSources: GGUF tensors (GgufRows) or an ONNX model's matrices (fuse-moe).

    Two sources (gate, up) are interleaved into [.., 2N, K], QMoE's fused SwiGLU layout: each is
    packed straight into its interleaved slot, nothing is copied to interleave. With `blob_layout`
    the codes are shaped [N, k_blocks, blob] as MatMulNBits wants them (same bytes); with `prepack`
    each expert's codes are in ONNX Runtime's SM80 layout [K, N*bits/8]. Scales are [.., N, k_blocks]
    ([.., N] for one scale per row, QMoE's per-row layout), float32 or float16 (`scale_dtype`). A form
    with offsets (one matrix [N, K]) also gives `extra`, the offsets transposed [k_blocks, N] for the
    product with the input's block sums; `zero_points` gives uint8 zero points [.., N, k_blocks *
    bits / 8] instead. The sources are packed once for all initializers (PackOnce), on `workers`
    threads, and the record of each part (exact?, relative RMS error) is filled in once all rows are
    written. The options named here are PackOptions' fields (`options`).
    """

    def __init__(
        self,
        sources: Sequence[RowSource],
        form: BlockForm,
        name: str,
        report: WeightReport,
        options: PackOptions | None = None,
        record: bool = True,
    ):
        options = options or PackOptions()
        self.sources, self.form, self.name, self.report = list(sources), form, name, report
        self.workers = options.workers
        self.options = options
        self._orders: dict[tuple[int, ...], PackedGroup] = {}  # the group packed in another expert order
        self._order_lock = threading.Lock()
        self.scale_type = FLOAT_TYPES[options.scale_dtype][0]
        self.offsets_type = FLOAT_TYPES[options.offsets_dtype][0]
        lead, k = sources[0].shape[:-1], sources[0].shape[-1]
        self.k = form.width(k)  # the columns stored: K, and block-sum features' corrections (form.sums)
        self.pad_rows = options.pad_rows  # zero rows after each matrix's (each expert's) own
        rows = (*lead[:-1], lead[-1] * len(sources) + options.pad_rows)
        self.k_blocks = self.k // (form.block_size or k)
        # prepack: per expert the SM80 mixed-GEMM layout [K, N*bits/8] (moepass.cuda_ops.prepack)
        self.prepack = options.prepack
        self.matrix_rows = lead[-1] if self.prepack or self.pad_rows else 0  # rows packed at a time: whole matrices
        if options.prepack:
            codes_shape = (*rows[:-1], self.k, form.packed_bytes(rows[-1]))
        elif options.blob_layout:
            codes_shape = (*rows, self.k_blocks, form.packed_bytes(form.block_size))
        else:
            codes_shape = (*rows, form.packed_bytes(self.k))
        scales_shape = (*rows, self.k_blocks) if form.block_size else rows
        if form.offsets and len(rows) != 1:
            raise ValueError(f"{name}: block offsets are for one matrix, not a stack {rows}")
        # the extra per block, if any, (columns, type): float32 offsets, or zero points packed to bytes
        zero_cols = -(-self.k_blocks * form.bits // 8)
        self.extra: tuple[int, np.dtype] | None = None
        if form.offsets:  # float32 while packed; stored in the scales' type (the graph's activations)
            self.extra = self.k_blocks, np.dtype(np.float32)
        elif options.zero_points:
            self.extra = zero_cols, np.dtype(np.uint8)
        if options.pad_rows and self.extra is not None:
            raise ValueError(f"{name}: zero rows with block offsets or zero points")
        nbytes = int(np.prod(codes_shape)) + np.dtype(self.scale_type).itemsize * int(np.prod(scales_shape))
        if self.extra is not None:
            nbytes += self.extra[1].itemsize * int(np.prod(rows)) * self.extra[0]
        elements = sum(int(np.prod(s.shape)) for s in sources)
        parts = PartRecord(self.sources)
        if record:  # a group packed again in another expert order shares its record
            report.add(
                WeightRecord(
                    name,
                    parts.names(),
                    parts.types(),
                    str(form),
                    nbytes,
                    round(nbytes * 8 / elements, 4),
                )
            )
        stack = len(lead) == 2  # an expert stack [E, N, K]: experts on axis 0 of every tensor

        def reorder(tensor: str) -> Callable[[list[int]], Callable[[], Iterator[np.ndarray]]] | None:
            if not stack:
                return None
            return lambda order: getattr(self._in_order(order), tensor)._chunks

        once = PackOnce(self._packed_chunks, 1 if self.extra is None else 2)
        self.codes = StreamedTensor(
            once.codes, ir.DataType.UINT8, codes_shape, f"{name}.{options.codes_name}", in_expert_order=reorder("codes")
        )
        self.scales = StreamedTensor(
            lambda: once.extra(0),
            options.scale_dtype,
            scales_shape,
            f"{name}.scales",
            in_expert_order=reorder("scales"),
        )
        self.offsets = self.zero_points = None
        if form.offsets:
            self.offsets = StreamedTensor(
                lambda: iter(
                    [np.concatenate(list(once.extra(1))).reshape(-1, self.k_blocks).T.astype(self.offsets_type)]
                ),
                options.offsets_dtype,
                (self.k_blocks, rows[0]),
                f"{name}.offsets",
            )
        elif options.zero_points:
            self.zero_points = StreamedTensor(
                lambda: once.extra(1),
                ir.DataType.UINT8,
                (*rows, zero_cols),
                f"{name}.zero_points",
                in_expert_order=reorder("zero_points"),
            )

    def _in_order(self, order: list[int]) -> PackedGroup:
        """This group with its experts in `order`, packed once for all its tensors (its weight
        record is this group's: filled in when that one is written)."""
        with self._order_lock:
            key = tuple(order)
            if key not in self._orders:
                sources = [ExpertOrder(s, order) for s in self.sources]
                self._orders[key] = PackedGroup(sources, self.form, self.name, self.report, self.options, record=False)
            return self._orders[key]

    def _packed_chunks(self) -> Iterator[tuple[np.ndarray, tuple[np.ndarray, ...]]]:
        """(codes, (scales[, extra])) per chunk of rows, as stored; records exactness and error once
        all rows are done."""
        n_src, form, k = len(self.sources), self.form, self.k
        record = PartRecord(self.sources)  # anew for each pass (PackOnce may pack again)

        def pack_chunk(span: tuple[int, int]) -> tuple[int, np.ndarray, tuple[np.ndarray, ...], list[Packed]]:
            rows = span[1]
            codes = np.empty((rows, n_src, form.packed_bytes(k)), dtype=np.uint8)
            scales = np.empty((rows, n_src, self.k_blocks), dtype=np.float32)
            extra = None if self.extra is None else np.empty((rows, n_src, self.extra[0]), self.extra[1])
            packs = [
                src.pack(
                    span,
                    form,
                    Slots(
                        codes[:, j],
                        scales[:, j],
                        None if extra is None else extra[:, j],
                        self.scale_type,
                        self.offsets_type,
                    ),
                )
                for j, src in enumerate(self.sources)
            ]
            n = self.matrix_rows * n_src
            if self.pad_rows:  # zero rows (codes at the zero point, scales 0) after each matrix's
                codes, scales = codes.reshape(-1, n, codes.shape[-1]), scales.reshape(-1, n, scales.shape[-1])
                zero = np.uint8(form.zero_byte)
                pad = (len(codes), self.pad_rows)
                codes = np.concatenate([codes, np.full((*pad, codes.shape[-1]), zero)], axis=1)
                scales = np.concatenate([scales, np.zeros((*pad, scales.shape[-1]), np.float32)], axis=1)
                n += self.pad_rows
            if self.prepack:
                experts = codes.reshape(-1, n, form.packed_bytes(k))
                codes = np.stack([prepack_sm80(e, n, k, form.bits) for e in experts])
            stored = scales.astype(self.scale_type, copy=False)
            return span[0], codes, (stored,) if extra is None else (stored, extra), packs

        spans = self.sources[0].spans(max(1, self.matrix_rows))
        for first, codes, extras, packs in _ordered_map(pack_chunk, spans, self.workers):
            for j, p in enumerate(packs):
                record.add(first, j, p.exact, p.error_sq, p.reference_sq)
            yield codes, extras
        record.measured(self.report, self.name)
