"""moepass: Mixture-of-Experts GGUF models -> ONNX decoders with com.microsoft::QMoE experts.

Python API (the same capabilities as the CLI):

    import moepass
    result = moepass.convert("model.gguf", "out/")    # ConvertResult, .summary_lines()
    info = moepass.inspect("out/")                     # dict: MoE layers, formats, bytes per group
    decoder = moepass.load("out/")                     # moepass.runtime.Decoder
    new_ids = list(decoder.generate([1, 2, 3], max_new_tokens=8))
    popularity = moepass.profile("out/", [[1, 2, 3]])  # Popularity
    placed = moepass.partition("out/", "placed/", "8G", profile=popularity)
"""

from moepass.convert import ConvertResult, convert
from moepass.errors import MoepassError
from moepass.inspection import inspect
from moepass.partition import PartitionResult, partition
from moepass.popularity import Popularity
from moepass.profile import profile
from moepass.runtime import Sampling, load
from moepass.version import __version__

__all__ = ["ConvertResult", "MoepassError", "PartitionResult", "Popularity", "Sampling", "__version__", "convert",
           "inspect", "load", "partition", "profile"]
