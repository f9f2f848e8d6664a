"""moepass.runtime: load a converted model with ONNX Runtime and generate.

This first version runs on the CPU execution provider. It keeps the KV cache between steps
(present.N.* of one step become past_key_values.N.* of the next) and decodes greedily.
It refuses, loudly, what it cannot do: a missing model, an ONNX Runtime without the contrib
operators the model uses, a device it does not support yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from moepass.errors import MoepassError
from moepass.files import MODEL_FILE, REPORT_FILE

if TYPE_CHECKING:
    import onnx_ir

DEVICES = ("auto", "cpu")


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise MoepassError("onnxruntime is not installed: pip install 'moepass[cpu]' (or [gpu])") from None
    return onnxruntime


class Decoder:
    """An ONNX Runtime session over a converted decoder, with its KV-cache bookkeeping."""

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", threads: int | None = None,
                 graph: "onnx_ir.Model | None" = None):
        """`graph`: run this in-memory variant of the model (e.g. a profiling copy) with the weights
        of `model_dir`'s data file instead of `model_dir`'s own model.onnx."""
        ort = _import_onnxruntime()
        self.model_dir = Path(model_dir)
        model_path = self.model_dir / MODEL_FILE if self.model_dir.is_dir() else self.model_dir
        if not model_path.is_file():
            raise MoepassError(f"{model_path}: no such model (run `moepass convert` first)")
        if device not in DEVICES:
            raise MoepassError(f"device {device!r} is not supported by this runtime yet (supported: {', '.join(DEVICES)})")
        report_path = model_path.parent / REPORT_FILE
        self.info = json.loads(report_path.read_text()) if report_path.is_file() else {}
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        source: str | bytes = str(model_path)
        if graph is not None:
            import onnx_ir

            source = onnx_ir.to_proto(graph).SerializeToString()
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(model_path.parent))
        try:
            self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types; keep its message, one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MoepassError(f"{model_path}: ONNX Runtime {ort.__version__} cannot load it: {first}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_layer_key)
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self._cache_shapes = {n: inputs[n].shape for n in self.past_names}

    @property
    def vocab_size(self) -> int:
        return int(self.session.get_outputs()[0].shape[-1])

    def empty_cache(self, batch: int = 1) -> dict[str, np.ndarray]:
        return {n: np.zeros((batch, shape[1], 0, shape[3]), dtype=np.float32)
                for n, shape in self._cache_shapes.items()}

    def forward(self, input_ids: np.ndarray, cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run new tokens `[B, S]` after the cached ones; returns logits `[B, S, V]` and the new cache."""
        logits, cache, _ = self.forward_with(input_ids, cache, [])
        return logits, cache

    def forward_with(self, input_ids: np.ndarray, cache: dict[str, np.ndarray], extra_outputs: Sequence[str],
                     ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """`forward`, also fetching the named extra graph outputs (e.g. a profiling copy's router logits)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        past_len = next(iter(cache.values())).shape[2] if cache else 0
        mask = np.ones((input_ids.shape[0], past_len + input_ids.shape[1]), dtype=np.int64)
        feeds = {"input_ids": input_ids, "attention_mask": mask, **cache}
        names = ["logits", *self.present_names, *extra_outputs]
        outputs = self.session.run(names, feeds)
        n_cache = len(self.present_names)
        new_cache = dict(zip(self.past_names, outputs[1:1 + n_cache]))
        return outputs[0], new_cache, dict(zip(extra_outputs, outputs[1 + n_cache:]))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Greedy decoding: prefill the prompt in one step, then one token per step through the KV cache."""
        if not prompt_ids:
            raise MoepassError("the prompt is empty: give at least one token id")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise MoepassError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        logits, cache = self.forward(np.array([prompt_ids]), self.empty_cache())
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits[0, -1]))
            yield token
            if token in stop_ids:
                return
            logits, cache = self.forward(np.array([[token]]), cache)


def _layer_key(name: str) -> tuple[int, str]:
    _, layer, kind = name.split(".")
    return int(layer), kind


def load(model_dir: str | os.PathLike, device: str = "auto", threads: int | None = None) -> Decoder:
    """Load a converted model directory (or its model.onnx) for inference."""
    return Decoder(model_dir, device=device, threads=threads)


__all__ = ["Decoder", "load"]
