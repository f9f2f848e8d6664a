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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from moepass.core import keys
from moepass.core.architectures import architecture_of
from moepass.core.capabilities import cuda_refusals, offload_violations
from moepass.core.choices import KV_CACHE_TYPES, PLUGIN_ENV, TARGETS, format_bytes, one_of, parse_bytes, with_settings
from moepass.core.errors import MoepassError, wording
from moepass.core.files import (
    DATA_FILE,
    GENAI_CONFIG_FILE,
    MODEL_FILE,
    OPTIONS_FILE,
    PLAN_FILE,
    SHARED_DATA_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    copy_companion,
    read_json_object,
    recorded_path,
    refuse_linked,
    relative_to_folder,
    shared_data_identity,
)
from moepass.core.formats import (
    PLAN_FORMAT,
    PLAN_VERSION,
    ModelReport,
    PlacementMode,
    PlanReport,
    SessionOptionsFile,
    read_report,
    write_report,
)
from moepass.core.gguf_reader import GGUFModel, is_gguf
from moepass.core.gpus import Bandwidths
from moepass.core.ir_values import copy_model
from moepass.core.model_io import load_model, model_file, save_model
from moepass.core.moe_nodes import MoeNode, moe_nodes
from moepass.core.options import PARTITION_OPTIONS
from moepass.core.version import __version__
from moepass.passes.annotate_layers import AnnotateLayersPass
from moepass.passes.gpu_form import ExpertRows, GgufExperts, GpuFormPass, StoredExperts
from moepass.passes.kv_cache import KvCachePass
from moepass.passes.reorder_experts import ReorderExpertsPass
from moepass.passes.weights.report import WeightReport, merged_records
from moepass.pipeline import conversion as gguf_conversion
from moepass.pipeline.atomic import atomic_directory, atomic_file, check_destination
from moepass.pipeline.conversion import GgufConversion
from moepass.pipeline.genai import with_session_entries
from moepass.pipeline.kv_precision import AUTO_CHOICES, cache_type_of, set_kv_cache
from moepass.pipeline.placement import Budget, MemoryModel, Plan, Speeds, onnxruntime_options, plan_placement
from moepass.pipeline.popularity import Popularity, model_identity


@dataclasses.dataclass
class PartitionResult:
    output_dir: Path
    plan: PlanReport
    options: dict[str, str]
    warnings: list[str]
    weights: str = "rewritten"  # how model.onnx.data came to be: rewritten, or the source's shared (hard link, ...)
    report: Path | None = None  # the plan's picture, where one was asked for

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
        bandwidth = pred.bandwidths_gbps
        lines = [
            head,
            f"  VRAM budget      {format_bytes(mem.vram_bytes):>12}",
            f"  non-expert       {format_bytes(mem.non_expert_bytes):>12}",
            f"  KV cache         {format_bytes(mem.kv_cache_bytes):>12}  "
            f"(context {plan.inputs.context:,}"
            + (f": {plan.context_words}" if plan.context_words else "")
            + f", batch {plan.inputs.batch}"
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
            _decode_estimate(plan.target, decode, timed=pred.cpu is not None),
            f"  GPU figures      {bandwidth.get('gpu', 0):g} GB/s, link {bandwidth.get('pcie', 0):g}"
            f" GB/s ({Bandwidths(source=pred.bandwidths_from or 'given').advice()}); a step at least "
            f"{pred.gpu_step_floor_ms:.3g} ms "
            "(launches of its GPU nodes and a synchronisation, assumed)",
        ]
        if decode.cpu_only is not None and pred.cpu is not None:
            lines.append(
                f"  CPU only         {decode.cpu_only:.3g} ms/token with every layer on "
                f"this CPU ({pred.cpu.threads or 'default'} threads; MoE layers and the LM head's "
                "rate timed on this model)"
            )
            slower = _slower_than_the_cpu(plan.target, decode, pred.gpu_step_floor_ms)
            if slower:
                lines.append(f"  slower           {slower}")
        lines.append(f"  weights          {self.weights}")
        if self.report is not None:
            lines.append(f"  picture          {self.report} (the plan: popularity, residency and the budget)")
        other = pred.per_expert_alternative
        if other:
            lines.append(
                f"  per expert       {other.gpu_hit_rate_by_mass:.1%} of routing mass, "
                f"{other.decode_ms_per_token.cold_experts_on_cpu:.3g} ms/token at the same budget "
                f"(what the CUDA plugin EP's expert offload would add: {wording().option('--target', 'offload')}, "
                "which runs on onnxruntime 1.32 with that EP only; onnxruntime-gpu 1.31.1 refuses its form)"
            )
        return lines


