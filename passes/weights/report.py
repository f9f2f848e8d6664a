"""The conversion record: per group of initializers made from GGUF tensors, its sources and their
types, the target form, bytes, and (once written) exactness and relative RMS error."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


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
