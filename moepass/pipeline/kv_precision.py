"""The KV cache's type: float32 as converted, float16, or int8 with per-channel scales calibrated on
the model's own keys and values.

GroupQueryAttention stores the cache in its own type (T_CACHE) whatever the activations are; for
int8 it quantizes each key and value as it writes it, with a fixed scale per KV head and channel
(`k_quant_type` / `v_quant_type` PER_CHANNEL, `k_scale` / `v_scale` [kv_heads, 1, head_size],
`kv_cache_bit_width` 8), saturating at the ends of the int8 range. The scales come from a short
calibration, as an importance matrix does: the converted model (float32 cache) runs a prompt of
CALIBRATION_TOKENS tokens (a text given, else the model's own sampled text) and each channel's
scale is HEADROOM times the largest magnitude it can take, over 127: for values the largest seen;
for rotated keys the largest each reaches at any position of the context (key_ranges), since a
short calibration sees the slow RoPE pairs barely turned, and their channels would saturate once
a long context has turned them.

What ONNX Runtime 1.32's CPU EP runs, in place (past and present one buffer, as moepass.runtime
binds them), measured on a Qwen3-30B-A3B-sized GQA node (32 q / 4 kv heads x 128), 2 threads, a
decode step after 2,048 / 8,192 / 32,768 cached tokens: float32 0.87 / 3.8 / 24 ms, float16
1.3 / 9.5 / 45 ms (converted back to float32 as it is read), int8 per-channel 0.67 / 3.1 / 12 ms.
The CUDA EP has no float32 GroupQueryAttention kernel (float16 / bfloat16 activations, caches of
the same type, int8, int4 or float8; read from its source), so a GPU runs the offload format's
float16 graph. The fidelity beside llama.cpp's caches: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from moepass.core.choices import KV_CACHE_TYPES, format_bytes, one_of
from moepass.core.errors import MoepassError, wording
from moepass.core.files import MODEL_FILE
from moepass.core.ir_values import dim, dtype_of, folded, required_input
from moepass.core.model_io import load_model
from moepass.core.onnx_format import stamp
from moepass.passes.kv_cache import KvCachePass

CALIBRATION_TOKENS = 256
INT8_MAX = 127
# the scale's room above the largest magnitude seen: a value past it saturates, which costs more
# than a coarser step (mean KLD on 4 held-out windows of the trained fixtures, markov / text model:
# room 1.0: 5.2e-6 / 1.3e-5; 1.3: 5.8e-7 / 3.2e-6; 1.6: 1.1e-6 / 3.0e-6; 2.0: 1.6e-6 / 7.5e-6)
HEADROOM = 1.3
# how the model's own text begins where it has a tokenizer (else: token 0)
OPENING = "The river rose in the night, and by morning"


# what partition --kv-cache auto chooses among: the types whose loss stays within llama.cpp's own
# q8_0 cache's (float16: a tenth of its F16 cache's; int8: 1.0-6x q8_0's on the trained fixtures,
# docs/benchmarks.md: used where asked for only)
AUTO_CHOICES = ("float32", "float16")


def cache_type_of(model: ir.Model) -> str | None:
    """The KV cache type (a KV_CACHE_TYPES name) of a converted model; None without a cache."""
    names = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.INT8: "int8"}
    past = next((v for v in model.graph.inputs if (v.name or "").startswith("past_key_values.")), None)
    return None if past is None or past.dtype is None else names.get(past.dtype)


def cache_inputs(graph: ir.Graph) -> list[tuple[ir.Value, int, int]]:
    """The KV cache's inputs of a known shape [batch, kv heads, positions, head size], each with its
    (kv heads, head size); MoepassError where either is symbolic."""
    return [
        (value, dim(value.shape, 1, f"{value.name}"), dim(value.shape, 3, f"{value.name}"))
        for value in graph.inputs
        if (value.name or "").startswith("past_key_values.") and value.shape is not None
    ]


def kv_bytes_per_position(graph: ir.Graph) -> int:
    """Bytes the KV cache holds for one position of one sequence: every layer's keys and values, in
    each cache input's own type (int8: 1 byte a value); 0 without a cache."""
    return sum(kv_heads * head_dim * int(dtype_of(value).itemsize) for value, kv_heads, head_dim in cache_inputs(graph))