def _slower_than_the_cpu(target: str, decode: Any, floor_ms: float | None) -> str | None:
    """Where the plan is predicted slower than every layer on this CPU: the two figures and why, in
    one line (None where it is not)."""
    gpu = decode.cold_experts_on_cpu
    if target != "layers":  # expert offload: the better of the two ways a cold expert is served
        gpu = min(gpu, decode.cold_experts_over_pcie)
    if decode.cpu_only is None or gpu <= decode.cpu_only:
        return None
    why = (
        f"a GPU step's launches and synchronisation alone take {floor_ms:.3g} ms (assumed), more than this CPU's "
        "whole step on a model this small"
        if floor_ms and floor_ms >= decode.cpu_only
        else "the layers and experts left in host memory cost more than the GPU saves"
    )
    figures = f"{gpu:.3g} against {decode.cpu_only:.3g} ms/token"
    return f"the GPU plan is predicted slower than this CPU alone ({figures}): {why}"


def _decode_estimate(target: str, decode: Any, timed: bool) -> str:
    """The summary's decode estimate: under --target layers the one the plan runs (its CPU layers on
    the CPU); for expert offload both ways a cold expert may be served."""
    how = "GPU side from the bandwidths, CPU side timed here" if timed else "bandwidth model, not a measurement"
    if target == "layers":
        return f"  decode estimate  {decode.cold_experts_on_cpu:.3g} ms/token (the plan's CPU layers on the CPU; {how})"
    return (
        f"  decode estimate  {decode.cold_experts_on_cpu:.3g} ms/token with cold experts on the CPU, "
        f"{decode.cold_experts_over_pcie:.3g} ms/token over PCIe ({how})"
    )


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


# ---- read: the model, what moepass knew of it, where its experts can be packed anew from ----------


@dataclasses.dataclass
class PartitionSource:
    """What partition starts from: a converted model's folder (its model read lazily, its weights
    left on disk) or a GGUF file lowered in this run (`conversion`), with its moepass.json and the
    GGUF its experts are packed anew from where the GPU form changes them."""

    label: Path
    folder: Path | None  # the converted model's folder; None for a GGUF lowered in this run
    report: ModelReport
    gguf: GgufSource
    conversion: GgufConversion | None = None
    _model: ir.Model | None = dataclasses.field(default=None, repr=False)

    @property
    def model(self) -> ir.Model:
        """The model as it came: the GGUF's lowering, or the folder's model.onnx read once (lazily: its
        weights stay on disk). Passes run on copies of it (`fresh`), never on it."""
        if self._model is None:
            self._model = self.conversion.model if self.conversion is not None else load_model(model_file(self.label))
        return self._model

    def fresh(self) -> tuple[ir.Model, GgufConversion | None]:
        """A fresh copy of the model (partition lowers one to plan on and another to write), and for
        GGUF input the conversion it belongs to (whose weight report its tensors fill in). The copy
        shares the source's tensors, which no pass changes in place: a GGUF is lowered once."""
        return copy_model(self.model), self.conversion

    @property
    def context_length(self) -> int | None:
        if self.conversion is not None:
            return self.conversion.lowered.hparams.context_length
        return self.report.context_length


@dataclasses.dataclass
class GgufSource:
    """The GGUF file a model was converted from, as moepass.json records it (its path and
    fingerprint), checked when its blocks are needed: a file that moved or changed is refused,
    naming it, unless `override` (--gguf) names one with the same fingerprint."""

    recorded: dict[str, Any]
    model_path: Path
    override: Path | None = None
    _open: GgufExperts | None = None

    def experts(self) -> GgufExperts | None:
        """The file, checked; None where the model came from no GGUF (an ONNX model's)."""
        if self._open is not None:
            return self._open
        if not self.recorded and self.override is None:
            return None
        recorded = self.recorded.get("path")
        path = self.override or (recorded_path(recorded, self.model_path.parent) if recorded else None)
        fingerprint = self.recorded.get("fingerprint")
        if path is None or fingerprint is None:
            raise MoepassError(
                f"{self.model_path}: its moepass.json records no GGUF path and fingerprint (converted by an "
                f"older moepass); its GPU form needs the file's own blocks: pass {wording().option('--gguf', 'FILE')}"
            )
        if not path.is_file():
            raise MoepassError(
                f"{path}: the GGUF file {self.model_path.parent} was converted from is not there any more; its "
                f"GPU form needs the file's own blocks: pass {wording().option('--gguf', 'FILE')} where it is now"
            )
        gguf = GGUFModel(path)
        if gguf.fingerprint() != fingerprint:
            raise MoepassError(
                f"{path}: not the GGUF file {self.model_path.parent} was converted from (it changed: another "
                f"fingerprint); convert it again, or pass {wording().option('--gguf', 'FILE')} with the file it was "
                "made from"
            )
        arch = architecture_of(gguf)
        self._open = GgufExperts(gguf, arch, arch.read_hparams(gguf))
        return self._open


