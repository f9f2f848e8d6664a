"""Names of the files in a moepass model directory (what convert and partition write), and how a
model given as a directory or a model.onnx path is found and loaded."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepass.core.choices import ACTIVATION_MODES, PASS_NAMES
from moepass.core.errors import MoepassError, first_line, no_such_path
from moepass.core.onnx_format import stamp

if TYPE_CHECKING:
    import onnx_ir

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"  # every weight, as ONNX external data
# partition: the source model's data file, hard-linked (or cloned) into the placed model's folder:
# the weights the placement leaves as they are, not copied
SHARED_DATA_FILE = "shared.onnx.data"
COPY_STEP = 256 << 20  # bytes a copy moves between progress reports
# a source data file is shared when the placed model still reads at least this share of its bytes
SHARE_MIN_SHARE = 0.5
INLINE_BYTES = 256  # initializers smaller than this stay inside model.onnx (onnx-ir's save's threshold)
REPORT_FILE = "moepass.json"  # hyperparameters, MoE layers, per-weight conversion report
PLAN_FILE = "plan.json"  # partition: memory breakdown, residency, predictions
OPTIONS_FILE = "onnxruntime_options.json"  # partition: session config entries for ONNX Runtime
TOKENIZER_FILE = "tokenizer.json"  # convert: Hugging Face tokenizers file rebuilt from the GGUF
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # convert: chat template, BOS/EOS
GENAI_CONFIG_FILE = "genai_config.json"  # convert: what onnxruntime-genai needs to load the model
# the decoder's optional input (an initializer a feed overrides): logits of the last N positions, 0 = all
LOGITS_TO_KEEP = "logits_to_keep"


def model_file(model_dir: str | os.PathLike) -> Path:
    """The model.onnx of a model directory (or the path itself when it names a file), which must exist."""
    path = Path(model_dir)
    if not path.exists():
        raise no_such_path(path)
    if path.is_dir() and not (path / MODEL_FILE).is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        others = sorted(p.name for p in path.glob("*.onnx"))
        if ggufs:
            shown = ", ".join(ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise MoepassError(
                f"{path}: a folder of GGUF files ({shown}),"
                f" not a converted model: convert the file, `moepass convert {path / ggufs[0]} -o OUT`"
            )
        if others:
            raise MoepassError(f"{path}: has no {MODEL_FILE}; it holds {', '.join(others[:3])}: give that file's path")
        raise MoepassError(f"{path}: not a converted model (no {MODEL_FILE} in it; `moepass convert` makes one)")
    path = path / MODEL_FILE if path.is_dir() else path
    if not path.is_file():
        raise MoepassError(f"{path}: not a converted model (not a file or folder moepass reads)")
    from moepass.core.gguf_reader import is_gguf

    if is_gguf(path):
        raise MoepassError(
            f"{path}: a GGUF file, not a converted model: moepass.load (and run, chat, serve, bench) "
            "convert it into a cache; moepass.runtime.load takes a converted folder"
        )
    return path


def load_model(model_dir: str | os.PathLike) -> onnx_ir.Model:
    """A model (directory or model.onnx) as onnx-ir, its weights left on disk (read lazily).

    The model file is untrusted: it must hold a graph, and every external data reference must name
    a file inside the model's folder (no absolute path, no `..`, no symbolic link out of it) that is
    long enough for the bytes it promises. Nothing is read before those checks pass."""
    import onnx_ir

    path = model_file(model_dir)
    try:
        model = onnx_ir.load(path)
    except Exception as e:  # noqa: BLE001 - onnx raises many decode error types; report one line
        raise MoepassError(f"{path}: not a readable ONNX model ({type(e).__name__}: {first_line(e)})") from None
    if not model.graph.outputs or not len(model.graph):
        raise MoepassError(f"{path}: not an ONNX model with a graph (empty or not ONNX)")
    check_external_data(model, path)
    check_shared_data(path.parent)
    _accept_shared_data(model, path)
    return model


def _accept_shared_data(model: onnx_ir.Model, path: Path) -> None:
    """partition shares a source model's data file with the placed model by a hard link
    (SHARED_DATA_FILE there), so both files have more than one link, which onnx-ir refuses to read
    (its guard against a hard link planted to a file outside the folder, which no containment check
    can see). moepass accepts its own two data file names with several links, inside the folder (the
    containment check_external_data made); ONNX Runtime 1.32 reads them as well. Their tensors are
    then read past onnx-ir's link check; any other file with several links stays refused by it."""
    import onnx_ir

    folder = path.parent
    linked = {
        name
        for name in (DATA_FILE, SHARED_DATA_FILE)
        if (folder / name).is_file() and (folder / name).stat().st_nlink > 1
    }
    if not linked:
        return
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, onnx_ir.ExternalTensor) and str(tensor.location) in linked:
            value.const_value = _SharedExternalTensor(
                tensor.location,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=tensor.shape,
                name=tensor.name,
                base_dir=tensor.base_dir,
            )


