"""Expert popularity: what `moepass profile` measures and `moepass partition` reads.

File format (JSON, `"format": "moepass-popularity"`, `"version": 1`):

    {"format": "moepass-popularity", "version": 1,
     "model": {"architecture": "qwen3moe", "fingerprint": "<sha256>",
               "moe_nodes": [{"node": "blk.0.moe", "experts": 128, "top_k": 8}, ...]},
     "tokens": 4096,                      # calibration tokens routed through every MoE node
     "prompts": 12,
     "nodes": {"blk.0.moe": {"selected": [int per expert],   # times the expert was in the top-k
                             "weight": [float per expert]}}} # routing weight it carried, summed

Per node, sum(selected) = tokens * top_k and sum(weight) = tokens when the routing renormalizes
over the top-k. The fingerprint hashes the model's MoE structure (architecture, node names, expert
counts, top-k, hidden and expert sizes, vocabulary), so a profile fits every conversion of the same model,
whatever its quantization, and no other. Profiles of the same model merge by adding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from moepass.core import keys
from moepass.core.errors import MoepassError
from moepass.core.files import read_json
from moepass.core.moe_nodes import moe_nodes
from moepass.pipeline.atomic import atomic_file

FORMAT = "moepass-popularity"
VERSION = 1


def model_identity(model: ir.Model) -> dict[str, Any]:
    """The MoE structure of a model and its fingerprint."""
    graph = model.graph
    logits = next((v for v in graph.outputs if v.name == "logits"), None)
    vocab = logits.shape[-1] if logits is not None and logits.shape is not None else None
    nodes = [
        {"node": m.name, "experts": m.experts, "top_k": m.top_k, "hidden": m.hidden, "ffn": m.ffn}
        for m in moe_nodes(graph)
    ]
    identity = {
        "architecture": model.metadata_props.get(keys.ARCHITECTURE),
        "moe_nodes": nodes,
        "vocab": vocab if isinstance(vocab, int) else None,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return {"architecture": identity["architecture"], "fingerprint": digest, "moe_nodes": nodes}


@dataclasses.dataclass
class Popularity:
    """Per MoE node and expert: selection counts and routing weight over `tokens` calibration tokens."""

    model: dict[str, Any]
    tokens: int
    prompts: int
    selected: dict[str, np.ndarray]  # node -> int64 [experts]
    weight: dict[str, np.ndarray]  # node -> float64 [experts]

    @classmethod
    def empty(cls, model: dict[str, Any]) -> Popularity:
        nodes = model["moe_nodes"]
        return cls(
            model,
            0,
            0,
            {n["node"]: np.zeros(n["experts"], np.int64) for n in nodes},
            {n["node"]: np.zeros(n["experts"], np.float64) for n in nodes},
        )

    @property
    def fingerprint(self) -> str:
        return self.model["fingerprint"]

    def mass(self, node: str) -> np.ndarray:
        """Share of the node's routing weight each expert carried (sums to 1)."""
        w = self.weight[node]
        total = w.sum()
        return w / total if total > 0 else np.full(len(w), 1.0 / len(w))

    def selection_rate(self, node: str) -> np.ndarray:
        """Share of the node's expert selections that went to each expert (sums to 1)."""
        s = self.selected[node].astype(np.float64)
        total = s.sum()
        return s / total if total > 0 else np.full(len(s), 1.0 / len(s))

    def never_selected(self) -> dict[str, int]:
        """Per node, how many experts no calibration token was routed to (a calibration set that
        reaches few experts gives the planner little to go on)."""
        return {node: int(np.count_nonzero(counts == 0)) for node, counts in self.selected.items()}

    def coverage_line(self) -> str:
        """One line on the experts the calibration never reached, worst layers first."""
        missing = {n: c for n, c in self.never_selected().items() if c}
        if not missing:
            return "every expert of every MoE layer was selected at least once"
        worst = sorted(missing.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{n} {c} of {len(self.selected[n])}" for n, c in worst[:4])
        more = f" (and {len(worst) - 4} more layers)" if len(worst) > 4 else ""
        return (
            f"experts never selected in {len(missing)} of {len(self.selected)} MoE layers: {shown}{more}; "
            "more or more varied prompts would measure them"
        )

    def merge(self, other: Popularity, other_label: str = "profile") -> Popularity:
        if other.fingerprint != self.fingerprint:
            raise MoepassError(
                f"{other_label}: profiles of different models cannot be merged "
                f"(fingerprint {other.fingerprint[:12]} vs {self.fingerprint[:12]})"
            )
        return Popularity(
            self.model,
            self.tokens + other.tokens,
            self.prompts + other.prompts,
            {n: self.selected[n] + other.selected[n] for n in self.selected},
            {n: self.weight[n] + other.weight[n] for n in self.weight},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "tokens": self.tokens,
            "prompts": self.prompts,
            "nodes": {
                n: {"selected": self.selected[n].tolist(), "weight": self.weight[n].tolist()} for n in self.selected
            },
        }

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        with atomic_file(path, overwrite) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Popularity:
        path = Path(path)
        data = read_json(path, "a popularity file")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MoepassError(f'{path}: not a popularity file (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise MoepassError(
                f"{path}: popularity format version {data.get('version')} is not supported "
                f"(this moepass reads version {VERSION})"
            )
        try:
            model = data["model"]
            selected, weight = {}, {}
            for spec in model["moe_nodes"]:
                node = spec["node"]
                entry = data["nodes"][node]
                selected[node] = np.asarray(entry["selected"], dtype=np.int64)
                weight[node] = np.asarray(entry["weight"], dtype=np.float64)
                if selected[node].shape != (spec["experts"],) or weight[node].shape != (spec["experts"],):
                    raise ValueError(f"node {node}: expected {spec['experts']} experts")
                if (selected[node] < 0).any() or (weight[node] < 0).any() or not np.isfinite(weight[node]).all():
                    raise ValueError(f"node {node}: negative or non-finite entries")
            tokens, prompts = data["tokens"], data.get("prompts", 0)
            if not isinstance(tokens, int) or not isinstance(prompts, int) or tokens < 0 or prompts < 0:
                raise ValueError("tokens and prompts must be non-negative integers")
            for spec in model["moe_nodes"]:  # recomputed, not trusted: every token selects top_k experts
                total = int(selected[spec["node"]].sum())
                if total != tokens * spec["top_k"]:
                    raise ValueError(
                        f"node {spec['node']}: {total} expert selections for {tokens} tokens at "
                        f"top-{spec['top_k']} (expected {tokens * spec['top_k']}; edited counts?)"
                    )
            return cls(model, tokens, prompts, selected, weight)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            raise MoepassError(f"{path}: malformed popularity file ({type(e).__name__}: {e})") from None

    def check_fits(self, model_identity_: dict[str, Any], label: str) -> None:
        if (
            model_identity_["fingerprint"] != self.fingerprint
            or model_identity_["moe_nodes"] != self.model["moe_nodes"]
        ):
            mine = [n["node"] for n in self.model["moe_nodes"]]
            theirs = [n["node"] for n in model_identity_["moe_nodes"]]
            detail = "different MoE layers" if mine != theirs else "same layer names, different shapes"
            raise MoepassError(
                f"{label}: this profile was measured on another model ({detail}; "
                f"fingerprint {self.fingerprint[:12]}, the model's is "
                f"{model_identity_['fingerprint'][:12]})"
            )
