"""The moepass command line: convert, inspect, run.

Bad input ends with one line `moepass: error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
import time

import click

from moepass.errors import MoepassError
from moepass.passes import PASS_NAMES
from moepass.passes.lower import FLOAT_EXPERT_CHOICES


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MoepassError as e:
            click.echo(f"moepass: error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="moepass")
def main() -> None:
    """Turn Mixture-of-Experts GGUF models into ONNX decoders with com.microsoft::QMoE experts."""


class _Progress:
    """A progress bar on stderr whose length is learned from the first report."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.bar = label, enabled, None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=True)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise MoepassError(f"--prompt-ids must be comma-separated integers, not {text!r}") from None


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", required=True, type=click.Path(file_okay=True),
              help="Directory to create for model.onnx, model.onnx.data and moepass.json.")
@click.option("--float-experts", type=click.Choice(FLOAT_EXPERT_CHOICES), default="keep", show_default=True,
              help="F32/F16/BF16 experts: keep as float (com.microsoft::MoE) or quantize into QMoE.")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
@click.option("--print-after", type=click.Choice(PASS_NAMES), default=None,
              help="Print the graph after this pass.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def convert(model: str, output: str, float_experts: str, force: bool, print_after: str | None, quiet: bool) -> None:
    """Convert a GGUF MoE model (first file of a split model) into an ONNX decoder."""
    from moepass.convert import convert as run_convert

    progress = _Progress("writing weights", enabled=not quiet)
    try:
        result = run_convert(model, output, float_experts=float_experts, overwrite=force, progress=progress,
                             print_after=print_after, echo=click.echo)
    finally:
        progress.close()
    for line in result.summary_lines():
        click.echo(line)


@main.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Describe a GGUF file or a converted ONNX model: architecture, MoE layers, formats, bytes per group."""
    from moepass.inspection import format_inspection, inspect as run_inspect

    info = run_inspect(path)
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
    else:
        for line in format_inspection(info):
            click.echo(line)


@main.command()
@click.argument("model_dir", type=click.Path())
@click.option("--prompt-ids", required=True, help="Prompt token ids, comma-separated (e.g. 1,2,3).")
@click.option("--max-new-tokens", type=click.IntRange(0, None), default=16, show_default=True)
@click.option("--threads", type=click.IntRange(1, None), default=None, help="ONNX Runtime intra-op threads.")
def run(model_dir: str, prompt_ids: str, max_new_tokens: int, threads: int | None) -> None:
    """Greedy generation on the CPU through moepass.runtime; prints the new token ids."""
    from moepass.runtime import load

    ids = _parse_ids(prompt_ids)
    decoder = load(model_dir, threads=threads)
    start = time.perf_counter()
    new = list(decoder.generate(ids, max_new_tokens))
    seconds = time.perf_counter() - start
    click.echo(",".join(str(t) for t in new))
    click.echo(f"{len(new)} tokens in {seconds:.3f} s", err=True)


if __name__ == "__main__":
    main()
