"""Memory model and expert placement: which experts live on the GPU, and what that buys.

Memory model (all exact except the working buffers, which are an estimate from the graph):

- weights: the bytes of every initializer; expert tensors (QMoE/MoE inputs with the experts on
  their first axis) are split evenly per expert, everything else is "non-expert" and always
  resident on the GPU;
- KV cache: for each past_key_values input, kv_heads * head_dim * dtype bytes per token, times
  `context` tokens and `batch` sequences (K and V both counted, every layer);
- working buffers for one step of T = batch * prefill_tokens tokens, with a = activation bytes:
      4*T*H*a                       residual stream, normed input, attention and MoE outputs
    + T*(heads + 2*kv_heads)*head_dim*a   q, k, v
    + batch*heads*prefill_tokens*context*a   attention probabilities of one layer
    + T*top_k*(3*I + H)*a + T*E*a   per routed token: fc1 output (2I), activation (I), fc2 output (H);
                                    router logits
    + T*V*a                         logits
  (buffers are reused across layers, so one layer's worth is counted);
- a runtime reserve (CUDA context, library workspaces, fragmentation), given by the user.

Placement maximizes the routing mass served from the GPU: each node's mass (the share of its
routing weight each expert carried) sums to 1, so every layer counts equally, and an expert's value
is its mass per byte. Policies:

- "global": rank all experts of all layers by mass per byte and take them greedily while they fit
  (ktransformers measured this 7-27 % faster than uniform placement at 30-80 % residency);
- "balanced": the same number of experts in every layer (each layer's most popular); what is left
  of the budget stays free (filling it from the global ranking would let a larger budget serve
  less, as a property test showed);
- "uniform": no profile: "balanced" with every expert equally popular (lowest ids first).
Ties break by layer order, then expert id, so the same inputs always give the same plan.

The decode-time prediction is an estimate from a bandwidth model, labelled as such: per token the
GPU reads the non-expert weights and the resident experts that are selected; the selected cold
experts are either computed on the CPU from host memory or streamed over PCIe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_ir as ir

from moepass.core import keys
from moepass.core.capabilities import cuda_refusals
from moepass.core.choices import PLAN_MODES, POLICIES, format_bytes, one_of
from moepass.core.errors import MoepassError, wording
from moepass.core.gpus import GPU_NODE_US, GPU_STEP_US, Bandwidths
from moepass.core.ir_values import dim, folded, input_at
from moepass.core.moe_nodes import is_moe, moe_nodes, tensor_bytes
from moepass.pipeline.kv_precision import cache_inputs, cache_type_of, kv_bytes_per_position
from moepass.pipeline.popularity import Popularity


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """The experts of one MoE node: how many, top-k, and the bytes of one expert (all its tensors)."""

    node: str
    experts: int
    top_k: int
    bytes_per_expert: int
    ffn: int  # expert intermediate size I


@dataclasses.dataclass
class MemoryModel:
    non_expert_bytes: int
    groups: list[ExpertGroup]
    kv_bytes_per_token: int  # one sequence, all layers, K and V
    dims: dict[str, int]  # hidden, vocab, heads, kv_heads, head_dim, activation_bytes
    # What the GPU's EP does not take, by its kernel table (capabilities): MoE nodes (their experts
    # stay in host memory and run on the CPU), the non-expert bytes other nodes read from host memory
    # each token, and whether attention itself stays on the CPU (then every non-expert byte does)
    cpu_only: frozenset[str] = frozenset()
    host_non_expert_bytes: int = 0
    attention_on_cpu: bool = False
    kv_type: str = "float32"  # the KV cache's type (kv_precision.cache_type_of), which kv_bytes_per_token counts
    gpu_nodes: int = 0  # the nodes a step runs on the GPU (each pays a launch: the step's floor)

    def gpu_step_s(self, bytes_s: float) -> float:
        """A step's GPU side, whose bytes take `bytes_s` at the GPU's bandwidth: that or the launches
        of the nodes it runs there, whichever is longer, and one synchronisation (choices.GPU_NODE_US,
        GPU_STEP_US: assumed). gpu_step_s(0): the least a step takes however few bytes it reads."""
        if not self.gpu_nodes:
            return bytes_s
        return max(bytes_s, self.gpu_nodes * GPU_NODE_US * 1e-6) + GPU_STEP_US * 1e-6

    @property
    def expert_bytes(self) -> int:
        return sum(g.experts * g.bytes_per_expert for g in self.groups)

    def kv_bytes(self, context: int, batch: int) -> int:
        return self.kv_bytes_per_token * context * batch

    def work_bytes(self, context: int, batch: int, prefill_tokens: int) -> int:
        d, a = self.dims, self.dims["activation_bytes"]
        t = batch * prefill_tokens
        moe = max((t * g.top_k * (3 * g.ffn + d["hidden"]) + t * g.experts for g in self.groups), default=0)
        return a * (
            4 * t * d["hidden"]
            + t * (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"]
            + batch * d["heads"] * prefill_tokens * context
            + moe
            + t * d["vocab"]
        )

    @classmethod
    def of(cls, model: ir.Model, kernel_table: bool = True, cpu_nodes: dict[str, str] | None = None) -> MemoryModel:
        """The memory model of `model` as it stands (partition gives it the GPU form); with
        `kernel_table`, what the CUDA EP takes decides what counts on the GPU (`cpu_nodes`: more
        nodes the GPU form keeps on the CPU)."""
        graph = model.graph
        nodes = moe_nodes(graph)
        if not nodes:
            raise MoepassError("the model has no QMoE/MoE node: nothing to place")
        expert_names = {v.name for m in nodes for v in m.expert_values}
        non_expert = sum(tensor_bytes(v) for v in graph.initializers.values() if v.name not in expert_names)
        # tables the session folds from constants when it loads (RoPE: passes/lower/rope.py rope_tables)
        computed = {
            v
            for node in graph
            if node.op_type == "GroupQueryAttention"
            for v in (input_at(node, 7), input_at(node, 8))
            if v is not None and v.const_value is None
        }
        non_expert += sum(folded(v).nbytes for v in computed)
        groups = [ExpertGroup(m.name, m.experts, m.top_k, m.bytes_per_expert, m.ffn) for m in nodes]
        caches = cache_inputs(graph)
        kv_per_token, heads = kv_bytes_per_position(graph), 0
        kv_heads, head_dim = caches[-1][1:] if caches else (0, 0)
        logits = next(v for v in graph.outputs if v.name == "logits")
        act = int(logits.dtype.itemsize) if logits.dtype is not None else 4
        for node in graph:
            if node.op_type == "GroupQueryAttention":
                heads = node.attributes.get_int("num_heads", 0)
                break
        hidden = nodes[0].hidden
        dims = {
            "hidden": hidden,
            "vocab": dim(logits.shape, -1, "logits"),
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "activation_bytes": act,
        }
        cpu_only: frozenset[str] = frozenset()
        host, attention_on_cpu = 0, False
        refused: dict[str, str] = {}
        if kernel_table:
            refused = {**cuda_refusals(model), **(cpu_nodes or {})}
            cpu_only = frozenset(m.name for m in nodes if m.name in refused)
            attention_on_cpu = any(
                (n.name or n.op_type) in refused for n in graph if n.op_type == "GroupQueryAttention"
            )
            read_on_cpu = {
                v.name or ""
                for n in graph
                if (n.name or n.op_type) in refused and not is_moe(n)
                for v in n.inputs
                if v is not None and v.is_initializer()
            }
            host = sum(
                tensor_bytes(graph.initializers[name]) for name in sorted(read_on_cpu) if name in graph.initializers
            )
        gpu_nodes = sum(1 for n in graph if n.op_type != "Constant" and (n.name or n.op_type) not in refused)
        return cls(
            non_expert,
            groups,
            kv_per_token,
            dims,
            cpu_only,
            non_expert if attention_on_cpu else host,
            attention_on_cpu,
            cache_type_of(model) or "float32",
            gpu_nodes,
        )


@dataclasses.dataclass(frozen=True)
class Budget:
    vram_bytes: int
    context: int = 4096
    batch: int = 1
    prefill_tokens: int = 512
    reserve_bytes: int = 512 * 1024**2


@dataclasses.dataclass
class Plan:
    """Where every expert lives, the memory breakdown, and the predictions."""

    memory: dict[str, int]
    fits: bool
    policy: str
    resident: dict[str, list[int]]  # node -> resident expert ids, most popular first
    order: dict[str, list[int]]  # node -> every expert id, resident first, by popularity
    mass_hit_rate: dict[str, float]
    selection_hit_rate: dict[str, float]
    prediction: dict[str, Any]
    warnings: list[str]

    @property
    def resident_bytes(self) -> int:
        return self.memory["resident_expert_bytes"]


def by_popularity(experts: Iterable[int], mass: np.ndarray) -> list[int]:
    """Expert ids, the most popular first (ties: the lower id)."""
    return sorted(experts, key=lambda e: (-mass[e], e))


def _ranking(groups: list[ExpertGroup], mass: list[np.ndarray]) -> list[tuple[int, int]]:
    """(group index, expert) by mass per byte, ties by layer then expert id."""
    items = [
        (-(m[e] / g.bytes_per_expert), gi, e) for gi, (g, m) in enumerate(zip(groups, mass)) for e in range(g.experts)
    ]
    items.sort()
    return [(gi, e) for _, gi, e in items]


def choose_resident(groups: list[ExpertGroup], mass: list[np.ndarray], budget: int, policy: str) -> list[list[int]]:
    """Resident expert ids per group within `budget` bytes, by `policy` ("uniform" = "balanced" on equal mass)."""
    if policy in ("balanced", "uniform"):
        # The same count in every layer, each layer's most popular; what is left of the budget stays
        # free (filling it from a global ranking would make more budget sometimes serve less).
        per_layer = sum(g.bytes_per_expert for g in groups)
        slots = min(min(g.experts for g in groups), budget // per_layer) if per_layer else 0
        chosen = [[int(e) for e in np.argsort(-m, kind="stable")[:slots]] for m in mass]
    else:
        chosen = [[] for _ in groups]
        left = budget
        for gi, e in _ranking(groups, mass):
            if groups[gi].bytes_per_expert <= left:
                chosen[gi].append(e)
                left -= groups[gi].bytes_per_expert
    # most popular first within each layer (the order the annotated model stores them in)
    return [by_popularity(c, m) for c, m in zip(chosen, mass)]


def choose_layers(groups: list[ExpertGroup], budget: int) -> list[bool]:
    """Which MoE nodes run whole on the GPU within `budget` bytes: the last ones, as many as fit
    (as llama.cpp's --n-cpu-moe N keeps the experts of the first N layers on the CPU). A prefix
    from the end, so a larger budget never places fewer nodes."""
    on_gpu = [False] * len(groups)
    left = budget
    for index in reversed(range(len(groups))):
        size = groups[index].experts * groups[index].bytes_per_expert
        if size > left:
            break
        on_gpu[index] = True
        left -= size
    return on_gpu


@dataclasses.dataclass(frozen=True)
class Speeds:
    """What a plan's decode-time prediction is reckoned from: the bandwidths (GB/s) of the GPU, host
    memory and PCIe, and, where they were timed, a decode step's pieces on this CPU (`cpu_costs`,
    moepass.runtime.calibrate): the cold experts are then timed by them, not by the bandwidth model."""

    bandwidths: Bandwidths = Bandwidths()
    cpu_costs: dict[str, Any] | None = None


def plan_placement(
    memory: MemoryModel,
    budget: Budget,
    popularity: Popularity | None = None,
    policy: str | None = None,
    mode: str = "auto",
    speeds: Speeds | None = None,
    target: str = "offload",
    cpu_only: frozenset[str] = frozenset(),
) -> Plan:
    """The placement for `target` "offload" (experts chosen one by one, by `policy`) or "layers"
    (whole MoE nodes, see choose_layers). `cpu_only`: MoE nodes the GPU's EP has no kernel for;
    none of their experts is placed on the GPU (the budget they would have had stays free).
    `speeds`: what the prediction is reckoned from (default: the assumed bandwidths alone); with a
    decode step's pieces timed on this CPU it times the cold experts by them and adds `cpu_only`,
    every layer on the CPU."""
    speeds = speeds or Speeds()
    one_of(mode, PLAN_MODES, "mode")
    if target not in ("offload", "layers"):
        raise MoepassError(f"target must be offload or layers here, not {target!r}")
    policy = policy or ("global" if popularity is not None else "uniform")
    one_of(policy, POLICIES, "policy")
    if popularity is None and policy != "uniform":
        raise MoepassError(
            f"policy {policy!r} needs a popularity profile (moepass profile); without one, placement is uniform"
        )
    if target == "layers":
        policy = "layers"  # whole nodes: the policy has nothing to choose
    groups = memory.groups
    if popularity is not None:
        mass = [popularity.mass(g.node) for g in groups]
        selection = [popularity.selection_rate(g.node) for g in groups]
    else:
        mass = [np.full(g.experts, 1.0 / g.experts) for g in groups]
        selection = mass
    kv = memory.kv_bytes(budget.context, budget.batch)
    work = memory.work_bytes(budget.context, budget.batch, budget.prefill_tokens)
    fixed = memory.non_expert_bytes + kv + work + budget.reserve_bytes
    warnings = []
    fits = fixed <= budget.vram_bytes
    if not fits:
        missing = fixed - budget.vram_bytes
        message = (
            f"{wording().option('--vram', format_bytes(budget.vram_bytes))} does not hold the non-expert weights "
            f"({format_bytes(memory.non_expert_bytes)}), KV cache ({format_bytes(kv)}), working buffers "
            f"({format_bytes(work)}) and reserve ({format_bytes(budget.reserve_bytes)}): "
            f"{missing:,} bytes ({format_bytes(missing)}) missing"
        )
        if mode == "required":
            raise MoepassError(message)
        warnings.append(message + "; no expert is placed on the GPU")
    expert_budget = max(0, budget.vram_bytes - fixed)
    if target == "layers":
        on_gpu = choose_layers(groups, expert_budget)
        resident = [by_popularity(range(g.experts), m) if gpu else [] for g, m, gpu in zip(groups, mass, on_gpu)]
    else:
        resident = choose_resident(groups, mass, expert_budget, policy)
    resident = [[] if g.node in cpu_only else r for g, r in zip(groups, resident)]
    resident_bytes = sum(len(r) * g.bytes_per_expert for r, g in zip(resident, groups))
    all_fit = all(len(r) == g.experts for g, r in zip(groups, resident) if g.node not in cpu_only)
    if fits and not all_fit and mode == "auto":
        if target == "layers":
            placed = sum(1 for r in resident if r)
            warnings.append(
                f"{placed} of {len(groups)} MoE layers fit on the GPU whole; the experts of the other "
                f"{len(groups) - placed} ({format_bytes(memory.expert_bytes - resident_bytes)}) stay in "
                "host memory and run on the CPU"
            )
        else:
            served = sum(len(r) for r in resident)
            total = sum(g.experts for g in groups)
            warnings.append(
                f"{served} of {total} experts fit on the GPU; the other "
                f"{format_bytes(memory.expert_bytes - resident_bytes)} of experts stay in host memory"
            )
    order, mass_hit, sel_hit = {}, {}, {}
    for g, r, m, s in zip(groups, resident, mass, selection):
        rest = by_popularity(set(range(g.experts)) - set(r), m)
        order[g.node] = list(r) + rest
        mass_hit[g.node] = float(m[r].sum()) if r else 0.0
        sel_hit[g.node] = float(s[r].sum()) if r else 0.0
    memory_breakdown = {
        "vram_bytes": budget.vram_bytes,
        "non_expert_bytes": memory.non_expert_bytes,
        "kv_cache_bytes": kv,
        "work_bytes": work,
        "reserve_bytes": budget.reserve_bytes,
        "expert_budget_bytes": expert_budget,
        "resident_expert_bytes": resident_bytes,
        "host_expert_bytes": memory.expert_bytes - resident_bytes,
        "total_expert_bytes": memory.expert_bytes,
        "free_bytes": budget.vram_bytes - fixed - resident_bytes if fits else 0,
    }
    prediction = _predict(
        memory,
        groups,
        resident,
        sel_hit,
        mass_hit,
        speeds.bandwidths,
        profiled=popularity is not None,
        cpu_costs=speeds.cpu_costs,
    )
    return Plan(
        memory_breakdown,
        fits,
        policy,
        {g.node: r for g, r in zip(groups, resident)},
        order,
        mass_hit,
        sel_hit,
        prediction,
        warnings,
    )


def _predict(
    memory: MemoryModel,
    groups: list[ExpertGroup],
    resident: list[list[int]],
    sel_hit: dict[str, float],
    mass_hit: dict[str, float],
    bw: Bandwidths,
    profiled: bool,
    cpu_costs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    hot = sum(g.top_k * sel_hit[g.node] * g.bytes_per_expert for g in groups)
    cold = sum(g.top_k * (1 - sel_hit[g.node]) * g.bytes_per_expert for g in groups)
    # a node counts on the GPU only where its EP takes it (MemoryModel's kernel table): what stays on
    # the CPU reads its bytes from host memory (attention there: every non-expert byte)
    on_gpu = memory.non_expert_bytes - memory.host_non_expert_bytes
    gpu_part = memory.gpu_step_s((on_gpu + hot) / (bw.gpu * 1e9))
    gpu_s = gpu_part + memory.host_non_expert_bytes / (bw.host * 1e9)
    n = len(groups)
    common = {  # in plan.json after the label
        "based_on": "measured popularity" if profiled else "uniform popularity (no profile)",
        "gpu_hit_rate_by_mass": sum(mass_hit.values()) / n,
        "gpu_hit_rate_by_selection": sum(sel_hit.values()) / n,
        "bytes_per_token": {
            "gpu": int(on_gpu + hot),
            "cold_experts": int(cold),
            "host_non_expert": int(memory.host_non_expert_bytes),
        },
        "bandwidths_gbps": bw.gbps(),
        "bandwidths_from": bw.source,
        "gpu_step_floor_ms": 1e3 * memory.gpu_step_s(0.0),
    }
    if cpu_costs is not None:  # measured on this CPU: the cold experts run there at the measured cost
        from moepass.runtime.calibrate import cpu_step_ms

        cold_ms = cpu_step_ms(cpu_costs, {g.node: 1 - sel_hit[g.node] for g in groups})["moe"]
        every = cpu_step_ms(cpu_costs)
        # the non-expert part that stays on the CPU: its share of the measured dense time
        host_share = memory.host_non_expert_bytes / memory.non_expert_bytes if memory.non_expert_bytes else 0.0
        gpu_s = gpu_part + host_share * every["dense"] / 1e3
        return {
            "label": "estimate: the GPU side from a bandwidth model, the CPU side from pieces of this model timed "
            "on this CPU",
            **common,
            "cpu": {
                "machine": cpu_costs["machine"],
                "threads": cpu_costs["threads"],
                "moe_ms": every["moe"],
                "non_expert_ms": every["dense"],
            },
            "decode_ms_per_token": {
                "cold_experts_on_cpu": 1e3 * gpu_s + cold_ms,
                "cold_experts_over_pcie": 1e3 * (gpu_s + cold / (bw.pcie * 1e9)),
                "cpu_only": every["moe"] + every["dense"],
            },
            "formula": "t = max((non-expert bytes + selected hot expert bytes) / gpu_bw, GPU nodes x "
            f"{GPU_NODE_US:g} us) + {GPU_STEP_US:g} us + the measured CPU time of each MoE layer x its cold "
            "share (or selected cold bytes / pcie_bw); cpu_only = every MoE layer's measured time + the "
            "non-expert bytes a step reads at the measured CPU rate",
        }
    return {
        "label": "estimate from a bandwidth model, not a measurement",
        **common,
        "decode_ms_per_token": {
            "cold_experts_on_cpu": 1e3 * (gpu_s + cold / (bw.host * 1e9)),
            "cold_experts_over_pcie": 1e3 * (gpu_s + cold / (bw.pcie * 1e9)),
        },
        "formula": f"t = max((non-expert bytes + selected hot expert bytes) / gpu_bw, GPU nodes x {GPU_NODE_US:g} "
        f"us) + {GPU_STEP_US:g} us + selected cold expert bytes / (host_bw | pcie_bw); selected bytes per "
        "layer = top_k * hit_rate * bytes_per_expert",
    }


def onnxruntime_options(plan: Plan, groups: list[ExpertGroup], mode: str, target: str = "offload") -> dict[str, str]:
    """The session config entries ONNX Runtime reads for this plan: expert offload (1.32, CUDA
    plugin EP) or the layer assignment that follows the model's layer_ann annotations."""
    if target == "layers":
        return {keys.LAYER_SETTINGS_KEY: keys.LAYER_SETTINGS}
    overrides = ";".join(
        f"{g.node}:max_resident_slots={len(plan.resident[g.node])},"
        f"device_expert_bytes={len(plan.resident[g.node]) * g.bytes_per_expert}"
        for g in groups
    )
    return {
        keys.OFFLOAD_MODE: mode,
        keys.OFFLOAD_PLACEMENT: "static",
        keys.OFFLOAD_GPU_BUDGET: str(plan.resident_bytes),
        keys.OFFLOAD_NODE_OVERRIDES: overrides,
    }
