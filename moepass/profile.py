"""`moepass profile`: measure which experts a converted model routes calibration tokens to.

A profiling copy of the graph (pass `expose-router-logits`) returns every MoE node's router logits
beside the model's own outputs; ONNX Runtime runs it on the CPU over each prompt (one prefill per
prompt) and the routing each node applies (softmax over the experts, top-k, renormalized over the k
when the node says so, as QMoE does) is tallied into a `Popularity`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from moepass.core.choices import PROMPT_FORMATS, one_of
from moepass.core.errors import MoepassError
from moepass.core.files import read_text
from moepass.core.model_io import load_model, model_file
from moepass.core.moe_nodes import moe_nodes
from moepass.passes.expose_router import ExposeRouterLogitsPass
from moepass.pipeline.popularity import Popularity, model_identity

Prompt = str | Sequence[int]  # text (tokenized with the model's tokenizer) or token ids


def read_prompts(path: str | os.PathLike, fmt: str = "text") -> list[Prompt]:
    """A prompts file. "text": one prompt per line (blank lines skipped); "ids": one prompt per line
    as token ids separated by commas or spaces, '#' comments; "jsonl": one JSON value per line, a
    string (text), a list of token ids, or an object with "text" or "ids"."""
    one_of(fmt, PROMPT_FORMATS, "prompts format")
    path = Path(path)
    lines = read_text(path).splitlines()
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if fmt == "text":
            if line.strip():
                prompts.append(line)
        elif fmt == "ids":
            text = line.split("#", 1)[0]
            if text.strip():
                prompts.append(token_ids(text, f"{path}:{number}"))
        elif line.strip():
            prompts.append(_json_prompt(line, f"{path}:{number}"))
    if not prompts:
        raise MoepassError(f"{path}: no prompts in the file")
    return prompts


def token_ids(text: str, where: str) -> list[int]:
    """Token ids separated by commas and/or whitespace ("1,2,3", "1 2 3", "1, 2, 3"); anything
    else (signs, other digits, an empty list) is an error naming `where`."""
    parts = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not parts or not all(re.fullmatch(r"[0-9]+", t) for t in parts):
        raise MoepassError(f"{where}: expected token ids separated by commas or spaces, got {text.strip()[:60]!r}")
    return [int(t) for t in parts]


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise MoepassError(f"{where}: not JSON ({e.msg})") from None
    if isinstance(value, dict):
        value = value.get("text", value.get("ids"))
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise MoepassError(f'{where}: expected a string, a list of token ids, or an object with "text" or "ids"')


def selected_experts(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """QMoE's routing of router logits [T, E]: chosen experts [T, k] and their weights [T, k]."""
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def profile(
    model_dir: str | os.PathLike,
    prompts: Sequence[Prompt],
    threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    chat: bool = False,
) -> Popularity:
    """Run `prompts` through the model and count each node's routing. A prompt is text (encoded with
    the tokenizer convert wrote; `chat` wraps it in the model's chat template first) or a list of
    token ids."""
    from moepass.runtime import Decoder

    if isinstance(prompts, str):
        raise MoepassError("prompts is a list of prompts (text or token ids), not one string")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise MoepassError("every prompt needs at least one token (an empty prompt was given)")
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
        if isinstance(prompt, str):
            prompt = decoder.encode_chat(decoder.apply_chat_template(prompt)) if chat else decoder.encode(prompt)
            if not prompt:
                raise MoepassError(f"prompt {i + 1}: no tokens after tokenization")
        elif chat:
            raise MoepassError(f"prompt {i + 1}: the chat template applies to text, not token ids")
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise MoepassError(f"prompt {i + 1}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        _, _, routers = decoder.forward_with(np.array([prompt]), decoder.empty_cache(), list(expose.outputs.values()))
        for name, output in expose.outputs.items():
            node = nodes[name]
            chosen, weights = selected_experts(routers[output].reshape(-1, node.experts), node.top_k, node.normalize)
            result.selected[name] += np.bincount(chosen.ravel(), minlength=node.experts)
            result.weight[name] += np.bincount(chosen.ravel(), weights.ravel(), minlength=node.experts)
        result.tokens += len(prompt)
        result.prompts += 1
        if progress is not None:
            progress(i + 1, len(prompts))
    return result
