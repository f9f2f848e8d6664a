"""Feed-forward blocks: a MoE layer as one QMoE / MoE node, the shared expert, the dense FFN."""

from __future__ import annotations

import onnx_ir as ir

from moepass.core import keys
from moepass.core.architectures import ACTIVATIONS, DENSE_FFN, SHARED_EXPERT
from moepass.core.errors import MoepassError, wording
from moepass.core.moe_nodes import (
    NATIVE_DOMAIN,
    ExpertCodes,
    Experts,
    PackedExperts,
    Router,
    moe_node,
    packed_moe_node,
)
from moepass.core.quants import (
    NATIVE_TYPES,
    OFFLOAD_FORM,
    ExpertForms,
    expert_form,
    quant_type,
    requantize_form,
    scales_in_float16,
)
from moepass.passes.lower.block_sums import measured_levels, narrow, widen
from moepass.passes.lower.experts import expert_tensors
from moepass.passes.lower.graph_builder import GraphBuilder
from moepass.passes.lower.routing import renormalizes, router_input
from moepass.passes.weights.packing import PackOptions


def feed_forward(builder: GraphBuilder, x2d: ir.Value, layer: int) -> ir.Value:
    """The block's FFN on tokens [T, hidden]: the dense FFN of a leading dense block (deepseek2),
    else the MoE layer plus the shared expert when the architecture has one."""
    if builder.arch.is_dense(layer, builder.hp):
        return gated_mlp(builder, x2d, DENSE_FFN, layer, f"blk.{layer}.ffn")
    out = moe(builder, x2d, layer, builder.hp.hidden)
    if builder.arch.features.shared_expert and builder.hp.shared_ff:
        out = builder.tape.op("Add", [out, shared_expert(builder, x2d, layer)], name=f"blk.{layer}.shared_expert.add")
    return out


