"""What ONNX Runtime's execution providers take, as facts: the expert-offload eligibility rules of
the CUDA plugin EP (`offload_violations`) and the CUDA kernel table (`cuda_refusal`): which node,
with which types and attributes, has a CUDA kernel.

An annotation or a plan is a preference: a node whose op, types or attributes have no CUDA kernel
stays on the CPU. The kernel table is read from ONNX Runtime's source, the CUDA contrib kernels
and their registry, in versions of late 2026's main branch (the 1.3x line; the CUDA plugin EP
0.4.0 compiles the same kernel files, minus aten/collective/transformers ops); each rule names
the file it comes from. It has not been run on a GPU here (docs/gpu.md says what has).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx_ir as ir

from moepass.core.errors import wording
from moepass.core.ir_values import input_at, required_input, tensor_dims
from moepass.core.moe_nodes import QMOE_SLOTS, is_cuda_packed, is_native, moe_nodes
from moepass.core.ort import CUDA_REGISTRY, HALF, OPERATORS
from moepass.core.quants import CUDA_QMOE_BLOCKS


def offload_violations(model: ir.Model) -> list[tuple[str, str]]:
    """(node, rule) for every MoE node that ONNX Runtime's expert offload would refuse."""
    found = []
    for moe in moe_nodes(model.graph):
        node, attrs = moe.node, moe.node.attributes
        if is_native(node):
            found.append(
                (moe.name, "a moepass::MoEPacked node runs on the CPU; partition lowers it to the offload form")
            )
            continue
        if node.op_type == "MoEPacked":
            found.append(
                (
                    moe.name,
                    "a MoEPacked node (the GGUF's own blocks) has its own offload (ep.cuda.moe_packed_gpu_experts), "
                    "which moepass does not plan; partition lowers it to the offload form",
                )
            )
            continue
        if node.op_type != "QMoE":
            found.append((moe.name, "only QMoE nodes are offloaded (this is a float MoE node)"))
            continue
        bits = attrs.get_int("expert_weight_bits", 4)
        prepacked = attrs.get_int("weights_prepacked", 0)
        block = attrs.get_int("block_size", 0)
        if bits == 4 and (prepacked != 1 or block != 32):
            found.append(
                (
                    moe.name,
                    f"int4 experts need weights_prepacked=1 and block_size 32 "
                    f"(has weights_prepacked={prepacked}, block_size {block or 'per row'})",
                )
            )
        elif bits == 3 and (prepacked != 0 or block not in (32, 64, 128)):
            found.append((moe.name, "int3 experts need weights_prepacked=0 and block_size 32, 64 or 128"))
        elif bits == 2 and prepacked != 1:
            found.append((moe.name, "int2 experts need weights_prepacked=1"))
        elif bits == 8:
            found.append((moe.name, "int8 experts are not offloaded (int4 prepacked block 32, int3 or int2 are)"))
        hidden = input_at(node, 0)  # the activations' type, as the node declares it
        dtype = (hidden.dtype if hidden is not None else None) or node.outputs[0].dtype
        if dtype not in HALF:
            found.append((moe.name, f"activations must be float16 or bfloat16 (are {dtype.name if dtype else '?'})"))
        if attrs.get_string("activation_type", "") == "swiglu" and attrs.get_int("swiglu_fusion", 0) != 1:
            found.append((moe.name, "SwiGLU must be interleaved (swiglu_fusion=1)"))
        if attrs.get_int("use_sparse_mixer", 0):
            found.append((moe.name, "the sparse mixer is not supported"))
        if any(not v.is_initializer() for v in moe.expert_values):
            found.append((moe.name, "expert weights and scales must be constant initializers"))
    return found


