"""`moepass inspect`: what is in a GGUF file or a converted ONNX model, without reading weights.

For both, the answer is a plain dict (for the API and `--json`) and the lines the CLI prints:
architecture, MoE layers, quantization formats, and bytes per group of weights. Weight groups:
"experts" (routed expert matrices and biases), "shared experts", "dense ffn" (deepseek2's leading
blocks), "attention", "embedding/output", "router" and "norms".
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

from moepass.core import keys
from moepass.core.architectures import architecture_of
from moepass.core.capabilities import cuda_refusals
from moepass.core.errors import MoepassError, no_such_path, wording
from moepass.core.formats import read_report
from moepass.core.gguf_reader import GGUFModel, is_gguf
from moepass.core.model_io import as_ir_model
from moepass.core.moe_nodes import moe_nodes, tensor_bytes
from moepass.core.quants import BlockForm, parse_form
from moepass.passes.fuse_moe import FuseMoePass
from moepass.pipeline.kv_precision import cache_type_of, describe_cache, kv_bytes_per_position


def _gguf_group(name: str) -> str:
    if "_exps" in name:
        return "experts"
    if "_shexp" in name:
        return "shared experts"
    if "ffn_gate_inp" in name or "exp_probs_b" in name:
        return "router"
    if name.endswith("norm.weight"):
        return "norms"
    if ".attn_" in name:
        return "attention"
    if ".ffn_" in name:
        return "dense ffn"
    if name.startswith(("token_embd", "output")):
        return "embedding/output"
    return "other"


def inspect_gguf(path: Path) -> dict[str, Any]:
    gguf = GGUFModel(path)
    arch_name = gguf.architecture
    try:
        arch, why_not = architecture_of(gguf), None
    except MoepassError as e:  # convert's own reason (an unknown or a dense architecture), said as a fact
        arch, why_not = None, str(e).split(": ", 1)[-1]
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    types: collections.Counter = collections.Counter()
    for t in gguf.tensors.values():
        groups[_gguf_group(t.name)][t.type_name] += t.nbytes
        types[t.type_name] += 1
    info: dict[str, Any] = {
        "kind": "gguf",
        "file": str(path),
        "parts": [p.name for p in gguf.parts],
        "file_bytes": gguf.file_bytes,
        "architecture": arch_name,
        "supported": arch is not None,
        "unsupported_reason": why_not,
        "tensor_types": dict(types),
        "bytes_by_group": {g: dict(c) for g, c in sorted(groups.items())},
    }
    if arch is not None:
        hp = arch.read_hparams(gguf)
        info["hparams"] = hp.as_dict()
        info["moe_layers"] = sum(not arch.is_dense(i, hp) for i in range(hp.n_layers))
        info["features"] = arch.describe(gguf, hp)
    return info


def inspect_onnx(source: Any) -> dict[str, Any]:
    model, label = as_ir_model(source)
    graph = model.graph
    found = moe_nodes(graph)
    expert_inputs = {v.name for m in found for v in m.expert_values}
    refused = cuda_refusals(model)  # node -> why ONNX Runtime's CUDA EP will not take it
    nodes = []
    for m in found:
        attrs = {k: a.value for k, a in m.node.attributes.items()}
        bits = attrs.get("expert_weight_bits", 4)  # ONNX Runtime's default
        if m.node.op_type == "QMoE":  # as the node computes it; block-sum features as recorded
            form = str(BlockForm(bits, attrs["block_size"])) if "block_size" in attrs else f"int{bits}/row"
            recorded = m.form
            if recorded is not None and recorded.plain == parse_form(form) and recorded.sums:
                form = str(recorded)
        elif m.node.op_type == "MoEPacked":  # the GGUF's own blocks, as recorded
            form = m.node.metadata_props.get(keys.EXPERT_FORM, "packed")
        else:
            form = "float32"
        placement = {
            k.removeprefix(keys.PLACEMENT_PREFIX): v
            for k, v in m.node.metadata_props.items()
            if k.startswith(keys.PLACEMENT_PREFIX)
        }
        nodes.append(
            {
                "node": m.name,
                "op": m.node.op_type,
                "form": form,
                "experts": m.experts,
                "top_k": m.top_k,
                "hidden": m.hidden,
                "ffn": m.ffn,
                "activation": attrs.get("activation_type"),
                "bytes": m.bytes_per_expert * m.experts,
                "resident": int(placement["resident"]) if "resident" in placement else None,
                "cuda": refused.get(m.name),  # None: the CUDA EP takes it
                "metadata": dict(m.node.metadata_props),
            }
        )
    groups: collections.Counter = collections.Counter()
    dtypes: collections.Counter = collections.Counter()
    for value in graph.initializers.values():
        n = tensor_bytes(value)
        groups["experts" if value.name in expert_inputs else "non-expert"] += n
        dtypes[value.const_value.dtype.name if value.const_value is not None else "?"] += n
    ops = collections.Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in graph)
    dry_run = FuseMoePass(dry_run=True)
    dry_run(model)
    report = read_report(Path(label).parent)
    fused = list(report.fusion) or None
    try:
        kv_bytes = kv_bytes_per_position(graph)
    except MoepassError:  # a cache laid out otherwise than moepass writes it (an export's): its type only
        kv_bytes = 0
    return {
        "kind": "onnx",
        "file": label,
        "architecture": model.metadata_props.get(keys.ARCHITECTURE),
        "metadata": dict(model.metadata_props),
        "moe_nodes": nodes,
        "bytes_by_group": dict(groups),
        "bytes_by_dtype": dict(dtypes),
        "ops": dict(sorted(ops.items())),
        "inputs": [v.name for v in graph.inputs],
        # the KV cache's type (None without one), bytes a position and the positions of the model
        "kv_cache": {
            "type": cache_type_of(model),
            "bytes_per_position": kv_bytes,
            "context": report.context_length,
        },
        "outputs": [v.name for v in graph.outputs],
        # MoE subgraphs `moepass convert` would fuse in this model, and why others would not be
        "fusion_candidates": [r.as_dict() for r in dry_run.records],
        # the nodes ONNX Runtime's CUDA EP has no kernel for, and why (moepass.core.capabilities)
        "cuda_refused": refused,
        # what convert did when it made this model from an ONNX model (its moepass.json)
        "fusion": fused,
    }


def inspect(source: Any) -> dict[str, Any]:
    """Describe a GGUF file, an ONNX model (file or converted directory) or an in-memory graph."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise no_such_path(path)
        if path.is_file() and (is_gguf(path) or path.suffix == ".gguf"):
            return inspect_gguf(path)
    return inspect_onnx(source)