class PartitionExperts:
    """ExpertSources for gpu-form: a node whose form holds keeps its codes (the model's own); one
    that changes is packed from the GGUF's own blocks; a model from no GGUF, from its stored values."""

    def __init__(self, gguf: GgufSource):
        self.gguf = gguf

    def rows(self, moe: MoeNode) -> ExpertRows:
        experts = self.gguf.experts()
        if experts is None:
            stored = StoredExperts().rows(moe)
            return dataclasses.replace(stored, origin=f"{stored.origin} (it came from no GGUF)")
        return experts.rows(moe)


def read_source(model: str | os.PathLike, gguf: str | os.PathLike | None = None) -> PartitionSource:
    """The model partition places: a converted folder (or its model.onnx), or a GGUF file, which is
    lowered here with convert's defaults (nothing written until the placed model is)."""
    label = Path(model)
    if label.is_file() and is_gguf(label):
        lowering = gguf_conversion.ConvertOptions().lowering()  # convert's defaults
        conversion = gguf_conversion.lower_gguf_file(label, lowering, echo=lambda line: None)
        hparams = {"context_length": conversion.lowered.hparams.context_length}
        report = ModelReport({"input": "gguf"}, input="gguf", hparams=hparams)
        recorded = {"path": str(label.resolve()), "fingerprint": conversion.gguf.fingerprint()}
        return PartitionSource(
            label, None, report, GgufSource(recorded, label, Path(gguf) if gguf else None), conversion
        )
    source = model_file(label)
    report = read_report(source.parent)
    recorded = report.document.get("source", {}) if report.input == "gguf" else {}
    return PartitionSource(
        source, source.parent, report, GgufSource(dict(recorded), source, Path(gguf) if gguf else None)
    )


# ---- lower: the GPU form of a placement -----------------------------------------------------------


@dataclasses.dataclass
class LoweredModel:
    """A model lowered for a placement: the model, the GPU form's records (where experts came from
    among them), and for GGUF input the conversion the model belongs to."""

    model: ir.Model
    report: WeightReport
    gpu_form: GpuFormPass | None
    conversion: GgufConversion | None = None

    def cpu_nodes(self) -> dict[str, str]:
        """Non-MoE nodes no CUDA kernel takes (they run on the CPU, as the plan counts them)."""
        return dict(self.gpu_form.cpu_refused) if self.gpu_form is not None else {}


def lower_for(source: PartitionSource, target: str, gpu_moe: frozenset[str], lower: bool, threads: int | None):
    """A fresh model lowered for `target` with `gpu_moe` on the GPU (lower=False: as it is)."""
    model, conversion = source.fresh()
    if not lower:
        return LoweredModel(model, WeightReport(), None, conversion)
    report = WeightReport()
    gpu_form = GpuFormPass(target, gpu_moe, PartitionExperts(source.gguf), report, workers=threads)
    gpu_form(model)
    return LoweredModel(model, report, gpu_form, conversion)


def check_gpu_nodes(lowered: LoweredModel, target: str, gpu_moe: frozenset[str]) -> None:
    """Every node the plan puts on the GPU in a form its EP takes (capabilities' kernel table and,
    for the offload target, the offload rules): otherwise partition refuses, naming node and rule,
    before anything is written."""
    model = lowered.model
    cpu_moe = {m.name for m in moe_nodes(model.graph) if target == "layers" and m.name not in gpu_moe}
    kept = set(lowered.cpu_nodes())
    for name, why in cuda_refusals(model).items():
        if name in cpu_moe or name in kept:
            continue
        node = next((n for n in model.graph if (n.name or n.op_type) == name), None)
        if node is not None and node.op_type == "Cast":
            continue  # the casts at a CPU layer's boundary: no weights, on either side
        raise MoepassError(f"{name}: planned for the GPU but {why}; moepass's GPU form should have made it one (a bug)")
    if target == "offload":
        for moe_name, rule in offload_violations(model):
            words = wording()
            convert_int4 = words.call("convert", words.option("--float-experts", "int4"))
            hint = f"; convert with {convert_int4} (or int8)" if "float MoE" in rule else ""
            raise MoepassError(f"{moe_name}: planned for expert offload, but {rule}{hint}")


