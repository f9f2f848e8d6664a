"""What a decode step costs on this machine's CPU, measured on pieces of the model itself.

`measure_cpu_costs(model_dir)` times, with ONNX Runtime on the CPU EP, one-token steps of
- each distinct MoE node form of the model (its first node of that form, alone in a graph, with
  the model's own expert weights and random router scores: top-k experts read per step), and
- the model's largest dense matrix product (the LM head's MatMulNBits or MatMul), giving the
  bytes per second the CPU reads the non-expert weights at,
so that `cpu_step_ms` can add up a step: every MoE layer's measured time, plus the non-expert
weights a step reads (all but the embedding table) at the measured rate. partition writes it as
`prediction.decode_ms_per_token.cpu_only`, uses the MoE time for its cold experts, and keeps the
costs in plan.json (`cpu_costs`; `partition --cpu-profile PLAN` takes them instead of measuring).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from gguf import GGMLQuantizationType

from moepass.core import keys
from moepass.core.capabilities import activation_dtype
from moepass.core.errors import MoepassError, no_such_path
from moepass.core.ir_values import dims, required_input, stored_constant, tensor_of
from moepass.core.model_io import load_model, model_file
from moepass.core.moe_nodes import MoeNode, moe_nodes, tensor_bytes
from moepass.core.onnx_format import OPSETS, stamp
from moepass.core.quants import quant_type
from moepass.runtime.providers import register_native_kernels

FORMAT = "moepass-cpu-costs"
STEPS = 24  # timed one-token steps per piece (after warm-up); the median counts
EMBEDDING_OPS = ("Gather", "GatherBlockQuantized")


def _form_key(m: MoeNode) -> str:
    attrs = m.node.attributes
    return (
        f"{m.node.op_type}/{attrs.get_int('expert_weight_bits', 0)}/{attrs.get_int('block_size', 0)}/"
        f"{attrs.get_int('weights_prepacked', 0)}/{m.experts}x{m.top_k}/{m.width}x{m.ffn}"
    )


def _constant(value: ir.Value) -> ir.Value:
    return ir.Value(name=value.name, shape=value.shape, type=value.type, const_value=value.const_value)


def _weight(value: ir.Value | None) -> ir.Value | None:
    """A node's constant input for a graph of that node alone (a float16 initializer that a Cast
    widens, widened here as the session folds it); None for an absent or computed input."""
    source = stored_constant(value)
    if value is None or source is None or source is value:
        return None if source is None else _constant(source)
    cast = value.producer()
    assert cast is not None  # stored_constant found the Cast
    to = ir.DataType(cast.attributes.get_int("to"))
    wide = tensor_of(source).numpy().astype(to.numpy())
    return ir.Value(
        name=value.name, shape=source.shape, type=ir.TensorType(to), const_value=ir.tensor(wide, name=value.name)
    )


def _single_node_model(node: ir.Node, inputs: list[ir.Value | None], outputs: int) -> ir.Model:
    graph_inputs = [v for v in inputs if v is not None and v.const_value is None]
    initializers = [v for v in inputs if v is not None and v.const_value is not None]
    copy = ir.Node(
        node.domain,
        node.op_type,
        inputs,
        attributes=list(node.attributes.values()),
        num_outputs=outputs,
        name=node.name,
    )
    for i, out in enumerate(copy.outputs):
        out.name = f"out{i}"
    graph = ir.Graph(
        graph_inputs,
        [copy.outputs[0]],
        nodes=[copy],
        initializers=initializers,
        opset_imports={**OPSETS, node.domain: 1} if node.domain not in OPSETS else dict(OPSETS),
    )
    return stamp(ir.Model(graph, ir_version=0))


def _time(model: ir.Model, folder: Path, feeds: list[dict[str, np.ndarray]], threads: int | None) -> float:
    """Median seconds of one run of `model` (its weights read from `folder`'s data file), the runs
    cycling through `feeds` (a decode step's experts change from token to token: timing one
    router choice again and again would time weights the caches hold)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry(keys.EXTERNAL_DATA_FOLDER_KEY, str(folder))
    register_native_kernels(options, model)  # a moepass::MoEPacked node: moepass's own kernels
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    for i in range(3):
        session.run(None, feeds[i % len(feeds)])
    times = []
    for i in range(STEPS):
        start = time.perf_counter()
        session.run(None, feeds[(i + 3) % len(feeds)])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _moe_seconds(m: MoeNode, dtype: ir.DataType, folder: Path, threads: int | None) -> float:
    np_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else np.float32
    rng = np.random.default_rng(0)
    hidden = ir.Value(name="hidden", shape=ir.Shape([1, m.width]), type=ir.TensorType(dtype))
    inputs: list[ir.Value | None] = [hidden]
    routers = []
    for i, value in enumerate(m.node.inputs[1:], 1):
        if value is None or value.const_value is not None:
            inputs.append(None if value is None else _constant(value))
            continue
        routers.append(f"router{i}")  # router scores (and router weights where the node takes them): one token
        inputs.append(ir.Value(name=routers[-1], shape=ir.Shape([1, m.experts]), type=ir.TensorType(dtype)))
    feeds = [
        {
            "hidden": rng.normal(0, 1, (1, m.width)).astype(np_dtype),
            **{name: rng.normal(0, 1, (1, m.experts)).astype(np_dtype) for name in routers},
        }
        for _ in range(STEPS)
    ]  # another choice of experts at every step
    return _time(_single_node_model(m.node, inputs, len(m.node.outputs)), folder, feeds, threads)


def _largest_dense(model: ir.Model) -> tuple[ir.Node, int] | None:
    best = None
    for node in model.graph:
        if node.op_type not in ("MatMulNBits", "MatMul", "MatMulPacked"):
            continue
        weights = [w for w in map(stored_constant, node.inputs[1:]) if w is not None]
        if node.op_type == "MatMul" and any(len(dims(w.shape, node.name or "MatMul")) != 2 for w in weights):
            continue  # a batched product (deepseek2's per-head latent matrices), not a matrix a token reads
        size = sum(tensor_bytes(v) for v in weights)
        if weights and (best is None or size > best[1]):
            best = (node, size)
    return best


def _dense_rate(node: ir.Node, size: int, dtype: ir.DataType, folder: Path, threads: int | None) -> float:
    """Bytes per second a one-token step of `node` reads its `size` bytes of weights at."""
    weight = dims(required_input(node, 1).shape, f"{node.name}'s weight")
    if node.op_type == "MatMulNBits":
        k = node.attributes.get_int("K", 0)
    elif node.op_type == "MatMulPacked":  # moepass's: [N, row bytes] of its GGML type's blocks
        qt = quant_type(GGMLQuantizationType(node.attributes.get_int("packed_type", 0)), node.name or "MatMulPacked")
        k = qt.row_elements(weight[-1])
    else:
        k = weight[0]
    np_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else np.float32
    a = ir.Value(name="a", shape=ir.Shape([1, k]), type=ir.TensorType(dtype))
    inputs = [a] + [_weight(v) for v in node.inputs[1:]]
    feeds = [{"a": np.random.default_rng(0).normal(0, 1, (1, k)).astype(np_dtype)}]
    return size / _time(_single_node_model(node, inputs, 1), folder, feeds, threads)


def machine() -> str:
    """The CPU, as the costs are keyed by it."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = sorted(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if _has_flag(f))
    return f"{model}; {' '.join(flags) or 'no AVX2'}; {os.cpu_count()} CPUs"


def _has_flag(flag: str) -> bool:
    try:
        return any(
            line.startswith("flags") and f" {flag} " in f" {line} "
            for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


def measure_cpu_costs(model_dir: str | os.PathLike, threads: int | None = None) -> dict[str, Any]:
    """The costs of `model_dir` on this CPU (see the module's docstring)."""
    from moepass.runtime.decoder import usable_threads

    threads = usable_threads(threads)
    path = model_file(model_dir)
    model = load_model(path)
    dtype = activation_dtype(model)
    forms: dict[str, float] = {}
    per_node: dict[str, str] = {}
    for m in moe_nodes(model.graph):
        key = _form_key(m)
        per_node[m.name] = key
        if key not in forms:
            forms[key] = _moe_seconds(m, dtype, path.parent, threads) * 1e3
    dense = _largest_dense(model)
    if dense is None:
        raise MoepassError(f"{path}: no dense matrix product to time the non-expert weights by")
    embedding = {
        v.name
        for n in model.graph
        if n.op_type in EMBEDDING_OPS
        for v in n.inputs[:1]
        if v is not None and v.const_value is not None
    }
    expert = {v.name for m in moe_nodes(model.graph) for v in m.expert_values}
    non_expert_read = sum(
        tensor_bytes(v) for v in model.graph.initializers.values() if v.name not in expert and v.name not in embedding
    )
    return {
        "format": FORMAT,
        "version": 1,
        "machine": machine(),
        "threads": threads or 0,
        "moe_ms": forms,
        "moe_form_of": per_node,
        "dense_bytes_per_s": _dense_rate(*dense, dtype, path.parent, threads),
        "non_expert_bytes_read": non_expert_read,
    }


def cpu_step_ms(costs: dict[str, Any], cold_share: dict[str, float] | None = None) -> dict[str, float]:
    """Milliseconds of one decode step on the CPU: {"moe": the MoE layers' (each scaled by the share
    of its selected experts that runs there, all of them by default), "dense": the non-expert
    weights at the measured rate}."""
    moe = sum(
        costs["moe_ms"][form] * (1.0 if cold_share is None else cold_share.get(node, 1.0))
        for node, form in costs["moe_form_of"].items()
    )
    return {"moe": moe, "dense": 1e3 * costs["non_expert_bytes_read"] / costs["dense_bytes_per_s"]}


def cpu_costs(
    model_dir: str | os.PathLike, threads: int | None = None, given: str | os.PathLike | None = None
) -> dict[str, Any]:
    """The model's costs: from `given` (`--cpu-profile`: a plan.json partition wrote, whose
    `cpu_costs` are taken, or a file of them), else measured now (a second or two)."""
    if given is None:
        return measure_cpu_costs(model_dir, threads)
    costs = _read(Path(given))
    ours = {m.name: _form_key(m) for m in moe_nodes(load_model(model_dir).graph)}
    if costs["moe_form_of"] != ours:
        raise MoepassError(
            f"{given}: its costs are of another model (MoE nodes and forms "
            f"{sorted(set(costs['moe_form_of'].values()))}, this model's {sorted(set(ours.values()))})"
        )
    return costs


def _read(path: Path) -> dict[str, Any]:
    try:
        costs = json.loads(path.read_text())
    except FileNotFoundError:
        raise no_such_path(path, "the CPU cost file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoepassError(f"{path}: not a readable CPU cost file ({type(e).__name__})") from None
    if isinstance(costs, dict) and isinstance(costs.get("cpu_costs"), dict):  # a plan.json
        costs = costs["cpu_costs"]
    if not isinstance(costs, dict) or costs.get("format") != FORMAT:
        raise MoepassError(f"{path}: not a moepass CPU cost file (format {FORMAT!r})")
    ok = (
        isinstance(costs.get("moe_ms"), dict)
        and isinstance(costs.get("moe_form_of"), dict)
        and all(isinstance(v, (int, float)) and v > 0 for v in costs["moe_ms"].values())
        and all(f in costs["moe_ms"] for f in costs["moe_form_of"].values())
        and isinstance(costs.get("dense_bytes_per_s"), (int, float))
        and costs["dense_bytes_per_s"] > 0
        and isinstance(costs.get("non_expert_bytes_read"), int)
        and costs["non_expert_bytes_read"] >= 0
    )
    if not ok:
        raise MoepassError(f"{path}: a CPU cost file whose fields are missing or not positive numbers")
    return costs
