"""Lowering: a GGUF model becomes an onnx-ir decoder graph.

The graph uses ONNX Runtime's contrib operators where they are the fast CPU path:
GroupQueryAttention (KV cache, causal mask and rotary embedding in one kernel), MatMulNBits
(block-quantized matrices without dequantizing them), SimplifiedLayerNormalization (RMSNorm;
`fuse-skip-norm` later folds residual adds into SkipSimplifiedLayerNormalization) and
com.microsoft::QMoE (one node per MoE layer: routing, top-k and every expert).

A recipe composes the building blocks: GraphBuilder (weights, linear layers, norms, embedding),
attention (grouped-query or latent), routing (softmax or deepseek2's grouped sigmoid) and ffn
(MoE, shared expert, dense). Inputs and outputs are named as onnxruntime-genai expects:
input_ids, attention_mask, past_key_values.N.key/value -> logits, present.N.key/value (KV cache in
BNSH layout).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from moepass.core import keys
from moepass.core.architectures import Architecture, HParams
from moepass.core.choices import EXPERT_FORMATS, FLOAT_EXPERT_CHOICES, MAX_CONTEXT, format_bytes, one_of
from moepass.core.errors import MoepassError, wording
from moepass.core.files import LOGITS_TO_KEEP
from moepass.core.gguf_reader import GGUFModel
from moepass.core.moe_nodes import NATIVE_DOMAIN
from moepass.core.onnx_format import OPSETS, ir_version_for
from moepass.core.version import __version__
from moepass.passes.lower.attention import attention, attention_inputs
from moepass.passes.lower.ffn import feed_forward
from moepass.passes.lower.graph_builder import GraphBuilder, LowerOptions
from moepass.passes.weights.report import WeightReport

# ---- recipes ----------------------------------------------------------------------------------------


def moe_decoder(builder: GraphBuilder) -> ir.Graph:
    """Pre-norm decoder: RMSNorm -> attention (q/k norm, RoPE) -> residual -> RMSNorm -> MoE (+ shared
    expert) -> residual; final RMSNorm and LM head (tied to the embedding when output.weight is absent).

    What differs between architectures comes from `builder.arch.features` (see moepass.core.architectures).
    """
    hparams, tape, features = builder.hp, builder.tape, builder.arch.features
    input_ids = ir.Value(
        name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size", "sequence_length"])
    )
    mask = ir.Value(
        name="attention_mask",
        type=ir.TensorType(ir.DataType.INT64),
        shape=ir.Shape(["batch_size", "total_sequence_length"]),
    )
    inputs = [input_ids, mask]
    outputs: list[ir.Value] = []
    shared = attention_inputs(builder, mask)
    residual_scale = hparams.residual_scale if features.multipliers else 0.0

    def residual_branch(value: ir.Value, name: str) -> ir.Value:
        return builder.scale(value, residual_scale, f"{name}.residual_scale") if residual_scale else value

    residual = builder.embedding(input_ids)
    if features.multipliers and hparams.embedding_scale:
        residual = builder.scale(residual, hparams.embedding_scale, "embed_tokens.scale")
    for layer in range(hparams.n_layers):
        block = f"blk.{layer}"
        normed = builder.rms_norm(
            residual,
            builder.tensor("attn_norm", layer),
            f"{block}.attn_norm",
            builder.optional("attn_norm_bias", layer),
        )
        attended, past, present = attention(builder, normed, layer, shared)
        inputs += past
        outputs += present
        residual = tape.op("Add", [residual, residual_branch(attended, f"{block}.attn")], name=f"{block}.attn_residual")
        normed = builder.rms_norm(
            residual,
            builder.tensor(features.ffn_norm, layer),
            f"{block}.ffn_norm",
            builder.optional("ffn_norm_bias", layer),
        )
        tokens = tape.op("Reshape", [normed, builder.ints(-1, hparams.hidden)], name=f"{block}.moe.flatten")
        ffn = feed_forward(builder, tokens, layer)
        ffn = tape.op(
            "Reshape", [ffn, tape.op("Shape", [residual], name=f"{block}.moe.shape")], name=f"{block}.moe.unflatten"
        )
        residual = tape.op("Add", [residual, residual_branch(ffn, f"{block}.moe")], name=f"{block}.moe_residual")

    normed = builder.rms_norm(
        residual, builder.tensor("output_norm"), "output_norm", builder.optional("output_norm_bias")
    )
    # logits for the last `logits_to_keep` positions only (0, the default: every position). During
    # generation only the last position's logits are used, and the LM head over a large vocabulary
    # is a large share of a prefill: the runtime feeds 1, as llama.cpp computes only what it returns.
    keep = tape.initializer(ir.Tensor(np.array([0], dtype=np.int64), name=LOGITS_TO_KEEP), name=LOGITS_TO_KEEP)
    inputs.append(keep)
    start = tape.op("Neg", [keep], name="logits_to_keep.start")
    normed = tape.op(
        "Slice", [normed, start, builder.ints(np.iinfo(np.int64).max), builder.ints(1)], name="logits_to_keep.slice"
    )
    tied = not builder.arch.has_tensor(builder.gguf, "output")
    head = builder.tensor("token_embd") if tied else builder.tensor("output")
    logits = builder.linear(
        normed, head, "lm_head", weight_name="lm_head.weight" if tied else None, bias=builder.optional("output_bias")
    )
    if features.multipliers:
        logits = builder.scale(logits, 1.0 / hparams.logit_scale, "lm_head.logit_scale")
    logits.name = "logits"
    logits.type = ir.TensorType(builder.act)
    logits.shape = ir.Shape(["batch_size", "logits_sequence_length", hparams.vocab])
    opsets = dict(OPSETS)
    if any(n.domain == NATIVE_DOMAIN for n in tape.nodes):  # moepass.cpu_ops's operators
        opsets[NATIVE_DOMAIN] = 1
    return ir.Graph(
        inputs,
        [logits] + outputs,
        nodes=tape.nodes,
        initializers=tape.initializers,
        opset_imports=opsets,
        name=f"moepass_{builder.arch.gguf_arch}",
    )


RECIPES: dict[str, Callable[[GraphBuilder], ir.Graph]] = {"moe_decoder": moe_decoder}


# The RoPE tables hold context x rotary dims floats. Larger than the whole file and than this, the
# context length is more likely corrupt than meant; --context then sets the positions wanted.
ROPE_TABLES_PLAUSIBLE = 64 << 20


def _check_rope_tables(gguf: GGUFModel, arch: Architecture, hp: HParams) -> None:
    rotary = hp.rope_dim if arch.features.mla else hp.head_dim
    table_bytes = hp.context_length * rotary * 4  # cos and sin, rotary/2 float32 each
    if table_bytes > ROPE_TABLES_PLAUSIBLE and table_bytes > gguf.file_bytes:
        raise MoepassError(
            f"{gguf.path}: metadata key '{arch.gguf_arch}.context_length' is {hp.context_length:,}: "
            f"its RoPE tables would take {format_bytes(table_bytes)}, more than the whole model "
            f"({format_bytes(gguf.file_bytes)}); convert with {wording().option('--context', 'N')} for the "
            "positions you need"
        )


@dataclasses.dataclass
class Lowered:
    model: ir.Model
    report: WeightReport
    hparams: HParams
    moe_layers: list[dict[str, Any]]


def lower_gguf(gguf: GGUFModel, arch: Architecture, options: LowerOptions = LowerOptions()) -> Lowered:
    """Build the ONNX decoder (as an onnx-ir model with lazy weights) for a GGUF model."""
    one_of(options.float_experts, FLOAT_EXPERT_CHOICES, "float_experts")
    one_of(options.expert_format, EXPERT_FORMATS, "expert_format")
    b = GraphBuilder(gguf, arch, options)
    arch.check_tensors(gguf, b.hp)  # every tensor present and of the right shape, before any work is done
    if options.context is not None:  # the RoPE tables' length; RoPE itself keeps the GGUF's parameters
        if not 0 < options.context <= MAX_CONTEXT:
            raise MoepassError(f"{wording().option('--context', options.context)} must be between 1 and {MAX_CONTEXT}")
        b.hp = dataclasses.replace(b.hp, context_length=options.context)
    else:
        _check_rope_tables(gguf, arch, b.hp)
    graph = RECIPES[arch.recipe](b)
    model = ir.Model(
        graph,
        ir_version=ir_version_for(graph.opset_imports),
        producer_name="moepass",
        producer_version=__version__,
        metadata_props={
            keys.VERSION: __version__,
            keys.ARCHITECTURE: arch.gguf_arch,
            keys.SOURCE: gguf.path.name,
            keys.MOE_LAYERS: str(len(b.moe_layers)),
            keys.FEATURES: json.dumps(arch.describe(gguf, b.hp), sort_keys=True),
        },
    )
    return Lowered(model, b.report, b.hp, b.moe_layers)
