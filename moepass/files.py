"""Names of the files in a moepass model directory (what convert and partition write), and how a
model given as a directory or a model.onnx path is found and loaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepass.errors import MoepassError

if TYPE_CHECKING:
    import onnx_ir

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"           # every weight, as ONNX external data
REPORT_FILE = "moepass.json"            # hyperparameters, MoE layers, per-weight conversion report
PLAN_FILE = "plan.json"                 # partition: memory breakdown, residency, predictions
OPTIONS_FILE = "onnxruntime_options.json"  # partition: session config entries for ONNX Runtime
TOKENIZER_FILE = "tokenizer.json"       # convert: Hugging Face tokenizers file rebuilt from the GGUF
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # convert: chat template, BOS/EOS
GENAI_CONFIG_FILE = "genai_config.json"  # convert: what onnxruntime-genai needs to load the model
# the decoder's optional input (an initializer a feed overrides): logits of the last N positions, 0 = all
LOGITS_TO_KEEP = "logits_to_keep"


def model_file(model_dir: str | os.PathLike) -> Path:
    """The model.onnx of a model directory (or the path itself when it names a file), which must exist."""
    path = Path(model_dir)
    path = path / MODEL_FILE if path.is_dir() else path
    if not path.is_file():
        raise MoepassError(f"{path}: no such model (run `moepass convert` first)")
    return path


def load_model(model_dir: str | os.PathLike) -> "onnx_ir.Model":
    """A model (directory or model.onnx) as onnx-ir, its weights left on disk (read lazily)."""
    import onnx_ir

    path = model_file(model_dir)
    try:
        return onnx_ir.load(path)
    except Exception as e:  # onnx raises many decode error types; report one line
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise MoepassError(f"{path}: not a readable ONNX model ({type(e).__name__}: {detail})") from None


def as_ir_model(source: Any) -> tuple["onnx_ir.Model", str]:
    """An onnx-ir model and a label for it, from a path (model.onnx or a model directory), an
    onnx.ModelProto, an onnx-ir model or an onnx-graphsurgeon graph (what pipelines hand in)."""
    import onnx
    import onnx_ir as ir

    if isinstance(source, ir.Model):
        return source, "<onnx_ir.Model>"
    if isinstance(source, onnx.ModelProto):
        return ir.from_proto(source), "<onnx.ModelProto>"
    if type(source).__module__.startswith("onnx_graphsurgeon"):
        import onnx_graphsurgeon as gs
        return ir.from_proto(gs.export_onnx(source)), "<onnx_graphsurgeon.Graph>"
    path = model_file(source)
    return load_model(path), str(path)
