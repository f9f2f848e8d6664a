"""Graph passes of moepass, in pipeline order.

A conversion makes an onnx-ir graph, from a GGUF model (`lower`, `passes/lower/`) or from an ONNX
model (`read`), then runs the passes of `PIPELINES[kind]` over it in place, through `run_pipeline`.
Each pass has a name for `--print-after NAME` and is usable alone from Python.
`ExposeRouterLogitsPass` (profiling copies), `ReorderExpertsPass` (per-expert placement) and
`AnnotateLayersPass` (per-layer placement) are run by `moepass profile` and `moepass partition` on
converted models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx_ir as ir
from onnx_ir.passes import PassBase
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from moepass.core.choices import PASS_NAMES
from moepass.passes.activations import QuantizeActivationsPass
from moepass.passes.annotate_layers import AnnotateLayersPass
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.passes.fuse_moe import FuseMoePass
from moepass.passes.fuse_skip_norm import FuseSkipNormPass
from moepass.passes.kv_cache import KvCachePass
from moepass.passes.lower import LowerOptions, lower_gguf
from moepass.passes.reorder_experts import ReorderExpertsPass


@dataclasses.dataclass
class PipelineRun:
    """What the passes of one conversion share: its options, and the passes run so far by name
    (the caller reads their records, e.g. fuse-moe's, afterwards)."""

    activations: str = "int8"  # "int8" (inside the quantized matrix products, as llama.cpp) or "float"
    kv_cache: str = "float32"  # GGUF input: float16 given here; int8 after the write (its calibration runs the model)
    float_experts: str = "keep"  # ONNX input: float experts kept (MoE) or quantized into QMoE
    ran: dict[str, PassBase] = dataclasses.field(default_factory=dict)

    @property
    def fuse_moe(self) -> FuseMoePass | None:
        """The fuse-moe pass this conversion ran (ONNX input), with its records."""
        fuse = self.ran.get("fuse-moe")
        return fuse if isinstance(fuse, FuseMoePass) else None

    @property
    def rewritten(self) -> bool:
        """Whether the graph is new or rewritten: an ONNX model none of whose layers fused is
        written as it came (no cleanup reorders it)."""
        return self.fuse_moe is None or any(r.fused for r in self.fuse_moe.records)


def _cleanup(make: Callable[[], PassBase]) -> Callable[[PipelineRun], PassBase | None]:
    return lambda run: make() if run.rewritten else None


# input kind -> pass name -> factory(run) (None: nothing to do); the order is the pipeline's order.
PIPELINES: dict[str, dict[str, Callable[[PipelineRun], PassBase | None]]] = {
    "gguf": {
        "fuse-skip-norm": lambda run: FuseSkipNormPass(),
        "quantize-activations": lambda run: QuantizeActivationsPass(run.activations),
        "kv-cache": lambda run: KvCachePass("float16") if run.kv_cache == "float16" else None,
        "remove-unused": _cleanup(RemoveUnusedNodesPass),
        "topological-sort": _cleanup(TopologicalSortPass),
    },
    "onnx": {
        "fuse-moe": lambda run: FuseMoePass(run.float_experts),
        "remove-unused": _cleanup(RemoveUnusedNodesPass),
        "topological-sort": _cleanup(TopologicalSortPass),
        "quantize-activations": lambda run: QuantizeActivationsPass(run.activations),
    },
}
if any(PASS_NAMES[kind][1:] != tuple(passes) for kind, passes in PIPELINES.items()):
    raise ImportError("moepass.core.choices.PASS_NAMES differs from moepass.passes.PIPELINES")


def run_pipeline(
    model: ir.Model,
    kind: str,
    run: PipelineRun | None = None,
    print_after: str | None = None,
    echo: Callable[[str], None] = print,
) -> ir.Model:
    """Run every pass of PIPELINES[kind] (`kind`: "gguf" or "onnx"); print the graph after the pass
    named `print_after` (or after the step that made it: "lower" or "read")."""
    run = run if run is not None else PipelineRun()
    names = PASS_NAMES[kind]
    if print_after is not None and print_after not in names:
        raise ValueError(f"no pass named {print_after!r} for {kind} input; passes: {', '.join(names)}")
    if print_after == names[0]:
        echo(str(model.graph))
    for name, factory in PIPELINES[kind].items():
        graph_pass = factory(run)
        if graph_pass is not None:
            model = graph_pass(model).model
            run.ran[name] = graph_pass
        if print_after == name:
            echo(str(model.graph))
    return model


__all__ = [
    "AnnotateLayersPass",
    "ExposeRouterLogitsPass",
    "FuseMoePass",
    "FuseSkipNormPass",
    "KvCachePass",
    "LowerOptions",
    "PASS_NAMES",
    "PIPELINES",
    "PipelineRun",
    "QuantizeActivationsPass",
    "ReorderExpertsPass",
    "lower_gguf",
    "run_pipeline",
]