@functools.cache
def _shared_tensor_class():  # made once, on first use (onnx-ir is imported lazily here)
    import onnx_ir

    class SharedExternalTensor(onnx_ir.ExternalTensor):
        """An external tensor in a placed model's SHARED_DATA_FILE (see _accept_shared_data)."""

        def _check_path_containment(self) -> None:  # checked by check_external_data and the plan's record
            return None

    return SharedExternalTensor


def _SharedExternalTensor(*args, **kwargs):
    return _shared_tensor_class()(*args, **kwargs)


def save_model(
    model: onnx_ir.Model,
    path: Path,
    progress: Callable[[int, int], None] | None = None,
    share_from: Path | None = None,
) -> str:
    """`model` as model.onnx at `path` with every weight in DATA_FILE beside it, one writer thread;
    `progress(bytes written, total bytes)` as the tensors go out. `share_from`: a data file whose
    tensors the model still reads unchanged (partition's source): it is hard-linked into the folder
    as SHARED_DATA_FILE (a reflink, else a copy, where no link can be made) and those tensors point
    into it; only the others are written. Says how the weights came to be."""
    import onnx
    import onnx_ir
    from onnx_ir.external_data import convert_tensors_to_external

    stamp(model, str(path))  # an IR version every supported ONNX Runtime loads
    tensors = {v: v.const_value for v in model.graph.initializers.values() if v.const_value is not None}
    source = os.path.realpath(share_from) if share_from is not None else ""
    shared = {
        v: t for v, t in tensors.items() if source and isinstance(t, onnx_ir.ExternalTensor) and _lies_in(t, source)
    }
    declined = bool(shared) and sum(t.nbytes for t in shared.values()) < SHARE_MIN_SHARE * os.path.getsize(source)
    if declined:  # most of the file is no longer read: a link would keep it all alive; copy what is
        shared = {}
    # small tensors stay inside model.onnx, as onnx-ir's save keeps them (ONNX Runtime's shape
    # inference reads constants such as a ReduceSum's axes only from there)
    written = {v: t for v, t in tensors.items() if v not in shared and t.nbytes >= INLINE_BYTES}
    total = sum(t.nbytes for t in written.values())
    callback = None
    if progress is not None:

        def callback(_tensor, info) -> None:  # called as each tensor starts: what lies before it is written
            progress(info.offset, total)

    if not shared:
        onnx_ir.save(
            model, path, external_data=DATA_FILE, callback=callback, max_workers=1, size_threshold_bytes=INLINE_BYTES
        )
        how = "copied" if declined else "written"
    else:
        how = link_or_share(Path(source), path.parent / SHARED_DATA_FILE)
        for value, tensor in shared.items():
            value.const_value = onnx_ir.ExternalTensor(
                SHARED_DATA_FILE,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=onnx_ir.Shape(tensor.shape),
                name=tensor.name or value.name or "",
                base_dir=path.parent,
            )
        if written:
            externals = convert_tensors_to_external(
                list(written.values()), path.parent, DATA_FILE, callback=callback, max_workers=1
            )
            for value, external in zip(written, externals):
                value.const_value = external
        onnx.save(onnx_ir.to_proto(model), path)
    if progress is not None:
        progress(total, total)
    return how


def _lies_in(tensor: onnx_ir.ExternalTensor, data_file: str) -> bool:
    """Whether an external tensor's bytes are in `data_file` (a real path)."""
    return os.path.realpath(tensor.path) == data_file


