"""Initializers streamed chunk by chunk: a `StreamedTensor` produces its bytes a few MiB of source
rows at a time when the model is saved, converted on worker threads, so no tensor is ever whole in
memory (peak memory set by CHUNK_BYTES)."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import onnx_ir as ir

from moepass.core.gguf_reader import SourceTensor
from moepass.passes.weights.direct import DirectSink

# Source bytes read and converted at a time. Small enough that temporaries are reused by the
# allocator instead of being faulted in afresh for every tensor.
CHUNK_BYTES = 8 << 20


def default_workers() -> int:
    """Worker threads of a conversion unless the user says (convert --threads): every core this
    process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def ordered_map(fn: Callable[[Any], Any], items: Iterator[Any], workers: int | None) -> Iterator[Any]:
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
