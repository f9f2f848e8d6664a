"""Which execution provider runs the model, which offload options go with it, and what cannot be had.

Order of preference for device="auto" (and what device="cuda" requires):
1. the ONNX Runtime CUDA plugin EP (`CudaPluginExecutionProvider`, the library that implements
   CPU/GPU expert offload), from `cuda_plugin=` or the MOEPASS_CUDA_PLUGIN environment variable,
   registered with `onnxruntime.register_execution_provider_library` and added for its devices;
2. the in-tree CUDA EP of onnxruntime-gpu (`CUDAExecutionProvider`; no expert offload options);
3. the CPU EP.

Expert offload is asked for with `mode` ("auto" or "required"; else the mode partition wrote into
onnxruntime_options.json; else "disabled"). Before a session is created, `plan_session` checks what
it can: the ONNX Runtime version, the EP, and each MoE node against ONNX Runtime's offload
eligibility rules. In "required" mode any reason offload cannot happen is an error naming the node
and the rule; in "auto" mode it falls back and says, in one warning, exactly what was lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import onnx_ir as ir

from moepass.core import keys
from moepass.core.capabilities import layout_problems, offload_violations, release_refusal
from moepass.core.choices import DEVICES, PLUGIN_ENV, one_of
from moepass.core.errors import MoepassError, first_line, no_such_path, wording
from moepass.core.keys import LAYER_ANNOTATION, LAYER_SETTINGS_KEY, OFFLOAD_PREFIX, RECORD_ASSIGNMENT_KEY
from moepass.core.moe_nodes import NATIVE_DOMAIN, is_cuda_packed, moe_nodes

log = logging.getLogger("moepass")

PLUGIN_EP = "CudaPluginExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
OFFLOAD_MIN_ORT = (1, 32)
# the first release that parses session.layer_assignment_settings (docs/gpu.md: probed per release)
LAYERING_MIN_ORT = (1, 25)


@dataclasses.dataclass
class SessionPlan:
    """What `load` will do: providers, session config entries, and the warnings it gives."""

    device: str
    provider: str
    providers: list[str]
    plugin_devices: list[Any]
    config_entries: dict[str, str]
    offload_mode: str
    warnings: list[str]
    layer_mode: str = "disabled"  # per-layer placement (layer_ann annotations) applied: auto or required


def _ort_version(ort) -> tuple[int, int]:
    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    return major, minor


def _register_plugin(ort, library: str) -> list[Any]:
    path = Path(library)
    if not path.exists():
        raise no_such_path(path, "the CUDA plugin EP library")
    if not path.is_file():
        raise MoepassError(f"{path}: not a CUDA plugin EP library (not a file)")
    try:
        ort.register_execution_provider_library(PLUGIN_EP, str(path))
    except Exception as e:  # noqa: BLE001 - ORT raises its own types; keep its words
        if "already registered" not in str(e).lower():
            raise MoepassError(f"{path}: ONNX Runtime cannot register it as {PLUGIN_EP}: {first_line(e)}") from None
    devices = [d for d in ort.get_ep_devices() if d.ep_name == PLUGIN_EP]
    if not devices:
        raise MoepassError(f"{path}: registered as {PLUGIN_EP}, but it reports no device")
    return devices


def plan_session(
    ort,
    model: ir.Model,
    options_file_entries: dict[str, str],
    device: str = "auto",
    cuda_plugin: str | None = None,
    mode: str | None = None,
    placement_mode: str | None = None,
) -> SessionPlan:
    """`mode`: what the user asked for (--offload), applied to the placement the model carries;
    `placement_mode`: what partition wrote for a per-layer plan."""
    one_of(device, DEVICES, "device")
    if mode is not None:
        one_of(mode, keys.OFFLOAD_MODES, "mode")
    _check_model(ort, model)
    entries = dict(options_file_entries)
    layered = LAYER_SETTINGS_KEY in entries
    layer_mode = (mode or placement_mode or "auto") if layered else "disabled"
    offload_mode = "disabled" if layered else mode or entries.get(keys.OFFLOAD_MODE, "disabled")
    warnings: list[str] = []
    n_moe = len(moe_nodes(model.graph))
    provider, plugin_devices = _choose_provider(ort, device, cuda_plugin or os.environ.get(PLUGIN_ENV))
    _check_packed(ort, model, device, provider)
    if offload_mode != "disabled":
        entries = _plan_offload(ort, model, provider, offload_mode, entries, warnings, n_moe)
    else:
        entries = {k: v for k, v in entries.items() if not k.startswith(OFFLOAD_PREFIX)}
    if layered:
        layer_mode = _plan_layers(ort, model, provider, layer_mode, entries, warnings)
    providers = [provider, CPU_EP] if provider not in (CPU_EP, PLUGIN_EP) else [CPU_EP]
    for message in warnings:
        log.warning(message)
    return SessionPlan(device, provider, providers, plugin_devices, entries, offload_mode, warnings, layer_mode)


def _check_model(ort, model: ir.Model) -> None:
    """Refuse a model whose MoE nodes' layout attributes are wrong, or that needs operators this ONNX
    Runtime release lacks."""
    mislabelled = layout_problems(model)
    if mislabelled:
        node, why = mislabelled[0]
        raise MoepassError(f"MoE node {node}: {why}; refused")
    lacking = release_refusal(model, _ort_version(ort), f"ONNX Runtime {ort.__version__}")
    if lacking:
        raise MoepassError(lacking)


def _choose_provider(ort, device: str, plugin_library: str | None) -> tuple[str, list[Any]]:
    """The EP that runs the model, by the order of preference (the module's docstring), and the CUDA
    plugin EP's devices where it is that one."""
    plugin_devices: list[Any] = []
    if device != "cpu" and plugin_library:
        plugin_devices = _register_plugin(ort, plugin_library)
        provider = PLUGIN_EP
    elif device != "cpu" and CUDA_EP in ort.get_available_providers():
        provider = CUDA_EP
        _load_cuda_libraries(ort)
    elif device == "cuda":
        raise MoepassError(
            f"device='cuda' but no CUDA EP is available: ONNX Runtime {ort.__version__} has "
            f"{', '.join(ort.get_available_providers())}; give the CUDA plugin EP library "
            f"({wording().option('--cuda-plugin', 'LIB')} or ${PLUGIN_ENV}), or install moepass[gpu] in place of "
            "moepass[cpu] (onnxruntime and onnxruntime-gpu cannot be installed together)"
        )
    else:
        provider = CPU_EP
    return provider, plugin_devices


def native_library(model: ir.Model, strict: bool = True) -> str | None:
    """The path of moepass's kernel library (moepass.cpu_ops, as this install built it) where the model
    has nodes of its domain (--expert-format native), None where it has none; where the kernels
    cannot run here, one line saying why (`strict`: a session needs them) or None (a genai_config
    written for another machine)."""
    native = [node for node in model.graph if node.domain == NATIVE_DOMAIN]
    if not native:
        return None
    import moepass.cpu_ops as cpu_ops

    why = cpu_ops.unavailable()
    if why is not None and not strict:
        return None
    if why is not None:
        node = native[0]
        raise MoepassError(
            f"node {node.name} is a moepass::{node.op_type} node, run by moepass's own CPU kernels, which cannot "
            f"run here: {why}; convert with {wording().option('--expert-format', 'qmoe')} to run it"
        )
    return str(cpu_ops.library_path())


def native_kernels_unavailable() -> str | None:
    """Why moepass's own CPU kernels (moepass.cpu_ops) cannot run in ONNX Runtime here; None where they can."""
    import moepass.cpu_ops as cpu_ops

    return cpu_ops.unavailable()


def register_native_kernels(options, model: ir.Model) -> None:
    """Register moepass.cpu_ops's kernels with `options` where the model has nodes of its domain."""
    if native_library(model) is not None:
        import moepass.cpu_ops as cpu_ops

        cpu_ops.register(options)


def _check_packed(ort, model: ir.Model, device: str, provider: str) -> None:
    """Refuse MoEPacked nodes (the GGUF's own blocks) on the CPU EP: ONNX Runtime runs them on CUDA only."""
    packed = [m.name for m in moe_nodes(model.graph) if is_cuda_packed(m.node)]
    if packed and provider == CPU_EP:
        raise MoepassError(
            f"MoE node {packed[0]} is a com.microsoft::MoEPacked node (the GGUF's own blocks), which ONNX Runtime "
            f"runs on CUDA only, and {'the device is cpu' if device == 'cpu' else 'this ONNX Runtime has no CUDA EP'} "
            f"({', '.join(ort.get_available_providers())}): convert without "
            f"{wording().option('--expert-format', 'packed')} to run here"
        )


def _plan_offload(
    ort,
    model: ir.Model,
    provider: str,
    offload_mode: str,
    entries: dict[str, str],
    warnings: list[str],
    n_moe: int,
) -> dict[str, str]:
    """Expert offload asked for (`offload_mode` auto or required) of the model's `n_moe` MoE layers:
    refused where it cannot happen (required), else what is lost added to `warnings` (auto). Returns
    the session entries: the offload options where this ONNX Runtime reads them, else none of them."""
    reasons = []
    if _ort_version(ort) < OFFLOAD_MIN_ORT:
        reasons.append(
            f"ONNX Runtime {ort.__version__} predates the session.moe.offload.* options "
            f"(needs {'.'.join(map(str, OFFLOAD_MIN_ORT))})"
        )
    if provider != PLUGIN_EP:
        what = "no CUDA plugin EP" if provider == CPU_EP else f"{provider} does not offload experts"
        reasons.append(what)
    violations = offload_violations(model)
    if offload_mode == "required":
        if reasons:
            raise MoepassError(f"expert offload required, but {reasons[0]}")
        if violations:
            node, rule = violations[0]
            more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
            raise MoepassError(f"expert offload required, but node {node} cannot be offloaded: {rule}{more}")
    else:
        if reasons:
            where = "the CPU" if provider == CPU_EP else f"{provider} without offload"
            warnings.append(f"{reasons[0]}: all {n_moe} MoE layers run on {where}")
        elif violations:
            nodes = sorted({n for n, _ in violations})
            warnings.append(
                f"{len(nodes)} of {n_moe} MoE layers cannot be offloaded ({violations[0][0]}: "
                f"{violations[0][1]}); ONNX Runtime keeps them where the EP places them"
            )
    if _ort_version(ort) < OFFLOAD_MIN_ORT:
        return {k: v for k, v in entries.items() if not k.startswith(OFFLOAD_PREFIX)}
    entries[keys.OFFLOAD_MODE] = offload_mode
    return entries


def _layer_devices(model: ir.Model) -> dict[str, str]:
    """MoE node -> the device its layer_ann annotation asks for ("gpu" or "cpu")."""
    return {m.name: m.node.metadata_props.get(LAYER_ANNOTATION, "gpu").split("/", 1)[0] for m in moe_nodes(model.graph)}


def _plan_layers(
    ort, model: ir.Model, provider: str, layer_mode: str, entries: dict[str, str], warnings: list[str]
) -> str:
    """Keep the layer assignment where ONNX Runtime and the EP can follow it; else refuse (required)
    or drop it with one warning (auto). Returns the layer mode in force."""
    devices = _layer_devices(model)
    n_moe, on_cpu = len(devices), sum(1 for d in devices.values() if d == "cpu")
    reason = None
    if _ort_version(ort) < LAYERING_MIN_ORT:
        reason = (
            f"ONNX Runtime {ort.__version__} predates layer assignment ({LAYER_SETTINGS_KEY}, needs "
            f"{'.'.join(map(str, LAYERING_MIN_ORT))})"
        )
    elif provider == CPU_EP:
        reason = "no CUDA EP"
    if layer_mode == "disabled" or reason:
        del entries[LAYER_SETTINGS_KEY]
        if reason and layer_mode == "required":
            raise MoepassError(f"per-layer placement required, but {reason}")
        if reason:
            where = "the CPU" if provider == CPU_EP else provider
            warnings.append(
                f"{reason}: all {n_moe} MoE layers run on {where} (the plan puts {n_moe - on_cpu} on the GPU)"
            )
        return "disabled"
    entries[RECORD_ASSIGNMENT_KEY] = "1"
    return layer_mode


def _load_cuda_libraries(ort) -> None:
    """Load the CUDA and cuDNN libraries of NVIDIA's pip wheels (what `moepass[gpu]` installs) before
    ONNX Runtime looks for them: its CUDA EP finds them only so (without: libcublasLt.so.13 "cannot
    open shared object file", measured with onnxruntime-gpu 1.31.1). A no-op where they are not
    installed; system libraries on the loader's path still serve."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload()
        except Exception as e:  # noqa: BLE001 - a library it could not load is named by the check after the session
            log.debug("onnxruntime.preload_dlls: %s", first_line(e))


def _cuda_failure(ort) -> str:
    """Why ONNX Runtime could not create its CUDA EP, as the dynamic loader says it: the first library
    of the EP's (its own, the CUDA and cuDNN libraries, the NVIDIA driver's libcuda) that does not load."""
    import ctypes

    capi = Path(getattr(ort, "__file__", "")).parent / "capi" / "libonnxruntime_providers_cuda.so"
    for library in (capi, "libcuda.so.1"):
        try:
            ctypes.CDLL(str(library))
        except OSError as e:
            what = (
                "no NVIDIA driver"
                if "libcuda.so" in str(e)
                else "its CUDA or cuDNN libraries are missing: pip install 'moepass[gpu]'"
            )
            return f"{first_line(e)}: {what}"
    return "a CUDA device it could not use (ONNX Runtime's log above says why)"


def provider_in_effect(session, plan: SessionPlan, ort=None) -> SessionPlan:
    """The plan as the session carries it out. ONNX Runtime creates a session on the CPU when it
    cannot create the CUDA EP it was given (CUDA or cuDNN libraries or the driver missing, no
    device): it logs an error and goes on. device='cuda' and a required per-layer plan refuse
    that, naming what the loader could not find; auto says so once and the plan names the CPU, so
    nothing reports CUDA for a CPU run."""
    if plan.provider != CUDA_EP or CUDA_EP in session.get_providers():
        return plan
    cause = _cuda_failure(ort) if ort is not None else "docs/gpu.md"
    problem = f"ONNX Runtime could not create {CUDA_EP} ({cause}) and made the session on the CPU"
    if plan.device == "cuda":
        raise MoepassError(f"device='cuda' but {problem}")
    if plan.layer_mode == "required":
        raise MoepassError(f"per-layer placement required, but {problem}")
    log.warning(f"{problem}: running on the CPU")
    return dataclasses.replace(
        plan,
        provider=CPU_EP,
        providers=[CPU_EP],
        layer_mode="disabled",
        warnings=[*plan.warnings, f"{problem}: running on the CPU"],
    )


def check_layer_placement(session, model: ir.Model, plan: SessionPlan) -> dict[str, str]:
    """MoE node -> the EP ONNX Runtime assigned it (its graph assignment record), checked against
    the annotations: a GPU layer that ended on the CPU is an error (required) or one warning (auto)."""
    if plan.layer_mode == "disabled" or not hasattr(session, "get_provider_graph_assignment_info"):
        return {}
    wanted = _layer_devices(model)
    placed = {
        node.name: subgraph.ep_name
        for subgraph in session.get_provider_graph_assignment_info()
        for node in subgraph.get_nodes()
        if node.name in wanted
    }
    moved = [n for n, d in wanted.items() if d == "gpu" and placed.get(n, CPU_EP) == CPU_EP]
    if moved:
        message = (
            f"{len(moved)} MoE layer(s) planned for the GPU run on the CPU ({moved[0]}: {plan.provider} "
            "has no kernel for it in this form)"
        )
        if plan.layer_mode == "required":
            raise MoepassError(f"per-layer placement required, but {message}")
        log.warning(message)
    return placed
