"""Packing row sources into codes, scales and zero points (`PackedGroup`, packed once for all the
tensors that read a group: `PackOnce`), and float tensors and expert stacks from the same sources."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from gguf import GGMLQuantizationType

from moepass.core.gguf_reader import SourceTensor
from moepass.core.quants import BlockForm, Packed, QuantType, dequantize, rel_rms
from moepass.cuda_ops.prepack import prepack_sm80
from moepass.passes.weights.report import WeightRecord, WeightReport
from moepass.passes.weights.sources import ExpertOrder, RowSource, Slots
from moepass.passes.weights.streaming import StreamedTensor, ordered_map, row_chunks


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
        for first, out, sums in ordered_map(dequantize_chunk, sources[0].spans(1), workers):
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
        for first, codes, extras, packs in ordered_map(pack_chunk, spans, self.workers):
            for j, p in enumerate(packs):
                record.add(first, j, p.exact, p.error_sq, p.reference_sq)
            yield codes, extras
        record.measured(self.report, self.name)