def describe_cache(kind: str, bytes_per_position: int, context: int | None) -> str:
    """The cache in words, as convert's summary and inspect print it: its type, its bytes a position
    and at the model's context."""
    text = kind
    if bytes_per_position:
        text += f", {format_bytes(bytes_per_position)} a position"
        if context:
            text += f", {format_bytes(bytes_per_position * context)} at the model's {context:,} positions"
    return text


def calibration_ids(decoder, text: str | None, length: int) -> tuple[list[int], str]:
    """The calibration prompt's tokens (at most `length`) and what they are, in words: the text
    given, else the model's own text: what it writes, sampled at temperature 1 (seed 0), after a
    few words (token 0 without a tokenizer), so that the keys and values are those of the text it
    will hold (calibrating a model of one language on another's gives scales 10-20x worse in KLD:
    measured on the trained fixtures)."""
    from moepass.runtime import Sampling

    if text is not None:
        if not decoder.has_tokenizer:
            raise MoepassError(
                f"{decoder.model_dir}: the model has no tokenizer to encode the KV calibration text with"
            )
        ids = decoder.encode(text)[:length]
        if not ids:
            raise MoepassError("the KV calibration text holds no token")
        return ids, f"{len(ids)} tokens of the text given"
    start = decoder.encode(OPENING)[: length // 2] if decoder.has_tokenizer else [0]
    written = list(
        decoder.generate(start, length - len(start), stop_ids=(), sampling=Sampling(temperature=1.0, seed=0))
    )
    return [*start, *written], f"{len(start) + len(written)} tokens of the model's own text (sampled, seed 0)"


def rope_pairs(rotary: int, interleaved: bool) -> tuple[slice, slice]:
    """The channels GroupQueryAttention rotates together, as (first, second) of each pair, among the
    first `rotary` of a head: consecutive ones (rotary_interleaved), else the two halves."""
    if interleaved:
        return slice(0, rotary, 2), slice(1, rotary, 2)
    return slice(0, rotary // 2), slice(rotary // 2, rotary)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """How a GroupQueryAttention turns its keys: the rotary tables [positions, pairs] of its cos and
    sin caches (every position of the model's context) and the pairs' layout (rope_pairs)."""

    cos: np.ndarray
    sin: np.ndarray
    interleaved: bool

    @property
    def channels(self) -> int:
        return 2 * self.cos.shape[1]


def key_ranges(keys: np.ndarray, rotation: Rotation | None) -> np.ndarray:
    """The largest magnitude each channel of keys [kv_heads, tokens, head_size], token t rotated at
    position t, can take at any position of the context, [kv_heads, head_size] (None: unrotated
    keys, the largest seen). A rotated pair (a, b) at position p is the complex r e^(i(psi + phi(p)))
    (GroupQueryAttention's a cos - b sin, a sin + b cos), so at another position p' its channels
    are r m(p') cos and sin of psi + phi(p'): each token's phase sweeps the arc of phases the
    context spans, and the largest |cos| (|sin|) on that arc bounds the channel. A calibration on
    the first few hundred positions sees the slow pairs barely turned, and their largest values
    would not bound them once a long context has turned them; the fast pairs sweep a half turn,
    and reach their pair's norm. The channels past the rotated ones: the largest seen."""
    top = np.abs(keys).max(axis=1)
    if rotation is None:
        return top
    first, second = rope_pairs(rotation.channels, rotation.interleaved)
    cos, sin = rotation.cos.astype(np.float64), rotation.sin.astype(np.float64)
    phase = np.unwrap(np.arctan2(sin, cos), axis=0)  # [positions, pairs], each pair's angle by position
    scale = np.hypot(cos, sin)  # YaRN's magnitude factor, 1 otherwise
    tokens = keys.shape[1]
    z = keys[..., first].astype(np.float64) + 1j * keys[..., second].astype(np.float64)
    radius = np.abs(z) / scale[:tokens] * scale.max(axis=0)  # [kv_heads, tokens, pairs]
    start = np.angle(z) - phase[:tokens] + phase.min(axis=0)  # each token's phase at the arc's ends
    end = start + (phase.max(axis=0) - phase.min(axis=0))

    def largest_cos(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # of |cos| over [lo, hi]
        return np.where(
            np.floor(hi / np.pi) >= np.ceil(lo / np.pi), 1.0, np.maximum(np.abs(np.cos(lo)), np.abs(np.cos(hi)))
        )

    top[:, first] = (radius * largest_cos(start, end)).max(axis=1)
    top[:, second] = (radius * largest_cos(start - np.pi / 2, end - np.pi / 2)).max(axis=1)
    return top


def cache_ranges(decoder, ids: Sequence[int], rotations: dict[str, Rotation | None]) -> dict[str, np.ndarray]:
    """present.N.key/value name -> the largest magnitude per [kv_heads, head_size] the prompt's
    keys (values) can take at any position: key_ranges for a key cache in `rotations` (name -> its
    GroupQueryAttention's Rotation), else the largest seen."""
    _, cache = decoder.forward(np.asarray([ids], dtype=np.int64), decoder.empty_cache())
    ranges = {}
    for past, value in cache.items():
        name = past.replace("past_key_values.", "present.")
        ranges[name] = key_ranges(value[0], rotations.get(name))
    return ranges


def rotation_of(node: ir.Node, folded_tables: dict[ir.Value, np.ndarray] | None = None) -> Rotation | None:
    """A GroupQueryAttention's Rotation (None where it rotates nothing: do_rotary off, its keys
    rotated already by the graph before it, which does not say how; such a model's key channels get
    the largest magnitudes seen). Its tables are constants, or computed from constants (rope_tables),
    folded here once per table into `folded_tables`."""
    if not node.attributes.get_int("do_rotary", 0):
        return None
    memo = {} if folded_tables is None else folded_tables
    tables = []
    for index in (7, 8):
        value = required_input(node, index)
        if value not in memo:
            memo[value] = folded(value)
        if memo[value].ndim != 2:
            raise MoepassError(f"{node.name}: input {index}, the rotary table, is not [positions, pairs]")
        tables.append(memo[value])
    if tables[0].shape != tables[1].shape:
        raise MoepassError(f"{node.name}: the rotary cos and sin tables differ in shape")
    return Rotation(tables[0], tables[1], bool(node.attributes.get_int("rotary_interleaved", 0)))


def cache_entry(kind: str | None) -> dict:
    """moepass.json's "kv_cache" for a cache of `kind` (None: the model has no KV cache)."""
    return {"type": kind, "bytes_per_value": KV_CACHE_TYPES[kind]} if kind else {"type": None}


def set_kv_cache(
    folder: Path,
    kind: str,
    current: str | None,
    context: int | None = None,
    text: str | None = None,
    threads: int | None = None,
    echo: Callable[[str], None] = lambda line: None,
) -> dict:
    """Give every GroupQueryAttention of the converted model in `folder`, whose cache is of type
    `current` (cache_type_of), a `kind` cache (the kv-cache pass), int8 calibrated on at most
    `context` tokens (the model's positions); rewrites model.onnx (the weights' data file stays as it
    is). "float32", or the type the model has (a float16 cache given in convert's pipeline), keeps
    the cache as it is. Returns moepass.json's entry."""
    one_of(kind, KV_CACHE_TYPES, wording().name("--kv-cache"))
    if kind == "float32" or kind == current:
        return cache_entry(current)
    if current is None:
        raise MoepassError(f"{folder}: the model has no GroupQueryAttention: no KV cache to give another type")
    if current != "float32" and not (current == "float16" and kind == "int8"):  # a GPU form's float16 cache: int8
        raise MoepassError(
            f"{folder}: the model's KV cache is {current}; {wording().name('--kv-cache')} applies to a float32 cache"
        )
    model = load_model(folder)
    attention = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    info = cache_entry(kind)
    scales = {}
    if kind == "int8":
        from moepass.runtime import Decoder

        echo("calibrating the int8 KV cache")
        folded_tables: dict[ir.Value, np.ndarray] = {}
        rotations = {node.outputs[1].name or "": rotation_of(node, folded_tables) for node in attention}
        decoder = Decoder(folder, device="cpu", threads=threads)
        length = min(CALIBRATION_TOKENS, context or CALIBRATION_TOKENS)
        ids, info["calibration"] = calibration_ids(decoder, text, length)
        scales = {
            name: np.maximum(top * HEADROOM, np.finfo(np.float32).tiny) / INT8_MAX
            for name, top in cache_ranges(decoder, ids, rotations).items()
        }
        del decoder
    KvCachePass(kind, scales if kind == "int8" else None)(model)
    stamp(model, str(folder / MODEL_FILE))
    onnx.save(ir.to_proto(model), folder / MODEL_FILE)  # external weights stay where they are
    return info
