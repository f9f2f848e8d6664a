"""The JSON files moepass writes and reads, one class each, which writes the file and reads it:
moepass.json (`ModelReport`), plan.json (`PlanReport` and its parts), onnxruntime_options.json
(`SessionOptionsFile`). A writer checks its document strictly (a key no field reads is refused) and
writes what the class holds (`plain_json`); a reader checks every field against its type
(`typed_from_json`), naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepass.core.choices import ACTIVATION_MODES, PASS_NAMES
from moepass.core.errors import MoepassError
from moepass.core.files import (
    OPTIONS_FILE,
    PLAN_FILE,
    REPORT_FILE,
    SHARED_DATA_FILE,
    read_json_object,
    recorded_path,
    shared_data_identity,
)

if TYPE_CHECKING:
    pass

# moepass.json's schema (docs/design.md, "moepass.json"): 1 since GGUF and ONNX conversions write one
# schema; a file without the field (written before) reads as schema 0, which differs in nothing read
REPORT_SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """moepass.json: the one class its writers (convert's two routes, partition) write through
    (`to_json`, each top-level key a field; a key no field reads refused when written) and its readers
    take it by (`from_json`: each field checked once, here, naming the file). The sections other
    modules own (hparams, tokenizer, weight records, MoE layers, the KV cache's calibration) are JSON
    objects whose read parts are checked here; `document` is the JSON read ({} where a folder has
    none)."""

    document: dict[str, Any] = dataclasses.field(compare=False, repr=False)
    schema: int = REPORT_SCHEMA
    moepass_version: str = ""  # the moepass that converted the model (partition keeps it)
    input: str | None = None  # "gguf" or "onnx" (None before schema 1)
    source: dict[str, Any] = dataclasses.field(default_factory=dict)  # the file converted, its path, fingerprint
    architecture: str | None = None  # the GGUF architecture ("onnx" for ONNX input without one)
    activations: str = "float"  # "int8": inside the quantized products (absent before: float)
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)  # HParams.as_dict()
    tokenizer: dict[str, Any] = dataclasses.field(default_factory=dict)  # what tokenizer.json was made from
    moe_layers: tuple[dict[str, Any], ...] = ()  # per MoE layer: node, experts, top-k, form
    weights: tuple[dict[str, Any], ...] = ()  # per initializer group: sources, target form, bytes, error
    fusion: tuple[dict[str, Any], ...] = ()  # ONNX input: what fuse-moe did with each candidate
    kv_cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # its type, and int8's calibration

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.get("stop_token_ids", ()))

    @property
    def context_length(self) -> int | None:
        """Positions the model has RoPE tables for (GGUF conversions)."""
        return self.hparams.get("context_length")

    def to_json(self) -> dict[str, Any]:
        """moepass.json as written: every field but an empty section or an unknown architecture (an
        absent one reads as such), in the current schema."""
        fields = {k: v for k, v in plain_json(self).items() if v is not None and v != {}}
        return {**fields, "schema": REPORT_SCHEMA}

    @classmethod
    def from_json(cls, document: dict[str, Any], path: Path, strict: bool = False) -> ModelReport:
        """The report of a moepass.json object read from `path`. `strict` (the writer's check): a
        top-level key no field reads is refused."""
        if "moepass_version" not in document:
            raise MoepassError(f"{path}: not moepass's (no moepass_version)")
        schema = document.get("schema", 0)
        if not isinstance(schema, int) or isinstance(schema, bool) or not 0 <= schema <= REPORT_SCHEMA:
            raise MoepassError(
                f"{path}: schema {schema!r}; this moepass reads schemas 0 to {REPORT_SCHEMA} "
                "(a newer moepass wrote it?)"
            )
        if strict:
            refuse_unread(cls, document, path, "")
        if not isinstance(document["moepass_version"], str):
            raise MoepassError(f"{path}: 'moepass_version' must be a string")
        sections = {key: json_field(document, key, dict, path) for key in ("source", "hparams", "tokenizer")}
        sections["kv_cache"] = json_field(document, "kv_cache", dict, path)
        stop = json_field(sections["tokenizer"], "stop_token_ids", list, path)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            raise MoepassError(f"{path}: tokenizer.stop_token_ids must be integers")
        context = sections["hparams"].get("context_length")
        if context is not None and (not isinstance(context, int) or isinstance(context, bool) or context < 1):
            raise MoepassError(f"{path}: hparams.context_length must be a positive integer")
        records = {key: json_field(document, key, list, path) for key in ("moe_layers", "weights", "fusion")}
        for key, items in records.items():
            if not all(isinstance(r, dict) for r in items):
                raise MoepassError(f"{path}: every entry of '{key}' must be a JSON object")
        activations = document.get("activations", "float")
        if activations not in ACTIVATION_MODES:
            raise MoepassError(f"{path}: activations {activations!r} is not {' or '.join(ACTIVATION_MODES)}")
        kind = document.get("input")
        if kind is not None and kind not in PASS_NAMES:  # the input kinds, each with its pipeline
            raise MoepassError(f"{path}: input {kind!r} is not {' or '.join(PASS_NAMES)}")
        architecture = document.get("architecture")
        if architecture is not None and not isinstance(architecture, str):
            raise MoepassError(f"{path}: 'architecture' must be a string")
        return cls(
            document,
            schema,
            document["moepass_version"],
            kind,
            sections["source"],
            architecture,
            activations,
            sections["hparams"],
            sections["tokenizer"],
            tuple(records["moe_layers"]),
            tuple(records["weights"]),
            tuple(records["fusion"]),
            sections["kv_cache"],
        )


def json_field(data: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    """data[key] when it is a `kind` (an empty one when absent); another type is a clear error."""
    value = data.get(key, kind())
    if not isinstance(value, kind):
        raise MoepassError(
            f"{path}: '{key}' must be a JSON {'object' if kind is dict else 'array'}, found {type(value).__name__}"
        )
    return value


def read_report(folder: Path, required: bool = False) -> ModelReport:
    """moepass.json of a model folder, checked to be moepass's and of a schema this moepass reads
    (an empty report when absent and not `required`). The one reader: runtime, inspect, partition,
    convert and the overwrite check all take it from here."""
    path = folder / REPORT_FILE
    if not path.is_file():
        if required:
            raise MoepassError(f"{folder}: no {REPORT_FILE} (not a folder moepass wrote)")
        return ModelReport({})
    return ModelReport.from_json(read_json_object(path), path)


def write_report(folder: Path, report: dict[str, Any]) -> ModelReport:
    """Write moepass.json in the current schema (sorted keys, one space of indent) through ModelReport,
    checked strictly (a key no field reads is refused), naming this moepass as its writer unless
    `report` carries the version of the one that converted it. Returns the report as readers take it."""
    import json

    from moepass.core.version import __version__

    path = folder / REPORT_FILE
    written = ModelReport.from_json({"moepass_version": __version__, **report, "schema": REPORT_SCHEMA}, path, True)
    path.write_text(json.dumps(written.to_json(), indent=1, sort_keys=True) + "\n")
    return written


PLAN_FORMAT = "moepass-plan"  # plan.json's "format"
PLAN_VERSION = 2  # and the newest "version" this moepass reads and writes (2: active, lowering)


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from: partition's arguments as given, and the profile's size (None:
    uniform popularity)."""

    model: str
    target: str
    vram: str
    context: int
    batch: int
    prefill_tokens: int
    policy: str
    mode: str
    profile: dict[str, Any] | None
    bandwidths_gbps: dict[str, float]
    bandwidths_from: str = ""  # the card whose data sheet gave them, the options, or "assumed: ..."


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """Where the VRAM budget goes, in bytes (free_bytes 0 when the fixed part does not fit)."""

    vram_bytes: int
    non_expert_bytes: int
    kv_cache_bytes: int
    work_bytes: int
    reserve_bytes: int
    expert_budget_bytes: int
    resident_expert_bytes: int
    host_expert_bytes: int
    total_expert_bytes: int
    free_bytes: int


@dataclasses.dataclass(frozen=True)
class PlanNode:
    """One MoE layer's placement: its resident experts (most popular first), every expert in the
    order the reordered model holds them, and the share of routing it serves from the GPU."""

    node: str
    experts: int
    top_k: int
    bytes_per_expert: int
    device: str  # gpu (every expert resident), cpu (none) or split
    resident_count: int
    resident: tuple[int, ...]
    order: tuple[int, ...]
    mass_hit_rate: float
    selection_hit_rate: float


@dataclasses.dataclass(frozen=True)
class DecodeEstimate:
    """Predicted milliseconds per decoded token."""

    cold_experts_on_cpu: float
    cold_experts_over_pcie: float
    cpu_only: float | None = None  # every layer on this CPU: with CPU costs measured here


@dataclasses.dataclass(frozen=True)
class CpuTiming:
    """The CPU side of an estimate, timed on this model (runtime.calibrate)."""

    machine: str
    threads: int  # 0: ONNX Runtime's default
    moe_ms: float
    non_expert_ms: float


@dataclasses.dataclass(frozen=True)
class PlacementAlternative:
    """What per-expert placement would serve at the same budget (beside a per-layer plan)."""

    gpu_hit_rate_by_mass: float
    gpu_hit_rate_by_selection: float
    decode_ms_per_token: DecodeEstimate


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The plan's estimate: GPU hit rates, bytes a token reads, decode time, and how it was made."""

    label: str
    based_on: str
    gpu_hit_rate_by_mass: float
    gpu_hit_rate_by_selection: float
    bytes_per_token: dict[str, int]
    bandwidths_gbps: dict[str, float]
    decode_ms_per_token: DecodeEstimate
    formula: str
    bandwidths_from: str = ""
    gpu_step_floor_ms: float = 0.0  # launches of the GPU's nodes and a synchronisation (assumed costs)
    cpu: CpuTiming | None = None
    per_expert_alternative: PlacementAlternative | None = None


@dataclasses.dataclass(frozen=True)
class KvCacheCandidate:
    """What a KV cache type would have bought at the plan's budget."""

    kv_cache_bytes: int
    bytes_per_value: float
    resident_experts: int
    gpu_hit_rate_by_mass: float
    decode_ms_per_token: float


@dataclasses.dataclass(frozen=True)
class KvCacheChoice:
    """The KV cache type a plan chose, the model's own, who chose (the model's, auto, asked), each
    candidate, and what the choice traded."""

    type: str
    source: str
    chosen_by: str
    candidates: dict[str, KvCacheCandidate]
    traded: str | None = None


@dataclasses.dataclass(frozen=True)
class OffloadState:
    """Whether ONNX Runtime will offload this model's experts as planned, and why not."""

    active: bool
    reason: str | None


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What partition lowered for the GPU (passes/gpu_form.py): each MoE node's form now (and
    whether its experts changed: packed anew from the GGUF or the model's own values), the float32
    initializers stored anew in float16 and the largest rounding, how the weights came to be, and
    which nodes stay on the CPU because no CUDA kernel takes them."""

    lowered: bool  # False: annotated only (--keep-form), the model's form as it was
    forms: dict[str, str]  # MoE node -> its form in the placed model
    reformed: dict[str, str]  # MoE node -> where its changed experts were packed from
    float16_initializers: int
    max_float16_rounding: float
    weights: str
    cpu_nodes: dict[str, str]  # node -> why it stays on the CPU (the kernel table)


@dataclasses.dataclass(frozen=True)
class ExpertRegion:
    """Where one expert tensor lies in the placed model's data file, and its resident prefix."""

    node: str
    tensor: str
    file: str
    offset: int
    length: int
    resident_bytes: int


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """What identifies a file: device, inode, size, mtime and a digest of sampled blocks
    (shared_data_identity)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    digest: str


@dataclasses.dataclass(frozen=True)
class SharedData:
    """The source's data file a placed model shares (hard-linked or copied as shared.onnx.data): its
    name in the placed folder, the source's file relative to it, and its identity when written
    (checked at every load: check_shared_data)."""

    file: str
    source: str
    identity: FileIdentity


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """plan.json as its readers take it: every field checked once, here, against its type, naming
    the file and the key; `document` is the whole JSON object as partition wrote it."""

    document: dict[str, Any] = dataclasses.field(compare=False, repr=False)
    version: int
    moepass_version: str
    target: str  # offload (per expert) or layers (whole MoE layers)
    model: dict[str, Any]  # the model's identity (popularity.model_identity)
    inputs: PlanInputs
    fits: bool
    memory: PlanMemory
    nodes: tuple[PlanNode, ...]
    prediction: Prediction
    warnings: tuple[str, ...]
    onnxruntime_options: dict[str, str]
    kv_cache: KvCacheChoice | None = None
    offload: OffloadState | None = None  # per-expert plans of version 1 (version 2: active, inactive_reason)
    cpu_costs: dict[str, Any] | None = None  # runtime.calibrate's document, when timed
    expert_regions: tuple[ExpertRegion, ...] = ()
    # version 2: whether ONNX Runtime will carry out the plan on a GPU (either target), and why not
    active: bool = True
    inactive_reason: str | None = None
    lowering: Lowering | None = None
    context_words: str = ""  # how the planned context was chosen, in words
    shared_data: SharedData | None = None  # the source's data file the placed model shares

    @property
    def offload_active(self) -> bool:
        """False for a plan ONNX Runtime will not carry out (written, but inactive)."""
        return self.active and (self.offload is None or self.offload.active)

    def to_json(self) -> dict[str, Any]:
        """The plan as plan.json holds it: what partition writes, every field of this class and nothing
        else (from_json(to_json()) is the same plan)."""
        return {"format": PLAN_FORMAT, **plain_json(self)}

    @classmethod
    def from_json(cls, document: Any, path: Path, strict: bool = False) -> PlanReport:
        """The plan of a plan.json object read from `path`. `strict` (the writer's check): a key no
        field reads is a bug, not a newer moepass's addition."""
        if not isinstance(document, dict) or document.get("format") != PLAN_FORMAT:
            raise MoepassError(f"{path}: not a moepass plan (format {PLAN_FORMAT!r})")
        version = document.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= PLAN_VERSION:
            raise MoepassError(
                f"{path}: plan version {version!r}; this moepass reads versions 1 to {PLAN_VERSION} "
                "(a newer moepass wrote it?)"
            )
        return typed_from_json(cls, document, path, "", strict, document=document)


def plain_json(value: Any) -> Any:
    """A typed report's value as JSON holds it: dataclasses as objects (all fields but `document`, the
    JSON read), tuples as arrays."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "document"}
    if isinstance(value, (tuple, list)):
        return [plain_json(item) for item in value]
    if isinstance(value, dict):
        return {key: plain_json(item) for key, item in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class PlacementMode:
    """How partition placed the model: its target, and its mode (required: fail where ONNX Runtime
    would not carry the plan out)."""

    target: str
    mode: str


@dataclasses.dataclass(frozen=True)
class SessionOptionsFile:
    """onnxruntime_options.json, written by partition and read by the runtime: the session config
    entries ONNX Runtime is given (session.moe.offload.*, ...), and the placement they come from. An
    absent file reads as no entries."""

    session_config_entries: dict[str, str] = dataclasses.field(default_factory=dict)
    placement: PlacementMode | None = None

    def write(self, folder: Path) -> None:
        import json

        document = plain_json(self)
        typed_from_json(SessionOptionsFile, document, folder / OPTIONS_FILE, "")  # each entry as its reader takes it
        (folder / OPTIONS_FILE).write_text(json.dumps(document, indent=1) + "\n")

    @classmethod
    def read(cls, folder: Path) -> SessionOptionsFile:
        """The file beside a model, each field checked, naming the file and the key."""
        path = folder / OPTIONS_FILE
        return typed_from_json(cls, read_json_object(path), path, "")


def read_plan(folder: str | os.PathLike) -> PlanReport:
    """plan.json of a folder partition wrote, checked (the one reader of plan files)."""
    folder = Path(folder)
    path = folder / PLAN_FILE
    if not path.is_file():
        raise MoepassError(f"{folder}: no {PLAN_FILE} (not a folder `moepass partition` wrote)")
    return PlanReport.from_json(read_json_object(path), path)


# keys a typed file holds beside its class's fields: what it is
_FILE_KEYS = frozenset({"format"})


def refuse_unread(cls: type, data: dict[str, Any], path: Path, where: str) -> None:
    """Refuses the keys of the JSON object `data` (at `where` in `path`) that no field of the dataclass
    `cls` reads: the writers' check that nothing is written unread."""
    names = {field.name for field in dataclasses.fields(cls)}
    unread = sorted(set(data) - names - (_FILE_KEYS if not where else set()))
    if unread:
        keys = ", ".join(repr(f"{where}.{k}" if where else k) for k in unread)
        raise MoepassError(f"{path}: {keys}: no field reads it")


def typed_from_json(cls: type, data: Any, path: Path, where: str, strict: bool = False, **given: Any) -> Any:
    """An instance of the dataclass `cls` from the JSON object `data`, each field checked against its
    annotation (nested dataclasses, tuples from arrays, optional fields); `given` fields are set as
    they are. A field of the wrong type, or a required one missing, is one error naming the key;
    `strict`: so is a key no field reads (the writer's check that nothing is written unread)."""
    if not isinstance(data, dict):
        raise MoepassError(f"{path}: '{where}' must be a JSON object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    if strict:
        refuse_unread(cls, data, path, where)
    values = dict(given)
    for field in dataclasses.fields(cls):
        if field.name in given:
            continue
        key = f"{where}.{field.name}" if where else field.name
        if field.name in data:
            values[field.name] = _checked(hints[field.name], data[field.name], path, key, strict)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise MoepassError(f"{path}: has no '{key}'")
    return cls(**values)


def _checked(kind: Any, value: Any, path: Path, key: str, strict: bool = False) -> Any:
    """`value` as the annotation `kind` says (see typed_from_json)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return typed_from_json(kind, value, path, key, strict)
    if origin is tuple and isinstance(value, list):
        return tuple(_checked(args[0], item, path, f"{key}[{i}]", strict) for i, item in enumerate(value))
    if origin is dict and isinstance(value, dict):
        return {k: _checked(args[1], v, path, f"{key}.{k}", strict) for k, v in value.items()}
    if kind is Any:
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind in (int, str, bool) and isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        kind, "a JSON array" if origin is tuple else "a JSON object"
    )
    raise MoepassError(f"{path}: '{key}' must be {words}, found {type(value).__name__}")


def check_shared_data(folder: Path) -> None:
    """Refuses a placed model whose SHARED_DATA_FILE is not the file partition recorded in plan.json
    (the source's data rewritten, replaced or cut short since: the placed model's weights would be
    another model's), naming the file and what changed. A plan without the record (written before
    moepass recorded it) is taken as it is."""
    shared = folder / SHARED_DATA_FILE
    plan = folder / PLAN_FILE
    if not shared.is_file() or not plan.is_file():
        return
    entry = read_plan(folder).shared_data
    if entry is None:
        return
    recorded, now = dataclasses.asdict(entry.identity), shared_data_identity(shared)
    changed = [key for key in now if recorded.get(key) != now[key]]
    if changed:
        source = recorded_path(entry.source, folder)
        raise MoepassError(
            f"{shared}: changed since partition wrote this model ({', '.join(changed)} differ): it shares "
            f"{source}, which was rewritten or replaced; partition the source again"
        )
