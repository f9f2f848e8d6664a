"""Attention: GroupQueryAttention over the KV cache, with grouped-query heads or deepseek2's
multi-head latent attention (one KV head over the compressed cache, the absorbed form llama.cpp
uses)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from moepass.core.architectures import ROPE_STYLES, latent_dims
from moepass.core.errors import MoepassError
from moepass.core.quants import dequantize
from moepass.passes.lower.graph_builder import GraphBuilder
from moepass.passes.lower.rope import rope_tables


@dataclasses.dataclass
class AttentionInputs:
    """What every layer's GroupQueryAttention shares: the sequence bookkeeping derived from the
    attention mask, the RoPE tables, and the cache geometry."""

    seqlens_k: ir.Value  # [batch] int32: tokens - 1 per sequence
    total_length: ir.Value  # scalar int32: the mask's length
    cos: ir.Value  # [positions, rotary / 2]
    sin: ir.Value
    kv_heads: int  # heads of the KV cache (1 for latent attention: the compressed cache)
    head_size: int  # per cache head (latent: rope + kv rank)
    scale: float  # applied to q.k


def attention_inputs(builder: GraphBuilder, mask: ir.Value) -> AttentionInputs:
    """GroupQueryAttention takes the cache length per sequence (seqlens_k = tokens - 1) and the
    total length, as onnxruntime-genai's builder derives them from the attention mask."""
    hparams, tape, latent = builder.hp, builder.tape, builder.arch.features.mla
    kv_heads, head_size = hparams.n_kv_heads, hparams.head_dim
    rotary = head_size  # rotary dimensions at the start of each GQA head
    if latent:  # GQA over the compressed cache: one KV head of [k_pe | c] (see latent_qkv)
        kv_heads, head_size, rotary = 1, hparams.kv_lora_rank + hparams.rope_dim, hparams.rope_dim
    one = builder.const("const.i64.one", np.array(1, np.int64))
    tokens = tape.op("ReduceSum", [mask, builder.ints(1)], {"keepdims": 0}, name="attn_mask.reduce_sum")
    seqlens_k = tape.op("Cast", [tape.op("Sub", [tokens, one])], {"to": ir.DataType.INT32}, name="attn_mask.seqlens_k")
    total_length = tape.op(
        "Cast",
        [tape.op("Gather", [tape.op("Shape", [mask]), one], {"axis": 0})],
        {"to": ir.DataType.INT32},
        name="attn_mask.total_seq_len",
    )
    positions = hparams.context_length
    if hparams.value_dim != hparams.head_dim and not latent:
        raise MoepassError(
            f"{builder.gguf.path}: value head size {hparams.value_dim} differs from key head size "
            f"{head_size}; GroupQueryAttention needs them equal"
        )
    rope = hparams.rope
    if rope is None:
        raise ValueError("hyperparameters without their RoPE (architectures.read_rope)")
    # LongRoPE: the factors llama.cpp takes for a context of `positions` (Rope.long_factors)
    factors = rope.freq_factors(positions)
    cos, sin = rope_tables(builder, positions, rotary, rope, factors)
    multiplied = builder.arch.features.multipliers and hparams.attention_scale
    scale = hparams.attention_scale if multiplied else 1.0 / np.sqrt(head_size)
    if latent:  # llama.cpp's deepseek2: mscale^2 / sqrt(key head), mscale from YaRN's log multiplier
        scale = rope.latent_attention_mscale() ** 2 / np.sqrt(latent_dims(hparams)[1])
    return AttentionInputs(seqlens_k, total_length, cos, sin, kv_heads, head_size, float(scale))


