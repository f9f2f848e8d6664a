"""moepass.runtime: load a converted (or partitioned) model with ONNX Runtime and generate.

`load(model_dir, device="auto"|"cpu"|"cuda"|"webgpu", cuda_plugin=None, mode=None)` picks the execution
provider and the expert-offload options that match the model's annotations (see
`moepass.runtime.providers`), checks what it can before creating the session, and returns a
`Decoder`: the KV cache kept between steps and between calls (`kv_cache`), decoding as llama.cpp's
sampler chain decodes (`sampling`), optionally several tokens per step (`speculative`), stop tokens
from the GGUF and stop strings, tokens streamed as they come, text in / text out through the
tokenizer.json that convert writes, and the model's chat template rendered as transformers renders
it (`chat_template`).
"""

from __future__ import annotations

import os

from moepass.core.choices import DEFAULT_DRAFT_TOKENS
from moepass.core.sampling import LLAMA_SERVER
from moepass.runtime import speculative as speculation
from moepass.runtime.conversation import Conversation
from moepass.runtime.decoder import ContextOverflow, Decoder, TextStream, usable_threads
from moepass.runtime.kv_cache import KVCache
from moepass.runtime.sampling import Sampling, choose_token
from moepass.runtime.speculative import Speculator


def load(
    model_dir: str | os.PathLike,
    device: str = "auto",
    cuda_plugin: str | None = None,
    mode: str | None = None,
    threads: int | None = None,
    speculative: str | None = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
) -> Decoder:
    """Load a converted model directory (or its model.onnx) for inference.

    device: "auto" (best available), "cpu", "cuda" (a CUDA EP is required) or "webgpu" (the WebGPU
    plugin EP, moepass[webgpu], and an adapter are required: docs/webgpu.md). cuda_plugin: path of
    the ONNX Runtime CUDA plugin EP library (default: $MOEPASS_CUDA_PLUGIN). mode: expert offload
    "disabled", "auto" (fall back with one warning) or "required" (fail, naming the node and rule);
    default: what partition wrote into onnxruntime_options.json, else "disabled". speculative:
    "ngram" (prompt lookup) or "draft:PATH" (a smaller converted model with the same vocabulary,
    loaded the same way), `draft_tokens` checked per step (moepass.runtime.speculative).
    """
    kind, path = speculation.parse(speculative) if speculative else (None, None)  # before a long load
    decoder = Decoder(model_dir, device=device, threads=threads, cuda_plugin=cuda_plugin, mode=mode)
    if kind:
        draft = Decoder(path, device=device, threads=threads, cuda_plugin=cuda_plugin) if path else None
        decoder.speculate(Speculator(kind, draft_tokens, draft))
    return decoder


__all__ = [
    "LLAMA_SERVER",
    "ContextOverflow",
    "Conversation",
    "Decoder",
    "KVCache",
    "Sampling",
    "Speculator",
    "TextStream",
    "choose_token",
    "load",
    "usable_threads",
]
