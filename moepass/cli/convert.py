"""`moepass convert`: a GGUF file (or an ONNX model) into an ONNX decoder with QMoE experts."""

from __future__ import annotations

from typing import Any

import click

from moepass.cli.common import Progress, model_argument, threads_option
from moepass.core.choices import (
    ACTIVATION_MODES,
    DEFAULT_DRAFT_TOKENS,
    EXPERT_FORMATS,
    FLOAT_EXPERT_CHOICES,
    KV_CACHE_TYPES,
    MAX_CONTEXT,
    PRINT_AFTER_CHOICES,
)


@click.command()
@model_argument("model")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(file_okay=True),
    help="Directory to create for model.onnx, model.onnx.data and moepass.json.",
)
@click.option(
    "--float-experts",
    type=click.Choice(FLOAT_EXPERT_CHOICES),
    default="keep",
    show_default=True,
    help="F32/F16/BF16 experts: keep as float (com.microsoft::MoE) or quantize into QMoE.",
)
@click.option(
    "--expert-format",
    type=click.Choice(EXPERT_FORMATS),
    default="auto",
    show_default=True,
    help="auto: the exact form when the experts move bit-exactly (Q4_0, Q8_0, IQ4_XS, MXFP4, ...), "
    "else 8 bits at the largest block (keeps llama.cpp's fidelity); int4: 4 bits (half the bytes, "
    "more error), int8: 8 bits; offload: what ONNX Runtime's expert offload takes "
    "(int4 block 32 prepacked, float16 graph); packed: the GGUF's own blocks as they are, in MoEPacked "
    "nodes (CUDA only: no CPU kernel runs them).",
)
@click.option(
    "--exact",
    is_flag=True,
    help="Keep the exact form of every tensor whose blocks move bit-exactly, even where a requantized "
    "form is faster (Q6_K: int8 block 16 instead of block 128).",
)
@threads_option("every core", "Threads converting weights.")
@click.option(
    "--activations",
    type=click.Choice(list(ACTIVATION_MODES)),
    default="int8",
    show_default=True,
    help="int8: quantized to 8 bits inside each quantized matmul, as llama.cpp does (ONNX Runtime "
    "accuracy_level 4; fast). float: exact float arithmetic on the weights (slower; for tests).",
)
@click.option(
    "--imatrix",
    type=click.Path(dir_okay=False),
    default=None,
    help="llama.cpp importance matrix (GGUF or .dat): weighs requantization errors per input column.",
)
@click.option(
    "--force", is_flag=True, help="Replace the output directory if moepass wrote it (never a folder of yours)."
)
@click.option(
    "-c",
    "--context",
    type=click.IntRange(1, MAX_CONTEXT),
    default=None,
    show_default="the GGUF's context_length",
    help="Positions (tokens) the model is built for: its RoPE tables.",
)
@click.option(
    "--allow-non-finite",
    is_flag=True,
    help="Convert tensors holding NaN or Inf (refused by default: the model would compute NaN logits).",
)
@click.option(
    "--print-after",
    type=click.Choice(PRINT_AFTER_CHOICES),
    default=None,
    help="Print the graph after this step (GGUF: lower, then its passes; ONNX: read, fuse-moe, ...).",
)
@click.option(
    "--genai-speculative",
    default=None,
    metavar="ngram|draft:PATH",
    show_default="off",
    help="Write speculative decoding into genai_config.json for onnxruntime-genai (PATH: the draft "
    "model's converted folder); moepass run/chat/serve take --speculative when they run.",
)
@click.option(
    "--draft-tokens",
    type=click.IntRange(1, 16),
    default=DEFAULT_DRAFT_TOKENS,
    show_default=True,
    help="With --genai-speculative: draft tokens per step.",
)
@click.option(
    "--kv-cache",
    type=click.Choice(list(KV_CACHE_TYPES)),
    default="float32",
    show_default=True,
    help="The KV cache's type: float16 halves it, int8 quarters it (per-channel scales calibrated on the "
    "model's own keys and values).",
)
@click.option(
    "--kv-calibration",
    type=click.Path(dir_okay=False),
    default=None,
    show_default="the model's own sampled text",
    help="With --kv-cache int8: text to calibrate the scales on.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def convert(model: str, output: str, force: bool, quiet: bool, **settings: Any) -> None:
    """Convert a GGUF MoE model (first file of a split model) into an ONNX decoder, or fuse the MoE
    subgraphs of an ONNX model (MODEL.onnx or a model directory) into QMoE nodes."""
    from moepass.convert import convert as run_convert

    progress = Progress("writing weights", enabled=not quiet)
    try:
        result = run_convert(model, output, overwrite=force, progress=progress, echo=click.echo, **settings)
    finally:
        progress.close()
    for line in result.summary_lines():
        click.echo(line)
