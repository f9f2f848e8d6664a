"""`moepass partition`: a GPU memory budget and expert popularity -> placement plan, annotated
model and the ONNX Runtime offload options that match.

Output directory (written atomically):
  model.onnx, model.onnx.data   target offload: the model with each MoE node's experts reordered,
                                GPU-resident first (router permuted to match: same outputs), see
                                below; target layers: the model with every node annotated
                                (layer_ann: "gpu", or "gpu/NODE" / "cpu/NODE" for MoE nodes)
  plan.json                     memory breakdown, resident experts per node, predictions, inputs
  onnxruntime_options.json      {"session_config_entries": {...}}: what moepass.runtime sets
  genai_config.json             the source's, with the same entries in the decoder's session options
  moepass.json, tokenizer*.json carried over from the source model

How the groups are laid out: in model.onnx.data every expert tensor of a node holds its experts
contiguously along axis 0, resident ones first, so the GPU-resident group of each tensor is one
byte range at the start of the tensor. plan.json lists every expert tensor with its offset and
length in the data file and the length of its resident prefix. The plan is also recorded in
metadata_props: model-level `moepass.placement` (JSON summary), node-level
`moepass.placement.expert_ids` and `moepass.placement.resident`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from moepass.atomic import atomic_directory, atomic_file, check_destination, share_file
from moepass.core import keys
from moepass.core.capabilities import cuda_refusals, offload_violations
from moepass.core.choices import KV_CACHE_TYPES, PLUGIN_ENV, TARGETS, Bandwidths, format_bytes, one_of, parse_bytes
from moepass.core.errors import MoepassError
from moepass.core.files import (
    DATA_FILE,
    GENAI_CONFIG_FILE,
    MODEL_FILE,
    OPTIONS_FILE,
    PLAN_FILE,
    PLAN_FORMAT,
    PLAN_VERSION,
    REPORT_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    PlanReport,
    load_model,
    model_file,
    read_json_object,
    read_report,
    save_model,
    write_report,
)
from moepass.core.moe_nodes import moe_nodes
from moepass.core.version import __version__
from moepass.genai import with_session_entries
from moepass.kv_precision import AUTO_CHOICES, cache_type_of, set_kv_cache
from moepass.passes.annotate_layers import AnnotateLayersPass
from moepass.passes.reorder_experts import ReorderExpertsPass
from moepass.placement import Budget, MemoryModel, Plan, onnxruntime_options, plan_placement
from moepass.popularity import Popularity, model_identity


@dataclasses.dataclass
class PartitionResult:
    output_dir: Path
    plan: PlanReport
    options: dict[str, str]
    warnings: list[str]
    weights: str = "rewritten"  # how model.onnx.data came to be: rewritten, or the source's shared (hard link, ...)

    def summary_lines(self) -> list[str]:
        plan = self.plan
        mem, pred, nodes = plan.memory, plan.prediction, plan.nodes
        resident = sum(n.resident_count for n in nodes)
        total = sum(n.experts for n in nodes)
        decode = pred.decode_ms_per_token
        if plan.target == "layers":
            on_gpu = len([n for n in nodes if n.device == "gpu"])
            rest = len(nodes) - on_gpu
            where = (
                "every MoE layer runs on the CPU"
                if not on_gpu
                else "all of them"
                if not rest
                else f"the experts of the other {rest} run on the CPU"
            )
            head = (
                f"placed {on_gpu} of {len(nodes)} MoE layers on the GPU whole (per-layer placement: {where}) "
                f"-> {self.output_dir}"
            )
        else:
            head = (
                f"placed {resident} of {total} experts on the GPU ({plan.inputs.policy} policy) -> "
                f"{self.output_dir}"
                + ("" if plan.offload_active else " (inactive: ONNX Runtime will not offload this model)")
            )
        kv = plan.kv_cache
        lines = [
            head,
            f"  VRAM budget      {format_bytes(mem.vram_bytes):>12}",
            f"  non-expert       {format_bytes(mem.non_expert_bytes):>12}",
            f"  KV cache         {format_bytes(mem.kv_cache_bytes):>12}  "
            f"(context {plan.inputs.context}, batch {plan.inputs.batch}"
            + (f", {kv.type}" if kv else "")
            + ")"
            + (f"; {kv.traded}" if kv and kv.traded else ""),
            f"  working buffers  {format_bytes(mem.work_bytes):>12}  (estimate)",
            f"  reserve          {format_bytes(mem.reserve_bytes):>12}",
            f"  resident experts {format_bytes(mem.resident_expert_bytes):>12}",
            f"  host experts     {format_bytes(mem.host_expert_bytes):>12}",
            f"  free             {format_bytes(mem.free_bytes):>12}"
            + (
                "  (nothing fits beside the non-expert part)"
                if not mem.resident_expert_bytes and not mem.free_bytes
                else ""
            ),
            f"  GPU hit rate     {pred.gpu_hit_rate_by_mass:.1%} of routing mass, "
            f"{pred.gpu_hit_rate_by_selection:.1%} of selections ({pred.based_on})",
            f"  decode estimate  {decode.cold_experts_on_cpu:.3g} ms/token with cold "
            f"experts on the CPU, {decode.cold_experts_over_pcie:.3g} ms/token over PCIe "
            + (
                "(GPU side from the bandwidths, CPU side timed here)"
                if pred.cpu
                else "(bandwidth model, not a measurement)"
            ),
        ]
        if decode.cpu_only is not None and pred.cpu is not None:
            lines.append(
                f"  CPU only         {decode.cpu_only:.3g} ms/token with every layer on "
                f"this CPU ({pred.cpu.threads or 'default'} threads; MoE layers and the LM head's "
                "rate timed on this model)"
            )
        lines.append(f"  weights          {self.weights}")
        other = pred.per_expert_alternative
        if other:
            lines.append(
                f"  per expert       {other.gpu_hit_rate_by_mass:.1%} of routing mass, "
                f"{other.decode_ms_per_token.cold_experts_on_cpu:.3g} ms/token at the same budget "
                "(what the CUDA plugin EP's expert offload would add: --target offload)"
            )
        return lines


def _plan_document(
    plan: Plan, memory: MemoryModel, inputs: dict[str, Any], identity: dict[str, Any], options: dict[str, str]
) -> dict[str, Any]:
    nodes = []
    for g in memory.groups:
        resident = plan.resident[g.node]
        nodes.append(
            {
                "node": g.node,
                "experts": g.experts,
                "top_k": g.top_k,
                "bytes_per_expert": g.bytes_per_expert,
                "device": "gpu" if len(resident) == g.experts else "cpu" if not resident else "split",
                "resident_count": len(resident),
                "resident": resident,
                "order": plan.order[g.node],
                "mass_hit_rate": plan.mass_hit_rate[g.node],
                "selection_hit_rate": plan.selection_hit_rate[g.node],
            }
        )
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "moepass_version": __version__,
        "target": inputs["target"],
        "model": identity,
        "inputs": inputs,
        "fits": plan.fits,
        "memory": plan.memory,
        "nodes": nodes,
        "prediction": plan.prediction,
        "warnings": plan.warnings,
        "onnxruntime_options": options,
    }


def _expert_regions(model_path: Path, memory: MemoryModel, plan: Plan) -> list[dict[str, Any]]:
    """Where each expert tensor of the saved model lies in the data file, and its resident prefix."""
    proto = onnx.load(model_path, load_external_data=False)
    located = {}
    for t in proto.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if "location" in info:
            located[t.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]))
    regions = []
    model = ir.load(model_path)
    groups = {g.node: g for g in memory.groups}
    for m in moe_nodes(model.graph):
        resident = len(plan.resident[m.name])
        for value in m.expert_values:
            location, offset, length = located[value.name]
            regions.append(
                {
                    "node": m.name,
                    "tensor": value.name,
                    "file": location,
                    "offset": offset,
                    "length": length,
                    "resident_bytes": length // groups[m.name].experts * resident,
                }
            )
    return regions


def partition(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    vram: str | int,
    *,
    profile: str | os.PathLike | Popularity | None = None,
    context: int = 4096,
    batch: int = 1,
    prefill_tokens: int = 512,
    reserve: str | int = "512MiB",
    policy: str | None = None,
    mode: str = "auto",
    bandwidths: Bandwidths = Bandwidths(),
    report: str | os.PathLike | None = None,
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
    target: str = "auto",
    cuda_plugin: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    kernel_table: bool = True,
    cpu_profile: str | os.PathLike | None = None,
    calibrate: bool = True,
    threads: int | None = None,
    kv_cache: str = "keep",
) -> PartitionResult:
    """Plan expert placement for a GPU budget and write the annotated model, plan and options.

    target: "offload" (per expert, for the CUDA plugin EP's expert offload), "layers" (whole MoE
    nodes on the GPU or the CPU, through layer annotations the in-tree CUDA EP follows) or "auto":
    offload when the model is eligible and a CUDA plugin EP is named (`cuda_plugin` or
    $MOEPASS_CUDA_PLUGIN), layers otherwise. `kernel_table`: MoE nodes that ONNX Runtime's CUDA EP
    has no kernel for (moepass.core.capabilities) stay on the CPU in the plan, said before planning;
    False plans as if it took every node (an ONNX Runtime build whose kernels the table does not
    describe). `calibrate`: time pieces of the model on this CPU (`threads`; moepass.runtime.calibrate)
    for the CPU side of the prediction, or take them from `cpu_profile` (an earlier plan.json);
    False: the bandwidth model alone. `kv_cache`: "keep" the model's KV cache type, give a float32
    one another (float16, int8; moepass.kv_precision), or "auto": the type of AUTO_CHOICES with the
    fastest predicted decode (a cheaper cache leaves room for more resident experts), the most
    precise on a tie; plan.json says what each would have bought."""
    one_of(target, TARGETS, "target")
    for name, value in (("context", context), ("batch", batch), ("prefill_tokens", prefill_tokens)):
        if not isinstance(value, int) or value < 1:
            raise MoepassError(f"{name} must be a positive integer, not {value!r}")
    if report is not None and Path(report).suffix.lower() != ".png":
        raise MoepassError(f"{report}: the report is a PNG picture; name it *.png")
    source = model_file(model_dir)
    source_report = read_report(source.parent)  # copied into the output: one this moepass reads, before any work
    check_destination(output_dir, overwrite, is_dir=True, inputs=[source])  # the outputs before any work
    if report is not None:
        check_destination(report, overwrite, is_dir=False, inputs=[source])
    model = load_model(source)
    identity = model_identity(model)
    memory = MemoryModel.of(model)
    source_cache = cache_type_of(model)
    one_of(kv_cache, ("keep", "auto", *KV_CACHE_TYPES), "--kv-cache")
    kv_kinds: list[str | None]
    if kv_cache == "keep" or source_cache is None:
        kv_kinds = [source_cache]
    elif kv_cache == "auto":
        kv_kinds = [k for k in AUTO_CHOICES if k == source_cache or source_cache == "float32"]
    else:
        kv_kinds = [kv_cache]
    if kv_kinds[0] != source_cache and source_cache != "float32":
        raise MoepassError(
            f"{source}: the model's KV cache is {source_cache}; --kv-cache {kv_cache} applies to a "
            "float32 cache (convert the GGUF with --kv-cache instead)"
        )
    popularity, profile_info = None, None
    if profile is not None:
        label = str(profile) if not isinstance(profile, Popularity) else "profile"
        popularity = profile if isinstance(profile, Popularity) else Popularity.load(profile)
        popularity.check_fits(identity, label)
        profile_info = {"file": Path(label).name, "tokens": popularity.tokens, "prompts": popularity.prompts}
    budget = Budget(parse_bytes(vram, "--vram"), context, batch, prefill_tokens, parse_bytes(reserve, "--reserve"))
    if budget.vram_bytes <= 0:
        raise MoepassError(f"--vram {vram!r}: the GPU budget must be more than 0")
    if budget.reserve_bytes >= budget.vram_bytes:
        raise MoepassError(f"--reserve {reserve!r} leaves nothing of --vram {vram!r} for the model")
    violations = offload_violations(model)
    cuda_refusals_of = cuda_refusals(model) if kernel_table else {}
    if target == "auto":
        target = "offload" if not violations and (cuda_plugin or os.environ.get(PLUGIN_ENV)) else "layers"
    inactive = None
    if violations and target == "offload":  # said before planning: the plan would not change what ONNX Runtime does
        node, rule = violations[0]
        inactive = (
            f"{source.parent}: ONNX Runtime will not offload this model's experts ({node}: {rule}); "
            "convert the GGUF with --expert-format offload for a model it will"
        )
        if mode == "required":
            raise MoepassError(inactive)
    refused = {m.name: why for m in moe_nodes(model.graph) if (why := cuda_refusals_of.get(m.name))}
    if refused:  # said before planning; the plan keeps those layers on the CPU, where they will run
        name, why = next(iter(refused.items()))
        stays = (
            f"{source.parent}: ONNX Runtime's CUDA EP has no kernel for {len(refused)} of {len(memory.groups)} "
            f"MoE layers ({name}: {why}): they run on the CPU whatever the plan; convert the GGUF with "
            "--expert-format offload for a float16 graph whose every node the CUDA EP takes"
        )
        if mode == "required":
            raise MoepassError(stays)
        if warn is not None:
            warn(stays)
    costs = None
    if calibrate or cpu_profile is not None:
        from moepass.runtime.calibrate import cpu_costs

        costs = cpu_costs(source, threads, cpu_profile)
    plans = {}
    for kind in kv_kinds:  # one plan per KV cache type, its bytes per token in the memory model
        kind_memory = (
            memory
            if kind is None or source_cache is None or kind == source_cache
            else dataclasses.replace(
                memory,
                kv_bytes_per_token=memory.kv_bytes_per_token // KV_CACHE_TYPES[source_cache] * KV_CACHE_TYPES[kind],
            )
        )
        plans[kind] = (
            kind_memory,
            plan_placement(
                kind_memory,
                budget,
                popularity,
                policy,
                mode,
                bandwidths,
                target=target,
                cpu_only=frozenset(refused),
                cpu_costs=costs,
            ),
        )
    chosen = min(
        kv_kinds,
        key=lambda k: (
            round(plans[k][1].prediction["decode_ms_per_token"]["cold_experts_on_cpu"], 6),
            kv_kinds.index(k),
        ),
    )
    memory, plan = plans[chosen]
    if inactive and warn is not None:  # first, once the inputs are known to be good
        warn(inactive + "; the plan is written but inactive")
    for message in plan.warnings:
        if warn is not None:
            warn(message)
    options = onnxruntime_options(plan, memory.groups, mode, target)
    inputs = {
        "model": str(source),
        "target": target,
        "vram": str(vram),
        "context": context,
        "batch": batch,
        "prefill_tokens": prefill_tokens,
        "policy": plan.policy,
        "mode": mode,
        "profile": profile_info,
        "bandwidths_gbps": dataclasses.asdict(bandwidths),
    }
    document = _plan_document(plan, memory, inputs, identity, options)
    if source_cache is not None and chosen is not None:
        document["kv_cache"] = _kv_cache_choice(plans, chosen, source_cache, kv_cache)
    if costs is not None:
        document["cpu_costs"] = costs
    if target == "layers":
        if popularity is not None:  # what per-expert placement would serve at the same budget
            per_expert = plan_placement(
                memory, budget, popularity, policy, mode, bandwidths, target="offload", cpu_costs=costs
            )
            document["prediction"]["per_expert_alternative"] = {
                k: per_expert.prediction[k]
                for k in ("gpu_hit_rate_by_mass", "gpu_hit_rate_by_selection", "decode_ms_per_token")
            }
        AnnotateLayersPass({g.node: bool(plan.resident[g.node]) for g in memory.groups})(model)
    else:
        document["offload"] = {"active": inactive is None, "reason": inactive}
        ReorderExpertsPass(plan.order, {n: len(r) for n, r in plan.resident.items()})(model)
    model.metadata_props[keys.PLACEMENT] = json.dumps(
        {
            "plan": PLAN_FILE,
            "options": OPTIONS_FILE,
            "target": target,
            "vram_bytes": budget.vram_bytes,
            "policy": plan.policy,
            "resident_expert_bytes": plan.resident_bytes,
            "fingerprint": identity["fingerprint"],
        },
        sort_keys=True,
    )
    output_dir = Path(output_dir)
    with atomic_directory(output_dir, overwrite) as tmp:
        weights = _save(model, source, tmp, unchanged=target == "layers", progress=progress)
        document["expert_regions"] = _expert_regions(tmp / MODEL_FILE, memory, plan)
        (tmp / PLAN_FILE).write_text(json.dumps(document, indent=1) + "\n")
        placed = PlanReport.from_json(document, output_dir / PLAN_FILE)  # what readers of the file will take
        for name in (REPORT_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, tmp / name)
        # the cache retyped once the weights are in place and before the placement options (int8 is
        # calibrated on the CPU)
        if chosen is not None and chosen != source_cache:
            kv_cache_entry = set_kv_cache(tmp, chosen, source_cache, source_report.context_length, threads=threads)
            write_report(tmp, {**source_report.document, "kv_cache": kv_cache_entry})
        (tmp / OPTIONS_FILE).write_text(
            json.dumps({"session_config_entries": options, "placement": {"target": target, "mode": mode}}, indent=1)
            + "\n"
        )
        if (source.parent / GENAI_CONFIG_FILE).is_file():
            # a per-layer plan is for onnxruntime-genai-cuda's in-tree CUDA EP; expert offload needs the
            # plugin EP, which genai is not given here (docs/gpu.md, route (c))
            genai = with_session_entries(
                read_json_object(source.parent / GENAI_CONFIG_FILE),
                options,
                source.parent / GENAI_CONFIG_FILE,
                provider="cuda" if target == "layers" else None,
            )
            (tmp / GENAI_CONFIG_FILE).write_text(json.dumps(genai, indent=1, sort_keys=True) + "\n")
        if report is not None:
            from moepass.plan_report import draw_plan

            with atomic_file(report, overwrite) as picture:
                draw_plan(placed, popularity, picture)
    return PartitionResult(output_dir, placed, options, ([inactive] if inactive else []) + plan.warnings, weights)


def _kv_cache_choice(plans: dict, chosen: str, source: str, asked: str) -> dict[str, Any]:
    """plan.json's "kv_cache": the type chosen, why, and what each candidate would have bought."""

    def summary(kind: str) -> dict[str, Any]:
        _, plan = plans[kind]
        return {
            "kv_cache_bytes": plan.memory["kv_cache_bytes"],
            "bytes_per_value": KV_CACHE_TYPES[kind],
            "resident_experts": sum(len(r) for r in plan.resident.values()),
            "gpu_hit_rate_by_mass": plan.prediction["gpu_hit_rate_by_mass"],
            "decode_ms_per_token": plan.prediction["decode_ms_per_token"]["cold_experts_on_cpu"],
        }

    entry: dict[str, Any] = {
        "type": chosen,
        "source": source,
        "chosen_by": {"keep": "the model's", "auto": "auto"}.get(asked, "asked"),
        "candidates": {k: summary(k) for k in plans},
    }
    if chosen != source:
        was, now = entry["candidates"][source] if source in plans else None, entry["candidates"][chosen]
        if was is not None:
            entry["traded"] = (
                f"{chosen} KV frees {format_bytes(was['kv_cache_bytes'] - now['kv_cache_bytes'])}: "
                f"{now['resident_experts'] - was['resident_experts']} more experts resident, predicted "
                f"hit rate {was['gpu_hit_rate_by_mass']:.0%} -> {now['gpu_hit_rate_by_mass']:.0%}"
            )
    return entry


def _save(
    model: ir.Model, source: Path, folder: Path, unchanged: bool, progress: Callable[[int, int], None] | None
) -> str:
    """Write the placed model into `folder`. A per-layer plan only annotates nodes: when every weight
    still lies in the source's data file, that file is shared (hard link, reflink, else a copy) and
    only model.onnx is written, pointing into it as before; otherwise (reordered experts) the
    weights are written anew. Says which."""
    data = source.parent / DATA_FILE
    external = [
        v.const_value for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)
    ]
    if (
        unchanged
        and data.is_file()
        and external
        and all(
            Path(t.location) == Path(DATA_FILE) and Path(t.base_dir).resolve() == source.parent.resolve()
            for t in external
        )
    ):
        how = share_file(data, folder / DATA_FILE, progress)
        onnx.save(ir.to_proto(model), folder / MODEL_FILE)
        return (
            f"{DATA_FILE} shared with {source.parent} ({how}: per-layer placement changes no weight)"
            if how != "copy"
            else f"{DATA_FILE} copied as it is from {source.parent} (per-layer placement "
            "changes no weight; this file system has no reflinks to share it)"
        )
    save_model(model, folder / MODEL_FILE, progress)
    return f"{DATA_FILE} rewritten (experts reordered resident-first)"
