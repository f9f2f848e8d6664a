"""`moepass profile` and `merge-profiles`: expert popularity measured on calibration prompts."""

from __future__ import annotations

import click

from moepass.cli.common import CACHE_DIR_OPTION, Progress, converted, model_argument, parse_ids, require, threads_option
from moepass.core.choices import (
    PROMPT_FORMATS,
)


@click.command()
@model_argument()
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Calibration prompts file (see --prompts-format).",
)
@click.option(
    "--prompts-format",
    type=click.Choice(PROMPT_FORMATS),
    default="text",
    show_default=True,
    help="text: one prompt per line; ids: token ids per line (commas or spaces, '#' comments); "
    'jsonl: a JSON string, id list, or {"text"|"ids": ...} per line.',
)
@click.option("--chat", is_flag=True, help="Wrap each text prompt in the model's chat template, as run --chat does.")
@click.option("--prompt-ids", default=None, help="One calibration prompt as comma-separated token ids.")
@click.option("-o", "--output", required=True, type=click.Path(), help="Popularity file to write (JSON).")
@click.option(
    "--merge",
    "merge_with",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Add these earlier profiles of the same model to the result (repeatable).",
)
@threads_option("ONNX Runtime's: every core", "ONNX Runtime intra-op threads.")
@CACHE_DIR_OPTION
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def profile(
    model_dir: str, output: str, merge_with: tuple[str, ...], threads: int | None, force: bool, quiet: bool, **flags
) -> None:
    """Measure expert popularity: run calibration prompts through a model on the CPU.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.pipeline.atomic import check_destination
    from moepass.pipeline.popularity import Popularity
    from moepass.profile import profile as run_profile
    from moepass.profile import read_prompts

    prompts_file, prompts_format, prompt_ids, chat = (
        flags.pop(k) for k in ("prompts_file", "prompts_format", "prompt_ids", "chat")
    )
    if (prompts_file is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompts FILE or --prompt-ids 1,2,3")
    check_destination(output, force, is_dir=False)  # before the work, not after it
    if chat:
        require("chat", "--chat", "jinja2")
    prompts = read_prompts(prompts_file, prompts_format) if prompts_file else [parse_ids(prompt_ids or "")]
    model_dir = converted(model_dir, flags)
    earlier = [Popularity.load(p) for p in merge_with]
    progress = Progress("profiling prompts", enabled=not quiet, unit="prompts")
    try:
        result = run_profile(model_dir, prompts, threads=threads, progress=progress, chat=chat)
    finally:
        progress.close()
    for path, other in zip(merge_with, earlier):
        result = result.merge(other, path)
    result.save(output, overwrite=force)
    click.echo(
        f"profiled {result.tokens} tokens ({result.prompts} prompts) over {len(result.selected)} MoE layers -> {output}"
    )
    click.echo(f"  {result.coverage_line()}")


@click.command("merge-profiles")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(), help="Merged popularity file to write.")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
def merge_profiles(profiles: tuple[str, ...], output: str, force: bool) -> None:
    """Add up popularity profiles of the same model."""
    from moepass.pipeline.atomic import check_destination
    from moepass.pipeline.popularity import Popularity

    check_destination(output, force, is_dir=False)  # before reading the profiles
    merged = Popularity.load(profiles[0])
    for path in profiles[1:]:
        merged = merged.merge(Popularity.load(path), path)
    merged.save(output, overwrite=force)
    click.echo(f"merged {len(profiles)} profiles: {merged.tokens} tokens -> {output}")
