"""The one table of per-architecture facts: GGUF metadata keys, tensor names, graph recipe.

An entry says which hyperparameters an architecture has (and their GGUF keys), which tensors its
blocks carry, and which recipe of `moepass.passes.lower` builds its graph. Adding an architecture
means adding an entry here, plus a recipe in `passes/lower.py` only for what is new about it.

Tensor names follow llama.cpp's GGUF naming, which all its architectures share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moepass.errors import MoepassError
from moepass.gguf_reader import GGUFModel

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class HParam:
    """A hyperparameter: its GGUF key (`{arch}` is replaced by the architecture) and default."""

    key: str
    default: Any = _REQUIRED
    kind: type = int


# Hyperparameters of decoder MoE models; an architecture lists the ones it reads.
HPARAMS: dict[str, HParam] = {
    "n_layers": HParam("{arch}.block_count"),
    "hidden": HParam("{arch}.embedding_length"),
    "context_length": HParam("{arch}.context_length"),
    "n_heads": HParam("{arch}.attention.head_count"),
    "n_kv_heads": HParam("{arch}.attention.head_count_kv", None),
    "head_dim": HParam("{arch}.attention.key_length", None),
    "value_dim": HParam("{arch}.attention.value_length", None),
    "rms_eps": HParam("{arch}.attention.layer_norm_rms_epsilon", kind=float),
    "rope_base": HParam("{arch}.rope.freq_base", 10000.0, kind=float),
    "n_experts": HParam("{arch}.expert_count"),
    "n_experts_used": HParam("{arch}.expert_used_count"),
    "expert_ff": HParam("{arch}.expert_feed_forward_length"),
}

# Tensor roles -> GGUF names; `{i}` is the block index.
TENSORS: dict[str, str] = {
    "token_embd": "token_embd.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn_q": "blk.{i}.attn_q.weight",
    "attn_k": "blk.{i}.attn_k.weight",
    "attn_v": "blk.{i}.attn_v.weight",
    "attn_output": "blk.{i}.attn_output.weight",
    "attn_q_norm": "blk.{i}.attn_q_norm.weight",
    "attn_k_norm": "blk.{i}.attn_k_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate_inp": "blk.{i}.ffn_gate_inp.weight",
    "ffn_gate_exps": "blk.{i}.ffn_gate_exps.weight",
    "ffn_up_exps": "blk.{i}.ffn_up_exps.weight",
    "ffn_down_exps": "blk.{i}.ffn_down_exps.weight",
}


GLOBAL_TENSORS = ("token_embd", "output_norm", "output")


def expected_shapes(hp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor role -> shape (numpy order) implied by the hyperparameters."""
    h, v, e, ff = hp["hidden"], hp["vocab"], hp.get("n_experts"), hp.get("expert_ff")
    q, kv, vd = hp["n_heads"] * hp["head_dim"], hp["n_kv_heads"] * hp["head_dim"], hp["n_kv_heads"] * hp["value_dim"]
    return {
        "token_embd": (v, h), "output_norm": (h,), "output": (v, h),
        "attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (vd, h),
        "attn_output": (h, hp["n_heads"] * hp["value_dim"]),
        "attn_q_norm": (hp["head_dim"],), "attn_k_norm": (hp["head_dim"],),
        "ffn_norm": (h,), "ffn_gate_inp": (e, h),
        "ffn_gate_exps": (e, ff, h), "ffn_up_exps": (e, ff, h), "ffn_down_exps": (e, h, ff),
    }


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Facts about one GGUF architecture.

    `recipe` names the graph recipe in `moepass.passes.lower.RECIPES`; `features` are the
    switches that recipe reads (e.g. "qk_norm": "head" for per-head q/k RMSNorm).
    """

    gguf_arch: str
    hparams: tuple[str, ...]
    block_tensors: tuple[str, ...]
    recipe: str
    features: dict[str, Any]
    description: str = ""

    def read_hparams(self, gguf: GGUFModel) -> dict[str, Any]:
        """Every hyperparameter from the GGUF metadata; a missing required key is a clear error."""
        values: dict[str, Any] = {}
        for name in self.hparams:
            spec = HPARAMS[name]
            key = spec.key.format(arch=self.gguf_arch)
            if key in gguf.metadata:
                raw = gguf.metadata[key]
                try:
                    values[name] = spec.kind(raw)
                except (TypeError, ValueError):
                    raise MoepassError(f"{gguf.path}: metadata key '{key}' has value {raw!r}, "
                                       f"expected {spec.kind.__name__}") from None
            elif spec.default is _REQUIRED:
                raise MoepassError(f"{gguf.path}: missing metadata key '{key}'")
            else:
                values[name] = spec.default
        if values.get("n_kv_heads") is None:
            values["n_kv_heads"] = values["n_heads"]
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden"] // values["n_heads"]
        if values.get("value_dim") is None:
            values["value_dim"] = values["head_dim"]
        values["vocab"] = gguf.tensor(TENSORS["token_embd"]).shape[0]
        _check_hparams(gguf, self, values)
        return values

    def tensor_name(self, role: str, layer: int | None = None) -> str:
        return TENSORS[role].format(i=layer)

    def check_tensors(self, gguf: GGUFModel, hp: dict[str, Any]) -> None:
        """Every tensor the recipe reads is present with the shape the metadata implies."""
        shapes = expected_shapes(hp)
        wanted = [(role, None) for role in GLOBAL_TENSORS] + \
            [(role, i) for i in range(hp["n_layers"]) for role in self.block_tensors]
        for role, layer in wanted:
            name = self.tensor_name(role, layer)
            if role == "output" and not gguf.has_tensor(name):
                continue  # absent output.weight: the LM head is tied to the embedding
            tensor = gguf.tensor(name)
            if tensor.shape != shapes[role]:
                raise MoepassError(f"{gguf.path}: tensor '{name}' has shape {list(tensor.shape)}, expected "
                                   f"{list(shapes[role])} from the {self.gguf_arch} metadata")


def _check_hparams(gguf: GGUFModel, arch: Architecture, hp: dict[str, Any]) -> None:
    def bad(what: str) -> MoepassError:
        return MoepassError(f"{gguf.path}: {arch.gguf_arch} hyperparameters are inconsistent: {what}")

    for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "n_experts", "n_experts_used", "expert_ff"):
        if name in hp and not 0 < hp[name] < (1 << 24):
            key = HPARAMS[name].key.format(arch=arch.gguf_arch)
            raise MoepassError(f"{gguf.path}: metadata key '{key}' has absurd value {hp[name]}")
    if hp["n_heads"] % hp["n_kv_heads"]:
        raise bad(f"{hp['n_heads']} query heads are not a multiple of {hp['n_kv_heads']} kv heads")
    if hp["n_experts_used"] > hp["n_experts"]:
        raise bad(f"expert_used_count {hp['n_experts_used']} > expert_count {hp['n_experts']}")
    if hp["head_dim"] % 2:
        raise bad(f"head dimension {hp['head_dim']} is odd; rotary embedding needs it even")


ARCHITECTURES: dict[str, Architecture] = {a.gguf_arch: a for a in [
    Architecture(
        gguf_arch="qwen3moe",
        description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)",
        hparams=("n_layers", "hidden", "context_length", "n_heads", "n_kv_heads", "head_dim", "value_dim",
                 "rms_eps", "rope_base", "n_experts", "n_experts_used", "expert_ff"),
        block_tensors=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                       "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
        recipe="moe_decoder",
        features={
            "qk_norm": "head",          # RMSNorm over each head's q and k before RoPE
            "rope": "neox",             # rotate halves (GGML_ROPE_TYPE_NEOX)
            "routing": "softmax_topk_renorm",
            "expert_activation": "swiglu",
        },
    ),
]}


def architecture_of(gguf: GGUFModel) -> Architecture:
    name = gguf.architecture
    if name not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise MoepassError(f"{gguf.path}: unknown architecture '{name}' (general.architecture); "
                           f"moepass converts: {known}")
    return ARCHITECTURES[name]
