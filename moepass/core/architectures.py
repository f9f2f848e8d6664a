"""The one table of per-architecture facts: GGUF metadata keys, tensor names, graph recipe.

An entry says which hyperparameters an architecture reads (and their GGUF keys), which tensors
its blocks must carry and which it uses when present, which recipe of `moepass.passes.lower`
builds its graph, and the feature switches that recipe reads for what differs between
architectures. Adding an architecture is a new entry here, plus recipe code only for what is new.

Tensor names follow llama.cpp's GGUF naming, which all its architectures share. The facts were
read from llama.cpp's own model code (the version llama-cpp-python 0.3.36 builds), which the tests
use as the oracle.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from moepass.core.choices import MAX_CONTEXT
from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import GGUFModel, SourceTensor
from moepass.core.moe_nodes import SWIGLU, Activation
from moepass.core.rope import Rope

_REQUIRED = object()
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class HParam:
    """A hyperparameter: its GGUF key (`{arch}` is replaced by the architecture) and default."""

    key: str
    default: Any = _REQUIRED
    kind: type = int
    # what a sane value is, in code and in words; integers default to [0, 2^24)
    valid: tuple[Callable[[Any], bool], str] | None = None

    def check(self, value: Any) -> str | None:
        """None when `value` is sane, else what a sane value is."""
        test, words = self.valid or (
            (lambda v: 0 <= v < _INT_LIMIT, f"between 0 and {_INT_LIMIT - 1}")
            if self.kind is int
            else (lambda v: True, "")
        )
        return None if test(value) else words


_INT_LIMIT = 1 << 24  # integer hyperparameters (counts, sizes) stay below this


# Hyperparameters of decoder MoE models; an architecture lists the ones it reads.
HPARAMS: dict[str, HParam] = {
    "n_layers": HParam(Keys.LLM.BLOCK_COUNT),
    "hidden": HParam(Keys.LLM.EMBEDDING_LENGTH),
    "context_length": HParam(
        Keys.LLM.CONTEXT_LENGTH, valid=(lambda v: 0 < v <= MAX_CONTEXT, f"between 1 and {MAX_CONTEXT}")
    ),
    "n_heads": HParam(Keys.Attention.HEAD_COUNT),
    "n_kv_heads": HParam(Keys.Attention.HEAD_COUNT_KV, None),
    "head_dim": HParam(Keys.Attention.KEY_LENGTH, None),
    "value_dim": HParam(Keys.Attention.VALUE_LENGTH, None),
    "rms_eps": HParam(
        Keys.Attention.LAYERNORM_RMS_EPS, kind=float, valid=(lambda v: 0 <= v < 1, "at least 0 and below 1")
    ),
    "rope_base": HParam(Keys.Rope.FREQ_BASE, 10000.0, kind=float, valid=(lambda v: v >= 1, "at least 1")),
    "n_experts": HParam(Keys.LLM.EXPERT_COUNT),
    "n_experts_used": HParam(Keys.LLM.EXPERT_USED_COUNT),
    "expert_ff": HParam(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
    "ffn": HParam(Keys.LLM.FEED_FORWARD_LENGTH),
    "shared_ff": HParam(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
    "expert_weights_scale": HParam(
        Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0, kind=float, valid=(lambda v: v >= 0, "at least 0")
    ),
    # granite multipliers (0 = not used, as llama.cpp treats them)
    "logit_scale": HParam(Keys.LLM.LOGIT_SCALE, kind=float),
    "residual_scale": HParam(Keys.LLM.RESIDUAL_SCALE, 0.0, kind=float),
    "embedding_scale": HParam(Keys.LLM.EMBEDDING_SCALE, 0.0, kind=float),
    "attention_scale": HParam(Keys.Attention.SCALE, 0.0, kind=float),
    "sliding_window": HParam(Keys.Attention.SLIDING_WINDOW, 0),
    # multi-head latent attention (deepseek2); key/value_length_mla absent: the older kv_b files
    "q_lora_rank": HParam(Keys.Attention.Q_LORA_RANK, 0),
    "kv_lora_rank": HParam(Keys.Attention.KV_LORA_RANK),
    "k_head_mla": HParam(Keys.Attention.KEY_LENGTH_MLA, 0),
    "v_head_mla": HParam(Keys.Attention.VALUE_LENGTH_MLA, 0),
    "rope_dim": HParam(Keys.Rope.DIMENSION_COUNT),
    "leading_dense": HParam(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
    "n_shared_experts": HParam(Keys.LLM.EXPERT_SHARED_COUNT, 0),
    # deepseek2 routing: 1 softmax, 2 sigmoid (0: absent, softmax as llama.cpp assumes)
    "gating_func": HParam(Keys.LLM.EXPERT_GATING_FUNC, 0),
    "expert_weights_norm": HParam(Keys.LLM.EXPERT_WEIGHTS_NORM, False, kind=bool),
    "n_expert_groups": HParam(Keys.LLM.EXPERT_GROUP_COUNT, 0),
    "n_group_used": HParam(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0),
}


@dataclasses.dataclass(frozen=True)
class HParams:
    """A model's hyperparameters: those its architecture reads (HPARAMS; the others keep their
    defaults) and what moepass derives from them."""

    n_layers: int
    hidden: int
    context_length: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    rms_eps: float
    rope_base: float
    n_experts: int
    n_experts_used: int
    expert_ff: int  # the routed experts' width (from expert_ff or ffn: Architecture.expert_ff_from)
    vocab: int  # rows of token_embd
    expert_weights_scale: float = 0.0
    ffn: int = 0
    shared_ff: int = 0
    logit_scale: float = 0.0
    residual_scale: float = 0.0
    embedding_scale: float = 0.0
    attention_scale: float = 0.0
    sliding_window: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    k_head_mla: int = 0
    v_head_mla: int = 0
    rope_dim: int = 0
    leading_dense: int = 0
    n_shared_experts: int = 0
    gating_func: int = 0
    expert_weights_norm: bool = False
    n_expert_groups: int = 0
    n_group_used: int = 0
    rope: Rope | None = None  # as llama.cpp derives it (read_rope)
    sliding_window_layers: tuple[int, ...] = ()
    read: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)  # the names set from the file

    def as_dict(self) -> dict[str, Any]:
        """What was read and derived, JSON-friendly (moepass.json, inspect --json)."""
        values = {name: getattr(self, name) for name in self.read}
        values.update(
            vocab=self.vocab,
            rope=dataclasses.asdict(self.rope) if self.rope else None,
            sliding_window_layers=list(self.sliding_window_layers),
        )
        return values


assert set(HPARAMS) <= {f.name for f in dataclasses.fields(HParams)}, "every HPARAMS entry is an HParams field"


# Tensor roles -> GGUF names, from gguf's own (MODEL_TENSOR, TENSOR_NAMES) and the suffix; `{i}` is
# the block index
TENSORS: dict[str, str] = {
    role: TENSOR_NAMES[tensor].replace("{bid}", "{i}") + "." + suffix
    for role, (tensor, suffix) in {
        "token_embd": (MODEL_TENSOR.TOKEN_EMBD, "weight"),
        "output_norm": (MODEL_TENSOR.OUTPUT_NORM, "weight"),
        "output_norm_bias": (MODEL_TENSOR.OUTPUT_NORM, "bias"),
        "output": (MODEL_TENSOR.OUTPUT, "weight"),
        "output_bias": (MODEL_TENSOR.OUTPUT, "bias"),
        "attn_norm": (MODEL_TENSOR.ATTN_NORM, "weight"),
        "attn_norm_bias": (MODEL_TENSOR.ATTN_NORM, "bias"),
        "attn_q": (MODEL_TENSOR.ATTN_Q, "weight"),
        "attn_k": (MODEL_TENSOR.ATTN_K, "weight"),
        "attn_v": (MODEL_TENSOR.ATTN_V, "weight"),
        "attn_q_bias": (MODEL_TENSOR.ATTN_Q, "bias"),
        "attn_k_bias": (MODEL_TENSOR.ATTN_K, "bias"),
        "attn_v_bias": (MODEL_TENSOR.ATTN_V, "bias"),
        "attn_output": (MODEL_TENSOR.ATTN_OUT, "weight"),
        "attn_output_bias": (MODEL_TENSOR.ATTN_OUT, "bias"),
        "attn_q_norm": (MODEL_TENSOR.ATTN_Q_NORM, "weight"),
        "attn_k_norm": (MODEL_TENSOR.ATTN_K_NORM, "weight"),
        "ffn_norm": (MODEL_TENSOR.FFN_NORM, "weight"),
        "ffn_norm_bias": (MODEL_TENSOR.FFN_NORM, "bias"),
        "ffn_gate_inp": (MODEL_TENSOR.FFN_GATE_INP, "weight"),
        "ffn_gate_exps": (MODEL_TENSOR.FFN_GATE_EXP, "weight"),
        "ffn_up_exps": (MODEL_TENSOR.FFN_UP_EXP, "weight"),
        "ffn_down_exps": (MODEL_TENSOR.FFN_DOWN_EXP, "weight"),
        "ffn_gate_inp_shexp": (MODEL_TENSOR.FFN_GATE_INP_SHEXP, "weight"),
        "ffn_gate_shexp": (MODEL_TENSOR.FFN_GATE_SHEXP, "weight"),
        "ffn_up_shexp": (MODEL_TENSOR.FFN_UP_SHEXP, "weight"),
        "ffn_down_shexp": (MODEL_TENSOR.FFN_DOWN_SHEXP, "weight"),
        "attn_post_norm": (MODEL_TENSOR.ATTN_POST_NORM, "weight"),
        "attn_sinks": (MODEL_TENSOR.ATTN_SINKS, "weight"),
        "ffn_gate_inp_bias": (MODEL_TENSOR.FFN_GATE_INP, "bias"),
        "ffn_gate_exps_bias": (MODEL_TENSOR.FFN_GATE_EXP, "bias"),
        "ffn_up_exps_bias": (MODEL_TENSOR.FFN_UP_EXP, "bias"),
        "ffn_down_exps_bias": (MODEL_TENSOR.FFN_DOWN_EXP, "bias"),
        "attn_q_a": (MODEL_TENSOR.ATTN_Q_A, "weight"),
        "attn_q_a_norm": (MODEL_TENSOR.ATTN_Q_A_NORM, "weight"),
        "attn_q_b": (MODEL_TENSOR.ATTN_Q_B, "weight"),
        "attn_kv_a_mqa": (MODEL_TENSOR.ATTN_KV_A_MQA, "weight"),
        "attn_kv_a_norm": (MODEL_TENSOR.ATTN_KV_A_NORM, "weight"),
        "attn_k_b": (MODEL_TENSOR.ATTN_K_B, "weight"),
        "attn_v_b": (MODEL_TENSOR.ATTN_V_B, "weight"),
        "attn_kv_b": (MODEL_TENSOR.ATTN_KV_B, "weight"),
        "ffn_gate": (MODEL_TENSOR.FFN_GATE, "weight"),
        "ffn_up": (MODEL_TENSOR.FFN_UP, "weight"),
        "ffn_down": (MODEL_TENSOR.FFN_DOWN, "weight"),
        "exp_probs_b": (MODEL_TENSOR.FFN_EXP_PROBS_B, "bias"),
    }.items()
}
# Legacy per-expert names (older Mixtral files) of the stacked expert roles (gguf has no name for them).
LEGACY_EXPERT_TENSORS = {
    "ffn_gate_exps": "blk.{i}.ffn_gate.{e}.weight",
    "ffn_up_exps": "blk.{i}.ffn_up.{e}.weight",
    "ffn_down_exps": "blk.{i}.ffn_down.{e}.weight",
}

GLOBAL_TENSORS = ("token_embd", "output_norm")
GLOBAL_OPTIONAL = ("output", "output_norm_bias", "output_bias")
ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
ROUTED_EXPERTS = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ATTENTION_BIASES = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias")
SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
EXPERT_BIASES = ("ffn_gate_inp_bias", "ffn_gate_exps_bias", "ffn_up_exps_bias", "ffn_down_exps_bias")
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
# Roles of a MoE block that a leading dense block (deepseek2) has in their place
MOE_ROLES = (*ROUTED_EXPERTS[1:], "ffn_gate_inp_shexp", *SHARED_EXPERT, "exp_probs_b", *EXPERT_BIASES)


ACTIVATIONS = {
    "swiglu": SWIGLU,
    # gpt-oss (llama.cpp's ggml_swiglu_oai, constants from its build_moe_ffn)
    "swiglu_oai": Activation(1.702, 1.0, 7.0, "clamped SwiGLU: alpha 1.702, limit 7, (up + 1)"),
}


def expected_shapes(hp: HParams, features: Features) -> dict[str, tuple[int, ...]]:
    """Tensor role -> shape (numpy order) implied by the hyperparameters."""
    h, v, e, ff, sff = hp.hidden, hp.vocab, hp.n_experts, hp.expert_ff, hp.shared_ff
    q, kv, vd = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim, hp.n_kv_heads * hp.value_dim
    qk_norm = features.qk_norm_style
    full = qk_norm is not None and not qk_norm.per_head
    return {
        "token_embd": (v, h),
        "output_norm": (h,),
        "output_norm_bias": (h,),
        "output": (v, h),
        "output_bias": (v,),
        "attn_norm": (h,),
        "attn_norm_bias": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (vd, h),
        "attn_q_bias": (q,),
        "attn_k_bias": (kv,),
        "attn_v_bias": (vd,),
        "attn_output": (h, hp.n_heads * hp.value_dim),
        "attn_output_bias": (h,),
        "attn_q_norm": (q,) if full else (hp.head_dim,),
        "attn_k_norm": (kv,) if full else (hp.head_dim,),
        "ffn_norm": (h,),
        "ffn_norm_bias": (h,),
        "ffn_gate_inp": (e, h),
        "ffn_gate_exps": (e, ff, h),
        "ffn_up_exps": (e, ff, h),
        "ffn_down_exps": (e, h, ff),
        "ffn_gate_inp_shexp": (h,),
        "ffn_gate_shexp": (sff, h),
        "ffn_up_shexp": (sff, h),
        "ffn_down_shexp": (h, sff),
        "attn_post_norm": (h,),
        "attn_sinks": (hp.n_heads,),
        "ffn_gate_inp_bias": (e,),
        "ffn_gate_exps_bias": (e, ff),
        "ffn_up_exps_bias": (e, ff),
        "ffn_down_exps_bias": (e, h),
        "ffn_gate": (hp.ffn, h),
        "ffn_up": (hp.ffn, h),
        "ffn_down": (h, hp.ffn),
        "exp_probs_b": (e,),
        **(latent_attention_shapes(hp) if features.mla else {}),
    }


GGML_MAX_DIMS = 4


def llama_cpp_accepts(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether llama.cpp's loader reads a tensor of `shape` where it expects `expected` (numpy
    order): llama_model_loader::check_tensor_dims compares ggml's GGML_MAX_DIMS dimensions, the ones
    create_tensor does not name being 1. So a size-1 outer dimension is no dimension:
    convert_hf_to_gguf.py writes Qwen2-MoE's shared-expert gate 2-D (ne [n_embd, 1], from the
    [1, n_embd] nn.Linear), llama.cpp's quantizer writes it 1-D, and llama.cpp loads both as the
    {n_embd} it asks for."""

    def padded(s: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * (GGML_MAX_DIMS - len(s)) + tuple(s)

    return len(shape) <= GGML_MAX_DIMS and padded(shape) == padded(expected)


def latent_dims(hp: HParams) -> tuple[int, int, int, int, int]:
    """(heads, key head size, value head size, RoPE part, no-RoPE part) of multi-head latent
    attention as llama.cpp derives them (key/value_length when the _mla keys are absent)."""
    k_head = hp.k_head_mla or hp.head_dim
    v_head = hp.v_head_mla or hp.value_dim
    return hp.n_heads, k_head, v_head, hp.rope_dim, k_head - hp.rope_dim


def latent_attention_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    n, k_head, v_head, rope, nope = latent_dims(hp)
    h, q_lora, kv_lora = hp.hidden, hp.q_lora_rank, hp.kv_lora_rank
    return {
        "attn_q": (n * k_head, h),
        "attn_q_a": (q_lora, h),
        "attn_q_a_norm": (q_lora,),
        "attn_q_b": (n * k_head, q_lora),
        "attn_kv_a_mqa": (kv_lora + rope, h),
        "attn_kv_a_norm": (kv_lora,),
        "attn_k_b": (n, kv_lora, nope),
        "attn_v_b": (n, v_head, kv_lora),
        "attn_kv_b": (n * (nope + v_head), kv_lora),
        "attn_output": (h, n * v_head),
    }


@dataclasses.dataclass(frozen=True)
class RopeStyle:
    words: str
    interleaved: bool  # rotates consecutive pairs (GroupQueryAttention's rotary_interleaved), else halves


@dataclasses.dataclass(frozen=True)
class Routing:
    words: str  # `{k}`: the experts chosen per token (deepseek's: describe() says which gating and groups)
    renormalizes: bool  # the MoE node renormalizes the top-k weights over the k (deepseek2's scores: deepseek_routing)


# Features.rope and Features.routing name one of these
ROPE_STYLES = {"neox": RopeStyle("NeoX (rotate halves)", False), "norm": RopeStyle("interleaved pairs", True)}
ROUTINGS = {
    "softmax_topk_renorm": Routing("softmax, top-{k}, renormalized", True),
    "softmax_topk": Routing("softmax, top-{k}, not renormalized", False),
    "topk_softmax": Routing("top-{k}, softmax over the selected", True),
    "deepseek": Routing("softmax or sigmoid gating, selection bias, group-limited top-{k}", True),
}


@dataclasses.dataclass(frozen=True)
class QkNorm:
    words: str
    per_head: bool  # RMSNorm over each head (weights [head_dim]), else over the whole projection


@dataclasses.dataclass(frozen=True)
class SharedExpert:
    words: str
    sigmoid_gated: bool  # its output times sigmoid(x . ffn_gate_inp_shexp) (qwen2moe)


# Features.qk_norm and Features.shared_expert name one of these (or None: the architecture has none)
QK_NORMS = {"head": QkNorm("RMSNorm per head", True), "full": QkNorm("RMSNorm over the full projection", False)}
SHARED_EXPERTS = {
    "sigmoid_gated": SharedExpert("sigmoid-gated shared expert", True),
    "plain": SharedExpert("shared experts where the file has them", False),
}


@dataclasses.dataclass(frozen=True)
class Features:
    """What differs between architectures, as the recipe's switches (tests/test_architectures.py
    checks that every one is read)."""

    rope: str  # a key of ROPE_STYLES
    # a key of ROUTINGS ("deepseek": softmax or sigmoid gating (expert_gating_func), selection bias
    # exp_probs_b, group-limited top-k, optional renormalization)
    routing: str
    qk_norm: str | None = None  # a key of QK_NORMS, or None
    shared_expert: str | None = None  # a key of SHARED_EXPERTS (used when shared_ff > 0), or None
    shared_ff_fallback: str | None = None  # the hyperparameter sizing the shared expert when its own key is absent
    multipliers: bool = False  # granite's embedding / residual / attention / logit multipliers
    legacy_experts: bool = False  # per-expert tensors accepted in place of stacked ones
    ffn_norm: str = "ffn_norm"  # the role of the norm before the MoE (gpt-oss: "attn_post_norm")
    attention_sinks: bool = False  # a learned per-head logit joins each softmax's denominator (gpt-oss)
    # period of sliding-window layers when the file has no pattern key (gpt-oss: 2, every even layer
    # slides over `sliding_window` tokens); 0: none
    sliding_window: int = 0
    activation: str = "swiglu"  # a key of ACTIVATIONS
    expert_biases: bool = False  # biases on the router and on every expert's gate/up/down (gpt-oss)
    # multi-head latent attention (deepseek2): compressed KV, decoupled RoPE; the first
    # `leading_dense` blocks have a dense FFN instead of experts
    mla: bool = False
    yarn_log_multiplier: bool = False  # read rope.scaling.yarn_log_multiplier as llama.cpp does for deepseek2
    # LongRoPE: llama.cpp loads rope_factors_long/short.weight (phimoe's load_arch_tensors); other
    # architectures' files holding them are refused (llama.cpp's loader would count them as extra)
    longrope: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (
            ("rope", ROPE_STYLES),
            ("routing", ROUTINGS),
            ("qk_norm", (None, *QK_NORMS)),
            ("shared_expert", (None, *SHARED_EXPERTS)),
            ("activation", ACTIVATIONS),
            ("ffn_norm", TENSORS),
            ("shared_ff_fallback", (None, *HPARAMS)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"feature {name}={getattr(self, name)!r} is not one of {', '.join(map(str, allowed))}")

    @property
    def qk_norm_style(self) -> QkNorm | None:
        """The q/k norm's facts (QK_NORMS), None without one."""
        return None if self.qk_norm is None else QK_NORMS[self.qk_norm]

    @property
    def shared_expert_style(self) -> SharedExpert | None:
        """The shared expert's facts (SHARED_EXPERTS), None without one."""
        return None if self.shared_expert is None else SHARED_EXPERTS[self.shared_expert]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Facts about one GGUF architecture.

    `hparams`: what to read; `expert_ff_from`: the hyperparameter that sizes the routed experts
    ("expert_ff" or "ffn"); `block_tensors`: required per block; `optional_tensors`: used when the
    file has them (norm biases, phimoe's, are found this way); `features`: the recipe's switches;
    `genai_type`: the onnxruntime-genai model type written to genai_config.json (it decides little
    for a plain decoder: the nearest type the installed onnxruntime-genai knows).
    """

    gguf_arch: str
    description: str
    hparams: tuple[str, ...]
    block_tensors: tuple[str, ...]
    features: Features
    genai_type: str
    optional_tensors: tuple[str, ...] = ()
    expert_ff_from: str = "expert_ff"
    recipe: str = "moe_decoder"

    def read_hparams(self, gguf: GGUFModel) -> HParams:
        """Every hyperparameter from the GGUF metadata; a missing required key is a clear error."""
        values: dict[str, Any] = {}
        for name in self.hparams:
            spec = HPARAMS[name]
            key = spec.key.format(arch=self.gguf_arch)
            if key in gguf.metadata:
                values[name] = gguf.typed(key, spec.kind)
                sane = spec.check(values[name])
                if sane is not None:
                    raise MoepassError(f"{gguf.path}: metadata key '{key}' is {values[name]}; it must be {sane}")
            elif spec.default is _REQUIRED:
                raise MoepassError(f"{gguf.path}: missing metadata key '{key}'")
            else:
                values[name] = spec.default
        values["expert_ff"] = values[self.expert_ff_from]
        if "shared_ff" in values and not values["shared_ff"] and self.features.shared_ff_fallback:
            values["shared_ff"] = values[self.features.shared_ff_fallback]
        if "n_shared_experts" in values:  # deepseek2: shared experts of the routed experts' width
            values["shared_ff"] = values["n_shared_experts"] * values["expert_ff"]
        if values.get("n_kv_heads") is None:
            values["n_kv_heads"] = values["n_heads"]
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden"] // values["n_heads"]
        if values.get("value_dim") is None:
            values["value_dim"] = values["head_dim"]
        values["vocab"] = gguf.tensor(TENSORS["token_embd"]).shape[0]
        tokens = gguf.get("tokenizer.ggml.tokens")
        tokens_listed = isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
        if tokens_listed and len(tokens) != values["vocab"]:  # as llama.cpp refuses it
            raise MoepassError(
                f"{gguf.path}: metadata key 'tokenizer.ggml.tokens' lists {len(tokens):,} tokens but tensor "
                f"'{TENSORS['token_embd']}' has {values['vocab']:,} rows (one per token): the tokenizer is not "
                "this model's"
            )
        hp = HParams(**values, read=tuple(name for name in values if name != "vocab"))
        _check_hparams(gguf, self, hp)
        windowed = tuple(i for i, slides in enumerate(sliding_window_layers(gguf, self, hp)) if slides)
        return dataclasses.replace(hp, rope=read_rope(gguf, self, hp), sliding_window_layers=windowed)

    def tensor_name(self, role: str, layer: int | None = None) -> str:
        return TENSORS[role].format(i=layer)

    def tensor(self, gguf: GGUFModel, role: str, layer: int | None, hp: HParams) -> SourceTensor:
        """The tensor of `role`, with the shape the metadata implies where llama.cpp reads it as that
        (llama_cpp_accepts); for legacy files, per-expert tensors stacked into the expert role."""
        name = self.tensor_name(role, layer)
        if gguf.has_tensor(name) or not (self.features.legacy_experts and role in LEGACY_EXPERT_TENSORS):
            tensor = gguf.tensor(name)
            expected = expected_shapes(hp, self.features).get(role)
            if expected and tensor.shape != expected and llama_cpp_accepts(tensor.shape, expected):
                return dataclasses.replace(tensor, shape=expected)  # the same bytes: only size-1 dimensions differ
            return tensor
        legacy = LEGACY_EXPERT_TENSORS[role]
        if not gguf.has_tensor(legacy.format(i=layer, e=0)):
            return gguf.tensor(name)  # neither form: the error names the stacked tensor
        return gguf.stacked(name, [legacy.format(i=layer, e=e) for e in range(hp.n_experts)])

    def describe(self, gguf: GGUFModel, hp: HParams) -> dict[str, Any]:
        """The architecture-specific parts of a model, in words and numbers (for inspect and metadata)."""
        f = self.features
        parts: dict[str, Any] = {
            "rope": ROPE_STYLES[f.rope].words,
            "routing": _deepseek_routing_text(hp)
            if f.routing == "deepseek"
            else ROUTINGS[f.routing].words.format(k=hp.n_experts_used),
        }
        if f.mla:
            n, k_head, v_head, rope, nope = latent_dims(hp)
            parts["attention"] = (
                f"multi-head latent attention: {n} heads, KV rank {hp.kv_lora_rank}, "
                f"q rank {hp.q_lora_rank or 'full'}, key {nope}+{rope} (RoPE), value {v_head}"
            )
            if hp.leading_dense:
                parts["dense_blocks"] = f"the first {hp.leading_dense} (ffn {hp.ffn})"
        scaling = hp.rope.describe(hp.context_length) if hp.rope else ""  # the converted model's context
        if scaling:
            parts["rope_scaling"] = scaling
        if hp.sliding_window_layers:
            parts["sliding_window"] = f"{hp.sliding_window} tokens on layers " + ",".join(
                str(i) for i in hp.sliding_window_layers
            )
        if f.attention_sinks:
            parts["attention_sinks"] = "one learned logit per head"
        if f.activation != "swiglu":
            parts["activation"] = ACTIVATIONS[f.activation].text
        qk_norm, shared = f.qk_norm_style, f.shared_expert_style
        if qk_norm is not None:
            parts["qk_norm"] = qk_norm.words
        if shared is not None and hp.shared_ff:
            gate = " with a sigmoid gate" if shared.sigmoid_gated else ""
            parts["shared_expert"] = f"ffn {hp.shared_ff}{gate}"
        if f.multipliers:
            parts["multipliers"] = {
                k: getattr(hp, f"{k}_scale") for k in ("embedding", "residual", "attention", "logit")
            }
        if hp.expert_weights_scale not in (None, 0.0, 1.0):
            parts["expert_weights_scale"] = hp.expert_weights_scale
        biases = [
            role
            for role in (*ATTENTION_BIASES, "attn_norm_bias", "ffn_norm_bias", "output_bias", *EXPERT_BIASES)
            if self.has_tensor(gguf, role, 0 if role.startswith(("attn", "ffn")) else None)
        ]
        if biases:
            parts["biases"] = biases
        if f.legacy_experts and not self.has_tensor(gguf, "ffn_gate_exps", 0):
            parts["experts"] = "legacy per-expert tensors (stacked on reading)"
        return parts

    def has_tensor(self, gguf: GGUFModel, role: str, layer: int | None = None) -> bool:
        return gguf.has_tensor(self.tensor_name(role, layer))

    def is_dense(self, layer: int, hp: HParams) -> bool:
        """A leading block with a dense FFN in place of experts (deepseek2's first_k_dense_replace)."""
        return layer < hp.leading_dense

    def block_roles(self, layer: int, hp: HParams) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) tensor roles of one block."""
        required, optional = list(self.block_tensors), list(self.optional_tensors)
        if self.features.mla:
            required += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if hp.q_lora_rank else ["attn_q"]
            required += ["attn_k_b", "attn_v_b"] if hp.k_head_mla else ["attn_kv_b"]
        if self.is_dense(layer, hp):
            required = [r for r in required if r not in MOE_ROLES] + list(DENSE_FFN)
            optional = [r for r in optional if r not in MOE_ROLES]
        return tuple(required), tuple(optional)

    def check_tensors(self, gguf: GGUFModel, hp: HParams) -> None:
        """Every tensor the recipe reads is present with the shape the metadata implies (up to the
        size-1 dimensions llama.cpp's loader ignores: `tensor` drops them)."""
        shapes = expected_shapes(hp, self.features)
        roles = [self.block_roles(i, hp) for i in range(hp.n_layers)]
        wanted = (
            [(role, None, True) for role in GLOBAL_TENSORS]
            + [(role, None, False) for role in GLOBAL_OPTIONAL]
            + [(role, i, True) for i in range(hp.n_layers) for role in roles[i][0]]
            + [(role, i, False) for i in range(hp.n_layers) for role in roles[i][1]]
        )
        for role, layer, required in wanted:
            if not required and not self.has_tensor(gguf, role, layer):
                continue
            tensor = self.tensor(gguf, role, layer, hp)
            if tensor.shape != shapes[role]:
                raise MoepassError(
                    f"{gguf.path}: tensor '{tensor.name}' has shape {list(tensor.shape)}, expected "
                    f"{list(shapes[role])} from the {self.gguf_arch} metadata"
                )


# RoPE variants the recipe does not build yet: refused by name rather than converted wrongly.
UNSUPPORTED_ROPE_TENSORS = ("rope_freqs.weight",)
# LongRoPE's frequency factors, converted where the architecture has Features.longrope (read_longrope)
LONGROPE_TENSORS = {"factors_short": "rope_factors_short.weight", "factors_long": "rope_factors_long.weight"}
SUPPORTED_ROPE_SCALING = ("none", "linear", "yarn")


def read_longrope(gguf: GGUFModel, hp: HParams) -> dict[str, tuple[float, ...] | None]:
    """LongRoPE's factor tensors, as llama.cpp loads and applies them (Rope.factors_short/long).

    - convert_hf_to_gguf.py (conversion/phi.py, Phi3MiniModel, which PhiMoeModel extends):
      generate_extra_tensors writes rope_factors_long.weight and rope_factors_short.weight (float32,
      rope_dims / 2 each, from rope_scaling.long_factor / short_factor) and
      `{arch}.rope.scaling.attn_factor` = sqrt(1 + ln(s) / ln(original_max_position_embeddings)),
      s = max_position_embeddings / original (1 when s <= 1); set_gguf_parameters writes
      `{arch}.rope.scaling.original_context_length`. No rope.scaling.type ("linear" by default).
    - llama.cpp, src/models/phimoe.cpp (llama_model_phimoe::load_arch_tensors): both optional
      (TENSOR_NOT_REQUIRED), global (one tensor shared by every layer: TENSOR_DUPLICATED), of
      dimensions {n_embd_head / 2}, n_embd_head = n_embd / n_head. ggml_rope_impl (ggml/src/ggml.c)
      asserts they are F32.
    - Which one applies: Rope.long_factors. The attention factor is the existing
      rope.scaling.attn_factor (read_rope: yarn_attn_factor *= hparams.rope_attn_factor, llama_context's
      constructor), in both regimes.
    - How: ggml/src/ggml-cpu/ops.cpp, ggml_rope_cache_init: each pair i0/2 turns by
      rope_yarn(theta / freq_factors[i0/2], ...), whose cos and sin are scaled by mscale =
      attn_factor (passes/lower/rope.py rope_cache).

    Refused with the tensor named: another type than F32, another shape, factors that are not
    finite and positive (they divide the angle: 0 gives infinite angles, llama.cpp NaN).
    """
    half = hp.hidden // hp.n_heads // 2
    factors: dict[str, tuple[float, ...] | None] = {}
    for field, name in LONGROPE_TENSORS.items():
        if not gguf.has_tensor(name):
            factors[field] = None
            continue
        tensor = dataclasses.replace(gguf.tensor(name), check_finite=False)  # refused below, with its reason
        if tensor.type_name != "F32":
            raise MoepassError(
                f"{gguf.path}: tensor '{name}' (LongRoPE factors) is {tensor.type_name}; llama.cpp "
                "applies only F32 RoPE factors"
            )
        # llama.cpp's loader compares all four ggml dimensions, the unnamed ones 1 (check_tensor_dims)
        if len(tensor.shape) > 4 or tensor.shape[-1] != half or any(d != 1 for d in tensor.shape[:-1]):
            raise MoepassError(
                f"{gguf.path}: tensor '{name}' (LongRoPE factors) has shape {list(tensor.shape)}, "
                f"expected [{half}] (head size {hp.hidden // hp.n_heads} / 2) from the metadata"
            )
        values = tensor.read_raw().view(np.float32).reshape(-1)
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise MoepassError(
                f"{gguf.path}: tensor '{name}' (LongRoPE factors) holds {values[i]} at index {i}; "
                "the factors divide RoPE's frequencies and must be finite and positive"
            )
        factors[field] = tuple(float(v) for v in values)
    return factors


def read_rope(gguf: GGUFModel, arch: Architecture, hp: HParams) -> Rope:
    """The RoPE parameters llama.cpp derives from the metadata (llama_model::load_hparams and
    llama_context's constructor), with their float32 arithmetic."""
    a, f32 = arch.gguf_arch, np.float32
    for name in UNSUPPORTED_ROPE_TENSORS:
        if gguf.has_tensor(name):
            raise MoepassError(
                f"{gguf.path}: tensor '{name}' holds RoPE frequency factors (llama3 scaling), "
                "which moepass does not convert yet"
            )
    if not arch.features.longrope:
        for name in LONGROPE_TENSORS.values():
            if gguf.has_tensor(name):
                raise MoepassError(
                    f"{gguf.path}: tensor '{name}' holds LongRoPE frequency factors, which moepass "
                    f"converts for phimoe only (not for {a})"
                )
    # "longrope" (where converted): llama.cpp's LLAMA_ROPE_SCALING_TYPE_LONGROPE, which phimoe's graph
    # treats as "linear" (neither "none" nor YaRN in the llama_context constructor)
    supported = SUPPORTED_ROPE_SCALING + (("longrope",) if arch.features.longrope else ())
    scaling = gguf.typed(Keys.Rope.SCALING_TYPE.format(arch=a), str, "linear")  # llama.cpp's default when absent
    if scaling not in supported:
        raise MoepassError(
            f"{gguf.path}: metadata key '{a}.rope.scaling.type' is {scaling!r}; moepass converts "
            f"RoPE scaling {', '.join(supported)}"
        )
    legacy = gguf.typed(f"{a}.rope.scale_linear", float, 0.0)  # an older key, not in gguf's Keys
    factor = gguf.typed(Keys.Rope.SCALING_FACTOR.format(arch=a), float, legacy)
    if factor < 0:
        raise MoepassError(f"{gguf.path}: metadata key '{a}.rope.scaling.factor' is {factor}; it must be at least 0")
    freq_scale = f32(1) if scaling == "none" or factor == 0 else f32(1) / f32(factor)
    attn_factor = f32(1)
    yarn = scaling == "yarn"
    log_mul = f32(0)
    if arch.features.yarn_log_multiplier:  # the converter stores 0.1 * mscale_all_dim
        log_mul = f32(gguf.typed(Keys.Rope.SCALING_YARN_LOG_MUL.format(arch=a), float, 0.0)) / f32(0.1)
    if yarn:

        def mscale(s: np.float32, m: float | np.float32) -> np.float32:
            return f32(1) if s <= 1 else f32(0.1) * f32(m) * np.log(s) + f32(1)

        scale = f32(1) / freq_scale
        if log_mul:  # llama_context: deepseek2 takes mscale = mscale_all_dim when that is not 1
            attn_factor = mscale(scale, log_mul if log_mul != 1 else 1.0) / mscale(scale, log_mul)
        else:
            attn_factor = mscale(scale, 1.0)
        attn_factor = attn_factor * (f32(1) / (f32(1) + f32(0.1) * np.log(scale)))
    attn_factor = attn_factor * f32(gguf.typed(Keys.Rope.SCALING_ATTN_FACTOR.format(arch=a), float, 1.0))
    n_ctx_orig = gguf.typed(Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=a), int, hp.context_length)
    longrope = read_longrope(gguf, hp) if arch.features.longrope else {}
    return Rope(
        base=float(f32(hp.rope_base)),
        freq_scale=float(freq_scale),
        ext_factor=1.0 if yarn else 0.0,
        attn_factor=float(attn_factor),
        n_ctx_orig=n_ctx_orig,
        yarn_log_mul=float(log_mul),
        factors_short=longrope.get("factors_short"),
        factors_long=longrope.get("factors_long"),
    )


def sliding_window_layers(gguf: GGUFModel, arch: Architecture, hp: HParams) -> tuple[bool, ...]:
    """Which layers attend through a sliding window: the `sliding_window_pattern` key (a bool per
    layer, or a period n: layer i slides unless i % n == n - 1), else the architecture's period."""
    period = arch.features.sliding_window
    n = hp.n_layers
    if not period:
        return (False,) * n
    key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch.gguf_arch)
    pattern = gguf.get(key, period)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise MoepassError(f"{gguf.path}: metadata key '{key}' has {len(pattern)} entries for {n} layers")
        return tuple(bool(p) for p in pattern)
    period = gguf.typed(key, int, period)
    if hp.sliding_window <= 0:
        raise MoepassError(f"{gguf.path}: missing metadata key '{arch.gguf_arch}.attention.sliding_window'")
    return tuple(period == 0 or i % period < period - 1 for i in range(n))


def _deepseek_routing_text(hp: HParams) -> str:
    gating = "sigmoid" if hp.gating_func == ExpertGatingFuncType.SIGMOID else "softmax"
    groups = f", best {hp.n_group_used} of {hp.n_expert_groups} groups" if hp.n_expert_groups > 1 else ""
    norm = "renormalized" if hp.expert_weights_norm else "not renormalized"
    return f"{gating}, selection bias when present{groups}, top-{hp.n_experts_used}, {norm}"


def _check_hparams(gguf: GGUFModel, arch: Architecture, hp: HParams) -> None:
    def bad(what: str) -> MoepassError:
        return MoepassError(f"{gguf.path}: {arch.gguf_arch} hyperparameters are inconsistent: {what}")

    for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "n_experts", "n_experts_used", "expert_ff"):
        if not 0 < getattr(hp, name) < _INT_LIMIT:
            source = arch.expert_ff_from if name == "expert_ff" else name
            key = HPARAMS[source].key.format(arch=arch.gguf_arch)
            raise MoepassError(f"{gguf.path}: metadata key '{key}' has absurd value {getattr(hp, name)}")
    blocks = [int(m[1]) for name in gguf.tensors if (m := _BLOCK.match(name))]
    if max(blocks, default=-1) + 1 < hp.n_layers:  # before anything is built per layer
        key = HPARAMS["n_layers"].key.format(arch=arch.gguf_arch)
        raise MoepassError(
            f"{gguf.path}: metadata key '{key}' is {hp.n_layers:,}, but the file has tensors for "
            f"{max(blocks, default=-1) + 1} blocks"
        )
    if hp.n_heads % hp.n_kv_heads:
        raise bad(f"{hp.n_heads} query heads are not a multiple of {hp.n_kv_heads} kv heads")
    if hp.n_experts_used > hp.n_experts:
        raise bad(f"expert_used_count {hp.n_experts_used} > expert_count {hp.n_experts}")
    if hp.head_dim % 2:
        raise bad(f"head dimension {hp.head_dim} is odd; rotary embedding needs it even")
    if arch.features.multipliers and hp.logit_scale == 0:
        raise bad("logit_scale is 0")
    if arch.features.mla:
        if hp.gating_func not in (0, *ExpertGatingFuncType):  # 0: absent, softmax
            raise MoepassError(
                f"{gguf.path}: metadata key '{arch.gguf_arch}.expert_gating_func' is "
                f"{hp.gating_func}; moepass converts 1 (softmax) and 2 (sigmoid)"
            )
        groups = hp.n_expert_groups
        if groups > 1 and (hp.n_experts % groups or not 0 < hp.n_group_used <= groups):
            raise bad(f"{hp.n_experts} experts in {groups} groups, {hp.n_group_used} used")
        if not 0 < hp.rope_dim < latent_dims(hp)[1] or hp.rope_dim % 2:
            raise bad(f"RoPE dimension {hp.rope_dim} does not fit the key head {latent_dims(hp)[1]}")
    rot = gguf.typed(Keys.Rope.DIMENSION_COUNT.format(arch=arch.gguf_arch), int, None)
    if rot is not None and rot != hp.head_dim and not arch.features.mla:
        raise MoepassError(
            f"{gguf.path}: metadata key '{arch.gguf_arch}.rope.dimension_count' is {rot}, not the head "
            f"size {hp.head_dim}; partial rotary embedding is not converted yet"
        )


_COMMON = (
    "n_layers",
    "hidden",
    "context_length",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "value_dim",
    "rms_eps",
    "rope_base",
    "n_experts",
    "n_experts_used",
    "expert_weights_scale",
)

ARCHITECTURES: dict[str, Architecture] = {
    a.gguf_arch: a
    for a in [
        Architecture(
            gguf_arch="qwen3moe",
            description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)",
            hparams=(*_COMMON, "expert_ff"),
            block_tensors=(*ATTENTION, "attn_q_norm", "attn_k_norm", *ROUTED_EXPERTS),
            optional_tensors=ATTENTION_BIASES,
            features=Features(rope="neox", qk_norm="head", routing="softmax_topk_renorm"),
            genai_type="qwen3",
        ),
        Architecture(
            gguf_arch="llama",
            description="Mixtral (llama with experts: Mixtral-8x7B, 8x22B)",
            hparams=(*_COMMON, "ffn"),
            expert_ff_from="ffn",
            block_tensors=(*ATTENTION, *ROUTED_EXPERTS),
            optional_tensors=ATTENTION_BIASES,
            features=Features(rope="norm", routing="softmax_topk_renorm", legacy_experts=True),
            genai_type="llama",
        ),
        Architecture(
            gguf_arch="qwen2moe",
            description="Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)",
            hparams=(*_COMMON, "expert_ff", "ffn", "shared_ff"),
            block_tensors=(*ATTENTION, *ROUTED_EXPERTS, "ffn_gate_inp_shexp", *SHARED_EXPERT),
            optional_tensors=ATTENTION_BIASES,
            features=Features(
                rope="neox", routing="softmax_topk", shared_expert="sigmoid_gated", shared_ff_fallback="ffn"
            ),
            genai_type="qwen2",
        ),
        Architecture(
            gguf_arch="olmoe",
            description="OLMoE (OLMoE-1B-7B)",
            hparams=(*_COMMON, "ffn"),
            expert_ff_from="ffn",
            block_tensors=(*ATTENTION, "attn_q_norm", "attn_k_norm", *ROUTED_EXPERTS),
            optional_tensors=ATTENTION_BIASES,
            features=Features(rope="neox", qk_norm="full", routing="softmax_topk"),
            genai_type="olmo",
        ),
        Architecture(
            gguf_arch="granitemoe",
            description="Granite MoE (granite-3.x-1b/3b-a400m/a800m, granite MoE shared)",
            hparams=(
                *_COMMON,
                "ffn",
                "shared_ff",
                "logit_scale",
                "residual_scale",
                "embedding_scale",
                "attention_scale",
            ),
            expert_ff_from="ffn",
            block_tensors=(*ATTENTION, *ROUTED_EXPERTS),
            optional_tensors=(*ATTENTION_BIASES, *SHARED_EXPERT),
            features=Features(rope="norm", routing="softmax_topk_renorm", shared_expert="plain", multipliers=True),
            genai_type="granite",
        ),
        Architecture(
            gguf_arch="phimoe",
            description="Phi-3.5-MoE",
            hparams=(*_COMMON, "ffn"),
            expert_ff_from="ffn",
            block_tensors=(*ATTENTION, "attn_norm_bias", "attn_output_bias", *ROUTED_EXPERTS, "ffn_norm_bias"),
            optional_tensors=ATTENTION_BIASES[:3],
            features=Features(rope="neox", routing="softmax_topk_renorm", longrope=True),
            genai_type="phi3",
        ),
        Architecture(
            gguf_arch="gpt-oss",
            description="gpt-oss (gpt-oss-20b, gpt-oss-120b)",
            hparams=(*_COMMON, "expert_ff", "sliding_window"),
            block_tensors=(
                *ATTENTION,
                "attn_output_bias",
                "attn_sinks",
                "attn_post_norm",
                *ROUTED_EXPERTS[1:],
                *EXPERT_BIASES,
            ),
            optional_tensors=ATTENTION_BIASES[:3],
            features=Features(
                rope="neox",
                routing="topk_softmax",
                ffn_norm="attn_post_norm",
                attention_sinks=True,
                sliding_window=2,
                activation="swiglu_oai",
                expert_biases=True,
            ),
            genai_type="gptoss",
        ),
        Architecture(
            gguf_arch="deepseek2",
            description="DeepSeek-V2/V2.5/V3/R1 and other MLA models (Kimi K2)",
            hparams=(
                *_COMMON,
                "expert_ff",
                "ffn",
                "q_lora_rank",
                "kv_lora_rank",
                "k_head_mla",
                "v_head_mla",
                "rope_dim",
                "leading_dense",
                "n_shared_experts",
                "gating_func",
                "expert_weights_norm",
                "n_expert_groups",
                "n_group_used",
            ),
            block_tensors=("attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", *ROUTED_EXPERTS),
            optional_tensors=("exp_probs_b", *SHARED_EXPERT),
            features=Features(
                rope="norm", routing="deepseek", mla=True, shared_expert="plain", yarn_log_multiplier=True
            ),
            genai_type="llama",
        ),
    ]
}


def architecture_of(gguf: GGUFModel) -> Architecture:
    name = gguf.architecture
    if name not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise MoepassError(
            f"{gguf.path}: unknown architecture '{name}' (general.architecture); moepass converts: {known}"
        )
    arch = ARCHITECTURES[name]
    if name == "llama" and not gguf.get("llama.expert_count"):
        raise MoepassError(f"{gguf.path}: a dense llama model (no llama.expert_count): moepass converts MoE models")
    return arch
