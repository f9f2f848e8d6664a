"""moepass: Mixture-of-Experts GGUF models -> ONNX decoders with com.microsoft::QMoE experts.

Python API (the same capabilities as the CLI):

    import moepass
    result = moepass.convert("model.gguf", "out/")    # ConvertResult, .summary_lines()
    info = moepass.inspect("out/")                     # dict: MoE layers, formats, bytes per group
    decoder = moepass.load("out/")                     # moepass.runtime.Decoder
    decoder = moepass.load("model.gguf")               # a GGUF: converted once into a cache, then reused
    new_ids = list(decoder.generate([1, 2, 3], max_new_tokens=8))
    text = "".join(decoder.generate_text("Hi", 32, moepass.Sampling(temperature=0.8, min_p=0.05), stop=["\n"]))
    chat = moepass.Conversation(decoder, system="Be brief.")  # chat.say("Hi", 64): streamed; history cached
    fast = moepass.load("out/", speculative="ngram", draft_tokens=4)  # or "draft:small/": speculative decoding
    small = moepass.convert("model.gguf", "out8/", kv_cache="int8")  # or "float16": a smaller KV cache
    popularity = moepass.profile("out/", [[1, 2, 3]])  # Popularity
    placed = moepass.partition("out/", "placed/", "8G", profile=popularity)  # .plan: a PlanReport
    plan = moepass.read_plan("placed/")                # the same, from its plan.json: plan.memory.free_bytes

Each name is imported when first used: `import moepass` (and `moepass --help`) loads none of the
compiler or ONNX Runtime.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from moepass.core.errors import MoepassError
from moepass.core.version import __version__

# name -> the module that defines it
_API = {
    "ConvertResult": "moepass.convert",
    "convert": "moepass.convert",
    "inspect": "moepass.inspection",
    "PartitionResult": "moepass.partition",
    "partition": "moepass.partition",
    "PlanReport": "moepass.core.formats",
    "read_plan": "moepass.core.formats",
    "Popularity": "moepass.pipeline.popularity",
    "profile": "moepass.profile",
    "Sampling": "moepass.runtime",
    "Conversation": "moepass.runtime",
    "load": "moepass.gguf_cache",
}

if TYPE_CHECKING:
    from moepass.convert import ConvertResult, convert
    from moepass.core.formats import PlanReport, read_plan
    from moepass.gguf_cache import load
    from moepass.inspection import inspect
    from moepass.partition import PartitionResult, partition
    from moepass.pipeline.popularity import Popularity
    from moepass.profile import profile
    from moepass.runtime import Conversation, Sampling


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'moepass' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


class _Package(types.ModuleType):
    """Importing a submodule sets it as an attribute of its package: moepass.convert, .partition and
    .profile would then name modules instead of the API functions of the same names."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "Conversation",
    "ConvertResult",
    "MoepassError",
    "PartitionResult",
    "PlanReport",
    "Popularity",
    "Sampling",
    "__version__",
    "convert",
    "inspect",
    "load",
    "partition",
    "profile",
    "read_plan",
]
