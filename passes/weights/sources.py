"""Where packed rows come from (`RowSource`): a GGUF tensor (`GgufRows`), an ONNX model's stored
initializers (`StoredRows`), experts in another order (`ExpertOrder`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import onnx_ir as ir

from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import SourceTensor
from moepass.core.imatrix import importance_rows
from moepass.core.ir_values import read_rows, tensor_dims
from moepass.core.quants import BlockForm, Packed, QuantType, dequantize, pack, quantize_values, unpack_values
from moepass.passes.weights import streaming
from moepass.passes.weights.streaming import row_spans


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
        step = max(1, streaming.CHUNK_BYTES // max(1, n * self.form.packed_bytes(self.form.width(k)))) * n
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