def moe(builder: GraphBuilder, x2d: ir.Value, layer: int, hidden_out: int) -> ir.Value:
    """One MoE layer as a single QMoE node (or MoE, for float experts kept as float).

    Routing: the node gets the router logits (with the router's bias, if any) and does softmax,
    top-k and renormalization over the k itself: for "softmax_topk_renorm", and for
    "topk_softmax" (softmax over the k selected logits, the same weights). For "softmax_topk"
    (weights not renormalized) a QMoE node also gets softmax(logits) as router_weights with
    normalize_routing_weights=0, because ORT's CPU QMoE renormalizes unless given the weights
    (the selection still follows the logits: the same order); the float MoE kernel honours
    normalize_routing_weights=0 by itself. Expert biases go to fc1_bias (gate and up
    interleaved like the weights) and fc2_bias."""
    hp, feats = builder.hp, builder.arch.features
    router, weight_sum = router_input(builder, x2d, layer)
    gate, up, down = (builder.tensor(r, layer) for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    types = [quant_type(t.ggml_type, t.name, t.path) for t in (gate, up, down)]
    name = f"blk.{layer}.moe"
    hidden_in = gate.shape[-1]

    def node(fc1: Experts, fc2: Experts, hidden: ir.Value = x2d, codes: ExpertCodes | None = None) -> ir.Value:
        return moe_node(
            builder.tape.op,
            name,
            hidden,
            Router(router, hp.n_experts_used, renormalizes(feats)),
            fc1,
            fc2,
            activation=ACTIVATIONS[feats.activation],
            codes=codes,
        )

    floats = [qt.storage == "float" for qt in types]
    prefix = f"blk.{layer}.ffn_experts"

    def fc1_bias() -> ir.Value | None:
        return _expert_bias(builder, f"{prefix}.fc1_bias", ("gate", "up"), layer)

    def fc2_bias(pad: int = 0) -> ir.Value | None:
        return _expert_bias(builder, f"{prefix}.fc2_bias", ("down",), layer, pad)

    pad = 0
    choice = builder.options.expert_format
    if not any(floats) and (choice == "packed" or builder.native(types)):
        out = _packed(builder, name, x2d, router, (gate, up, down), types, renormalizes(feats), layer)
        form_name = f"{'packed' if choice == 'packed' else 'native'} " + "/".join(qt.name for qt in types)
    elif all(floats) and builder.options.float_experts == "keep":
        fc1 = builder.float_experts(f"{prefix}.fc1", [gate, up])
        fc2 = builder.float_experts(f"{prefix}.fc2", [down])
        out = node(Experts(fc1, bias=fc1_bias()), Experts(fc2, bias=fc2_bias()))
        form_name = "float32"
    else:
        if any(floats) and builder.options.float_experts == "keep":
            t = (gate, up, down)[floats.index(True)]
            raise MoepassError(
                f"{t.path}: expert tensor '{t.name}' is {t.type_name} while the other experts of layer "
                f"{layer} are quantized; pass {wording().option('--float-experts', 'int8')} (or int4) to quantize it"
            )
        ks = [gate.shape[-1], down.shape[-1]]
        if all(floats):
            forms = ExpertForms(requantize_form(8 if builder.options.float_experts == "int8" else 4, ks))
        else:
            qmoe = "auto" if choice in ("auto", "qmoe", "native") else choice  # expert_form's own "auto"
            forms = expert_form(types, ks, qmoe, builder.options.exact)
        node_form = forms.node
        # scales of the activation type but where float16 holds no more in memory (blocks of 128:
        # quants.scales_in_float16); block-sum features round theirs to float16 (--exact: float32)
        half = builder.offload or (scales_in_float16(types, node_form) if not forms.sums else not builder.options.exact)
        scales = ir.DataType.FLOAT16 if half else ir.DataType.FLOAT
        levels = 0
        if forms.sums:
            levels = measured_levels(list(zip((gate, up), types[:2])), node_form, half, builder.options.exact)
        fc1_form = forms.fc1(levels)
        prepack = builder.offload and node_form == OFFLOAD_FORM
        try:
            tensors = expert_tensors(
                name,
                prefix,
                builder.gguf_rows([gate, up]),
                builder.gguf_rows([down]),
                fc1_form,
                builder.report,
                PackOptions(scale_dtype=scales, prepack=prepack, workers=builder.options.threads),
            )
        except MoepassError as e:
            offload = wording().option("--expert-format", "offload")
            raise MoepassError(f"{e}; convert without {offload}" if prepack else str(e)) from None
        pad = tensors.pad
        fc1_w, fc1_s = builder.group_initializers(tensors.fc1)
        fc2_w, fc2_s = builder.group_initializers(tensors.fc2)
        widened = widen(builder.tape.op, builder.const, x2d, hidden_in, fc1_form, name) if pad else x2d
        out = node(
            Experts(fc1_w, fc1_s, bias=fc1_bias()),
            Experts(fc2_w, fc2_s, bias=fc2_bias(pad)),
            hidden=widened,
            codes=ExpertCodes(node_form.bits, node_form.block_size, prepack),
        )
        form_name = str(fc1_form)
    out.name = f"{name}.output"
    out.dtype = builder.act
    out.shape = ir.Shape(["tokens", hidden_out + pad])
    moe = out.producer()
    if moe is None:
        raise ValueError(f"{name}: the MoE output has no node")
    moe.metadata_props.update(
        {
            keys.LAYER: str(layer),
            keys.EXPERT_FORM: form_name,
            keys.SOURCE_TYPES: ",".join(qt.name for qt in types),
        }
    )
    builder.moe_layers.append(
        {
            "layer": layer,
            "node": name,
            "experts": hp.n_experts,
            "top_k": hp.n_experts_used,
            "form": form_name,
            "source_types": [qt.name for qt in types],
        }
    )
    if pad:  # the features' columns of the widened output dropped
        out = narrow(builder.tape.op, builder.const, out, hidden_out, name)
    if weight_sum is not None:  # the node renormalized weights that the model leaves as they are
        out = builder.tape.op("Mul", [out, weight_sum], name=f"{name}.weights_unnormalize")
    if hp.expert_weights_scale not in (0.0, 1.0):  # llama.cpp scales the routing weights
        out = builder.scale(out, hp.expert_weights_scale, f"{name}.weights_scale")
    return out


def _expert_bias(builder: GraphBuilder, name: str, roles: tuple[str, ...], layer: int, pad: int = 0) -> ir.Value | None:
    """The experts' biases of these roles (graph_builder.expert_bias), None for a model without them."""
    if not builder.arch.features.expert_biases:
        return None
    return builder.expert_bias(name, [builder.tensor(f"ffn_{role}_exps_bias", layer) for role in roles], pad=pad)


def _packed(
    builder: GraphBuilder, name: str, x2d: ir.Value, router: ir.Value, sources, types, normalize: bool, layer: int
):
    """A MoE layer as MoEPacked over the GGUF's own gate, up and down blocks (--expert-format packed:
    ONNX Runtime's, CUDA only, which has no input for expert biases or a clamped or shifted SwiGLU and
    refuses them; native: moepass's, run on the CPU by moepass.cpu_ops, for the types its kernels take,
    with gpt-oss's biases and SwiGLU)."""
    feats = builder.arch.features
    activation = ACTIVATIONS[feats.activation]
    expert_format = builder.options.expert_format
    native = expert_format != "packed"
    plain = not feats.expert_biases and (activation.alpha, activation.beta, activation.limit) == (1.0, 0.0, None)
    if not native and not plain:
        raise MoepassError(
            f"{name}: {wording().option('--expert-format', expert_format)}: MoEPacked has no expert biases and "
            f"computes the plain SwiGLU; this {builder.arch.gguf_arch} model's experts need them (convert with "
            f"{wording().option('--expert-format', 'offload')})"
        )
    untaken = [qt.name for qt in types if qt.name not in NATIVE_TYPES]
    if native and untaken:
        raise MoepassError(
            f"{name}: {wording().option('--expert-format', 'native')}: moepass's CPU kernels take "
            f"{', '.join(NATIVE_TYPES)} experts, not {', '.join(dict.fromkeys(untaken))} (convert with "
            f"{wording().option('--expert-format', 'auto')}, which gives those layers the qmoe form)"
        )
    prefix = f"{name.removesuffix('.moe')}.ffn_experts"
    gate, up, down = (
        builder.gguf_blob(f"{prefix}.{role}", src, grouped=native) for role, src in zip(("gate", "up", "down"), sources)
    )
    ids = (int(types[0].ggml_type), int(types[1].ggml_type), int(types[2].ggml_type))
    routing = Router(router, builder.hp.n_experts_used, normalize)
    if not native:
        return packed_moe_node(builder.tape.op, name, x2d, routing, PackedExperts((gate, up, down), ids))
    biases = [_expert_bias(builder, f"{prefix}.{role}_bias", (role,), layer) for role in ("gate", "up", "down")]
    experts = PackedExperts((gate, up, down), ids, None if None in biases else tuple(biases))  # type: ignore[arg-type]
    return packed_moe_node(builder.tape.op, name, x2d, routing, experts, domain=NATIVE_DOMAIN, activation=activation)


def gated_mlp(builder: GraphBuilder, x2d: ir.Value, roles: tuple[str, str, str], layer: int, prefix: str) -> ir.Value:
    """down(silu(gate(x)) * up(x)) of the (gate, up, down) tensor roles of one block."""
    t = builder.tape
    gate = builder.linear(x2d, builder.tensor(roles[0], layer), f"{prefix}.gate")
    up = builder.linear(x2d, builder.tensor(roles[1], layer), f"{prefix}.up")
    act = t.op(
        "Mul",
        [t.op("Mul", [gate, t.op("Sigmoid", [gate], name=f"{prefix}.sigmoid")], name=f"{prefix}.silu"), up],
        name=f"{prefix}.swiglu",
    )
    return builder.linear(act, builder.tensor(roles[2], layer), f"{prefix}.down")


def shared_expert(builder: GraphBuilder, x2d: ir.Value, layer: int) -> ir.Value:
    """The dense shared expert, times sigmoid(x . g) when gated (qwen2moe)."""
    t, p = builder.tape, f"blk.{layer}.shared_expert"
    out = gated_mlp(builder, x2d, SHARED_EXPERT, layer, p)
    kind = builder.arch.features.shared_expert_style
    if kind is None or not kind.sigmoid_gated:
        return out
    g = builder.tensor("ffn_gate_inp_shexp", layer)
    weight = builder.float_weight(g.name, g)
    logit = t.op(
        "MatMul",
        [x2d, t.op("Unsqueeze", [weight, builder.ints(-1)], name=f"{p}.gate_inp.column")],
        name=f"{p}.gate_inp",
    )
    return t.op("Mul", [out, t.op("Sigmoid", [logit], name=f"{p}.gate_sigmoid")], name=f"{p}.gated")
