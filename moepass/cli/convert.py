"""`moepass convert`: a GGUF file (or an ONNX model) into an ONNX decoder with QMoE experts."""

from __future__ import annotations

from typing import Any

import click

from moepass.cli.common import Progress, declared, model_argument, threads_option
from moepass.core.options import CONVERT_OPTIONS


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
@declared(CONVERT_OPTIONS.values())
@threads_option("every core", "Threads converting weights.")
@click.option(
    "--force", is_flag=True, help="Replace the output directory if moepass wrote it (never a folder of yours)."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, and the summary in one line.")
def convert(model: str, output: str, force: bool, quiet: bool, **settings: Any) -> None:
    """Convert a GGUF MoE model (first file of a split model) into an ONNX decoder, or fuse the MoE
    subgraphs of an ONNX model (MODEL.onnx or a model directory) into QMoE nodes."""
    from moepass.convert import convert as run_convert

    progress = Progress("writing weights", enabled=not quiet)
    try:
        result = run_convert(model, output, overwrite=force, progress=progress, echo=click.echo, **settings)
    finally:
        progress.close()
    lines = result.summary_lines()
    if quiet:  # the first line and the expert forms: what was written, and in which form
        form = next((line.split(maxsplit=2)[2] for line in lines if line.startswith("  expert form ")), None)
        lines = [lines[0] + (f": {form}" if form else "")]
    for line in lines:
        click.echo(line)