@dataclasses.dataclass(frozen=True)
class PartitionOptions:
    """How partition plans and lowers: the Python API's keywords and, under the same names, the
    CLI's flags (moepass.cli maps its flag spellings onto these fields).

    target: "offload" (per expert, for the CUDA plugin EP's expert offload), "layers" (whole MoE
    nodes on the GPU or the CPU, through layer annotations the in-tree CUDA EP follows) or "auto":
    offload when a CUDA plugin EP is named (`cuda_plugin` or $MOEPASS_CUDA_PLUGIN), layers otherwise.
    `lower`=False keeps the model's form (annotations and order only): a node the GPU's EP has no
    kernel for then stays on the CPU in the plan (`kernel_table`; False plans as if it took every
    node: an ONNX Runtime build whose kernels the table does not describe). `context`: the KV
    cache's tokens (default: the model's, at most DEFAULT_CONTEXT). `calibrate`: time pieces of the
    model on this CPU (`threads`; moepass.runtime.calibrate) for the CPU side of the prediction, or
    take them from `cpu_profile` (an earlier plan.json); False: the bandwidth model alone.
    `kv_cache`: "keep" the model's KV cache type, give a float32 one another (float16, int8;
    moepass.pipeline.kv_precision), or "auto": the type of AUTO_CHOICES with the fastest predicted decode.
    `gguf`: where the GGUF the model was converted from is now, if it moved. `report`: a PNG
    picture of the plan."""

    # each default is its option's (moepass.core.options.PARTITION_OPTIONS), declared once for the CLI too
    profile: str | os.PathLike | Popularity | None = PARTITION_OPTIONS["profile"].default
    context: int | None = PARTITION_OPTIONS["context"].default
    batch: int = PARTITION_OPTIONS["batch"].default
    prefill_tokens: int = PARTITION_OPTIONS["prefill_tokens"].default
    reserve: str | int = PARTITION_OPTIONS["reserve"].default
    policy: str | None = PARTITION_OPTIONS["policy"].default
    mode: str = PARTITION_OPTIONS["mode"].default
    bandwidths: Bandwidths = Bandwidths()  # the CLI composes it from three flags and --gpu's data sheet
    report: str | os.PathLike | None = PARTITION_OPTIONS["report"].default
    target: str = PARTITION_OPTIONS["target"].default
    cuda_plugin: str | os.PathLike | None = PARTITION_OPTIONS["cuda_plugin"].default
    kernel_table: bool = PARTITION_OPTIONS["kernel_table"].default
    cpu_profile: str | os.PathLike | None = PARTITION_OPTIONS["cpu_profile"].default
    calibrate: bool = PARTITION_OPTIONS["calibrate"].default
    threads: int | None = None  # ONNX Runtime's: every core (the CLI's --threads, shared by commands)
    kv_cache: str = PARTITION_OPTIONS["kv_cache"].default
    lower: bool = PARTITION_OPTIONS["lower"].default
    gguf: str | os.PathLike | None = PARTITION_OPTIONS["gguf"].default

    def __post_init__(self) -> None:
        one_of(self.target, TARGETS, "target")
        for name, value in (("batch", self.batch), ("prefill_tokens", self.prefill_tokens)):
            if not isinstance(value, int) or value < 1:
                raise MoepassError(f"{name} must be a positive integer, not {value!r}")
        if self.context is not None and (not isinstance(self.context, int) or self.context < 1):
            raise MoepassError(f"context must be a positive integer, not {self.context!r}")
        if self.report is not None and Path(self.report).suffix.lower() != ".png":
            raise MoepassError(f"{self.report}: the report is a PNG picture; name it *.png")

    @classmethod
    def of(cls, options: PartitionOptions | None, settings: dict[str, Any]) -> PartitionOptions:
        """`options` (default: the defaults) with `settings` in place of its fields; an unknown name is
        refused, naming the nearest field."""
        return with_settings(cls, options, settings, "partition")


def partition(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike | None,
    vram: str | int,
    options: PartitionOptions | None = None,
    *,
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    **settings: Any,
) -> PartitionResult:
    """Plan expert placement for a GPU budget and write the model lowered for it, the plan and options.

    Stages: read (the converted model, or a GGUF lowered with convert's defaults), plan (the memory
    model of the GPU form, placement, prediction: moepass.pipeline.placement), lower (passes/gpu_form.py:
    float16 on the GPU, each MoE node there in the form its EP takes, experts packed anew from the
    GGUF's own blocks where that form differs; the layer annotations or the expert order), write
    (what changed; the source's unchanged weights shared with it, `output_dir`/shared.onnx.data).
    `options` (PartitionOptions) says how; `settings` are its fields by name (target="layers", ...)."""
    options = PartitionOptions.of(options, settings)
    label = Path(model_dir)
    output_dir = Path(output_dir) if output_dir is not None else default_output(label)
    # ---- read
    source = read_source(label, options.gguf)
    inputs_of = _check_outputs(source, output_dir, options.report, overwrite)
    request = PlanRequest.of(source, vram, options)
    # ---- plan, on the memory model of the GPU form (every MoE node lowered for the GPU)
    placement = plan_for(source, request, options)
    for message in placement.warnings_said():
        if warn is not None:
            warn(message)
    # ---- lower for the plan
    lowered = lower_for_plan(source, request, placement, options)
    document = placement.document(request, options, relative_to_folder(label, output_dir))
    # ---- write
    with atomic_directory(output_dir, overwrite, inputs=inputs_of) as tmp:
        weights_how = _write_model(source, lowered, lowered.model, tmp, progress, options.threads)
        placed = _write_placed(source, lowered, placement, document, weights_how, tmp, output_dir, options)
        if options.report is not None:
            from moepass.pipeline.plan_report import draw_plan

            with atomic_file(options.report, overwrite) as picture:
                draw_plan(placed, request.popularity, picture)
    report = Path(options.report) if options.report is not None else None
    return PartitionResult(output_dir, placed, placement.options, placement.warnings(), weights_how, report)


