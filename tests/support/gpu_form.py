"""What partition's GPU form must hold, checked on a placed model without a GPU: every node the plan
puts on the GPU is in a form ONNX Runtime's CUDA kernels take (moepass.core.capabilities), or its
expert offload takes."""

from __future__ import annotations

from moepass.core.capabilities import cuda_refusals, layout_problems, offload_violations
from moepass.core.formats import read_plan
from moepass.core.model_io import load_model


def gpu_nodes_are_taken(model_dir, target: str) -> None:
    """Every node partition put on the GPU passes the kernel table (a CPU layer's MoE node and the
    Casts at its boundary are the CPU's); the offload target's nodes pass the offload rules too."""
    model = load_model(model_dir)
    plan = read_plan(model_dir)
    cpu = {n.node for n in plan.nodes if n.device == "cpu"} if target == "layers" else set()
    cpu |= set(plan.lowering.cpu_nodes if plan.lowering else {})
    refused = {name: why for name, why in cuda_refusals(model).items() if name not in cpu}
    casts = {n.name for n in model.graph if n.op_type == "Cast"}
    assert set(refused) <= casts, refused
    if target == "offload":
        assert offload_violations(model) == []
    assert layout_problems(model) == []
