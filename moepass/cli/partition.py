"""`moepass partition`: which experts or MoE layers live on the GPU, and the model in its GPU form."""

from __future__ import annotations

from typing import Any

import click

from moepass.cli.common import Progress, bandwidth_option, declared, model_argument, threads_option
from moepass.core.choices import BYTES_RULE
from moepass.core.gpus import GPU_PRESETS, Bandwidths
from moepass.core.options import PARTITION_OPTIONS


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
@declared(PARTITION_OPTIONS.values())
@bandwidth_option("--gpu-bandwidth", f"the --gpu card's, else {Bandwidths.gpu:g}", "GPU memory GB/s, for the estimate.")
@bandwidth_option(
    "--host-bandwidth", Bandwidths.host, "Host memory GB/s, where the CPU side is not timed (--no-calibrate)."
)
@bandwidth_option(
    "--pcie-bandwidth", f"the --gpu card's link, else {Bandwidths.pcie:g}", "Host-GPU link GB/s, for the estimate."
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
@threads_option("ONNX Runtime's: every core", "Threads the CPU timing uses (those run and bench will use).")
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
    """partition's flags as moepass.partition.PartitionOptions' fields: the bandwidths from the flags
    over the --gpu card's data sheet over the defaults (the other flags are the fields already)."""
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
    return {**flags, "bandwidths": Bandwidths(**chosen)}
