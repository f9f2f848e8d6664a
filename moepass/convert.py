"""`moepass convert`: GGUF -> ONNX decoder with QMoE experts, or an ONNX model's MoE subgraphs
fused into QMoE; written atomically.

GGUF: read (moepass.core.gguf_reader) -> lower (moepass.passes.lower) -> the passes of
moepass.passes.PIPELINES["gguf"] -> write: model.onnx + model.onnx.data (weights streamed tensor by
tensor) + moepass.json (hyperparameters, MoE layers and the per-tensor conversion report), tokenizer
and genai config.
ONNX: read (weights stay on disk until written) -> the passes of PIPELINES["onnx"] (fuse-moe, then
cleanup and activations) -> write: model.onnx + model.onnx.data + moepass.json (which layers were
fused and why others were not, and the per-tensor report).

Everything is written into a temporary directory beside the output and renamed at the end, so a
failure leaves nothing at the output path, and an existing output is replaced only on request.
The files depend only on the input and the options: converting twice gives identical bytes.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moepass.core import keys
from moepass.core.capabilities import offload_violations
from moepass.core.choices import (
    FLOAT_EXPERT_CHOICES,
    PASS_NAMES,
    one_of,
)
from moepass.core.errors import API_WORDING, MoepassError, wording
from moepass.core.files import GENAI_CONFIG_FILE, MODEL_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, copy_companion
from moepass.core.formats import read_report, write_report
from moepass.core.gguf_reader import is_gguf
from moepass.core.model_io import as_ir_model, model_file, save_model
from moepass.core.moe_nodes import moe_nodes
from moepass.core.version import __version__
from moepass.passes import PipelineRun, run_pipeline
from moepass.pipeline.atomic import atomic_directory
from moepass.pipeline.conversion import ConvertOptions, ConvertResult, ProgressFn, convert_gguf


def convert(
    model: Any,
    output_dir: str | os.PathLike,
    options: ConvertOptions | None = None,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    echo: Callable[[str], None] = print,
    **settings: Any,
) -> ConvertResult:
    """Convert a GGUF model into an ONNX decoder directory, or fuse an ONNX model's MoE layers.

    Args:
        model: the .gguf file (for split files, the first part); or an ONNX model: a .onnx file, a
            model directory, an onnx.ModelProto, an onnx-ir model or an onnx-graphsurgeon graph
            (see convert_onnx; `expert_format` and `imatrix` are for GGUF input).
        output_dir: the directory to create (must not exist, or be empty, unless `overwrite`).
        options: how (ConvertOptions); `settings` are its fields by name (expert_format="int4", ...).
        overwrite: replace an existing output_dir.
        progress: called as progress(done, total) while weights are written.
        echo: where the steps' lines go (--print-after's graph, the KV cache's calibration).
    """
    options = ConvertOptions.of(options, settings)
    kind = "onnx" if _is_onnx(model) else "gguf"
    if options.print_after is not None and options.print_after not in PASS_NAMES[kind]:
        raise MoepassError(
            f"{wording().option('--print-after', options.print_after)}: no such step for {kind.upper()} input; "
            f"its steps: {', '.join(PASS_NAMES[kind])}"
        )
    if kind == "onnx":
        _check_onnx_input(model, options)
        return convert_onnx(
            model,
            output_dir,
            float_experts=options.float_experts,
            activations=options.activations,
            overwrite=overwrite,
            progress=progress,
            print_after=options.print_after,
            echo=echo,
        )
    return convert_gguf(Path(model), Path(output_dir), options, overwrite=overwrite, progress=progress, echo=echo)


def _check_onnx_input(model: Any, options: ConvertOptions) -> None:
    """An ONNX input's folder holds model.onnx, and no option for GGUF input is given (refused, not
    ignored)."""
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        folder = Path(model)
        if not (folder / MODEL_FILE).is_file():
            if any(folder.glob("*.gguf")) or any(folder.glob("*.onnx")):
                model_file(folder)  # says what the folder holds, as every command says it
            raise MoepassError(
                f"{model}: a folder without {MODEL_FILE}; convert takes a .gguf file, an .onnx file or a folder "
                f"holding {MODEL_FILE}"
            )
    defaults, words = ConvertOptions(), wording()
    for flag in GGUF_ONLY_FLAGS:
        name = API_WORDING.name(flag)
        if getattr(options, name) != getattr(defaults, name):
            raise MoepassError(
                f"{words.name(flag)} applies to GGUF input; an ONNX model's MoE layers are fused as they "
                f"are ({words.name('--float-experts')} and {words.name('--activations')} apply)"
            )


# convert's options that apply to GGUF input only, by flag (the field of ConvertOptions of the same name)
GGUF_ONLY_FLAGS = (
    "--expert-format",
    "--exact",
    "--imatrix",
    "--context",
    "--allow-non-finite",
    "--genai-speculative",
    "--kv-cache",
    "--kv-calibration",
)


def _moepass_source(label: str) -> tuple[Path | None, dict[str, Any]]:
    """The folder of an ONNX input that moepass wrote, and its report (None, {} for other input):
    what its conversion knew of the model (tokenizer, hyperparameters) carries over."""
    folder = Path(label).parent if label.endswith(".onnx") else None
    if folder is None:
        return None, {}
    try:
        report = read_report(folder)
    except MoepassError:  # another tool's moepass.json: the model converts as any ONNX model
        return None, {}
    return (folder, report.document) if report.document else (None, {})


def _is_onnx(model: Any) -> bool:
    """An ONNX model (file, directory or in-memory), rather than a GGUF file."""
    if not isinstance(model, (str, os.PathLike)):
        return True
    path = Path(model)
    if path.is_dir():
        return True
    if path.is_file():
        return not is_gguf(path) and path.suffix == ".onnx"
    return path.suffix == ".onnx"


def convert_onnx(
    model: Any,
    output_dir: str | os.PathLike,
    *,
    float_experts: str = "keep",
    activations: str = "int8",
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    print_after: str | None = None,
    echo: Callable[[str], None] = print,
) -> ConvertResult:
    """Fuse the MoE layers of an ONNX model into QMoE (or float MoE) nodes (moepass.passes.fuse_moe).

    Per-expert MatMulNBits blobs move bit-exactly when their block geometry fits QMoE; float
    experts become one float com.microsoft::MoE node unless `float_experts` is "int8" or "int4";
    com.microsoft::MoE nodes are quantized into QMoE when `float_experts` asks for it. A layer the
    rules do not match is left as it was, and moepass.json says why. A model with no MoE layer is
    written unchanged. `activations` sets accuracy_level on every quantized matrix product, as for GGUF;
    `print_after` prints the graph after that step (moepass.core.choices.PASS_NAMES["onnx"]).
    """
    one_of(float_experts, FLOAT_EXPERT_CHOICES, "float_experts")
    start = time.perf_counter()
    onnx_model, label = as_ir_model(model)
    source = Path(label)
    source_bytes = _model_bytes(source)
    existing = sum(
        1
        for m in moe_nodes(onnx_model.graph)  # those the fusion leaves as they are
        if m.node.op_type == "QMoE" or float_experts == "keep"
    )
    run = PipelineRun(activations=activations, float_experts=float_experts)
    onnx_model = run_pipeline(onnx_model, "onnx", run, print_after, echo)
    fuse = run.fuse_moe
    if fuse is None:
        raise RuntimeError("the ONNX pipeline ran without fuse-moe")
    fused = [r for r in fuse.records if r.fused]
    decoder = any(v.name == "input_ids" for v in onnx_model.graph.inputs)
    if not fuse.records and not existing and not decoder:
        raise MoepassError(
            f"{label}: neither a MoE model (no router over experts to fuse, no QMoE or MoE node) nor a decoder "
            "moepass runs (no input 'input_ids'); nothing written"
        )
    onnx_model.metadata_props[keys.VERSION] = __version__
    onnx_model.metadata_props[keys.SOURCE] = source.name
    onnx_model.metadata_props[keys.MOE_LAYERS] = str(len(fused))
    violations = offload_violations(onnx_model)
    offload = (
        "eligible"
        if fused and not violations
        else f"not eligible: {violations[0][0]}: {violations[0][1]}"
        if violations
        else "no MoE layer"
    )
    moe_layers = [
        {"layer": i, "node": r.node, "experts": r.experts, "top_k": r.top_k, "form": r.form, "fused_from": r.anchor}
        for i, r in enumerate(fused)
    ]
    inputs = [source, *_data_files(source)] if source.is_file() else []
    with atomic_directory(Path(output_dir), overwrite, inputs=inputs) as tmp:
        # one writer thread, in initializer order: each tensor converted on several threads chunk by chunk
        # (moepass.passes.weights), a group's codes written before its scales
        save_model(onnx_model, tmp / MODEL_FILE, progress)
        weights = [r.as_dict() for r in fuse.report.records.values()]
        report = {
            "input": "onnx",
            "source": {"file": source.name, "bytes": source_bytes},
            "activations": activations,
            "fusion": [r.as_dict() for r in fuse.records],
            "moe_layers": moe_layers,
            "weights": weights,
        }
        earlier, known = _moepass_source(label)
        if earlier is not None:  # a model moepass converted before: its tokenizer and genai config still hold
            report.update({k: known[k] for k in ("architecture", "hparams", "tokenizer") if k in known})
            for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENAI_CONFIG_FILE):
                copy_companion(earlier, name, tmp)
        write_report(tmp, report)
        output_bytes = sum(f.stat().st_size for f in tmp.iterdir())
    bytes_by_target: dict[str, int] = collections.Counter()
    for w in weights:
        bytes_by_target[w["target"]] += w["bytes"]
    return ConvertResult(
        output_dir=Path(output_dir),
        source=source,
        architecture="onnx",
        n_layers=len(fuse.records),
        moe_layers=moe_layers,
        bytes_by_target=dict(bytes_by_target),
        weights=weights,
        source_bytes=source_bytes,
        output_bytes=output_bytes,
        seconds=time.perf_counter() - start,
        offload=offload,
        fusion=[r.as_dict() for r in fuse.records],
        activations=activations,
        existing_moe=existing,
    )


def _data_files(path: Path) -> list[Path]:
    """The external data files beside an ONNX model file (named after it, as onnx writes them)."""
    return [f for f in path.parent.iterdir() if f.is_file() and f.name.startswith(path.name) and f != path]


def _model_bytes(path: Path) -> int:
    """Bytes of an ONNX model file and the external data files beside it (0 for in-memory models)."""
    if not path.is_file():
        return 0
    return sum(f.stat().st_size for f in [path, *_data_files(path)])
