"""Whether the machine has the memory ONNX Runtime's CPU kernels will take for a model, asked
before the session is made: past it the kernel kills the process while ONNX Runtime packs the
experts, with no message. The CPU EP prepacks every QMoE node's experts into anonymous memory,
more than the file holds (moepass.core.quants.QMOE_CPU_HELD: int4/b32 experts with float32 scales
take 1.17x their bytes with int8 activations), so a model whose file fits the memory may not run in
it.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx_ir as ir

from moepass.core.errors import MoepassError
from moepass.core.moe_nodes import QMOE_SLOTS, input_at, moe_nodes, tensor_bytes
from moepass.core.quants import QMOE_CPU_HELD

# set to 1 to load a model the check finds too large (the estimate is a lower bound, but the
# kernel's swap or overcommit settings are the user's to know)
SKIP_ENV = "MOEPASS_SKIP_MEMORY_CHECK"
GIB = 2**30


def cpu_held_bytes(model: ir.Model) -> int:
    """At least the anonymous bytes the CPU EP holds for the model's weights once it has prepacked
    them: QMoE experts by QMOE_CPU_HELD for their form and scale type (other forms as stored), and
    the float32 copy of every float16 scale a folded Cast widens for MatMulNBits or
    GatherBlockQuantized (what MLAS packs from the mapped file besides, measured 0.1-0.5 bytes a
    block, is left out: a lower bound)."""
    total = 0
    for node in model.graph:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            scales = input_at(node, 2)  # both take (weights, activations or indices, scales, ...)
            stored = _stored(scales)
            if stored is not None and stored is not scales:  # widened by a Cast: folded on the heap
                total += 2 * tensor_bytes(stored)
    for moe in moe_nodes(model.graph):
        if moe.node.op_type != "QMoE":
            continue
        scales = input_at(moe.node, QMOE_SLOTS["fc1"][1])
        stored_scales = _stored(scales)
        dtype = stored_scales.dtype if stored_scales is not None else None
        kind = "float16" if dtype == ir.DataType.FLOAT16 else "float32"
        # by the node's bits and block size: block-sum features and offsets widen the rows, not the
        # bytes held per block
        factors = QMOE_CPU_HELD.get((moe.form.plain, kind)) if moe.form is not None else None
        int8 = moe.node.attributes.get_int("accuracy_level", 0) == 4
        total += int(moe.bytes_per_expert * moe.experts * (factors[0 if int8 else 1] if factors else 1.0))
    return total


def _stored(value: ir.Value | None) -> ir.Value | None:
    """The initializer behind a weight input: itself, or the one a Cast widens (float16 scales,
    which ONNX Runtime folds into float32 at load)."""
    if value is not None and not value.is_initializer():
        producer = value.producer()
        value = producer.inputs[0] if producer is not None and producer.op_type == "Cast" else None
    return value if value is not None and value.is_initializer() else None


def available_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What this process can still take: MemAvailable (free memory and the page cache the kernel
    can reclaim), and inside a container the least its memory cgroups leave (MemAvailable there
    shows the host's memory); None where the system says neither (not Linux)."""
    found = [h for h in (_meminfo_available(meminfo), _cgroup_headroom(cgroups, own)) if h is not None]
    return min(found, default=None)


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# (limit, usage, the reclaimable page cache in memory.stat) per cgroup version: v2 (the unified
# hierarchy) and v1's memory controller
_CGROUP_FILES = (("memory.max", "memory.current", "inactive_file"),
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))  # fmt: skip
_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a page-rounded 2^63 - 1


def _cgroup_headroom(cgroups: Path, own: Path) -> int | None:
    """The least limit - (usage - reclaimable page cache) over this process's memory cgroups and
    their parents (a container sees its own as the root of the mount); None where none has a limit."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    folders = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        base = (
            cgroups
            if parts[0] == "0" and not parts[1]
            else cgroups / "memory"
            if "memory" in parts[1].split(",")
            else None
        )
        if base is None:
            continue
        relative = Path(parts[2].lstrip("/"))
        folders += [base / relative, *(base / p for p in relative.parents)]
    headroom = None
    for folder in dict.fromkeys(folders):
        for limit_file, usage_file, cache_key in _CGROUP_FILES:
            try:
                text = (folder / limit_file).read_text().strip()
                if text == "max" or int(text) >= _NO_LIMIT:
                    continue
                limit, usage = int(text), int((folder / usage_file).read_text())
            except (OSError, ValueError):
                continue
            cache = 0
            try:
                for line in (folder / "memory.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == cache_key:
                        cache = int(value)
            except (OSError, ValueError):
                pass
            room = max(0, limit - max(0, usage - cache))
            headroom = room if headroom is None else min(headroom, room)
    return headroom


def check_fits(model: ir.Model, model_path: Path) -> None:
    """Refuse, in one line, a model whose prepacked experts need more memory than is available."""
    if os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    need, have = cpu_held_bytes(model), available_bytes()
    if have is None or need <= have:
        return
    raise MoepassError(
        f"{model_path}: ONNX Runtime's CPU kernels would hold at least {need / GIB:.1f} GiB for its weights "
        f"once packed (more than the file: a float32 scale and block sum beside each block's codes), and "
        f"{have / GIB:.1f} GiB are available: the process would be killed while loading. Place experts on a "
        f"GPU (moepass partition), free memory, or set {SKIP_ENV}=1 to try anyway"
    )
