"""GPU data sheets for partition's decode estimate: the bandwidths it assumes or is given
(`Bandwidths`), the cards `--gpu NAME` names (`GPU_PRESETS`, from their vendors' pages), and what a
GPU step costs beside reading its bytes (assumed)."""

from __future__ import annotations

import dataclasses
import math

from moepass.core.errors import MoepassError, wording

# where partition's bandwidths come from when neither a card nor a figure is given
ASSUMED_BANDWIDTHS = "assumed, a desktop GDDR6X card"


@dataclasses.dataclass(frozen=True)
class Bandwidths:
    """GB/s used by partition's decode-time estimate (defaults: a desktop GPU with GDDR6X,
    dual-channel DDR5 host memory, PCIe 4.0 x16), and where the figures come from (`source`, said
    beside the estimate)."""

    gpu: float = 900.0
    host: float = 60.0
    pcie: float = 25.0
    source: str = ASSUMED_BANDWIDTHS

    def gbps(self) -> dict[str, float]:
        return {"gpu": self.gpu, "host": self.host, "pcie": self.pcie}

    def __post_init__(self) -> None:
        for name in ("gpu", "host", "pcie"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise MoepassError(f"{Bandwidths.given(name, value)} is not a positive number of GB/s")

    @staticmethod
    def given(name: str, value: object) -> str:
        """The bandwidth `name` given as `value`, as the caller gives it: `--gpu-bandwidth 900` on the
        command line, `Bandwidths(gpu=900)` in Python."""
        words = wording()
        return words.option(f"--{name}-bandwidth", value) if words.cli else f"Bandwidths({name}={value!r})"

    def advice(self) -> str:
        """Where the figures come from, and with the assumed ones, how to give the card's own."""
        if self.source != ASSUMED_BANDWIDTHS:
            return self.source
        words = wording()
        card = (
            f"{words.option('--gpu', 'NAME')} or {words.name('--gpu-bandwidth')}"
            if words.cli
            else "bandwidths=Bandwidths(gpu=...)"
        )
        return f"{self.source}: give {card}"


@dataclasses.dataclass(frozen=True)
class GpuPreset:
    """A card's memory, memory bandwidth and host link, as its vendor's data sheet states them."""

    vram: str  # as partition --vram takes it
    bandwidth: float  # GB/s
    pcie: float  # GB/s, one direction: PCIe 4.0 x16 31.5, x8 15.8; PCIe 5.0 x16 63
    source: str


# What a decode step costs on a GPU besides reading its bytes, assumed (not measured here: no GPU was
# lent): ONNX Runtime's dispatch and the kernel launch of each node the GPU runs, which a step pays in
# turn however small the node; and the step's synchronisation with the host (the logits copied back).
GPU_NODE_US = 8.0
GPU_STEP_US = 30.0

# partition --gpu NAME (NVIDIA's product pages, read 2026-12-01)
GPU_PRESETS = {
    "rtx3060-12g": GpuPreset(
        "12GiB",
        360.0,
        31.5,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/"
        "rtx-3060-3060ti/ (GDDR6 192-bit 15 Gbps; PCIe 4.0 x16)",
    ),
    "rtx4060-8g": GpuPreset(
        "8GiB",
        272.0,
        15.8,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
        "rtx-4060-4060ti/ (GDDR6 128-bit 17 Gbps; PCIe 4.0 x8)",
    ),
    "rtx4090-24g": GpuPreset(
        "24GiB",
        1008.0,
        31.5,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
        "rtx-4090/ (GDDR6X 384-bit 21 Gbps; PCIe 4.0 x16)",
    ),
    "a100-80g": GpuPreset(
        "80GiB",
        2039.0,
        31.5,
        "https://www.nvidia.com/en-us/data-center/a100/ (80 GB HBM2e SXM: 2,039 GB/s; PCIe 4.0 x16)",
    ),
    "h100": GpuPreset(
        "80GiB",
        3350.0,
        63.0,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM 80 GB HBM3: 3.35 TB/s; PCIe 5.0 x16)",
    ),
    "h200": GpuPreset(
        "141GB", 4800.0, 63.0, "https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e: 4.8 TB/s; PCIe 5.0 x16)"
    ),
}