def attention(
    builder: GraphBuilder, normed: ir.Value, layer: int, shared: AttentionInputs
) -> tuple[ir.Value, tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value]]:
    """One layer's attention on the normed residual stream: (its output projection, the
    (key, value) cache inputs past_key_values.N.*, the (key, value) outputs present.N.*)."""
    hparams, tape, features, prefix = builder.hp, builder.tape, builder.arch.features, f"blk.{layer}"
    cache_type = ir.TensorType(builder.act)  # float32, or float16 for the offload format
    if features.mla:
        query, key, value = latent_qkv(builder, normed, layer)
    else:
        query, key, value = (
            builder.linear(
                normed,
                builder.tensor(f"attn_{p}", layer),
                f"{prefix}.attn_{p}",
                bias=builder.optional(f"attn_{p}_bias", layer),
            )
            for p in "qkv"
        )
    qk_norm = features.qk_norm_style
    if qk_norm is not None and qk_norm.per_head:
        query = builder.per_head_rms_norm(
            query, builder.tensor("attn_q_norm", layer), hparams.n_heads, f"{prefix}.attn_q_norm"
        )
        key = builder.per_head_rms_norm(
            key, builder.tensor("attn_k_norm", layer), shared.kv_heads, f"{prefix}.attn_k_norm"
        )
    elif qk_norm is not None:
        query = builder.rms_norm(query, builder.tensor("attn_q_norm", layer), f"{prefix}.attn_q_norm")
        key = builder.rms_norm(key, builder.tensor("attn_k_norm", layer), f"{prefix}.attn_k_norm")
    past_key, past_value = (
        ir.Value(
            name=f"past_key_values.{layer}.{kind}",
            type=cache_type,
            shape=ir.Shape(["batch_size", shared.kv_heads, "past_sequence_length", shared.head_size]),
        )
        for kind in ("key", "value")
    )
    past = past_key, past_value
    inputs: list[ir.Value | None] = [
        query,
        key,
        value,
        past_key,
        past_value,
        shared.seqlens_k,
        shared.total_length,
        shared.cos,
        shared.sin,
    ]
    attributes = {
        "num_heads": hparams.n_heads,
        "kv_num_heads": shared.kv_heads,
        "do_rotary": 1,
        "rotary_interleaved": int(ROPE_STYLES[features.rope].interleaved),
        "scale": shared.scale,
    }
    if features.attention_sinks:  # head_sink (input 11): one logit per head in every softmax
        inputs += [
            None,
            None,
            builder.float_weight(builder.arch.tensor_name("attn_sinks", layer), builder.tensor("attn_sinks", layer)),
        ]
    if layer in hparams.sliding_window_layers:
        # ORT attends to the last local_window_size keys (the query's own included), as llama.cpp's
        # n_swa (a key p0 is masked for query p1 when p1 - p0 >= n_swa): measured equal.
        attributes["local_window_size"] = hparams.sliding_window
    out, present_key, present_value = tape.op_multi_out(
        "GroupQueryAttention", inputs, attributes, num_outputs=3, domain="com.microsoft", name=f"{prefix}.attn"
    )
    for present, kind in ((present_key, "key"), (present_value, "value")):
        present.name = f"present.{layer}.{kind}"
        present.type = cache_type
        present.shape = ir.Shape(["batch_size", shared.kv_heads, "total_sequence_length", shared.head_size])
    if features.mla:
        out = latent_values(builder, out, layer)
    out = builder.linear(
        out,
        builder.tensor("attn_output", layer),
        f"{prefix}.attn_output",
        bias=builder.optional("attn_output_bias", layer),
    )
    return out, past, (present_key, present_value)


