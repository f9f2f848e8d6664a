"""Which execution provider runs the model, which offload options go with it, and what cannot be had.

Order of preference for device="auto" (and what device="cuda" or "webgpu" requires):
1. the ONNX Runtime CUDA plugin EP (`CudaPluginExecutionProvider`, the library that implements
   CPU/GPU expert offload), from `cuda_plugin=` or the MOEPASS_CUDA_PLUGIN environment variable,
   registered with `onnxruntime.register_execution_provider_library` and added for its devices;
2. the in-tree CUDA EP of onnxruntime-gpu (`CUDAExecutionProvider`; no expert offload options);
3. the WebGPU plugin EP (`WebGpuExecutionProvider`, the onnxruntime-ep-webgpu package that
   `moepass[webgpu]` installs: AMD, Intel, Apple and NVIDIA GPUs through Vulkan, Metal or D3D12),
   where it finds a GPU, or a software adapter where ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 asks;
4. the CPU EP.

Expert offload is asked for with `mode` ("auto" or "required"; else the mode partition wrote into
onnxruntime_options.json; else "disabled"). Before a session is created, `plan_session` checks what
it can: the ONNX Runtime version, the EP, and each MoE node against ONNX Runtime's offload
eligibility rules. In "required" mode any reason offload cannot happen is an error naming the node
and the rule; in "auto" mode it falls back and says, in one warning, exactly what was lost.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import onnx_ir as ir

from moepass.core import keys
from moepass.core.capabilities import layout_problems, offload_violations, release_refusal
from moepass.core.choices import DEVICES, PLUGIN_ENV, WEBGPU_SOFTWARE_ENV, one_of
from moepass.core.errors import MoepassError, first_line, no_such_path, wording
from moepass.core.ir_values import input_at
from moepass.core.keys import LAYER_ANNOTATION, LAYER_SETTINGS_KEY, OFFLOAD_PREFIX, RECORD_ASSIGNMENT_KEY
from moepass.core.moe_nodes import NATIVE_DOMAIN, QMOE_SLOTS, ROUTER_WEIGHTS, MoeNode, is_cuda_packed, moe_nodes

log = logging.getLogger("moepass")

PLUGIN_EP = "CudaPluginExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
WEBGPU_EP = "WebGpuExecutionProvider"
PLUGIN_PROVIDERS = (PLUGIN_EP, WEBGPU_EP)  # added for their devices, with the CPU EP behind them
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
    ep_options: dict[str, str] = dataclasses.field(default_factory=dict)  # a plugin EP's options
    # the options of a second session for calls of several tokens (None: none): WebGPU's with the MoE
    # layers on the CPU, where the device's multi-token MoE path computes wrong rows at times
    prompt_ep_options: dict[str, str] | None = None


def _ort_version(ort) -> tuple[int, int]:
    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    return major, minor


def _register_plugin(ort, library: str) -> list[Any]:
    path = Path(library)
    if not path.exists():
        raise no_such_path(path, "the CUDA plugin EP library")
    if not path.is_file():
        raise MoepassError(f"{path}: not a CUDA plugin EP library (not a file)")
    devices = _register_library(ort, PLUGIN_EP, str(path))
    if not devices:
        raise MoepassError(f"{path}: registered as {PLUGIN_EP}, but it reports no device")
    return devices


def _register_library(ort, ep: str, library: str) -> list[Any]:
    """A plugin EP's library registered as `ep`, once a process, and the devices it reports. Not
    again where its devices are listed: registered again while sessions of it were alive (`bench
    --profile`'s second decoder), the WebGPU plugin killed the process (SIGSEGV); ONNX Runtime
    refuses other repeats as "already registered"."""
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep]
    if devices:
        return devices
    try:
        ort.register_execution_provider_library(ep, library)
    except Exception as e:  # noqa: BLE001 - ORT raises its own types; keep its words
        if "already registered" not in str(e).lower():
            raise MoepassError(f"{library}: ONNX Runtime cannot register it as {ep}: {first_line(e)}") from None
    return [d for d in ort.get_ep_devices() if d.ep_name == ep]


def _webgpu_devices(ort, required: bool) -> list[Any]:
    """The WebGPU plugin EP's device (the plugin registered once a process): [] where the plugin is not
    installed or finds no adapter, or where `required`, one line saying which. A software adapter
    only where ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 asked for one (the plugin reads it) and the
    device was named (`required`): never for device="auto", where the CPU EP is faster; said once."""
    try:
        import onnxruntime_ep_webgpu as webgpu
    except ImportError:
        if required:
            raise MoepassError(
                "device='webgpu' but the WebGPU plugin EP (onnxruntime-ep-webgpu) is not installed: "
                "pip install 'moepass[webgpu]' (beside onnxruntime-gpu: pip install onnxruntime-ep-webgpu==0.4.0)"
            ) from None
        return []
    if not hasattr(ort, "register_execution_provider_library"):  # plugin EPs came in ONNX Runtime 1.22
        if required:
            raise MoepassError(f"device='webgpu' but ONNX Runtime {ort.__version__} cannot load plugin EPs (1.22 can)")
        return []
    devices = _register_library(ort, WEBGPU_EP, webgpu.get_library_path())
    if not required:
        devices = [d for d in devices if d.device.type == ort.OrtHardwareDeviceType.GPU]
    if not devices:
        if required:
            software = os.environ.get(WEBGPU_SOFTWARE_ENV) == "1"
            raise MoepassError(
                "device='webgpu' but the WebGPU plugin EP finds no adapter"
                + (
                    " (not even a software one: its Vulkan driver is missing or refused; docs/webgpu.md)"
                    if software
                    else f": no GPU with a Vulkan, Metal or D3D12 driver; {WEBGPU_SOFTWARE_ENV}=1 accepts a "
                    "software adapter (lavapipe, SwiftShader: slow, for tests)"
                )
            )
        return []
    if devices[0].device.type == ort.OrtHardwareDeviceType.CPU:
        log.warning(f"WebGPU on a software adapter ({WEBGPU_SOFTWARE_ENV}=1): the CPU emulates the GPU, slowly")
    return devices[:1]  # the plugin takes one device and picks the adapter itself


def webgpu_refusal(moe: MoeNode, activations: ir.DataType | None) -> str | None:
    """Why the WebGPU plugin EP (0.4.0) cannot run this MoE node in its form; None where it can. Both
    fail inside it at run time (measured on lavapipe): separate router_weights ("not yet implemented
    on WebGPU"), and scales of another type than the activations' (a float32 graph's QMoE with
    float16 scales, moepass's 8-bit and block-sum forms: `raw_hash_map::at`)."""
    node = moe.node
    if node.op_type != "QMoE" or activations is None:
        return None
    if input_at(node, ROUTER_WEIGHTS) is not None:  # its words: "not yet implemented on WebGPU"
        return "it takes separate router_weights (mixing weights computed outside the node)"
    for projection, slots in QMOE_SLOTS.items():
        scales = input_at(node, slots[1])
        if scales is not None and scales.dtype is not None and scales.dtype != activations:
            return f"its {projection} scales are {_type_name(scales.dtype)} in a {_type_name(activations)} graph"
    return None


def _type_name(dtype: ir.DataType) -> str:
    return {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16"}.get(dtype, dtype.name.lower())


def _webgpu_options(model: ir.Model, device, warnings: list[str]) -> tuple[dict[str, str], dict[str, str] | None]:
    """The WebGPU EP's options, and those of the session for calls of several tokens (None: the same
    session): MoE nodes whose form it cannot run kept on the CPU (forceCpuNodeNames); and, where it
    runs some, a second session for prompts with every MoE node on the CPU. The plugin's QMoE computes
    wrong rows at times in calls of several tokens (0.4.0: 1 call in 200 at 8 and 33 tokens on lavapipe,
    68 in 120 on SwiftShader; one token always right: docs/webgpu.md); a prompt's MoE layers on the
    CPU give right rows, and single-token decoding keeps them on the device. Each said in one warning."""
    activations = model.graph.outputs[0].dtype if model.graph.outputs else None
    nodes = moe_nodes(model.graph)
    refused = {m.name: why for m in nodes if (why := webgpu_refusal(m, activations))}
    on_device = [m.name for m in nodes if m.name not in refused and m.node.op_type == "QMoE"]
    options: dict[str, str] = {}
    prompt_options: dict[str, str] | None = None
    if refused:
        first = next(iter(refused.items()))
        warnings.append(
            f"{len(refused)} of {len(nodes)} MoE layers run on the CPU: the WebGPU EP's QMoE cannot run {first[0]} "
            f"({first[1]})"
        )
        options["forceCpuNodeNames"] = "\n".join(refused)
    if on_device:
        version = device.ep_metadata.get("version", "?")
        warnings.append(
            f"the WebGPU EP's QMoE ({version}) computes wrong rows at times in calls of several tokens: prompts run "
            f"their {len(on_device)} device MoE layers on the CPU (a second session), single tokens on WebGPU"
        )
        prompt_options = {"forceCpuNodeNames": "\n".join(m.name for m in nodes)}
    return options, prompt_options


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
    ep_options: dict[str, str] = {}
    prompt_ep_options: dict[str, str] | None = None
    if provider == WEBGPU_EP:  # which nodes it takes, said after the session is made (node_placement)
        entries[RECORD_ASSIGNMENT_KEY] = "1"
        ep_options, prompt_ep_options = _webgpu_options(model, plugin_devices[0], warnings)
    providers = [provider, CPU_EP] if provider not in (CPU_EP, *PLUGIN_PROVIDERS) else [CPU_EP]
    for message in warnings:
        log.warning(message)
    return SessionPlan(
        device,
        provider,
        providers,
        plugin_devices,
        entries,
        offload_mode,
        warnings,
        layer_mode,
        ep_options,
        prompt_ep_options,
    )


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
    """The EP that runs the model, by the order of preference (the module's docstring), and the plugin
    EP's devices where it is one of those."""
    cuda = device in ("auto", "cuda")
    if cuda and plugin_library:
        return PLUGIN_EP, _register_plugin(ort, plugin_library)
    if cuda and CUDA_EP in ort.get_available_providers():
        _load_cuda_libraries(ort)
        return CUDA_EP, []
    if device == "cuda":
        raise MoepassError(
            f"device='cuda' but no CUDA EP is available: ONNX Runtime {ort.__version__} has "
            f"{', '.join(ort.get_available_providers())}; give the CUDA plugin EP library "
            f"({wording().option('--cuda-plugin', 'LIB')} or ${PLUGIN_ENV}), or install moepass[gpu] in place of "
            "moepass[cpu] (onnxruntime and onnxruntime-gpu cannot be installed together)"
        )
    if device in ("auto", "webgpu"):
        webgpu = _webgpu_devices(ort, required=device == "webgpu")
        if webgpu:
            return WEBGPU_EP, webgpu
    return CPU_EP, []


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
    if packed and provider in (CPU_EP, WEBGPU_EP):
        where = f"the device is {device}" if device != "auto" else "this ONNX Runtime has no CUDA EP"
        raise MoepassError(
            f"MoE node {packed[0]} is a com.microsoft::MoEPacked node (the GGUF's own blocks), which ONNX Runtime "
            f"runs on CUDA only, and {where} "
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
    elif provider == WEBGPU_EP:
        reason = "the plan places layers for CUDA, not for WebGPU"
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


def node_placement(session, plan: SessionPlan) -> dict[str, tuple[str, str]]:
    """node name -> (operator, the EP ONNX Runtime gave it), where the session recorded its graph
    assignment (the WebGPU EP's sessions: it takes what it has kernels for, the CPU the rest); {}
    elsewhere."""
    if RECORD_ASSIGNMENT_KEY not in plan.config_entries or not hasattr(session, "get_provider_graph_assignment_info"):
        return {}
    return {
        node.name: (f"{node.domain + '::' if node.domain else ''}{node.op_type}", subgraph.ep_name)
        for subgraph in session.get_provider_graph_assignment_info()
        for node in subgraph.get_nodes()
    }


def placement_summary(placement: dict[str, tuple[str, str]]) -> str:
    """One line: each EP's node count and its operators (most nodes first)."""
    by_ep: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, ep in placement.values():
        by_ep[ep][op] += 1
    parts = []
    for ep, ops in sorted(by_ep.items(), key=lambda item: -item[1].total()):
        listed = ", ".join(f"{op} {n}" if n > 1 else op for op, n in ops.most_common())
        parts.append(f"{ops.total()} on {ep} ({listed})")
    return "nodes: " + "; ".join(parts)


def provider_in_effect(session, plan: SessionPlan, ort=None) -> SessionPlan:
    """The plan as the session carries it out. ONNX Runtime creates a session on the CPU when it
    cannot create the CUDA EP it was given (CUDA or cuDNN libraries or the driver missing, no
    device): it logs an error and goes on. device='cuda' and a required per-layer plan refuse
    that, naming what the loader could not find; auto says so once and the plan names the CPU, so
    nothing reports CUDA for a CPU run."""
    if plan.provider not in (CUDA_EP, WEBGPU_EP) or plan.provider in session.get_providers():
        return plan
    if plan.provider == CUDA_EP:
        cause = _cuda_failure(ort) if ort is not None else "docs/gpu.md"
    else:
        cause = "the plugin gave no EP for its device"
    problem = f"ONNX Runtime could not create {plan.provider} ({cause}) and made the session on the CPU"
    if plan.device in ("cuda", "webgpu"):
        raise MoepassError(f"device='{plan.device}' but {problem}")
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