def layout_problems(model: ir.Model) -> list[tuple[str, str]]:
    """(node, why) for every QMoE node whose codes' shape contradicts its weights_prepacked: the
    row-major layout is fc1 [E, N, K*bits/8], the SM80 layout [E, K, N*bits/8] (N the rows of its
    scales, K its blocks times block_size). ONNX Runtime takes either as labelled and computes garbage
    for the other without a word (row-major codes labelled weights_prepacked=1: relative error 1.25;
    the CUDA EP reads an absent label, -1, as the SM80 layout)."""
    found = []
    for moe in moe_nodes(model.graph):
        node = moe.node
        block = node.attributes.get_int("block_size", 0)
        if node.op_type != "QMoE" or block <= 0:
            continue
        bits = node.attributes.get_int("expert_weight_bits", 4)
        prepacked = node.attributes.get_int("weights_prepacked", -1)
        for projection in ("fc1", "fc2"):
            codes, scales = (input_at(node, QMOE_SLOTS[projection][i]) for i in (0, 1))
            if codes is None or scales is None or codes.shape is None or scales.shape is None:
                continue
            dims, scale_dims = list(codes.shape), list(scales.shape)
            if len(dims) != 3 or len(scale_dims) != 3 or not all(isinstance(d, int) for d in dims + scale_dims):
                continue
            n, k = scale_dims[1], scale_dims[2] * block
            row_major = dims[1:] == [n, k * bits // 8]
            sm80 = dims[1:] == [k, n * bits // 8]
            if prepacked == 1 and not sm80:
                found.append(
                    (
                        moe.name,
                        f"{projection}'s codes {dims} are row-major ([E, {n}, {k * bits // 8}]) but "
                        "labelled weights_prepacked=1 (the SM80 layout): ONNX Runtime would compute "
                        "garbage",
                    )
                )
            elif prepacked in (0, -1) and sm80 and not row_major:
                found.append(
                    (
                        moe.name,
                        f"{projection}'s codes {dims} are in the SM80 layout but labelled "
                        f"weights_prepacked={prepacked}: ONNX Runtime would compute garbage",
                    )
                )
    return found


def activation_dtype(model: ir.Model) -> ir.DataType:
    """The type the graph computes in: its KV cache's (GroupQueryAttention's past and present, the
    type of the attention and MoE inputs in moepass's graphs), else its logits', else float32."""
    for value in (*model.graph.inputs, *model.graph.outputs):
        if (value.name or "").startswith("past_key_values.") and value.dtype is not None:
            return value.dtype
    logits = next((v.dtype for v in model.graph.outputs if v.name == "logits" and v.dtype is not None), None)
    return logits or ir.DataType.FLOAT


def _activations(node: ir.Node, graph_dtype: ir.DataType) -> ir.DataType:
    """The type a kernel is registered by: the node's first input (GatherBlockQuantized: its
    scales, whose type its output has), else its output, else the graph's."""
    first = node.inputs[2] if node.op_type == "GatherBlockQuantized" and len(node.inputs) > 2 else node.inputs[0]
    return (first.dtype if first is not None else None) or node.outputs[0].dtype or graph_dtype


def _name(dtype: ir.DataType) -> str:
    return {ir.DataType.FLOAT: "float32"}.get(dtype, dtype.name.lower())


@dataclasses.dataclass(frozen=True)
class CudaKernel:
    """One CUDA kernel's registration and constructor checks: the activation types it is registered
    for, and `check(node) -> the rule a node breaks (None: taken)`."""

    types: tuple[ir.DataType, ...]
    source: str
    check: Callable[[ir.Node], str | None] = lambda node: None  # takes every form it is given


def _qmoe(node: ir.Node) -> str | None:
    attrs = node.attributes
    bits = attrs.get_int("expert_weight_bits", 4)
    if bits not in (4, 8):  # mixed and 2-bit widths: merged per ONNX Runtime's plans, not in the source read
        return f"expert_weight_bits {bits}: the CUDA QMoE kernel takes 4 or 8"
    block = attrs.get_int("block_size", -1)
    if block > 0 and block not in CUDA_QMOE_BLOCKS:
        return f"block_size {block}: the CUDA kernel's integer group sizes are {', '.join(map(str, CUDA_QMOE_BLOCKS))}"
    if attrs.get_int("weights_prepacked", -1) not in (0, 1):
        return (
            "weights_prepacked is absent (-1): the CUDA kernel reads the codes as its SM80 layout; row-major "
            "codes need weights_prepacked=0"
        )
    zero_points = any(
        i < len(node.inputs) and node.inputs[i] is not None for i in (QMOE_SLOTS["fc1"][3], QMOE_SLOTS["fc2"][3])
    )
    if zero_points and block <= 0:
        return "zero points with row-wise scales (block_size <= 0) are refused"
    if zero_points and block < 32:
        return f"zero points need block_size >= 32 (has {block})"
    if input_at(node, QMOE_SLOTS["fc3"][0]) is not None:
        return "separate fc3 expert weights are refused"
    fc2_scales, fc1_scales = (input_at(node, QMOE_SLOTS[fc][1]) for fc in ("fc2", "fc1"))
    scales = None if fc2_scales is None else fc2_scales.const_value
    fc1 = None if fc1_scales is None else fc1_scales.const_value
    if scales is not None and fc1 is not None:
        hidden, rows = tensor_dims(scales)[1], tensor_dims(fc1)[1]
        inter = rows // 2 if attrs.get_string("activation_type", "") == "swiglu" else rows
        if hidden % 64 or inter % 64:
            return f"hidden {hidden} and expert size {inter} must be multiples of 64 (the int kernel's K tile)"
    return None


def _moe_packed(node: ir.Node) -> str | None:
    attrs = node.attributes
    if attrs.get_string("activation_type", "swiglu") not in ("swiglu", "relu2", "relu_squared"):
        return f"activation {attrs.get_string('activation_type', '')}: MoEPacked takes swiglu or relu2"
    if not 1 <= attrs.get_int("k", 1) <= 16:
        return f"k {attrs.get_int('k', 1)}: MoEPacked's softmax routing takes 1 to 16"
    return None


def _gqa(node: ir.Node) -> str | None:
    if len(node.inputs) > 10 and node.inputs[10] is not None:
        return "attention_bias is refused"
    return None


def _matmul_nbits(node: ir.Node) -> str | None:
    bits = node.attributes.get_int("bits", 4)
    if bits not in (4, 8):
        return f"bits {bits}: the kernel dispatches 4 and 8"
    return None


def _gather_block_quantized(node: ir.Node) -> str | None:
    block = node.attributes.get_int("block_size", 128)
    data = required_input(node, 0)
    if data.dtype is not None and data.dtype not in (ir.DataType.UINT8, ir.DataType.UINT4, ir.DataType.INT4):
        return f"data in {_name(data.dtype)}: uint8, uint4 or int4"
    rank = len(data.shape) if data.shape is not None else None
    axis = node.attributes.get_int("quantize_axis", 1)
    if block and (block < 16 or block & (block - 1)):
        return f"block_size {block}: 0 or a power of two >= 16"
    if rank is not None and axis not in (rank - 1, -1):
        return "only the last axis may be quantized"
    return None


# the constructor checks of each CUDA kernel that has some (the others take every form they are given)
_CUDA_CHECKS: dict[tuple[str, str], Callable[[ir.Node], str | None]] = {
    ("com.microsoft", "QMoE"): _qmoe,
    ("com.microsoft", "MoEPacked"): _moe_packed,
    ("com.microsoft", "GroupQueryAttention"): _gqa,
    ("com.microsoft", "MatMulNBits"): _matmul_nbits,
    ("com.microsoft", "GatherBlockQuantized"): _gather_block_quantized,
}
# (domain, op) -> the CUDA kernel (None: none), from moepass.core.ort's records; ops of the ONNX
# domain moepass emits (MatMul, Gather, Reshape, ...) have CUDA kernels for every type they take here
CUDA_KERNELS: dict[tuple[str, str], CudaKernel | None] = {
    key: None
    if op.cuda_types is None
    else CudaKernel(op.cuda_types, op.cuda_source, _CUDA_CHECKS.get(key, CudaKernel.check))
    for key, op in OPERATORS.items()
}


def cuda_refusal(node: ir.Node, graph_dtype: ir.DataType = ir.DataType.FLOAT) -> str | None:
    """Why the CUDA EP has no kernel for `node` (None: it takes it). `graph_dtype`: the type the
    graph computes in, where the node's own values carry none (`activation_dtype`)."""
    key = (node.domain or "", node.op_type)
    if key not in CUDA_KERNELS:
        return None if key[0] in ("", "ai.onnx") else f"{node.op_type} ({key[0]}) is not in moepass's CUDA table"
    kernel = CUDA_KERNELS[key]
    if kernel is None:
        return f"{node.op_type}: ONNX Runtime's CUDA EP registers no kernel for it ({CUDA_REGISTRY})"
    dtype = _activations(node, graph_dtype)
    if dtype not in kernel.types:
        names = "/".join(_name(t) for t in kernel.types)
        return f"{node.op_type} in {_name(dtype)}: the CUDA kernel is registered for {names} ({kernel.source})"
    return _broken_rule(node, kernel)


def cuda_form_refusal(node: ir.Node) -> str | None:
    """What the CUDA EP's kernel refuses of a node's form (its attributes and shapes), whatever
    its activation type: the form a float16 lowering may keep (None: it takes it)."""
    kernel = CUDA_KERNELS.get((node.domain or "", node.op_type))
    return _broken_rule(node, kernel) if kernel is not None else None


def _broken_rule(node: ir.Node, kernel: CudaKernel) -> str | None:
    """The kernel's constructor check on `node`, in words naming its source (None: it passes)."""
    rule = kernel.check(node)
    return f"{node.op_type}: {rule} ({kernel.source})" if rule else None


def cuda_refusals(model: ir.Model) -> dict[str, str]:
    """node name -> why the CUDA EP will not take it, for every node of the main graph it will not."""
    dtype = activation_dtype(model)
    found = {}
    for node in model.graph:
        why = cuda_refusal(node, dtype)
        if why:
            found[node.name or node.op_type] = why
    return found


@dataclasses.dataclass(frozen=True)
class ReleaseGap:
    """A form the ONNX Runtime releases before `since` cannot run as moepass writes it: `form`, in
    words, with the flag that makes it, and what goes wrong (probed on 1.31.1, the newest
    onnxruntime-gpu, on the CPU EP: tests/test_ort_releases.py runs every form on both releases)."""

    since: tuple[int, int]
    form: str
    what: str
    applies: Callable[[ir.Node], bool]
    converts_around: bool = True  # another expert form or target avoids it (else: only a newer release)


RELEASE_GAPS = (
    ReleaseGap(
        (1, 32),
        "SM80-prepacked QMoE experts (weights_prepacked=1: the offload expert format, partition's offload target)",
        "its CPU EP computes other values without a word (other greedy tokens) or crashes creating the session",
        lambda node: node.op_type == "QMoE" and node.attributes.get_int("weights_prepacked", 0) == 1,
    ),
    ReleaseGap(
        (1, 32),
        "com.microsoft::MoEPacked nodes (the GGUF's own blocks: the packed expert format)",
        "the operator is new in 1.32",
        is_cuda_packed,
    ),
    ReleaseGap(
        (1, 32),
        "com.microsoft::MoEGroupRouter nodes (sigmoid routing over expert groups: DeepSeek-V3-style models)",
        "the operator is new in 1.32",
        lambda node: node.op_type == "MoEGroupRouter",
        converts_around=False,
    ),
)


def release_refusal(model: ir.Model, version: tuple[int, int], label: str) -> str | None:
    """Why ONNX Runtime `label` (of `version`) cannot run `model` as written, naming the form and a
    node; None where it can."""
    for gap in RELEASE_GAPS:
        if version >= gap.since:
            continue
        nodes = [node.name for node in model.graph if node.domain == "com.microsoft" and gap.applies(node)]
        if nodes:
            since = ".".join(map(str, gap.since))
            more = f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""
            around = (
                f"convert with the default expert format (or "
                f"{wording().call('partition', wording().option('--target', 'layers'))}) to run on {label}, or "
                if gap.converts_around
                else f"no form of this model runs on {label}: "
            )
            return (
                f"{gap.form} need ONNX Runtime {since} or newer; {label} is installed, and {gap.what} "
                f"({nodes[0]}{more}): {around}install moepass[cpu] (onnxruntime {since})"
            )
    return None