def latent_qkv(builder: GraphBuilder, h: ir.Value, layer: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Query, key and value of multi-head latent attention, in the absorbed form llama.cpp uses,
    for one GroupQueryAttention with a single KV head over the compressed cache:

      c = RMSNorm(kv_a(x)[:rank]), k_pe = kv_a(x)[rank:]        (compressed KV, shared RoPE key)
      key   = [k_pe | c]                                         (rope + rank per token)
      value = [c | 0]                                            (padded to the key width)
      query = [q_pe | q_nope @ Wk_h] per head                    (Wk_h: [nope, rank], from attn_k_b)

    q.k = q_pe.k_pe + q_nope.(Wk_h c): the key each head would decompress. GQA rotates the
    first `rope` dims of each head (interleaved pairs, as deepseek2's RoPE). The attention output
    per head is then mapped by Wv_h (latent_values)."""
    t, hp, p = builder.tape, builder.hp, f"blk.{layer}"
    n, k_head, _, rope, nope = latent_dims(hp)
    rank = hp.kv_lora_rank
    if hp.q_lora_rank:
        q = builder.linear(h, builder.tensor("attn_q_a", layer), f"{p}.attn_q_a")
        q = builder.rms_norm(q, builder.tensor("attn_q_a_norm", layer), f"{p}.attn_q_a_norm")
        q = builder.linear(q, builder.tensor("attn_q_b", layer), f"{p}.attn_q_b")
    else:
        q = builder.linear(h, builder.tensor("attn_q", layer), f"{p}.attn_q")
    heads = t.op("Reshape", [q, builder.ints(0, 0, n, k_head)], name=f"{p}.attn_q.split_heads")
    q_nope = t.op("Slice", [heads, builder.ints(0), builder.ints(nope), builder.ints(3)], name=f"{p}.attn_q.nope")
    q_pe = t.op("Slice", [heads, builder.ints(nope), builder.ints(k_head), builder.ints(3)], name=f"{p}.attn_q.pe")
    per_head = t.op("Transpose", [q_nope], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_q.heads_first")
    absorbed = t.op("MatMul", [per_head, latent_matrix(builder, layer, "k")], name=f"{p}.attn_q.absorb")
    absorbed = t.op("Transpose", [absorbed], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_q.tokens_first")
    q = t.op(
        "Reshape",
        [
            t.op("Concat", [q_pe, absorbed], {"axis": 3}, name=f"{p}.attn_q.concat"),
            builder.ints(0, 0, n * (rope + rank)),
        ],
        name=f"{p}.attn_q.merge_heads",
    )
    kv = builder.linear(h, builder.tensor("attn_kv_a_mqa", layer), f"{p}.attn_kv_a_mqa")
    compressed = t.op(
        "Slice", [kv, builder.ints(0), builder.ints(rank), builder.ints(2)], name=f"{p}.attn_kv.compressed"
    )
    k_pe = t.op("Slice", [kv, builder.ints(rank), builder.ints(rank + rope), builder.ints(2)], name=f"{p}.attn_kv.k_pe")
    compressed = builder.rms_norm(compressed, builder.tensor("attn_kv_a_norm", layer), f"{p}.attn_kv_a_norm")
    k = t.op("Concat", [k_pe, compressed], {"axis": 2}, name=f"{p}.attn_k")
    v = t.op("Pad", [compressed, builder.ints(0, 0, 0, 0, 0, rope)], name=f"{p}.attn_v")
    return q, k, v


def latent_values(builder: GraphBuilder, attn: ir.Value, layer: int) -> ir.Value:
    """GQA's output per head ([weighted c | 0]) -> the heads' values: c' @ Wv_h, [B, S, n * v_head]."""
    t, hp, p = builder.tape, builder.hp, f"blk.{layer}"
    n, _, v_head, rope, _ = latent_dims(hp)
    rank = hp.kv_lora_rank
    heads = t.op("Reshape", [attn, builder.ints(0, 0, n, rope + rank)], name=f"{p}.attn_out.split_heads")
    latent = t.op("Slice", [heads, builder.ints(0), builder.ints(rank), builder.ints(3)], name=f"{p}.attn_out.latent")
    latent = t.op("Transpose", [latent], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_out.heads_first")
    values = t.op("MatMul", [latent, latent_matrix(builder, layer, "v")], name=f"{p}.attn_out.decompress")
    values = t.op("Transpose", [values], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_out.tokens_first")
    return t.op("Reshape", [values, builder.ints(0, 0, n * v_head)], name=f"{p}.attn_out.merge_heads")


def latent_matrix(builder: GraphBuilder, layer: int, which: str) -> ir.Value:
    """Per-head decompression matrices as float: "k" -> Wk [n, nope, rank] (q_nope to the latent
    space), "v" -> Wv [n, rank, v_head]; from attn_k_b / attn_v_b, or split from an older file's
    attn_kv_b ([n * (nope + v_head), rank])."""
    hp = builder.hp
    n, _, v_head, _, nope = latent_dims(hp)
    rank = hp.kv_lora_rank
    absorbed = bool(hp.k_head_mla)
    src = builder.tensor(f"attn_{which}_b" if absorbed else "attn_kv_b", layer)
    shape = (n, nope, rank) if which == "k" else (n, rank, v_head)

    def make() -> np.ndarray:
        values = dequantize(src.read_rows(), src.ggml_type)
        if absorbed:  # attn_k_b [n, rank, nope], attn_v_b [n, v_head, rank]
            return values.reshape(src.shape).transpose(0, 2, 1)
        kv = values.reshape(n, nope + v_head, rank)
        return kv[:, :nope, :] if which == "k" else kv[:, nope:, :].transpose(0, 2, 1)

    return builder.lazy_initializer(f"blk.{layer}.attn_{which}_b.latent", builder.act, shape, make)
