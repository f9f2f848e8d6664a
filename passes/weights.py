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
import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np
import onnx_ir as ir

from moepass.gguf_reader import GGUFTensor
from moepass.imatrix import importance_rows
from moepass.quants import BlockForm, Packed, QuantType, dequantize, pack

# Source bytes read and converted at a time. Small enough that temporaries are reused by the
# allocator instead of being faulted in afresh for every tensor.
CHUNK_BYTES = 8 << 20
WORKERS = min(4, os.cpu_count() or 1)


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


class StreamedTensor(ir.LazyTensor):
    """A lazy tensor produced as a sequence of C-ordered chunks along its first axes.

    `tofile` writes the chunks as they come; `numpy()`/`tobytes()` (used by tests and small
    consumers) concatenate them.
    """

    __slots__ = ("_chunks",)

    def __init__(self, chunks: Callable[[], Iterator[np.ndarray]], dtype: ir.DataType, shape: tuple[int, ...],
                 name: str):
        self._chunks = chunks

        def whole() -> ir.TensorProtocol:
            parts = [np.ascontiguousarray(c).reshape(-1) for c in chunks()]
            return ir.Tensor(np.concatenate(parts).reshape(shape), name=name)

        super().__init__(whole, dtype=dtype, shape=ir.Shape(shape), name=name)

    def tofile(self, file) -> None:
        for chunk in self._chunks():
            file.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))


