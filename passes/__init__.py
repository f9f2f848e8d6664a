"""Graph passes of moepass, in pipeline order.

`lower` builds the graph from a GGUF model (`passes/lower.py`); the passes in `PIPELINE` then
rewrite it in place. Each has a name for `--print-after NAME` and is usable alone from Python.
`ExposeRouterLogitsPass` (profiling copies), `ReorderExpertsPass` (per-expert placement) and
`AnnotateLayersPass` (per-layer placement) are run by `moepass profile` and `moepass partition` on
converted models.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir
from onnx_ir.passes import PassBase
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from moepass.core.choices import PASS_NAMES
from moepass.passes.activations import QuantizeActivationsPass
from moepass.passes.annotate_layers import AnnotateLayersPass
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.passes.fuse_skip_norm import FuseSkipNormPass
from moepass.passes.lower import LowerOptions, lower_gguf
from moepass.passes.reorder_experts import ReorderExpertsPass

# name -> factory(activations mode); the order is the pipeline's order.
PIPELINE: dict[str, Callable[[str], PassBase]] = {
    "fuse-skip-norm": lambda activations: FuseSkipNormPass(),
    "quantize-activations": QuantizeActivationsPass,
    "remove-unused": lambda activations: RemoveUnusedNodesPass(),
    "topological-sort": lambda activations: TopologicalSortPass(),
}
if PASS_NAMES != ("lower", *PIPELINE):  # --print-after offers these names without importing the passes
    raise ImportError("moepass.core.choices.PASS_NAMES differs from moepass.passes.PIPELINE")


def run_pipeline(model: ir.Model, print_after: str | None = None,
                 echo: Callable[[str], None] = print, activations: str = "int8") -> ir.Model:
    """Run every pass of PIPELINE; print the graph after the pass named `print_after` (or after `lower`).
    `activations`: "int8" (quantized inside the quantized matrix products, as llama.cpp) or "float"."""
    if print_after is not None and print_after not in PASS_NAMES:
        raise ValueError(f"no pass named {print_after!r}; passes: {', '.join(PASS_NAMES)}")
    if print_after == "lower":
        echo(str(model.graph))
    for name, factory in PIPELINE.items():
        model = factory(activations)(model).model
        if print_after == name:
            echo(str(model.graph))
    return model


__all__ = ["AnnotateLayersPass", "ExposeRouterLogitsPass", "FuseSkipNormPass", "LowerOptions", "PASS_NAMES", "PIPELINE",
           "QuantizeActivationsPass", "ReorderExpertsPass", "lower_gguf", "run_pipeline"]