def _check_outputs(
    source: PartitionSource, output_dir: Path, report: str | os.PathLike | None, overwrite: bool
) -> list[Path]:
    """The outputs checked before minutes of work (and the files copied at the end); the inputs no
    output may replace."""
    if source.folder is not None:
        refuse_linked(source.folder, (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE))
    inputs_of = [source.label] if source.folder is None else [model_file(source.label)]
    check_destination(output_dir, overwrite, is_dir=True, inputs=inputs_of)
    if report is not None:
        check_destination(report, overwrite, is_dir=False, inputs=inputs_of)
    return inputs_of


@dataclasses.dataclass
class PlanRequest:
    """What a plan is asked for, resolved against the model: its target, KV cache tokens, popularity
    and budget."""

    label: Path
    model: ir.Model  # the source model (read lazily: its weights stay on disk)
    identity: dict[str, Any]
    cache: str | None  # the source model's KV cache type
    target: str
    vram: str | int
    context: int
    context_words: str
    popularity: Popularity | None
    profile_info: dict[str, Any] | None
    budget: Budget

    @classmethod
    def of(cls, source: PartitionSource, vram: str | int, options: PartitionOptions) -> PlanRequest:
        model = source.model
        identity = model_identity(model)
        words = wording()
        one_of(options.kv_cache, ("keep", "auto", *KV_CACHE_TYPES), words.name("--kv-cache"))
        target = options.target
        if target == "auto":
            named = options.cuda_plugin or os.environ.get(PLUGIN_ENV)
            target = "offload" if named and (options.lower or not offload_violations(model)) else "layers"
        context, context_words = planned_context(options.context, source.context_length)
        popularity, profile_info = _popularity(options.profile, identity)
        budget = Budget(
            parse_bytes(vram, words.name("--vram")),
            context,
            options.batch,
            options.prefill_tokens,
            parse_bytes(options.reserve, words.name("--reserve")),
        )
        if budget.vram_bytes <= 0:
            raise MoepassError(f"{words.option('--vram', vram)}: the GPU budget must be more than 0")
        if budget.reserve_bytes >= budget.vram_bytes:
            raise MoepassError(
                f"{words.option('--reserve', options.reserve)} leaves nothing of {words.option('--vram', vram)} "
                "for the model"
            )
        cache = cache_type_of(model)
        return cls(
            source.label, model, identity, cache, target, vram, context, context_words, popularity, profile_info, budget
        )


def _popularity(
    profile: str | os.PathLike | Popularity | None, identity: dict[str, Any]
) -> tuple[Popularity | None, dict[str, Any] | None]:
    """The expert popularity a plan weighs (checked against the model), and plan.json's note of it."""
    if profile is None:
        return None, None
    label = str(profile) if not isinstance(profile, Popularity) else "profile"
    popularity = profile if isinstance(profile, Popularity) else Popularity.load(profile)
    popularity.check_fits(identity, label)
    return popularity, {"file": Path(label).name, "tokens": popularity.tokens, "prompts": popularity.prompts}


@dataclasses.dataclass
class Placement:
    """The plan stage's outcome: the model lowered to plan on, the memory model and plan chosen (one
    per KV cache type weighed), the CPU's timed costs, and what partition has to say about them."""

    planning: LoweredModel
    memory: MemoryModel
    plan: Plan
    plans: dict[str | None, tuple[MemoryModel, Plan]]
    kv_type: str | None  # the KV cache type chosen
    cache: str | None  # the planned model's own (its GPU form's)
    every: frozenset[str]  # the model's MoE nodes
    costs: dict[str, Any] | None
    before: list[str]  # warnings before the plan's own
    inactive: str | None  # why ONNX Runtime will not offload the model, where it will not
    options: dict[str, str] = dataclasses.field(default_factory=dict)  # ONNX Runtime's session entries

    def warnings_said(self) -> list[str]:
        """The warnings as partition says them while it works."""
        inactive = [self.inactive + "; the plan is written but inactive"] if self.inactive else []
        return self.before + inactive + self.plan.warnings

    def warnings(self) -> list[str]:
        return self.before + ([self.inactive] if self.inactive else []) + self.plan.warnings

    def gpu_moe(self, target: str) -> frozenset[str]:
        """The MoE nodes that run on the GPU: under --target layers the nodes the plan places."""
        if target != "layers":
            return self.every
        return frozenset(g.node for g in self.memory.groups if self.plan.resident[g.node])

    def document(self, request: PlanRequest, options: PartitionOptions, model: str) -> dict[str, Any]:
        """plan.json before the write adds where the weights went. `model`: the source, relative to the
        placed folder."""
        plan, memory = self.plan, self.memory
        inputs = {
            "model": model,
            "target": request.target,
            "vram": str(request.vram),
            "context": request.context,
            "batch": options.batch,
            "prefill_tokens": options.prefill_tokens,
            "policy": plan.policy,
            "mode": options.mode,
            "profile": request.profile_info,
            "bandwidths_gbps": options.bandwidths.gbps(),
            "bandwidths_from": options.bandwidths.source,
        }
        document = _plan_document(plan, memory, inputs, request.identity, self.options)
        document["warnings"] = self.warnings()
        document["context_words"] = request.context_words
        if self.cache is not None and self.kv_type is not None:
            document["kv_cache"] = _kv_cache_choice(self.plans, self.kv_type, self.cache, options.kv_cache)
        if self.costs is not None:
            document["cpu_costs"] = self.costs
        if request.target == "layers" and request.popularity is not None:
            # what per-expert placement would serve at the same budget
            per_expert = plan_placement(
                memory,
                request.budget,
                request.popularity,
                options.policy,
                options.mode,
                Speeds(options.bandwidths, self.costs),
                target="offload",
            )
            document["prediction"]["per_expert_alternative"] = {
                k: per_expert.prediction[k]
                for k in ("gpu_hit_rate_by_mass", "gpu_hit_rate_by_selection", "decode_ms_per_token")
            }
        document["active"] = self.inactive is None
        document["inactive_reason"] = self.inactive
        return document


