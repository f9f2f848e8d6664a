"""Lowering: a GGUF model becomes an onnx-ir decoder graph.

The graph uses ONNX Runtime's contrib operators where they are the fast CPU path:
GroupQueryAttention (KV cache, causal mask and rotary embedding in one kernel), MatMulNBits
(block-quantized matrices without dequantizing them), SimplifiedLayerNormalization (RMSNorm;
`fuse-skip-norm` later folds residual adds into SkipSimplifiedLayerNormalization) and
com.microsoft::QMoE (one node per MoE layer: routing, top-k and every expert).

Weights are lazy (`passes/weights.py`): nothing is read from the GGUF file until the model is
saved, and then chunk by chunk, so memory does not grow with the size of the model. Each weight's
conversion (source type, target form, measured error) is recorded in a `WeightReport`.

Inputs and outputs are named as onnxruntime-genai expects: input_ids, attention_mask,
past_key_values.N.key/value -> logits, present.N.key/value (KV cache in BNSH layout).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

import numpy as np
import onnx_ir as ir
from onnx_ir import tape as ir_tape

from moepass.core.choices import EXPERT_FORMATS, FLOAT_EXPERT_CHOICES, MAX_CONTEXT
from moepass.core.architectures import (ACTIVATIONS, DENSE_FFN, SHARED_EXPERT, Architecture, Rope,
                                   latent_dims)
from moepass.core import keys
from moepass.core.errors import MoepassError
from moepass.core.files import LOGITS_TO_KEEP
from moepass.core.gguf_reader import GGUFModel, GGUFTensor
from moepass.cuda_ops.prepack import prepack_problem
from moepass.passes.weights import PackedGroup, WeightReport, float_expert_stack, float_tensor
from moepass.core.version import __version__
from moepass.core.moe_nodes import Experts, moe_node
from moepass.core.quants import (OFFLOAD_FORM, BlockForm, dequantize, expert_form, matrix_form, quant_type,
                                 takes_zero_points)

OPSETS = {"": 21, "com.microsoft": 1}
IR_VERSION = 10


@dataclasses.dataclass(frozen=True)
class LowerOptions:
    """What the user chose. `float_experts`: keep F32/F16/BF16 experts as float (com.microsoft::MoE)
    or quantize them into QMoE int8 / int4 (block 32). `expert_format`: "auto" (see
    moepass.core.quants.expert_form), or force "int4" / "int8" for quantized experts; requantizable non-expert
    matrices follow it too (int4 for "int4", else int8 block 32). "offload": what ONNX Runtime's
    expert offload requires: int4 block 32 experts prepacked in the SM80 layout
    (weights_prepacked=1) and a float16 graph."""

    float_experts: str = "keep"
    expert_format: str = "auto"
    imatrix: dict[str, np.ndarray] | None = dataclasses.field(default=None, compare=False)  # name -> [n_mat, K]
    context: int | None = None  # positions the model is built for (RoPE tables); None: the GGUF's context_length


def rope_cache(n_positions: int, head_dim: int, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables `[n_positions, head_dim/2]` for RoPE, as ggml's rope (rope_yarn) computes them.

    The angles follow llama.cpp's float32 recurrence (theta_i = theta_{i-1} * base^(-2/d)), so the
    tables agree with llama.cpp's to the last bit of float32 for the positions tests reach. Scaling
    ("linear", YaRN) and YaRN's magnitude factor, in float32 as ggml does them: for YaRN each
    dimension pair mixes the interpolated angle (theta * freq_scale) and the original one along a
    ramp between the correction dimensions, and cos/sin are scaled by attn_factor * (1 + 0.1 ln s)
    (which GroupQueryAttention's rotation then applies to q and k).
    """
    f32 = np.float32
    half = head_dim // 2
    theta_scale = f32(np.power(f32(rope.base), f32(-2.0 / head_dim)))
    theta = np.empty((n_positions, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_positions, dtype=np.float32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * theta_scale
    freq_scale, mscale = f32(rope.freq_scale), f32(rope.attn_factor)
    angles = theta * freq_scale
    if rope.ext_factor:
        low, high = yarn_correction_dims(head_dim, rope)
        y = (np.arange(half, dtype=np.float32) - low) / max(f32(0.001), high - low)
        ramp = (f32(1) - np.clip(y, f32(0), f32(1))) * f32(rope.ext_factor)
        angles = angles * (f32(1) - ramp) + theta * ramp
        mscale = mscale * (f32(1) + f32(0.1) * np.log(f32(1) / freq_scale))
    angles = angles.astype(np.float64)
    cos = (np.cos(angles).astype(np.float32) * mscale).astype(np.float32)
    sin = (np.sin(angles).astype(np.float32) * mscale).astype(np.float32)
    if not (np.isfinite(cos).all() and np.isfinite(sin).all()):  # metadata in range can still overflow float32
        raise MoepassError(f"the RoPE parameters ({rope}) give non-finite cos/sin tables")
    return cos, sin


def yarn_correction_dims(n_dims: int, rope: Rope) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN blends the two angles."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        return f32(n_dims) * np.log(f32(rope.n_ctx_orig) / (f32(n_rot) * f32(2) * f32(np.pi))) / \
            (f32(2) * np.log(f32(rope.base)))

    start, end = np.floor(corr_dim(rope.beta_fast)), np.ceil(corr_dim(rope.beta_slow))
    return f32(max(0, start)), f32(min(n_dims - 1, end))


class GraphBuilder:
    """Emits nodes and lazy initializers on an onnx-ir tape; recipes call its domain-level methods."""

    def __init__(self, gguf: GGUFModel, arch: Architecture, options: LowerOptions):
        self.gguf = gguf
        self.arch = arch
        self.options = options
        self.hp = arch.read_hparams(gguf)
        self.tape = ir_tape.Tape()
        self.report = WeightReport()
        self._consts: dict[tuple, ir.Value] = {}
        self.moe_layers: list[dict[str, Any]] = []
        self.offload = options.expert_format == "offload"
        # activations, float weights and scales: float16 for the offload format, else float32
        self.act = ir.DataType.FLOAT16 if self.offload else ir.DataType.FLOAT
        self.np_act = np.float16 if self.offload else np.float32

    # ---- initializers -------------------------------------------------------------------------
    def lazy_initializer(self, name: str, dtype: ir.DataType, shape: tuple[int, ...],
                         make: Callable[[], np.ndarray]) -> ir.Value:
        def materialize() -> ir.TensorProtocol:
            array = make()
            if dtype == ir.DataType.FLOAT16:
                array = array.astype(np.float16)
            if tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{name}: built shape {array.shape}, declared {shape}")
            return ir.Tensor(np.ascontiguousarray(array), name=name)

        tensor = ir.LazyTensor(materialize, dtype=dtype, shape=ir.Shape(shape), name=name)
        return self.tape.initializer(tensor, name=name)

    def const(self, key: str, array: np.ndarray) -> ir.Value:
        """A small constant initializer, shared by every node that needs the same value."""
        cache_key = (key, array.dtype.str, array.shape, array.tobytes())
        if cache_key not in self._consts:
            self._consts[cache_key] = self.tape.initializer(ir.Tensor(array, name=key), name=key)
        return self._consts[cache_key]

    def ints(self, *values: int) -> ir.Value:
        name = "const.i64." + "_".join(str(v).replace("-", "m") for v in values)
        return self.const(name, np.array(values, dtype=np.int64))

    def tensor(self, role: str, layer: int | None = None) -> GGUFTensor:
        return self.arch.tensor(self.gguf, role, layer, self.hp)

    def optional(self, role: str, layer: int | None = None) -> GGUFTensor | None:
        """The tensor of `role` if the file has it (biases, shared experts, an untied LM head)."""
        return self.tensor(role, layer) if self.arch.has_tensor(self.gguf, role, layer) else None

    def scale(self, x: ir.Value, factor: float, name: str) -> ir.Value:
        """x * factor (a float32 constant), for architecture multipliers."""
        value = self.const(f"const.{self.act.name.lower()}.{factor!r}", np.array(factor, dtype=self.np_act))
        return self.tape.op("Mul", [x, value], name=name)

    def float_weight(self, name: str, src: GGUFTensor, transpose: bool = False) -> ir.Value:
        """A GGUF tensor as float32 (its values exactly as the gguf package dequantizes them)."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        return self.tape.initializer(float_tensor(src, qt, name, self.report, transpose, self.act), name=name)

    def packed_weights(self, name: str, sources: list[GGUFTensor], form: BlockForm, blob_layout: bool = False,
                       prepack: bool = False, zero_points: bool = False) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        """Codes and scales initializers of GGUF matrices in `form` (see weights.PackedGroup)."""
        types = [quant_type(s.ggml_type, s.name, s.path) for s in sources]
        if self.options.imatrix is not None:
            for s in sources:
                imp = self.options.imatrix.get(s.name)
                k, n_mat = s.shape[-1], (s.shape[0] if len(s.shape) == 3 else 1)
                if imp is not None and imp.size not in (k, n_mat * k):
                    per = f"one matrix or {n_mat} (one per expert)" if n_mat > 1 else "one matrix"
                    raise MoepassError(f"importance matrix entry '{s.name}' has {imp.size} values, not {k} columns "
                                       f"for {per}")
        group = PackedGroup(sources, types, form, name, self.report, blob_layout, self.options.imatrix,
                            scale_dtype=self.act, prepack=prepack, zero_points=zero_points)
        zeros = self.tape.initializer(group.zero_points, name=group.zero_points.name) if zero_points else None
        return (self.tape.initializer(group.codes, name=group.codes.name),
                self.tape.initializer(group.scales, name=group.scales.name), zeros)

    # ---- layers ---------------------------------------------------------------------------------
    def linear(self, x: ir.Value, src: GGUFTensor, name: str, weight_name: str | None = None,
               bias: GGUFTensor | None = None) -> ir.Value:
        """y = x @ W^T (+ b) for a GGUF matrix W [N, K]: MatMulNBits when W's blocks move exactly,
        else float32 MatMul (+ Add).

        The weight initializers are named after the GGUF tensor unless `weight_name` says otherwise
        (a tied LM head shares its GGUF tensor with the embedding table)."""
        n, k = src.shape
        weight_name = weight_name or src.name
        b = self.float_weight(bias.name, bias) if bias is not None else None
        form, zero_points = self.matrix_form(src)
        if form is None:
            w = self.float_weight(f"{weight_name}.T", src, transpose=True)
            y = self.tape.op("MatMul", [x, w], name=name)
            return y if b is None else self.tape.op("Add", [y, b], name=f"{name}.bias")
        codes, scales, zeros = self.packed_weights(weight_name, [src], form, blob_layout=True, zero_points=zero_points)
        inputs = [x, codes, scales, zeros] + ([None, b] if b is not None else [])
        return self.tape.op("MatMulNBits", inputs, {"K": k, "N": n, "bits": form.bits, "block_size": form.block_size},
                            domain="com.microsoft", name=name)

    def matrix_form(self, src: GGUFTensor, requantize_bits: int | None = None) -> tuple[BlockForm | None, bool]:
        """(block form, zero points) of a non-expert matrix (quants.matrix_form); None for float."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        form = matrix_form(qt, self.options.expert_format, requantize_bits)
        return form, takes_zero_points(form, [qt])

    def rms_norm(self, x: ir.Value, src: GGUFTensor, name: str, bias: GGUFTensor | None = None) -> ir.Value:
        """RMSNorm(x) * gamma (+ beta: phimoe's norms add a bias after normalizing, as llama.cpp does)."""
        gamma = self.float_weight(src.name, src)
        y = self.tape.op("SimplifiedLayerNormalization", [x, gamma],
                         {"axis": -1, "epsilon": self.hp["rms_eps"], "stash_type": 1}, name=name)
        if bias is None:
            return y
        return self.tape.op("Add", [y, self.float_weight(bias.name, bias)], name=f"{name}.bias")

    def per_head_rms_norm(self, x: ir.Value, src: GGUFTensor, n_heads: int, name: str) -> ir.Value:
        d = self.hp["head_dim"]
        heads = self.tape.op("Reshape", [x, self.ints(0, 0, n_heads, d)], name=f"{name}.split_heads")
        normed = self.rms_norm(heads, src, name)
        return self.tape.op("Reshape", [normed, self.ints(0, 0, n_heads * d)], name=f"{name}.merge_heads")

    def embedding(self, input_ids: ir.Value) -> ir.Value:
        """Rows of the token embedding table. A quantized table stays quantized: exact where its
        blocks move exactly, else requantized to 8 bits (com.microsoft::GatherBlockQuantized
        dequantizes only the rows it gathers, codes laid out as QMoE's rows): a float32 copy of a
        151,936-token table would take 1.2 GB where llama.cpp keeps its blocks."""
        src = self.tensor("token_embd")
        # never requantized to 4 bits: an embedding's error enters the residual stream before every
        # layer (a Q4_K table at int4: 5x the logit error of every other matrix at int4 together)
        form, zero_points = self.matrix_form(src, requantize_bits=8)
        if form is None:
            table = self.float_weight(self.arch.tensor_name("token_embd"), src)
            return self.tape.op("Gather", [table, input_ids], {"axis": 0}, name="embed_tokens")
        codes, scales, zeros = self.packed_weights(src.name, [src], form, zero_points=zero_points)
        return self.tape.op("GatherBlockQuantized", [codes, input_ids, scales, zeros],
                            {"gather_axis": 0, "quantize_axis": 1, "block_size": form.block_size, "bits": form.bits},
                            domain="com.microsoft", name="embed_tokens")

    def moe(self, x2d: ir.Value, layer: int, hidden_out: int) -> ir.Value:
        """One MoE layer as a single QMoE node (or MoE, for float experts kept as float).

        Routing: the node gets the router logits (with the router's bias, if any) and does softmax,
        top-k and renormalization over the k itself: for "softmax_topk_renorm", and for
        "topk_softmax" (softmax over the k selected logits, the same weights). For "softmax_topk"
        (weights not renormalized) a QMoE node also gets softmax(logits) as router_weights with
        normalize_routing_weights=0, because ORT's CPU QMoE renormalizes unless given the weights
        (the selection still follows the logits: the same order); the float MoE kernel honours
        normalize_routing_weights=0 by itself. Expert biases go to fc1_bias (gate and up
        interleaved like the weights) and fc2_bias."""
        hp, feats = self.hp, self.arch.features
        router = self.linear(x2d, self.tensor("ffn_gate_inp", layer), f"blk.{layer}.router",
                             bias=self.optional("ffn_gate_inp_bias", layer))
        weight_sum = None
        if feats.routing == "deepseek":
            router, weight_sum = self.deepseek_routing(router, layer)
        gate, up, down = (self.tensor(r, layer) for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        types = [quant_type(t.ggml_type, t.name, t.path) for t in (gate, up, down)]
        renormalize = feats.routing in ("softmax_topk_renorm", "topk_softmax", "deepseek")
        node = functools.partial(moe_node, self.tape.op, f"blk.{layer}.moe", x2d, router, top_k=hp["n_experts_used"],
                                 normalize=renormalize, activation=ACTIVATIONS[feats.activation])
        name = f"blk.{layer}.moe"
        floats = [qt.storage == "float" for qt in types]
        prefix = f"blk.{layer}.ffn_experts"
        fc1_b = fc2_b = None
        if feats.expert_biases:
            fc1_b = self.expert_bias(f"{prefix}.fc1_bias", [self.tensor(f"ffn_{p}_exps_bias", layer) for p in ("gate", "up")])
            fc2_b = self.expert_bias(f"{prefix}.fc2_bias", [self.tensor("ffn_down_exps_bias", layer)])
        if all(floats) and self.options.float_experts == "keep":
            fc1 = self.float_experts(f"{prefix}.fc1", [gate, up])
            fc2 = self.float_experts(f"{prefix}.fc2", [down])
            out = node(Experts(fc1, bias=fc1_b), Experts(fc2, bias=fc2_b))
            form_name = "float32"
        else:
            if any(floats) and self.options.float_experts == "keep":
                t = (gate, up, down)[floats.index(True)]
                raise MoepassError(f"{t.path}: expert tensor '{t.name}' is {t.type_name} while the other experts of layer "
                                   f"{layer} are quantized; pass --float-experts int8 (or int4) to quantize it")
            if all(floats):
                form = BlockForm(8 if self.options.float_experts == "int8" else 4, 32)
            else:
                form = expert_form([qt for qt in types if qt.storage != "float"], self.options.expert_format)
            prepack = self.offload and form == OFFLOAD_FORM
            if prepack:
                for label, (n, k) in (("fc1 (gate and up)", (2 * gate.shape[-2], gate.shape[-1])),
                                      ("fc2 (down)", (down.shape[-2], down.shape[-1]))):
                    problem = prepack_problem(n, k, form.bits)
                    if problem:
                        raise MoepassError(f"{name}: {label} cannot take the prepacked layout expert offload needs: "
                                           f"{problem}; convert without --expert-format offload")
            # 4-bit requantization takes zero points (not in the prepacked offload layout)
            zero_points = not prepack and takes_zero_points(form, types)
            fc1_w, fc1_s, fc1_z = self.packed_weights(f"{prefix}.fc1", [gate, up], form, prepack=prepack,
                                                      zero_points=zero_points)
            fc2_w, fc2_s, fc2_z = self.packed_weights(f"{prefix}.fc2", [down], form, prepack=prepack,
                                                      zero_points=zero_points)
            out = node(Experts(fc1_w, fc1_s, fc1_z, fc1_b), Experts(fc2_w, fc2_s, fc2_z, fc2_b), bits=form.bits,
                       block_size=form.block_size, prepacked=prepack)
            form_name = str(form)
        out.name = f"{name}.output"
        out.dtype = self.act
        out.shape = ir.Shape(["tokens", hidden_out])
        out.producer().metadata_props.update({
            keys.LAYER: str(layer),
            keys.EXPERT_FORM: form_name,
            keys.SOURCE_TYPES: ",".join(qt.name for qt in types),
        })
        self.moe_layers.append({"layer": layer, "node": name, "experts": hp["n_experts"], "top_k": hp["n_experts_used"],
                                "form": form_name, "source_types": [qt.name for qt in types]})
        if weight_sum is not None:  # the node renormalized weights that the model leaves as they are
            out = self.tape.op("Mul", [out, weight_sum], name=f"{name}.weights_unnormalize")
        if hp["expert_weights_scale"] not in (0.0, 1.0):   # llama.cpp scales the routing weights
            out = self.scale(out, hp["expert_weights_scale"], f"{name}.weights_scale")
        return out

    def deepseek_routing(self, logits: ir.Value, layer: int) -> tuple[ir.Value, ir.Value | None]:
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
        hp, t, name = self.hp, self.tape, f"blk.{layer}.router"
        k, groups = hp["n_experts_used"], max(hp["n_expert_groups"], 1)
        groups_used = hp["n_group_used"] if groups > 1 else 1
        bias = self.optional("exp_probs_b", layer)
        if hp["gating_func"] == 2:
            n = hp["n_experts"]
            bias_value = self.lazy_initializer(
                bias.name if bias is not None else f"{name}.no_selection_bias", ir.DataType.FLOAT, (n,),
                (lambda: dequantize(bias.read_rows(), bias.ggml_type).reshape(n)) if bias is not None
                else (lambda: np.zeros(n, np.float32)))
            scores = t.op("MoEGroupRouter", [logits, bias_value],
                          {"n_group": groups, "topk_group": groups_used, "group_topk": 2, "top_k": k,
                           "router_sentinel": float("-inf")}, domain="com.microsoft", name=f"{name}.group_topk")
            if hp["expert_weights_norm"]:
                return scores, None
            weights = t.op("Exp", [scores], name=f"{name}.selected_weights")
            return scores, t.op("ReduceSum", [weights, self.ints(-1)], {"keepdims": 1}, name=f"{name}.weight_sum")
        probs = t.op("Softmax", [logits], {"axis": -1}, name=f"{name}.softmax")
        selection = probs if bias is None else \
            t.op("Add", [probs, self.float_weight(bias.name, bias)], name=f"{name}.selection_bias")
        if groups > 1:
            selection = self.group_limit(selection, groups, groups_used, name)
        _, chosen = t.op_multi_out("TopK", [selection, self.ints(k)], {"axis": -1}, num_outputs=2, name=f"{name}.topk")
        weights = t.op("GatherElements", [probs, chosen], {"axis": -1}, name=f"{name}.selected_weights")
        fill = t.op("Expand", [self.const(f"const.{self.act.name.lower()}.-inf", np.array(-np.inf, self.np_act)),
                               t.op("Shape", [logits], name=f"{name}.shape")], name=f"{name}.fill")
        scores = t.op("ScatterElements", [fill, chosen, t.op("Log", [weights], name=f"{name}.log_weights")],
                      {"axis": -1}, name=f"{name}.scores")
        if hp["expert_weights_norm"]:
            return scores, None
        return scores, t.op("ReduceSum", [weights, self.ints(-1)], {"keepdims": 1}, name=f"{name}.weight_sum")

    def group_limit(self, selection: ir.Value, groups: int, used: int, name: str) -> ir.Value:
        """Selection scores [T, E] with every expert outside the `used` best groups set to -inf;
        a group's score is the sum of its two best experts (llama.cpp, DeepSeek-V3)."""
        t, per_group = self.tape, self.hp["n_experts"] // groups
        grouped = t.op("Reshape", [selection, self.ints(-1, groups, per_group)], name=f"{name}.groups")
        best = grouped if per_group < 2 else \
            t.op_multi_out("TopK", [grouped, self.ints(2)], {"axis": -1}, num_outputs=2, name=f"{name}.group_best")[0]
        group_scores = t.op("ReduceSum", [best, self.ints(-1)], {"keepdims": 0}, name=f"{name}.group_scores")
        _, kept = t.op_multi_out("TopK", [group_scores, self.ints(used)], {"axis": -1}, num_outputs=2,
                                 name=f"{name}.group_topk")
        zero = self.const("const.bool.false", np.array(False))
        keep = t.op("ScatterElements", [
            t.op("Expand", [zero, t.op("Shape", [group_scores], name=f"{name}.group_shape")], name=f"{name}.no_group"),
            kept, t.op("Expand", [self.const("const.bool.true", np.array(True)),
                                  t.op("Shape", [kept], name=f"{name}.kept_shape")], name=f"{name}.kept_true")],
            {"axis": -1}, name=f"{name}.group_mask")
        masked = t.op("Where", [t.op("Unsqueeze", [keep, self.ints(-1)], name=f"{name}.group_mask_column"), grouped,
                                self.const(f"const.{self.act.name.lower()}.-inf", np.array(-np.inf, self.np_act))],
                      name=f"{name}.group_limited")
        return t.op("Reshape", [masked, self.ints(-1, self.hp["n_experts"])], name=f"{name}.ungroup")

    def gated_mlp(self, x2d: ir.Value, roles: tuple[str, str, str], layer: int, prefix: str) -> ir.Value:
        """down(silu(gate(x)) * up(x)) of the (gate, up, down) tensor roles of one block."""
        t = self.tape
        gate = self.linear(x2d, self.tensor(roles[0], layer), f"{prefix}.gate")
        up = self.linear(x2d, self.tensor(roles[1], layer), f"{prefix}.up")
        act = t.op("Mul", [t.op("Mul", [gate, t.op("Sigmoid", [gate], name=f"{prefix}.sigmoid")], name=f"{prefix}.silu"),
                           up], name=f"{prefix}.swiglu")
        return self.linear(act, self.tensor(roles[2], layer), f"{prefix}.down")

    def shared_expert(self, x2d: ir.Value, layer: int) -> ir.Value:
        """The dense shared expert, times sigmoid(x . g) when gated (qwen2moe)."""
        t, p = self.tape, f"blk.{layer}.shared_expert"
        out = self.gated_mlp(x2d, SHARED_EXPERT, layer, p)
        if self.arch.features.shared_expert != "sigmoid_gated":
            return out
        g = self.tensor("ffn_gate_inp_shexp", layer)
        weight = self.float_weight(g.name, g)
        logit = t.op("MatMul", [x2d, t.op("Unsqueeze", [weight, self.ints(-1)], name=f"{p}.gate_inp.column")],
                     name=f"{p}.gate_inp")
        return t.op("Mul", [out, t.op("Sigmoid", [logit], name=f"{p}.gate_sigmoid")], name=f"{p}.gated")

    # ---- multi-head latent attention (deepseek2) --------------------------------------------------
    def latent_qkv(self, h: ir.Value, layer: int) -> tuple[ir.Value, ir.Value, ir.Value]:
        """Query, key and value of multi-head latent attention, in the absorbed form llama.cpp uses,
        for one GroupQueryAttention with a single KV head over the compressed cache:

          c = RMSNorm(kv_a(x)[:rank]), k_pe = kv_a(x)[rank:]        (compressed KV, shared RoPE key)
          key   = [k_pe | c]                                         (rope + rank per token)
          value = [c | 0]                                            (padded to the key width)
          query = [q_pe | q_nope @ Wk_h] per head                    (Wk_h: [nope, rank], from attn_k_b)

        q.k = q_pe.k_pe + q_nope.(Wk_h c): the key each head would decompress. GQA rotates the
        first `rope` dims of each head (interleaved pairs, as deepseek2's RoPE). The attention output
        per head is then mapped by Wv_h (latent_values)."""
        t, hp, p = self.tape, self.hp, f"blk.{layer}"
        n, k_head, _, rope, nope = latent_dims(hp)
        rank = hp["kv_lora_rank"]
        if hp["q_lora_rank"]:
            q = self.linear(h, self.tensor("attn_q_a", layer), f"{p}.attn_q_a")
            q = self.rms_norm(q, self.tensor("attn_q_a_norm", layer), f"{p}.attn_q_a_norm")
            q = self.linear(q, self.tensor("attn_q_b", layer), f"{p}.attn_q_b")
        else:
            q = self.linear(h, self.tensor("attn_q", layer), f"{p}.attn_q")
        heads = t.op("Reshape", [q, self.ints(0, 0, n, k_head)], name=f"{p}.attn_q.split_heads")
        q_nope = t.op("Slice", [heads, self.ints(0), self.ints(nope), self.ints(3)], name=f"{p}.attn_q.nope")
        q_pe = t.op("Slice", [heads, self.ints(nope), self.ints(k_head), self.ints(3)], name=f"{p}.attn_q.pe")
        per_head = t.op("Transpose", [q_nope], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_q.heads_first")
        absorbed = t.op("MatMul", [per_head, self.latent_matrix(layer, "k")], name=f"{p}.attn_q.absorb")
        absorbed = t.op("Transpose", [absorbed], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_q.tokens_first")
        q = t.op("Reshape", [t.op("Concat", [q_pe, absorbed], {"axis": 3}, name=f"{p}.attn_q.concat"),
                             self.ints(0, 0, n * (rope + rank))], name=f"{p}.attn_q.merge_heads")
        kv = self.linear(h, self.tensor("attn_kv_a_mqa", layer), f"{p}.attn_kv_a_mqa")
        compressed = t.op("Slice", [kv, self.ints(0), self.ints(rank), self.ints(2)], name=f"{p}.attn_kv.compressed")
        k_pe = t.op("Slice", [kv, self.ints(rank), self.ints(rank + rope), self.ints(2)], name=f"{p}.attn_kv.k_pe")
        compressed = self.rms_norm(compressed, self.tensor("attn_kv_a_norm", layer), f"{p}.attn_kv_a_norm")
        k = t.op("Concat", [k_pe, compressed], {"axis": 2}, name=f"{p}.attn_k")
        v = t.op("Pad", [compressed, self.ints(0, 0, 0, 0, 0, rope)], name=f"{p}.attn_v")
        return q, k, v

    def latent_values(self, attn: ir.Value, layer: int) -> ir.Value:
        """GQA's output per head ([weighted c | 0]) -> the heads' values: c' @ Wv_h, [B, S, n * v_head]."""
        t, hp, p = self.tape, self.hp, f"blk.{layer}"
        n, _, v_head, rope, _ = latent_dims(hp)
        rank = hp["kv_lora_rank"]
        heads = t.op("Reshape", [attn, self.ints(0, 0, n, rope + rank)], name=f"{p}.attn_out.split_heads")
        latent = t.op("Slice", [heads, self.ints(0), self.ints(rank), self.ints(3)], name=f"{p}.attn_out.latent")
        latent = t.op("Transpose", [latent], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_out.heads_first")
        values = t.op("MatMul", [latent, self.latent_matrix(layer, "v")], name=f"{p}.attn_out.decompress")
        values = t.op("Transpose", [values], {"perm": [0, 2, 1, 3]}, name=f"{p}.attn_out.tokens_first")
        return t.op("Reshape", [values, self.ints(0, 0, n * v_head)], name=f"{p}.attn_out.merge_heads")

    def latent_matrix(self, layer: int, which: str) -> ir.Value:
        """Per-head decompression matrices as float: "k" -> Wk [n, nope, rank] (q_nope to the latent
        space), "v" -> Wv [n, rank, v_head]; from attn_k_b / attn_v_b, or split from an older file's
        attn_kv_b ([n * (nope + v_head), rank])."""
        hp = self.hp
        n, _, v_head, _, nope = latent_dims(hp)
        rank = hp["kv_lora_rank"]
        absorbed = bool(hp["k_head_mla"])
        src = self.tensor(f"attn_{which}_b" if absorbed else "attn_kv_b", layer)
        shape = (n, nope, rank) if which == "k" else (n, rank, v_head)

        def make() -> np.ndarray:
            values = dequantize(src.read_rows(), src.ggml_type)
            if absorbed:  # attn_k_b [n, rank, nope], attn_v_b [n, v_head, rank]
                return values.reshape(src.shape).transpose(0, 2, 1)
            kv = values.reshape(n, nope + v_head, rank)
            return kv[:, :nope, :] if which == "k" else kv[:, nope:, :].transpose(0, 2, 1)

        return self.lazy_initializer(f"blk.{layer}.attn_{which}_b.latent", self.act, shape, make)

    def expert_bias(self, name: str, sources: list[GGUFTensor]) -> ir.Value:
        """Per-expert biases [E, N] of one or two sources as [E, N * len(sources)] (gate and up
        interleaved, as the fc1 rows are), in the activation type."""
        e, n = sources[0].shape

        def make() -> np.ndarray:
            values = [dequantize(s.read_rows(), s.ggml_type).reshape(e, n) for s in sources]
            return np.stack(values, axis=-1).reshape(e, n * len(sources))

        return self.lazy_initializer(name, self.act, (e, n * len(sources)), make)

    def float_experts(self, name: str, sources: list[GGUFTensor]) -> ir.Value:
        return self.tape.initializer(float_expert_stack(sources, name, self.report, self.act), name=name)


# ---- recipes ----------------------------------------------------------------------------------------

def moe_decoder(b: GraphBuilder) -> ir.Graph:
    """Pre-norm decoder: RMSNorm -> GQA (q/k norm, RoPE) -> residual -> RMSNorm -> MoE (+ shared
    expert) -> residual; final RMSNorm and LM head (tied to the embedding when output.weight is absent).

    What differs between architectures comes from `b.arch.features` (see moepass.core.architectures).
    """
    hp, t, feats = b.hp, b.tape, b.arch.features
    nh, nkv, d = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
    latent = feats.mla
    rot = d  # rotary dimensions at the start of each GQA head
    if latent:  # GQA over the compressed cache: one KV head of [k_pe | c] (see latent_attention)
        nkv, d, rot = 1, hp["kv_lora_rank"] + hp["rope_dim"], hp["rope_dim"]
    multipliers = feats.multipliers
    act_type = ir.TensorType(b.act)  # float32, or float16 for the offload format
    input_ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64),
                         shape=ir.Shape(["batch_size", "sequence_length"]))
    mask = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape(["batch_size", "total_sequence_length"]))
    inputs, outputs = [input_ids, mask], []

    # GroupQueryAttention takes the cache length per sequence (seqlens_k = tokens - 1) and the total length.
    one = b.const("const.i64.one", np.array(1, np.int64))
    tokens = t.op("ReduceSum", [mask, b.ints(1)], {"keepdims": 0}, name="attn_mask.reduce_sum")
    seqlens_k = t.op("Cast", [t.op("Sub", [tokens, one])], {"to": ir.DataType.INT32}, name="attn_mask.seqlens_k")
    total_len = t.op("Cast", [t.op("Gather", [t.op("Shape", [mask]), one], {"axis": 0})],
                     {"to": ir.DataType.INT32}, name="attn_mask.total_seq_len")
    n_pos = hp["context_length"]
    if hp["value_dim"] != hp["head_dim"] and not latent:
        raise MoepassError(f"{b.gguf.path}: value head size {hp['value_dim']} differs from key head size {d}; "
                           "GroupQueryAttention needs them equal")
    rope = Rope(**hp["rope"])
    tables = functools.cache(lambda: rope_cache(n_pos, rot, rope))  # cos and sin from one pass
    cos = b.lazy_initializer("rope.cos_cache", b.act, (n_pos, rot // 2), lambda: tables()[0])
    sin = b.lazy_initializer("rope.sin_cache", b.act, (n_pos, rot // 2), lambda: tables()[1])
    attention_scale = hp["attention_scale"] if multipliers and hp["attention_scale"] else 1.0 / np.sqrt(d)
    if latent:  # llama.cpp's deepseek2: mscale^2 / sqrt(key head), mscale from YaRN's log multiplier
        attention_scale = rope.latent_attention_mscale() ** 2 / np.sqrt(latent_dims(hp)[1])
    residual_scale = hp["residual_scale"] if multipliers else 0.0

    def residual_branch(value: ir.Value, name: str) -> ir.Value:
        return b.scale(value, residual_scale, f"{name}.residual_scale") if residual_scale else value

    x = b.embedding(input_ids)
    if multipliers and hp["embedding_scale"]:
        x = b.scale(x, hp["embedding_scale"], "embed_tokens.scale")
    for i in range(hp["n_layers"]):
        h = b.rms_norm(x, b.tensor("attn_norm", i), f"blk.{i}.attn_norm", b.optional("attn_norm_bias", i))
        if latent:
            q, k, v = b.latent_qkv(h, i)
        else:
            q, k, v = (b.linear(h, b.tensor(f"attn_{p}", i), f"blk.{i}.attn_{p}", bias=b.optional(f"attn_{p}_bias", i))
                       for p in "qkv")
        if feats.qk_norm == "head":
            q = b.per_head_rms_norm(q, b.tensor("attn_q_norm", i), nh, f"blk.{i}.attn_q_norm")
            k = b.per_head_rms_norm(k, b.tensor("attn_k_norm", i), nkv, f"blk.{i}.attn_k_norm")
        elif feats.qk_norm == "full":
            q = b.rms_norm(q, b.tensor("attn_q_norm", i), f"blk.{i}.attn_q_norm")
            k = b.rms_norm(k, b.tensor("attn_k_norm", i), f"blk.{i}.attn_k_norm")
        past = []
        for kind in ("key", "value"):
            past.append(ir.Value(name=f"past_key_values.{i}.{kind}", type=act_type,
                                 shape=ir.Shape(["batch_size", nkv, "past_sequence_length", d])))
        inputs += past
        attn_inputs = [q, k, v, past[0], past[1], seqlens_k, total_len, cos, sin]
        attn_attrs = {"num_heads": nh, "kv_num_heads": nkv, "do_rotary": 1,
                      "rotary_interleaved": int(feats.rope == "norm"), "scale": float(attention_scale)}
        if feats.attention_sinks:  # head_sink (input 11): one logit per head in every softmax
            attn_inputs += [None, None, b.float_weight(b.arch.tensor_name("attn_sinks", i), b.tensor("attn_sinks", i))]
        if i in hp["sliding_window_layers"]:
            # ORT attends to the last local_window_size keys (the query's own included), as llama.cpp's
            # n_swa (a key p0 is masked for query p1 when p1 - p0 >= n_swa): measured equal.
            attn_attrs["local_window_size"] = hp["sliding_window"]
        attn, present_k, present_v = t.op_multi_out("GroupQueryAttention", attn_inputs, attn_attrs, num_outputs=3,
                                                    domain="com.microsoft", name=f"blk.{i}.attn")
        for value, kind in ((present_k, "key"), (present_v, "value")):
            value.name = f"present.{i}.{kind}"
            value.type = act_type
            value.shape = ir.Shape(["batch_size", nkv, "total_sequence_length", d])
        outputs += [present_k, present_v]
        if latent:
            attn = b.latent_values(attn, i)
        attn = b.linear(attn, b.tensor("attn_output", i), f"blk.{i}.attn_output", bias=b.optional("attn_output_bias", i))
        x = t.op("Add", [x, residual_branch(attn, f"blk.{i}.attn")], name=f"blk.{i}.attn_residual")
        h = b.rms_norm(x, b.tensor(feats.ffn_norm, i), f"blk.{i}.ffn_norm",
                       b.optional("ffn_norm_bias", i))
        h2d = t.op("Reshape", [h, b.ints(-1, hp["hidden"])], name=f"blk.{i}.moe.flatten")
        if b.arch.is_dense(i, hp):
            ffn = b.gated_mlp(h2d, DENSE_FFN, i, f"blk.{i}.ffn")
        else:
            ffn = b.moe(h2d, i, hp["hidden"])
            if feats.shared_expert and hp["shared_ff"]:
                ffn = t.op("Add", [ffn, b.shared_expert(h2d, i)], name=f"blk.{i}.shared_expert.add")
        ffn = t.op("Reshape", [ffn, t.op("Shape", [x], name=f"blk.{i}.moe.shape")], name=f"blk.{i}.moe.unflatten")
        x = t.op("Add", [x, residual_branch(ffn, f"blk.{i}.moe")], name=f"blk.{i}.moe_residual")

    h = b.rms_norm(x, b.tensor("output_norm"), "output_norm", b.optional("output_norm_bias"))
    # logits for the last `logits_to_keep` positions only (0, the default: every position). During
    # generation only the last position's logits are used, and the LM head over a large vocabulary
    # is a large share of a prefill: the runtime feeds 1, as llama.cpp computes only what it returns.
    keep = t.initializer(ir.Tensor(np.array([0], dtype=np.int64), name=LOGITS_TO_KEEP), name=LOGITS_TO_KEEP)
    inputs.append(keep)
    start = t.op("Neg", [keep], name="logits_to_keep.start")
    h = t.op("Slice", [h, start, b.ints(np.iinfo(np.int64).max), b.ints(1)], name="logits_to_keep.slice")
    tied = not b.arch.has_tensor(b.gguf, "output")
    head = b.tensor("token_embd") if tied else b.tensor("output")
    logits = b.linear(h, head, "lm_head", weight_name="lm_head.weight" if tied else None, bias=b.optional("output_bias"))
    if multipliers:
        logits = b.scale(logits, 1.0 / hp["logit_scale"], "lm_head.logit_scale")
    logits.name = "logits"
    logits.type = act_type
    logits.shape = ir.Shape(["batch_size", "logits_sequence_length", hp["vocab"]])
    return ir.Graph(inputs, [logits] + outputs, nodes=t.nodes, initializers=t.initializers,
                    opset_imports=dict(OPSETS), name=f"moepass_{b.arch.gguf_arch}")


RECIPES: dict[str, Callable[[GraphBuilder], ir.Graph]] = {"moe_decoder": moe_decoder}


# The RoPE tables hold context x rotary dims floats. Larger than the whole file and than this, the
# context length is more likely corrupt than meant; --context then sets the positions wanted.
ROPE_TABLES_PLAUSIBLE = 64 << 20


def _check_rope_tables(gguf: GGUFModel, arch: Architecture, hp: dict[str, Any]) -> None:
    rotary = hp["rope_dim"] if arch.features.mla else hp["head_dim"]
    table_bytes = hp["context_length"] * rotary * 4  # cos and sin, rotary/2 float32 each
    if table_bytes > ROPE_TABLES_PLAUSIBLE and table_bytes > gguf.file_bytes:
        raise MoepassError(f"{gguf.path}: metadata key '{arch.gguf_arch}.context_length' is {hp['context_length']:,}: "
                           f"its RoPE tables would take {table_bytes / 2**30:.1f} GiB, more than the whole model "
                           f"({gguf.file_bytes / 2**30:.2f} GiB); convert with --context N for the positions you need")


@dataclasses.dataclass
class Lowered:
    model: ir.Model
    report: WeightReport
    hparams: dict[str, Any]
    moe_layers: list[dict[str, Any]]


def lower_gguf(gguf: GGUFModel, arch: Architecture, options: LowerOptions = LowerOptions()) -> Lowered:
    """Build the ONNX decoder (as an onnx-ir model with lazy weights) for a GGUF model."""
    if options.float_experts not in FLOAT_EXPERT_CHOICES:
        raise MoepassError(f"float_experts must be one of {', '.join(FLOAT_EXPERT_CHOICES)}, "
                           f"not {options.float_experts!r}")
    if options.expert_format not in EXPERT_FORMATS:
        raise MoepassError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, not {options.expert_format!r}")
    b = GraphBuilder(gguf, arch, options)
    arch.check_tensors(gguf, b.hp)  # every tensor present and of the right shape, before any work is done
    if options.context is not None:  # the RoPE tables' length; RoPE itself keeps the GGUF's parameters
        if not 0 < options.context <= MAX_CONTEXT:
            raise MoepassError(f"--context {options.context} must be between 1 and {MAX_CONTEXT}")
        b.hp["context_length"] = options.context
    else:
        _check_rope_tables(gguf, arch, b.hp)
    graph = RECIPES[arch.recipe](b)
    model = ir.Model(graph, ir_version=IR_VERSION, producer_name="moepass", producer_version=__version__,
                     metadata_props={
                         keys.VERSION: __version__,
                         keys.ARCHITECTURE: arch.gguf_arch,
                         keys.SOURCE: gguf.path.name,
                         keys.MOE_LAYERS: str(len(b.moe_layers)),
                         keys.FEATURES: json.dumps(arch.describe(gguf, b.hp), sort_keys=True),
                     })
    return Lowered(model, b.report, b.hp, b.moe_layers)
