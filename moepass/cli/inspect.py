"""`moepass inspect`: what a GGUF file, an ONNX model or a converted folder holds."""

from __future__ import annotations

import json

import click

from moepass.cli.common import model_argument


@click.command()
@model_argument("path", "PATH")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Describe a GGUF file or a converted ONNX model: architecture, MoE layers, formats, bytes per group."""
    from moepass.inspection import format_inspection
    from moepass.inspection import inspect as run_inspect

    info = run_inspect(path)
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
    else:
        for line in format_inspection(info):
            click.echo(line)
