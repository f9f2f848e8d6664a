"""`moepass profile`: measure which experts a converted model routes calibration tokens to.

A profiling copy of the graph (pass `expose-router-logits`) returns every MoE node's router logits
beside the model's own outputs; ONNX Runtime runs it on the CPU over each prompt (one prefill per
prompt) and the routing each node applies (softmax over the experts, top-k, renormalized over the k
when the node says so, as QMoE does) is tallied into a `Popularity`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moepass.errors import MoepassError
from moepass.files import load_model, model_file
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.passes.moe_nodes import moe_nodes
from moepass.popularity import Popularity, model_identity



def read_prompts(path: str | os.PathLike) -> list[list[int]]:
    """A prompts file: one prompt per line as token ids separated by commas or spaces; '#' comments."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise MoepassError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise MoepassError(f"{path}: not a text file of token ids") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].replace(",", " ").strip()
        if not text:
            continue
        try:
            prompts.append([int(t) for t in text.split()])
        except ValueError:
            raise MoepassError(f"{path}:{number}: expected token ids separated by commas or spaces, "
                               f"got {line.strip()[:60]!r}") from None
    if not prompts:
        raise MoepassError(f"{path}: no prompts in the file")
    return prompts


def route(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """QMoE's routing of router logits [T, E]: chosen experts [T, k] and their weights [T, k]."""
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def profile(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], threads: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> Popularity:
    """Run `prompts` (lists of token ids) through the model and count each node's routing."""
    from moepass.runtime import Decoder

    if not prompts or any(len(p) == 0 for p in prompts):
        raise MoepassError("every prompt needs at least one token id")
    source = model_file(model_dir)
    model = load_model(source)
    identity = model_identity(model)
    nodes = {m.name: m for m in moe_nodes(model.graph)}
    if not nodes:
        raise MoepassError(f"{source}: the model has no QMoE/MoE node to profile")
    expose = ExposeRouterLogitsPass()
    expose(model)
    result = Popularity.empty(identity)
    # The profiling copy's graph lives in memory; its weights are read from the model's own data file.
    decoder = Decoder(source, threads=threads, graph=model)
    vocab = decoder.vocab_size
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise MoepassError(f"prompt {i + 1}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        _, _, routers = decoder.forward_with(np.array([prompt]), decoder.empty_cache(), list(expose.outputs.values()))
        for name, output in expose.outputs.items():
            node = nodes[name]
            chosen, weights = route(routers[output].reshape(-1, node.experts), node.top_k, node.normalize)
            result.selected[name] += np.bincount(chosen.ravel(), minlength=node.experts)
            result.weight[name] += np.bincount(chosen.ravel(), weights.ravel(), minlength=node.experts)
        result.tokens += len(prompt)
        result.prompts += 1
        if progress is not None:
            progress(i + 1, len(prompts))
    return result
