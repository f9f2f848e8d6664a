"""The IR version and opsets of every model moepass writes or builds in memory, in one place.

moepass's own graphs import ai.onnx opset 21 and com.microsoft 1, which need IR version 10 (onnx's
VERSION_TABLE). A model made without an explicit IR version gets the newest the installed onnx knows
(14 with onnx 1.23, `onnx.helper.make_model`), which ONNX Runtime 1.31.1, the newest onnxruntime-gpu
on the package index, refuses ("Unsupported model IR version: 14, max supported IR version: 13").
So each model is stamped with the lowest IR version its opsets need (`stamp`), and one whose opsets
a supported ONNX Runtime cannot load is refused, naming the release, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from moepass.core.errors import MoepassError

if TYPE_CHECKING:
    import onnx_ir as ir

OPSETS = {"": 21, "com.microsoft": 1}

# The newest (IR version, ai.onnx opset) each supported ONNX Runtime release loads, probed by
# creating a session on a one-node model of each (tests/test_onnx_format.py probes the installed one):
# 1.31 is onnxruntime-gpu 1.31.1 (the [gpu] extra), 1.32 is onnxruntime 1.32.0 (the [cpu] extra).
ORT_LIMITS: dict[tuple[int, int], tuple[int, int]] = {(1, 31): (13, 26), (1, 32): (14, 28)}
MAX_IR_VERSION = min(ir_version for ir_version, _ in ORT_LIMITS.values())
MAX_OPSET = min(opset for _, opset in ORT_LIMITS.values())


def ir_version_for(opsets: Mapping[str, int]) -> int:
    """The lowest IR version that may import `opsets` (domain -> version; unknown domains, such as
    com.microsoft, ask for none)."""
    from onnx import helper

    ids = [helper.make_opsetid(domain, version) for domain, version in opsets.items()]
    return max(helper.find_min_ir_version_for(ids, ignore_unknown=True), 3)


def check_opsets(opsets: Mapping[str, int], what: str) -> None:
    """MoepassError, naming `what` and the release, where a supported ONNX Runtime cannot load a model
    that imports `opsets`."""
    opset = opsets.get("", opsets.get("ai.onnx"))
    if opset is not None and opset > MAX_OPSET:
        release = min(v for v, (_, o) in ORT_LIMITS.items() if o < opset)
        raise MoepassError(
            f"{what}: it imports ai.onnx opset {opset}; ONNX Runtime {release[0]}.{release[1]} loads up to "
            f"opset {ORT_LIMITS[release][1]}: export it with opset {MAX_OPSET} or lower"
        )


def stamp(model: ir.Model, what: str = "the model") -> ir.Model:
    """`model` with the lowest IR version its opsets need (every supported ONNX Runtime loads it);
    MoepassError where its opsets are too new for one of them."""
    check_opsets(model.opset_imports, what)
    model.ir_version = ir_version_for(model.opset_imports)
    return model