def row_chunks(src: GGUFTensor) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, raw rows) over a tensor's flattened rows, about CHUNK_BYTES at a time."""
    n_rows = src.nbytes // src.row_bytes
    step = max(1, CHUNK_BYTES // src.row_bytes)
    for first in range(0, n_rows, step):
        yield first, src.read_rows(first, min(step, n_rows - first))


def _ordered_map(fn: Callable[[Any], Any], items: Iterator[Any]) -> Iterator[Any]:
    """fn over items on WORKERS threads (numpy releases the GIL), results in order, a few ahead of
    the consumer, which meanwhile writes the previous result."""
    with ThreadPoolExecutor(WORKERS) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > WORKERS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _source_rows(sources: list[GGUFTensor]) -> Iterator[list[np.ndarray]]:
    """The sources' raw rows, chunk by chunk, walked together (gate and up of the same experts)."""
    for parts in zip(*(row_chunks(s) for s in sources)):
        yield [raw for _, raw in parts]


def _numbered_source_rows(sources: list[GGUFTensor]) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(first row, [raw rows per source]), chunk by chunk."""
    for parts in zip(*(row_chunks(s) for s in sources)):
        yield parts[0][0], [raw for _, raw in parts]


def float_tensor(src: GGUFTensor, qt: QuantType, name: str, report: WeightReport,
                 transpose: bool = False) -> ir.TensorProtocol:
    """A GGUF tensor as float32, its values exactly as the gguf package dequantizes them."""
    shape = src.shape[::-1] if transpose else src.shape
    report.add(WeightRecord(name, [src.name], [qt.name], "float32", int(np.prod(shape)) * 4, 32.0,
                            exact=[True], rel_rms_error=[0.0]))
    if not transpose:
        return StreamedTensor(lambda: (dequantize(raw, qt.ggml_type) for _, raw in row_chunks(src)),
                              ir.DataType.FLOAT, shape, name)

    def whole() -> ir.TensorProtocol:
        # A transposed matrix needs all source rows for each output row: built whole. Only
        # non-expert matrices without an exact block form take this path.
        out = np.empty(shape, dtype=np.float32)
        for first, raw in row_chunks(src):
            out.T[first:first + len(raw)] = dequantize(raw, qt.ggml_type)
        return ir.Tensor(out, name=name)

    return ir.LazyTensor(whole, dtype=ir.DataType.FLOAT, shape=ir.Shape(shape), name=name)


def float_expert_stack(sources: list[GGUFTensor], name: str, report: WeightReport) -> ir.TensorProtocol:
    """Float expert stacks [E, N, K] as float32 [E, N * len(sources), K] (gate/up rows interleaved)."""
    e, n, k = sources[0].shape
    shape = (e, n * len(sources), k)
    report.add(WeightRecord(name, [s.name for s in sources], [s.type_name for s in sources], "float32",
                            int(np.prod(shape)) * 4, 32.0, exact=[True] * len(sources),
                            rel_rms_error=[0.0] * len(sources)))

    def dequantize_chunk(parts: list[np.ndarray]) -> np.ndarray:
        out = np.empty((len(parts[0]), len(sources), k), dtype=np.float32)  # row 2i gate_i, 2i+1 up_i
        for j, (raw, src) in enumerate(zip(parts, sources)):
            out[:, j] = dequantize(raw, src.ggml_type)
        return out

    return StreamedTensor(lambda: _ordered_map(dequantize_chunk, _source_rows(sources)), ir.DataType.FLOAT,
                          shape, name)


class PackedGroup:
    """Codes and scales initializers of GGUF matrices [.., N, K] packed into one BlockForm.

    Two sources (gate, up) are interleaved into [.., 2N, K], QMoE's fused SwiGLU layout. With
    `blob_layout` the codes are shaped [N, k_blocks, blob] as MatMulNBits wants them (same bytes).

    Writing the codes packs the sources once and keeps the (4-8x smaller) scales for the scales
    initializer, which the writer saves next (the model is saved in initializer order); if the
    scales are asked for first, they are computed on their own.
    """

    def __init__(self, sources: list[GGUFTensor], types: list[QuantType], form: BlockForm, name: str,
                 report: WeightReport, blob_layout: bool = False, importance: dict[str, np.ndarray] | None = None):
        self.sources, self.types, self.form, self.name, self.report = sources, types, form, name, report
        self.importance = importance or {}
        lead, k = sources[0].shape[:-1], sources[0].shape[-1]
        rows = (*lead[:-1], lead[-1] * len(sources))
        k_blocks = k // form.block_size
        self.codes_shape = (*rows, k_blocks, form.packed_bytes(form.block_size)) if blob_layout else \
            (*rows, form.packed_bytes(k))
        self.scales_shape = (*rows, k_blocks)
        self._lock = threading.Lock()
        self._kept_scales: list[np.ndarray] | None = None
        nbytes = int(np.prod(self.codes_shape)) + 4 * int(np.prod(self.scales_shape))
        elements = sum(int(np.prod(s.shape)) for s in sources)
        report.add(WeightRecord(name, [s.name for s in sources], [t.name for t in types], str(form), nbytes,
                                round(nbytes * 8 / elements, 4)))
        self.codes = StreamedTensor(self._codes_chunks, ir.DataType.UINT8, self.codes_shape, f"{name}.q")
        self.scales = StreamedTensor(self._scales_chunks, ir.DataType.FLOAT, self.scales_shape, f"{name}.scales")

    def _packed_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(codes, scales) per chunk of rows; records exactness and error once all rows are done."""
        n_src, form = len(self.sources), self.form
        k = self.sources[0].shape[-1]
        stats = [[True, 0.0, 0.0] for _ in self.sources]  # exact, error_sq, reference_sq per source

        def pack_chunk(item: tuple[int, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[Packed]]:
            first, parts = item
            rows = len(parts[0])
            # Each source is packed straight into its interleaved slot: nothing is copied to interleave.
            codes = np.empty((rows, n_src, form.packed_bytes(k)), dtype=np.uint8)
            scales = np.empty((rows, n_src, k // form.block_size), dtype=np.float32)
            packs = []
            for j, (raw, qt, src) in enumerate(zip(parts, self.types, self.sources)):
                imp = self.importance.get(src.name)
                weights = None if imp is None else importance_rows(imp, src.shape, first, rows)
                packs.append(pack(raw, qt, form, codes[:, j], scales[:, j], weights))
            return codes, scales, packs

        for codes, scales, packs in _ordered_map(pack_chunk, _numbered_source_rows(self.sources)):
            for stat, p in zip(stats, packs):
                stat[0] &= p.exact
                stat[1] += p.error_sq
                stat[2] += p.reference_sq
            yield codes, scales
        self.report.measured(self.name, [exact for exact, _, _ in stats],
                             [float(np.sqrt(e / r)) if r else 0.0 for _, e, r in stats])

    def _codes_chunks(self) -> Iterator[np.ndarray]:
        kept = []
        for codes, scales in self._packed_chunks():
            kept.append(scales)
            yield codes
        with self._lock:
            self._kept_scales = kept

    def _scales_chunks(self) -> Iterator[np.ndarray]:
        with self._lock:
            kept, self._kept_scales = self._kept_scales, None
        if kept is not None:
            yield from kept
        else:
            yield from (scales for _, scales in self._packed_chunks())
