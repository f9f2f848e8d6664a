"""`moepass partition`: which experts or MoE layers live on the GPU, and the model in its GPU form."""

from __future__ import annotations

from typing import Any

import click

from moepass.cli.common import Progress, bandwidth_option, model_argument, threads_option
from moepass.core.choices import (
    BYTES_RULE,
    KV_CACHE_TYPES,
    PLAN_MODES,
    PLUGIN_ENV,
    POLICIES,
    TARGETS,
)
from moepass.core.gpus import GPU_PRESETS, Bandwidths


@click.command()
@model_argument()
@click.option(
    "--vram",
    default=None,
    show_default="the --gpu card's memory",
    help=f"GPU memory to use: {BYTES_RULE}.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(),
    help="Directory for the placed model and plan (default: MODEL-placed beside the model).",
)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="auto",
    show_default=True,
    help="offload: per expert, for the ONNX Runtime CUDA plugin EP's expert offload; layers: whole MoE "
    "layers on the GPU or the CPU, through layer annotations the CUDA EP of a pip-installed "
    "onnxruntime-gpu follows (like llama.cpp's --n-cpu-moe); auto: offload when the model is "
    "eligible and a CUDA plugin EP is named, else layers.",
)
@click.option(
    "--cuda-plugin",
    type=click.Path(dir_okay=False),
    default=None,
    help=f"The CUDA plugin EP library the model will run with (default: ${PLUGIN_ENV}); for --target auto.",
)
@click.option(
    "--profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Popularity file from `moepass profile` (without one, placement is uniform).",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default=None,
    help="global (default with a profile), balanced, or uniform (default without).",
)
@click.option(
    "--mode",
    type=click.Choice(PLAN_MODES),
    default="auto",
    show_default=True,
    help="required: fail when the non-expert weights, KV cache and buffers do not fit.",
)
@click.option(
    "-c",
    "--context",
    type=click.IntRange(1, None),
    default=None,
    help="Tokens the KV cache holds (default: the model's context, at most 4096; the summary says which).",
)
@click.option("--batch", type=click.IntRange(1, None), default=1, show_default=True, help="Sequences at once.")
@click.option(
    "--prefill-tokens",
    type=click.IntRange(1, None),
    default=512,
    show_default=True,
    help="Tokens per prefill step (sizes the working buffers).",
)
@click.option("--reserve", default="512MiB", show_default=True, help="GPU memory kept for the runtime itself.")
@bandwidth_option("--gpu-bandwidth", f"the --gpu card's, else {Bandwidths.gpu:g}", "GPU memory GB/s, for the estimate.")
@bandwidth_option(
    "--host-bandwidth", Bandwidths.host, "Host memory GB/s, where the CPU side is not timed (--no-calibrate)."
)
@bandwidth_option(
    "--pcie-bandwidth", f"the --gpu card's link, else {Bandwidths.pcie:g}", "Host-GPU link GB/s, for the estimate."
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also draw the plan (heatmap and memory bar) into this PNG file.",
)
@click.option("--force", is_flag=True, help="Replace the output directory (and report) if moepass wrote them.")
@click.option(
    "--gpu",
    "gpu_preset",
    type=click.Choice(sorted(GPU_PRESETS)),
    default=None,
    help="A card's memory, bandwidth and PCIe link from its data sheet (moepass/core/gpus.py); "
    "--vram and the bandwidth options override it.",
)
@click.option(
    "--cpu-profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Take the CPU side of the estimate from an earlier plan.json instead of timing it now.",
)
@click.option("--no-calibrate", is_flag=True, help="No timing on this CPU: the bandwidth model alone.")
@threads_option("ONNX Runtime's: every core", "Threads the CPU timing uses (those run and bench will use).")
@click.option(
    "--ignore-kernel-table",
    is_flag=True,
    help="Plan as if the CUDA EP took every node (for an ONNX Runtime build newer than moepass's table of "
    "its kernels); by default MoE layers it has no kernel for stay on the CPU.",
)
@click.option(
    "--kv-cache",
    type=click.Choice(["keep", "auto", *KV_CACHE_TYPES]),
    default="keep",
    show_default=True,
    help="The KV cache's type in the placed model: the model's, another (from float32), or auto: float16 "
    "where its smaller cache buys resident experts (plan.json says what each type would buy).",
)
@click.option(
    "--keep-form",
    is_flag=True,
    help="Annotate (or reorder) the model as it is instead of writing its GPU form: its float32 nodes, which "
    "no CUDA kernel takes, then stay on the CPU whatever the plan.",
)
@click.option(
    "--gguf",
    type=click.Path(dir_okay=False),
    default=None,
    help="The GGUF the model was converted from, where it is now (its GPU form is packed from the file's "
    "blocks); default: where its moepass.json records it.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress.")
def partition(model_dir: str, vram: str | None, output: str | None, force: bool, quiet: bool, **flags: Any) -> None:
    """Choose which experts (or whole MoE layers) live on the GPU for a VRAM budget; write the model in
    the form the GPU's EP takes (float16, each GPU node in a form its kernels take), the plan and the
    ONNX Runtime options. MODEL: a converted model, or a GGUF file (converted here in one step)."""
    from moepass.partition import partition as run_partition

    card = GPU_PRESETS.get(flags["gpu_preset"]) if flags["gpu_preset"] else None
    vram = vram or (card.vram if card else "")
    if not vram:
        raise click.UsageError("give --vram SIZE or --gpu NAME")
    progress = Progress("writing the placed model", enabled=not quiet)
    try:
        result = run_partition(
            model_dir,
            output,
            vram,
            overwrite=force,
            warn=lambda m: click.echo(f"moepass: warning: {m}", err=True),
            progress=progress,
            **_partition_settings(flags, card),
        )
    finally:
        progress.close()
    for line in result.summary_lines():
        click.echo(line)


def _partition_settings(flags: dict[str, Any], card: Any) -> dict[str, Any]:
    """partition's flags as moepass.partition.PartitionOptions' fields: the negated flags turned
    round, the bandwidths from the flags over the --gpu card's data sheet over the defaults."""
    flags = dict(flags)
    gpu_preset = flags.pop("gpu_preset")
    given = {name: flags.pop(f"{name}_bandwidth") for name in ("gpu", "host", "pcie")}
    sheet = {"gpu": card.bandwidth, "host": None, "pcie": card.pcie} if card else {}
    figures = [f"--gpu {gpu_preset}'s data sheet"] if card else []
    figures += [f"--{name}-bandwidth" for name, value in given.items() if value is not None]
    chosen: dict[str, Any] = {}
    for name, value in given.items():
        preset = sheet.get(name)
        chosen[name] = value if value is not None else preset if preset is not None else getattr(Bandwidths, name)
    if figures and (card or given["gpu"]):
        chosen["source"] = "from " + ", ".join(figures)
    turned = {
        "kernel_table": not flags.pop("ignore_kernel_table"),
        "calibrate": not flags.pop("no_calibrate"),
        "lower": not flags.pop("keep_form"),
    }
    return {**flags, **turned, "bandwidths": Bandwidths(**chosen)}
