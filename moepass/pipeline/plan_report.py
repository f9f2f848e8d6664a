"""The placement plan as a picture: layers x experts heatmap of popularity with residency marked,
and a bar of the GPU memory budget. Needs matplotlib (`pip install 'moepass[report]'`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moepass.core.choices import byte_unit, format_bytes
from moepass.core.errors import MoepassError, wording
from moepass.core.formats import PlanReport
from moepass.pipeline.popularity import Popularity


def draw_plan(plan: PlanReport, popularity: Popularity | None, path: Path) -> None:
    """Write the plan's picture as a PNG file."""
    import matplotlib.pyplot as plt

    fig = plan_figure(plan, popularity)
    fig.savefig(path, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)


def plan_figure(plan: PlanReport, popularity: Popularity | None):
    """The plan as a matplotlib figure: the heatmap (axes 0) and the memory bar (axes 2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoepassError(f"{wording().name('--report')} needs matplotlib: pip install 'moepass[report]'") from None
    nodes = plan.nodes
    n_experts = max(n.experts for n in nodes)
    heat = np.full((len(nodes), n_experts), np.nan)
    resident = np.zeros_like(heat, dtype=bool)
    for i, n in enumerate(nodes):
        mass = popularity.mass(n.node) if popularity is not None else np.full(n.experts, 1.0 / n.experts)
        heat[i, : n.experts] = mass * n.experts  # 1.0 = average popularity
        resident[i, list(n.resident)] = True

    fig = plt.figure(figsize=(max(8, n_experts * 0.12 + 3), max(4, len(nodes) * 0.22 + 3)))
    grid = fig.add_gridspec(2, 1, height_ratios=[max(3, len(nodes) * 0.22), 0.6], hspace=0.5)
    ax = fig.add_subplot(grid[0])
    from matplotlib.colors import LogNorm

    # popularity is heavy-tailed: a log scale shows the cold experts apart as well as the hot ones
    floor = 1e-2
    image = ax.imshow(
        np.clip(heat, floor, None),
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
        norm=LogNorm(vmin=floor, vmax=max(float(np.nanmax(heat)), 1.0)),
    )
    active = plan.offload_active
    ys, xs = np.nonzero(resident)
    ax.scatter(
        xs,
        ys,
        marker="s",
        s=max(4, 400 / max(n_experts, len(nodes))),
        facecolors="none",
        edgecolors="white",
        linewidths=0.8,
    )
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(nodes)))
    layers = plan.target == "layers"  # whole MoE layers run on the GPU or the CPU: say which, per row
    ax.set_yticklabels(
        [f"{n.node} ({n.device.upper()})" if layers else n.node for n in nodes], fontsize=7 if len(nodes) > 24 else 9
    )
    based, hit = plan.prediction.based_on, plan.prediction.gpu_hit_rate_by_mass
    residency = (
        f"{hit:.1%} of routing mass on the GPU"
        if active
        else f"INACTIVE plan: ONNX Runtime will not offload this model, every expert runs on the CPU\n"
        f"(as planned, {hit:.1%} of routing mass would be on the GPU)"
    )
    ax.set_title(
        f"{'Per-layer placement. ' if layers else ''}Expert popularity ({based}; 1.0 = average) "
        f"and GPU residency:\n{residency}",
        pad=20,
        fontsize=10,
        color="black" if active else "#b00000",
    )
    # above the heatmap, not on it (no cell hidden); a black square stands for the white ones
    from matplotlib.lines import Line2D

    marker = Line2D(
        [],
        [],
        marker="s",
        markerfacecolor="none",
        markeredgecolor="black",
        linestyle="none",
        label="on the GPU" if active else "planned for the GPU (inactive)",
    )
    ax.legend(
        handles=[marker], loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, frameon=False, borderaxespad=0.2
    )
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01).set_label("popularity (1 = average; log scale)", fontsize=8)

    bar = fig.add_subplot(grid[1])
    mem = plan.memory
    unit, scale = byte_unit(mem.vram_bytes)
    parts = [
        ("non-expert", mem.non_expert_bytes, "#4c72b0"),
        ("KV cache", mem.kv_cache_bytes, "#55a868"),
        ("buffers (est.)", mem.work_bytes, "#c44e52"),
        ("reserve", mem.reserve_bytes, "#8172b2"),
        ("resident experts", mem.resident_expert_bytes, "#ccb974"),
        ("free", mem.free_bytes, "#dddddd"),
    ]
    widths = bar_widths([size for _, size, _ in parts], mem.vram_bytes)
    left = 0.0
    for (label, size, color), width in zip(parts, widths):  # each size in its own unit: no "0.00 GiB"
        bar.barh(0, width / scale, left=left, color=color, label=f"{label} {format_bytes(size)}", edgecolor="white")
        left += width / scale
    bar.axvline(mem.vram_bytes / scale, color="black", linestyle="--", linewidth=1)
    bar.set_xlim(0, max(left, mem.vram_bytes / scale) * 1.01)
    bar.set_yticks([])
    bar.set_xlabel(
        f"{unit} of the {format_bytes(mem.vram_bytes)} budget (dashed); "
        f"{format_bytes(mem.host_expert_bytes)} of experts stay in host memory"
    )
    bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=3, fontsize=8, frameon=False)
    return fig


def bar_widths(sizes: list[int], budget: int) -> list[float]:
    """The memory bar's segment widths: each part of under 1 % of the budget drawn at 1 %, so that a
    small KV cache or reserve is seen, the room taken from the last part (free) and then from the
    widest, so that the bar ends where the parts' sum does (at the budget line when they fill it)."""
    least = 0.01 * budget
    widths = [max(float(size), least) if size else 0.0 for size in sizes]
    excess = sum(widths) - sum(sizes)
    for i in [len(widths) - 1, *sorted(range(len(widths)), key=lambda j: -widths[j])]:
        if excess <= 0:
            break
        take = min(excess, max(widths[i] - least, 0.0))
        widths[i] -= take
        excess -= take
    return widths
