"""Routing: the scores a MoE layer's node selects and mixes its experts by.

The router's logits go to the QMoE / MoE node as they are for the softmax routings (the kernel does
softmax, top-k and renormalization over the k itself); deepseek2's routing (sigmoid or softmax
gating, a selection bias, group-limited top-k) is built before the node, as scores whose softmax
over the selected experts gives their weights.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from gguf import ExpertGatingFuncType

from moepass.core.architectures import ROUTINGS, Features
from moepass.core.quants import dequantize
from moepass.passes.lower.graph_builder import GraphBuilder


def renormalizes(features: Features) -> bool:
    return ROUTINGS[features.routing].renormalizes


def router_input(builder: GraphBuilder, x2d: ir.Value, layer: int) -> tuple[ir.Value, ir.Value | None]:
    """(the MoE node's router input, and for deepseek2 without renormalization the sum of the
    selected weights to multiply the node's output by, else None)."""
    logits = builder.linear(
        x2d,
        builder.tensor("ffn_gate_inp", layer),
        f"blk.{layer}.router",
        bias=builder.optional("ffn_gate_inp_bias", layer),
    )
    if builder.arch.features.routing == "deepseek":
        return deepseek_routing(builder, logits, layer)
    return logits, None


def deepseek_routing(builder: GraphBuilder, logits: ir.Value, layer: int) -> tuple[ir.Value, ir.Value | None]:
    """deepseek2's routing as llama.cpp's build_moe_ffn does it, as scores for the MoE node:
    log(weight) at the selected experts, -inf elsewhere, so that the node's softmax over them
    gives the selected weights renormalized (expert_weights_norm); without that flag, the sum
    of the selected weights is returned too, to multiply the node's output by.

    Gating probs = softmax or sigmoid(logits) (expert_gating_func); selection by probs plus the
    bias exp_probs_b, within the best `expert_group_used_count` of `expert_group_count` groups
    (a group's score is the sum of its best two); weights = the unbiased probs of the selected.
    Sigmoid gating uses ONNX Runtime's com.microsoft::MoEGroupRouter, which computes exactly
    these scores (measured equal to llama.cpp's selection); softmax gating is built from ONNX ops.
    """
    hp, t, name = builder.hp, builder.tape, f"blk.{layer}.router"
    k, groups = hp.n_experts_used, max(hp.n_expert_groups, 1)
    groups_used = hp.n_group_used if groups > 1 else 1
    bias = builder.optional("exp_probs_b", layer)
    if hp.gating_func == ExpertGatingFuncType.SIGMOID:
        n = hp.n_experts
        bias_value = builder.lazy_initializer(
            bias.name if bias is not None else f"{name}.no_selection_bias",
            ir.DataType.FLOAT,
            (n,),
            (lambda: dequantize(bias.read_rows(), bias.ggml_type).reshape(n))
            if bias is not None
            else (lambda: np.zeros(n, np.float32)),
        )
        scores = t.op(
            "MoEGroupRouter",
            [logits, bias_value],
            {
                "n_group": groups,
                "topk_group": groups_used,
                "group_topk": 2,
                "top_k": k,
                "router_sentinel": float("-inf"),
            },
            domain="com.microsoft",
            name=f"{name}.group_topk",
        )
        if hp.expert_weights_norm:
            return scores, None
        weights = t.op("Exp", [scores], name=f"{name}.selected_weights")
        return scores, t.op("ReduceSum", [weights, builder.ints(-1)], {"keepdims": 1}, name=f"{name}.weight_sum")
    probs = t.op("Softmax", [logits], {"axis": -1}, name=f"{name}.softmax")
    selection = (
        probs
        if bias is None
        else t.op("Add", [probs, builder.float_weight(bias.name, bias)], name=f"{name}.selection_bias")
    )
    if groups > 1:
        selection = group_limit(builder, selection, groups, groups_used, name)
    _, chosen = t.op_multi_out("TopK", [selection, builder.ints(k)], {"axis": -1}, num_outputs=2, name=f"{name}.topk")
    weights = t.op("GatherElements", [probs, chosen], {"axis": -1}, name=f"{name}.selected_weights")
    fill = t.op(
        "Expand",
        [
            builder.const(f"const.{builder.act.name.lower()}.-inf", np.array(-np.inf, builder.np_act)),
            t.op("Shape", [logits], name=f"{name}.shape"),
        ],
        name=f"{name}.fill",
    )
    scores = t.op(
        "ScatterElements",
        [fill, chosen, t.op("Log", [weights], name=f"{name}.log_weights")],
        {"axis": -1},
        name=f"{name}.scores",
    )
    if hp.expert_weights_norm:
        return scores, None
    return scores, t.op("ReduceSum", [weights, builder.ints(-1)], {"keepdims": 1}, name=f"{name}.weight_sum")


def group_limit(builder: GraphBuilder, selection: ir.Value, groups: int, used: int, name: str) -> ir.Value:
    """Selection scores [T, E] with every expert outside the `used` best groups set to -inf;
    a group's score is the sum of its two best experts (llama.cpp, DeepSeek-V3)."""
    t, per_group = builder.tape, builder.hp.n_experts // groups
    grouped = t.op("Reshape", [selection, builder.ints(-1, groups, per_group)], name=f"{name}.groups")
    best = (
        grouped
        if per_group < 2
        else t.op_multi_out("TopK", [grouped, builder.ints(2)], {"axis": -1}, num_outputs=2, name=f"{name}.group_best")[
            0
        ]
    )
    group_scores = t.op("ReduceSum", [best, builder.ints(-1)], {"keepdims": 0}, name=f"{name}.group_scores")
    _, kept = t.op_multi_out(
        "TopK", [group_scores, builder.ints(used)], {"axis": -1}, num_outputs=2, name=f"{name}.group_topk"
    )
    zero = builder.const("const.bool.false", np.array(False))
    keep = t.op(
        "ScatterElements",
        [
            t.op("Expand", [zero, t.op("Shape", [group_scores], name=f"{name}.group_shape")], name=f"{name}.no_group"),
            kept,
            t.op(
                "Expand",
                [builder.const("const.bool.true", np.array(True)), t.op("Shape", [kept], name=f"{name}.kept_shape")],
                name=f"{name}.kept_true",
            ),
        ],
        {"axis": -1},
        name=f"{name}.group_mask",
    )
    masked = t.op(
        "Where",
        [
            t.op("Unsqueeze", [keep, builder.ints(-1)], name=f"{name}.group_mask_column"),
            grouped,
            builder.const(f"const.{builder.act.name.lower()}.-inf", np.array(-np.inf, builder.np_act)),
        ],
        name=f"{name}.group_limited",
    )
    return t.op("Reshape", [masked, builder.ints(-1, builder.hp.n_experts)], name=f"{name}.ungroup")
