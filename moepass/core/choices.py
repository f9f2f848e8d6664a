"""The values each user-facing option takes: the CLI offers them and the API checks against them.

Kept free of heavy imports, so that `moepass --help` needs nothing but click and this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any, TypeVar

from moepass.core import keys
from moepass.core.errors import MoepassError

T = TypeVar("T")


def one_of(value: str, choices: Iterable[str], what: str) -> str:
    """`value`, if it is one of `choices`; else the one line every option says: "<what> must be one
    of a, b, c, not 'x'"."""
    choices = tuple(choices)
    if value not in choices:
        raise MoepassError(f"{what} must be one of {', '.join(choices)}, not {value!r}")
    return value


# sizes: --vram, --reserve, and the bytes every summary prints
_UNITS = {
    "": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "b": 1,
}
_SIZE = re.compile(r"^\s*(\d{1,15}(?:\.\d{1,15})?)\s*([a-zA-Z]*)\s*$")
# No GPU comes near 1 PiB; a plain number below 1 MiB is a forgotten unit ("--vram 8")
_MAX_BYTES = 1 << 50
_MIN_PLAIN = 1 << 20


# The one rule for sizes, as every help text and document words it
BYTES_RULE = "8G and 8GiB are binary (8 x 2^30), 8GB decimal (8 x 10^9); 7.5GB, 8000M or plain bytes work too"


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'8G', '8GiB', '7.5GB', '8000M' or plain bytes -> bytes (BYTES_RULE): K/M/G/T and
    KiB/MiB/GiB/TiB are binary (1024), KB/MB/GB/TB decimal (1000)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise MoepassError(f"{what} {text!r} is not a size: use e.g. 8G, 8GiB, 7.5GB, 8000M or plain bytes")
        value = int(float(m.group(1)) * _UNITS[unit])
        if not unit and 0 < value < _MIN_PLAIN:
            raise MoepassError(f"{what} {text!r} means {value} bytes; give a unit: 8G, 8GiB, 7.5GB or 8000M")
    if value < 0:
        raise MoepassError(f"{what} {text!r} is negative")
    if value > _MAX_BYTES:
        raise MoepassError(f"{what} {text!r} is more than 1 PiB; use e.g. 8G, 8GiB, 7.5GB or 8000M")
    return value


# sizes are shown in binary units (as --vram takes them), rates of bytes in decimal ones (as bandwidths
# are given on data sheets and by llama.cpp)
_BINARY_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def byte_unit(n: float) -> tuple[str, int]:
    """The unit a size of `n` bytes is shown in: the largest binary unit not above it (B below 1 KiB)."""
    for unit, size in _BINARY_UNITS:
        if abs(n) >= size:
            return unit, size
    return "B", 1


def format_bytes(n: float) -> str:
    """A size: 1.50 GiB, 12.00 MiB, 512 B."""
    unit, size = byte_unit(n)
    return f"{int(n)} B" if size == 1 else f"{n / size:.2f} {unit}"


def format_rate(bytes_per_second: float) -> str:
    """A rate of bytes, in decimal units: 1.23 GB/s, 45.6 MB/s (never 0.00 GB/s)."""
    rate = bytes_per_second
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.1f} MB/s"


# convert
FLOAT_EXPERT_CHOICES = ("keep", "int8", "int4")  # F32/F16/BF16 experts: kept float (MoE) or quantized (QMoE)
# auto: native where moepass.cpu_ops takes the types and runs here, else qmoe; qmoe: the QMoE forms any
# ONNX Runtime runs (moepass.core.quants.expert_form), int4 / int8 among them; packed: the GGUF's own
# blocks in MoEPacked (CUDA only); native: the GGUF's own blocks in moepass::MoEPacked, run on the CPU by
# moepass.cpu_ops, every layer (refused where a type has no kernel)
EXPERT_FORMATS = ("auto", "qmoe", "int4", "int8", "offload", "packed", "native")
# activations mode -> accuracy_level of every quantized matrix product (None: the attribute is absent,
# ONNX Runtime's float default; 4: int8 activations inside the product, as llama.cpp)
ACTIVATION_MODES: dict[str, int | None] = {"int8": 4, "float": None}
# --print-after, per input kind: the step that makes the graph ("lower" a GGUF, "read" an ONNX model),
# then the passes of moepass.passes.PIPELINES[kind] in order (moepass.passes checks them at import)
PASS_NAMES = {
    "gguf": ("lower", "fuse-skip-norm", "quantize-activations", "kv-cache", "remove-unused", "topological-sort"),
    "onnx": ("read", "fuse-moe", "remove-unused", "topological-sort", "quantize-activations"),
}
PRINT_AFTER_CHOICES = tuple(dict.fromkeys(name for names in PASS_NAMES.values() for name in names))
# --kv-cache: GroupQueryAttention's cache type -> bytes per cached value (moepass.pipeline.kv_precision)
KV_CACHE_TYPES = {"float32": 4, "float16": 2, "int8": 1}
MAX_CONTEXT = 1 << 24  # positions: 16M, above every released model's context

# profile
PROMPT_FORMATS = ("text", "ids", "jsonl")

# partition
POLICIES = ("global", "balanced", "uniform")
PLAN_MODES = keys.OFFLOAD_MODES[1:]  # what a plan asks of ONNX Runtime: auto or required
# offload: per expert, through the ONNX Runtime CUDA plugin EP's expert offload (session.moe.offload.*);
# layers: per MoE node, through node annotations (layer_ann) and session.layer_assignment_settings, which
# the in-tree CUDA EP of a pip-installed onnxruntime-gpu follows; auto: offload when the model is
# eligible and a CUDA plugin EP is named, else layers
TARGETS = ("auto", "offload", "layers")
# run / bench
DEVICES = ("auto", "cpu", "cuda", "webgpu")
PLUGIN_ENV = "MOEPASS_CUDA_PLUGIN"  # path of the CUDA plugin EP library, when not given as an option
# the WebGPU plugin EP's own switch: set, it offers a software adapter (lavapipe, SwiftShader) as a
# device where no GPU is found; read when the plugin is registered
WEBGPU_SOFTWARE_ENV = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"


# run, chat, serve, bench: speculative decoding (moepass.runtime.speculative): --speculative ngram | draft:PATH
SPECULATIVE_KINDS = ("ngram", "draft")
DEFAULT_DRAFT_TOKENS = 4


def with_settings(kind: type[T], options: T | None, settings: dict[str, Any], command: str) -> T:
    """`options` (an instance of the options dataclass `kind`; default: its defaults) with
    `settings`, keywords of `command`'s Python API, in place of its fields; an unknown name is
    refused in one line, naming the nearest field."""
    fields = sorted(f.name for f in dataclasses.fields(kind))  # type: ignore[arg-type]
    for name in settings:
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise MoepassError(f"{command}: no option {name!r}{hint}; its options: {', '.join(fields)}")
    return dataclasses.replace(options or kind(), **settings)  # type: ignore[type-var]