def plan_for(source: PartitionSource, request: PlanRequest, options: PartitionOptions) -> Placement:
    """The plan: on the memory model of the GPU form, one per KV cache type weighed, the fastest
    predicted decode chosen."""
    every = frozenset(m.name for m in moe_nodes(request.model.graph))
    planning = lower_for(source, request.target, every, options.lower, options.threads)
    memory = MemoryModel.of(planning.model, kernel_table=options.kernel_table, cpu_nodes=planning.cpu_nodes())
    inactive = _inactive(request, options)
    refused = frozenset(memory.cpu_only)
    before = _cpu_only_layers(request, options, memory, planning.model, refused)
    costs = None
    if (options.calibrate or options.cpu_profile is not None) and source.folder is not None:
        from moepass.runtime.calibrate import cpu_costs

        costs = cpu_costs(source.label, options.threads, options.cpu_profile)
    cache = cache_type_of(planning.model) if options.lower else request.cache  # the GPU form's: float16 for float32
    kv_kinds = _kv_kinds(options.kv_cache, cache, options.lower)
    plans = {}
    for kind in kv_kinds:  # one plan per KV cache type, its bytes per token in the memory model
        kind_memory = memory
        if kind is not None and cache is not None and kind != cache:
            per_token = memory.kv_bytes_per_token // KV_CACHE_TYPES[memory.kv_type] * KV_CACHE_TYPES[kind]
            kind_memory = dataclasses.replace(memory, kv_bytes_per_token=per_token)
        plans[kind] = (
            kind_memory,
            plan_placement(
                kind_memory,
                request.budget,
                request.popularity,
                options.policy,
                options.mode,
                Speeds(options.bandwidths, costs),
                target=request.target,
                cpu_only=refused,
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
    placement = Placement(planning, memory, plan, plans, chosen, cache, every, costs, before, inactive)
    placement.options = onnxruntime_options(plan, memory.groups, options.mode, request.target)
    return placement


def _inactive(request: PlanRequest, options: PartitionOptions) -> str | None:
    """Why ONNX Runtime will not offload a model kept in its form (--keep-form) whose experts break
    the offload rules; refused under mode "required"."""
    if options.lower or request.target != "offload":
        return None
    violations = offload_violations(request.model)
    if not violations:
        return None
    node, rule = violations[0]
    words = wording()
    lowering = f"without {words.option('--keep-form')}" if words.cli else "lower=True, the default"
    inactive = (
        f"{request.label}: ONNX Runtime will not offload this model's experts ({node}: {rule}); let partition "
        f"lower it ({lowering}) for a model it will"
    )
    if options.mode == "required":
        raise MoepassError(inactive)
    return inactive


def _cpu_only_layers(
    request: PlanRequest, options: PartitionOptions, memory: MemoryModel, model: ir.Model, refused: frozenset[str]
) -> list[str]:
    """MoE layers no CUDA kernel takes even in the GPU form (a hidden or expert size the QMoE kernel's
    tiles do not divide): the plan keeps them on the CPU, and says so (or refuses, where it cannot)."""
    if not refused:
        return []
    name = sorted(refused)[0]
    why = cuda_refusals(model)[name]
    count = f"{len(refused)} of {len(memory.groups)} MoE layers"
    if not options.lower:
        stays = (
            f"{request.label}: ONNX Runtime's CUDA EP has no kernel for {count} ({name}: {why}): with "
            f"{wording().option('--keep-form')} they run on the CPU whatever the plan; without it partition writes "
            "the GPU form, whose every GPU node the CUDA EP takes"
        )
    elif request.target == "offload":
        raise MoepassError(
            f"{name}: ONNX Runtime's CUDA EP has no kernel for this MoE layer ({why}), and "
            f"{wording().option('--target', 'offload')} places experts of layers on the GPU; "
            f"{wording().option('--target', 'layers')} keeps such layers on the CPU"
        )
    else:
        stays = (
            f"{request.label}: {count} stay on the CPU: ONNX Runtime's CUDA EP has no kernel for them ({name}: {why})"
        )
    if options.mode == "required":
        raise MoepassError(stays)
    return [stays]


def lower_for_plan(
    source: PartitionSource, request: PlanRequest, placement: Placement, options: PartitionOptions
) -> LoweredModel:
    """The model to write: lowered for the plan's GPU nodes (the model planned on where the plan puts
    every MoE node on the GPU, or lowers none), checked, annotated or reordered, the plan in its
    metadata."""
    target, plan = request.target, placement.plan
    gpu_moe = placement.gpu_moe(target)
    lowered = placement.planning
    if gpu_moe != placement.every and options.lower:
        lowered = lower_for(source, target, gpu_moe, options.lower, options.threads)
    if options.lower:
        check_gpu_nodes(lowered, target, gpu_moe)
    model = lowered.model
    if target == "layers":
        AnnotateLayersPass({g.node: bool(plan.resident[g.node]) for g in placement.memory.groups})(model)
    else:
        ReorderExpertsPass(plan.order, {n: len(r) for n, r in plan.resident.items()})(model)
    if placement.kv_type == "float16" and placement.cache == "float32":  # int8's is calibrated on the written model
        KvCachePass("float16")(model)
    model.metadata_props[keys.PLACEMENT] = json.dumps(
        {
            "plan": PLAN_FILE,
            "options": OPTIONS_FILE,
            "target": target,
            "vram_bytes": request.budget.vram_bytes,
            "policy": plan.policy,
            "resident_expert_bytes": plan.resident_bytes,
            "fingerprint": request.identity["fingerprint"],
        },
        sort_keys=True,
    )
    return lowered


def _write_placed(
    source: PartitionSource,
    lowered: LoweredModel,
    placement: Placement,
    document: dict[str, Any],
    weights_how: str,
    tmp: Path,
    output_dir: Path,
    options: PartitionOptions,
) -> PlanReport:
    """Beside the written model: plan.json, the source's companions and moepass.json, the KV cache's
    retype, the options and genai_config.json. Returns the plan as readers of the file take it."""
    document["lowering"] = _lowering_record(lowered, lowered.model, options.lower, weights_how)
    if (tmp / SHARED_DATA_FILE).is_file():
        document["shared_data"] = {
            "file": SHARED_DATA_FILE,
            "source": relative_to_folder((source.folder or tmp) / DATA_FILE, tmp),
            "identity": shared_data_identity(tmp / SHARED_DATA_FILE),  # checked at every load
        }
    document["expert_regions"] = _expert_regions(tmp / MODEL_FILE, placement.memory, placement.plan)
    # the file is the plan's class written out, what its readers take: a key no field reads is refused
    placed = PlanReport.from_json(document, output_dir / PLAN_FILE, strict=True)
    (tmp / PLAN_FILE).write_text(json.dumps(placed.to_json(), indent=1) + "\n")
    if source.folder is not None:
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            copy_companion(source.folder, name, tmp)
        _write_report(source, lowered, tmp)
    # an int8 cache once the weights are in place and before the placement options (it is calibrated
    # on the CPU, running the written model); a float16 one was given before the write
    chosen, cache = placement.kv_type, cache_type_of(lowered.model)  # float16 given before the write
    if chosen is not None and chosen != placement.cache:
        entry = set_kv_cache(tmp, chosen, cache, source.context_length, threads=options.threads)
        write_report(tmp, {**read_report(tmp).document, "kv_cache": entry})
    target = placed.target
    SessionOptionsFile(dict(placement.options), PlacementMode(target, options.mode)).write(tmp)
    genai_source = tmp / GENAI_CONFIG_FILE if source.folder is None else source.folder / GENAI_CONFIG_FILE
    if genai_source.is_file():
        # a per-layer plan is for onnxruntime-genai-cuda's in-tree CUDA EP; expert offload needs the
        # plugin EP, which genai is not given here (docs/gpu.md, route (c))
        provider = "cuda" if target == "layers" else None
        genai = with_session_entries(read_json_object(genai_source), placement.options, genai_source, provider=provider)
        (tmp / GENAI_CONFIG_FILE).write_text(json.dumps(genai, indent=1, sort_keys=True) + "\n")
    return placed


DEFAULT_CONTEXT = 4096  # the KV cache partition plans for unless told: the model's context, at most this


def planned_context(asked: int | None, model_context: int | None) -> tuple[int, str]:
    """The KV cache's tokens a plan holds, and how it came to be, in words."""
    if asked is not None:
        return asked, f"asked ({wording().name('--context')})"
    given = wording().option("--context", "N")
    if model_context is None:
        return DEFAULT_CONTEXT, f"{DEFAULT_CONTEXT:,} (the model records no context; {given})"
    if model_context <= DEFAULT_CONTEXT:
        return model_context, "the model's"
    return DEFAULT_CONTEXT, f"the model's {model_context:,} capped at {DEFAULT_CONTEXT:,}; {given}"


def default_output(model: Path) -> Path:
    """Where a plan goes when no -o is given: beside the model, MODEL-placed."""
    folder = model.parent if model.is_file() and not is_gguf(model) else model
    stem = folder.stem if folder.is_file() else folder.name
    return folder.parent / f"{stem}-placed"


def _kv_kinds(kv_cache: str, source_cache: str | None, lowered: bool) -> list[str | None]:
    """The KV cache types a plan weighs: the model's (its GPU form's: float16 for a float32 cache,
    whose type no CUDA kernel takes), or what --kv-cache asks of it."""
    if kv_cache == "keep" or source_cache is None:
        return [source_cache]
    if lowered and source_cache == "float16":
        if kv_cache == "float32":
            words = wording()
            raise MoepassError(
                f"{words.option('--kv-cache', 'float32')}: no CUDA kernel takes a float32 cache (GroupQueryAttention's "
                f"are float16 or bfloat16 with a float16 or int8 cache); {words.option('--keep-form')} keeps the "
                "model's float32 cache"
            )
        return ["float16", "int8"] if kv_cache == "auto" else [kv_cache]
    if kv_cache == "auto":
        return [k for k in AUTO_CHOICES if k == source_cache or source_cache == "float32"]
    if source_cache != "float32" and kv_cache != source_cache:
        raise MoepassError(
            f"the model's KV cache is {source_cache}; {wording().option('--kv-cache', kv_cache)} applies to a "
            f"float32 cache (convert the GGUF with {wording().name('--kv-cache')} instead)"
        )
    return [kv_cache]


def _write_model(
    source: PartitionSource,
    lowered: LoweredModel,
    model: ir.Model,
    tmp: Path,
    progress: Callable[[int, int], None] | None,
    threads: int | None,
) -> str:
    """The placed model's files; says how its weights came to be."""
    if lowered.conversion is not None:  # a GGUF lowered in this run: written as convert writes it
        conversion = dataclasses.replace(lowered.conversion, model=model)
        options = gguf_conversion.ConvertOptions(threads=threads)
        gguf_conversion.write_gguf_conversion(
            conversion, tmp, options, progress, echo=lambda line: None, also=lowered.report
        )
        return f"{DATA_FILE} written (converted from {source.label.name} in this run)"
    assert source.folder is not None
    how = save_model(model, tmp / MODEL_FILE, progress, share_from=source.folder / DATA_FILE)
    if how == "written":
        return f"{DATA_FILE} written anew (every weight changed)"
    if how == "copied":
        return (
            f"{DATA_FILE} written anew: the GPU form changes most of {source.folder.name}'s bytes (what it keeps "
            "copied, not linked: a link would keep the whole source file alive)"
        )
    new = (tmp / DATA_FILE).stat().st_size if (tmp / DATA_FILE).is_file() else 0
    return (
        f"{SHARED_DATA_FILE}: {source.folder.name}'s weights, shared ({how}); {DATA_FILE}: the {new:,} bytes "
        "the GPU form changed"
    )


def _write_report(source: PartitionSource, lowered: LoweredModel, tmp: Path) -> None:
    """The source's moepass.json, its weight records updated where the GPU form changed them, its
    GGUF's path recorded from the placed folder (a sibling of `tmp`: the same relative path)."""
    document = dict(source.report.document)
    if not document:
        return
    recorded = document.get("source")
    if isinstance(recorded, dict) and isinstance(recorded.get("path"), str) and source.folder is not None:
        gguf = recorded_path(recorded["path"], source.folder)
        document["source"] = {**recorded, "path": relative_to_folder(gguf, tmp)}
    if lowered.gpu_form is not None:
        document["weights"] = merged_records(list(document.get("weights", [])), lowered.report)
    write_report(tmp, document)


def _lowering_record(lowered: LoweredModel, model: ir.Model, lower: bool, weights: str) -> dict[str, Any]:
    gpu_form = lowered.gpu_form
    rounded = gpu_form.rounded if gpu_form is not None else []
    return {
        "lowered": lower,
        "forms": {m.name: str(m.form or "float") for m in moe_nodes(model.graph)},
        "reformed": dict(gpu_form.packed_from) if gpu_form is not None else {},
        "float16_initializers": len(rounded),
        "max_float16_rounding": max((r.rel_rms_error for r in rounded), default=0.0),
        "weights": weights,
        "cpu_nodes": lowered.cpu_nodes(),
    }


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