def _feature_lines(features: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in features.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:g}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(value)
        lines.append(f"{key.replace('_', ' '):<13} {value}")
    return lines


def format_inspection(info: dict[str, Any]) -> list[str]:
    lines = [f"file          {info['file']}"]
    if info["kind"] == "gguf":
        lines.append(f"format        GGUF, {len(info['parts'])} part(s), {info['file_bytes']:,} bytes")
        lines.append(
            f"architecture  {info['architecture']}"
            + ("" if info["supported"] else f"  (not converted by moepass: {info['unsupported_reason']})")
        )
        if "hparams" in info:
            hp = info["hparams"]
            lines.append(
                f"model         {hp['n_layers']} layers, hidden {hp['hidden']}, "
                f"{hp['n_heads']} q / {hp['n_kv_heads']} kv heads x {hp['head_dim']}, vocab {hp['vocab']}, "
                f"context {hp['context_length']}"
            )
            lines.append(
                f"MoE layers    {info['moe_layers']}: {hp['n_experts']} experts, top-{hp['n_experts_used']}, "
                f"expert ffn {hp['expert_ff']}"
            )
            lines.extend(_feature_lines(info["features"]))
        lines.append("tensor types  " + ", ".join(f"{t} x{n}" for t, n in sorted(info["tensor_types"].items())))
        lines.append("bytes by group")
        for group, by_type in info["bytes_by_group"].items():
            detail = ", ".join(f"{t} {n:,}" for t, n in sorted(by_type.items()))
            lines.append(f"  {group:<18}{sum(by_type.values()):>16,}  ({detail})")
        return lines
    lines.append(f"format        ONNX, architecture {info['architecture'] or 'unknown'}")
    features = info["metadata"].get(keys.FEATURES)
    if features:
        try:
            lines.extend(_feature_lines(json.loads(features)))
        except (ValueError, TypeError, AttributeError):
            lines.append("features      (the model's moepass.features metadata is unreadable)")
    lines.append(f"MoE layers    {len(info['moe_nodes'])}")
    for m in info["moe_nodes"]:
        resident = "" if m["resident"] is None else f", {m['resident']} resident on the GPU (stored first)"
        cuda = "; CUDA takes it" if m["cuda"] is None else "; not on CUDA"
        lines.append(
            f"  {m['node']:<16}{m['op']:<6} {m['form']:<18} {m['experts']} experts, top-{m['top_k']}, "
            f"{m['bytes']:,} bytes{resident}{cuda}"
        )
    kv = info.get("kv_cache") or {}
    if kv.get("type"):
        lines.append(f"KV cache      {describe_cache(kv['type'], kv['bytes_per_position'], kv['context'])}")
    refused = info.get("cuda_refused") or {}
    if refused:
        reasons = collections.Counter(refused.values())
        lines.append(f"CUDA EP       {len(refused)} nodes it has no kernel for (they would run on the CPU):")
        lines.extend(f"  {n} x {why}" for why, n in reasons.most_common())
        if any("float32" in why for why in reasons):
            lines.append(
                f"  ({wording().call('convert', wording().option('--expert-format', 'offload'))} writes a float16 "
                "graph whose every node the CUDA EP takes)"
            )
    else:
        lines.append("CUDA EP       takes every node")
    for record in info.get("fusion") or []:
        lines.append(
            f"  fused {record['anchor']} -> {record['node']} ({record['form']})"
            if record["fused"]
            else f"  not fused: {record['reason']}"
        )
    # float MoE nodes that stay as they are are listed above already
    candidates = [r for r in info.get("fusion_candidates") or [] if r["fused"] or r["rule"] != "moe-node"]
    if candidates:
        lines.append(
            f"fusable       {sum(r['fused'] for r in candidates)} of {len(candidates)} MoE subgraphs "
            "(moepass convert fuses them into QMoE)"
        )
        lines.extend(
            f"  {r['anchor']}: {r['geometry']}" if r["fused"] else f"  not fusable: {r['reason']}" for r in candidates
        )
    lines.append("bytes by group")
    for group, n in sorted(info["bytes_by_group"].items()):
        lines.append(f"  {group:<18}{n:>16,}")
    lines.append("bytes by dtype  " + ", ".join(f"{t} {n:,}" for t, n in sorted(info["bytes_by_dtype"].items())))
    lines.append("operators     " + ", ".join(f"{op} x{n}" for op, n in info["ops"].items()))
    return lines