def check_external_data(model: onnx_ir.Model, path: Path) -> None:
    """Every external tensor of `model` (loaded from `path`) lies inside the model's folder, whole."""
    import onnx_ir

    folder = Path(os.path.realpath(path.parent))
    sizes: dict[str, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, onnx_ir.ExternalTensor):
            continue
        location = os.fspath(tensor.location)
        where = f"{path}: initializer '{value.name}' keeps its data in '{location}'"
        if not location or os.path.isabs(location) or ".." in Path(location).parts:
            raise MoepassError(f"{where}, outside the model's folder; refused")
        target = Path(os.path.realpath(folder / location))
        if folder not in target.parents:
            raise MoepassError(f"{where}, which leads outside the model's folder; refused")
        if location not in sizes:
            if not target.is_file():
                raise MoepassError(f"{where}, which does not exist")
            sizes[location] = target.stat().st_size
        end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
        if end > sizes[location]:
            raise MoepassError(f"{where} up to byte {end}, but the file has {sizes[location]} bytes (truncated?)")


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents; an unreadable file is a clear error naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise no_such_path(path) from None
    except OSError as e:
        raise MoepassError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise MoepassError(f"{path}: not a UTF-8 text file") from None


def read_json(path: Path, what: str | None = None) -> Any:
    """The JSON value of a file; an unreadable file or invalid JSON is a clear error naming it (and,
    when given, `what` the file should have been)."""
    import json

    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise no_such_path(path) from None
    except OSError as e:
        raise MoepassError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoepassError(
            f"{path}: not {what} (invalid JSON: {e})" if what else f"{path}: not valid JSON ({e})"
        ) from None


def read_json_object(path: Path) -> dict:
    """A JSON object file beside a model ({} when absent); anything else is a clear error naming it."""
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise MoepassError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


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
        unread = sorted(set(document) - {f.name for f in dataclasses.fields(cls)})
        if strict and unread:
            raise MoepassError(f"{path}: {', '.join(map(repr, unread))}: no field reads it")
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

        typed_from_json(SessionOptionsFile, plain_json(self), folder / OPTIONS_FILE, "", strict=True)  # nothing unread
        (folder / OPTIONS_FILE).write_text(json.dumps(plain_json(self), indent=1) + "\n")

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


def typed_from_json(cls: type, data: Any, path: Path, where: str, strict: bool = False, **given: Any) -> Any:
    """An instance of the dataclass `cls` from the JSON object `data`, each field checked against its
    annotation (nested dataclasses, tuples from arrays, optional fields); `given` fields are set as
    they are. A field of the wrong type, or a required one missing, is one error naming the key;
    `strict`: so is a key no field reads (the writer's check that nothing is written unread)."""
    if not isinstance(data, dict):
        raise MoepassError(f"{path}: '{where}' must be a JSON object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    unread = sorted(set(data) - names - (_FILE_KEYS if not where else set()))
    if strict and unread:
        keys = ", ".join(repr(f"{where}.{k}" if where else k) for k in unread)
        raise MoepassError(f"{path}: {keys}: no field reads it")
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


def as_ir_model(source: Any) -> tuple[onnx_ir.Model, str]:
    """An onnx-ir model and a label for it, from a path (model.onnx or a model directory), an
    onnx.ModelProto, an onnx-ir model or an onnx-graphsurgeon graph (what pipelines hand in)."""
    import onnx
    import onnx_ir as ir

    if isinstance(source, ir.Model):
        return source, "<onnx_ir.Model>"
    if isinstance(source, onnx.ModelProto):
        return ir.from_proto(source), "<onnx.ModelProto>"
    if type(source).__module__.startswith("onnx_graphsurgeon"):
        import onnx_graphsurgeon as gs

        return ir.from_proto(gs.export_onnx(source)), "<onnx_graphsurgeon.Graph>"
    path = model_file(source)
    return load_model(path), str(path)


def link_or_share(source: Path, destination: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """`destination` as a hard link to `source` (the same bytes, no copy: ONNX Runtime reads
    external data with several links; moepass's loader accepts the one partition records), else
    as share_file shares it. Says which."""
    try:
        os.link(source, destination)
        return "hard link"
    except OSError:
        return share_file(source, destination, progress)


def share_file(source: Path, destination: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """`destination` with `source`'s bytes, without copying them where the file system allows: a
    reflink (a copy-on-write clone: Btrfs, XFS, bcachefs), else a copy in the kernel; what
    link_or_share falls back to where no hard link can be made. Says which."""
    import fcntl

    ficlone = 0x40049409  # FICLONE (linux/fs.h)
    try:
        with open(source, "rb") as src, open(destination, "wb") as dst:
            fcntl.ioctl(dst.fileno(), ficlone, src.fileno())
        return "reflink"
    except OSError:
        pass
    total = source.stat().st_size
    in_kernel = True
    with open(source, "rb") as src, open(destination, "wb") as dst:
        done = 0
        while done < total:  # in the kernel where it can, in steps that can report progress
            size = min(COPY_STEP, total - done)
            if in_kernel:
                try:
                    step = os.copy_file_range(src.fileno(), dst.fileno(), size)
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY:
                        raise
                    in_kernel = False  # another file system (EXDEV) or none: read and write, from here
                    src.seek(done)
                    dst.seek(done)
                    continue
            else:
                step = dst.write(src.read(size))
            if step == 0:
                raise MoepassError(f"{source}: shrank while it was copied")
            done += step
            if progress is not None:
                progress(done, total)
    return "copy"


# copy_file_range's refusals that a plain read and write does not share: across file systems
# (EXDEV: partition -o /dev/shm/...), no such call or not for these files
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM)


def sampled_digest(path: Path, blocks: int, block_bytes: int, whole_up_to: int) -> str:
    """A digest of the file at `path`: all of it up to `whole_up_to` bytes, else its size and
    `blocks` blocks of `block_bytes` spread evenly from its start to its end. Cheap at any size;
    finds a file cut short, replaced, or damaged where it is read."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f"{size}\n".encode())
        if size <= whole_up_to:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            for i in range(blocks):
                digest.update(os.pread(f.fileno(), block_bytes, max(size - block_bytes, 0) * i // max(blocks - 1, 1)))
    return digest.hexdigest()


# the placed model's SHARED_DATA_FILE as plan.json records it: a hard link shares the source's file,
# so a rewrite of the source's data is a rewrite of the placed model's; its ctime is not kept (each
# link made or removed, another partition of the same source, changes it)
SHARED_DATA_BLOCKS = 16
SHARED_DATA_BLOCK_BYTES = 64 << 10


def shared_data_identity(path: Path) -> dict[str, Any]:
    """What identifies the shared data file at `path`: device, inode, size, mtime and a digest of
    SHARED_DATA_BLOCKS blocks."""
    st = path.stat()
    return {
        "device": st.st_dev,
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "digest": sampled_digest(path, SHARED_DATA_BLOCKS, SHARED_DATA_BLOCK_BYTES, 0),
    }


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


def refuse_linked(folder: Path, names: tuple[str, ...]) -> None:
    """Refuses `folder`'s files `names` (the tokenizer and config files convert wrote) where one is a
    link: moepass copies them into its outputs and does not follow a link to whatever it names."""
    for name in names:
        if (folder / name).is_symlink():
            raise MoepassError(
                f"{folder / name}: a symbolic link, not the file convert wrote; moepass does not copy what a "
                "link points to (replace it with the file)"
            )


def copy_companion(folder: Path, name: str, destination: Path) -> None:
    """`folder`/`name` (a tokenizer or config file convert wrote) copied into `destination`, where
    it is there; never through a link (refuse_linked)."""
    import shutil

    refuse_linked(folder, (name,))
    if (folder / name).is_file():
        shutil.copyfile(folder / name, destination / name)


def relative_to_folder(path: Path, folder: Path) -> str:
    """`path` as a written file records it: relative to the output `folder` it is recorded in (the
    same bytes wherever the input and output lie, no absolute path; found again while the two keep
    their places relative to each other)."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(folder))


def recorded_path(recorded: str, folder: Path) -> Path:
    """A path a file in `folder` records (relative_to_folder; an absolute one, as older moepass
    wrote them, as it is)."""
    return Path(recorded) if os.path.isabs(recorded) else folder / recorded
