"""`moepass bench`: prefill and decode throughput of a loaded model, where the time goes, peak RSS.

Measured on the generation path users get (`Decoder.generate`, greedy, KV cache in place through
an IO binding, logits of the last position only): prefill is the time to the first new token (one
pass over `prompt_tokens` tokens from an empty cache); decode is `new_tokens` single-token steps
after `depth` cached tokens (default: after the prompt). Each figure is given as min / median / max
over `repeats`; tokens/s come from the best (the least disturbed) run, as llama-bench reports its
mean over quiet runs. The prompt is a fixed pseudo-random token sequence (seed 0) so runs compare.

`profile_phases` runs a few prefills and decode steps under ONNX Runtime's profiler and adds up, for
each phase, the kernel time per operator type, node and layer, and what the executor takes
between kernels.
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from moepass.core.errors import MoepassError


def _prompt(decoder, n: int) -> list[int]:
    return np.random.default_rng(0).integers(0, decoder.vocab_size, size=n).tolist()


def _stats(seconds: list[float], tokens: int) -> dict[str, float]:
    """Best-run tokens/s, the seconds' min/median/max, and llama-bench's avg_ts / stddev_ts (tokens/s
    over the runs)."""
    rates = [tokens / t for t in seconds]
    return {
        "tokens_per_s": tokens / min(seconds),
        "seconds_min": min(seconds),
        "seconds_median": statistics.median(seconds),
        "seconds_max": max(seconds),
        "tokens": tokens,
        "avg_ts": statistics.fmean(rates),
        "stddev_ts": statistics.stdev(rates) if len(rates) > 1 else 0.0,
    }


def _timed_generation(decoder, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the `new_tokens` after it)."""
    tokens = decoder.generate(prompt, new_tokens + 1, stop_ids=())
    start = time.perf_counter()
    next(tokens)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in tokens:
        pass
    return first, time.perf_counter() - start


def measure(
    decoder,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int = 3,
    depth: int | None = None,
    progress=None,
    prompt: list[int] | None = None,
) -> dict[str, Any]:
    """Prefill of `prompt_tokens` and decode of `new_tokens` after `depth` cached tokens (default:
    the prompt), each `repeats` times; `progress(text)` is told what runs. `prompt`: these tokens
    instead of pseudo-random ones (a text, for speculative decoding, whose drafts depend on it).
    With the decoder's speculator, decode is measured with it and without it, on the same prompt:
    `speculative` holds both rates, their ratio and the acceptance rate."""
    if prompt is not None:
        prompt_tokens = len(prompt)
    depth = prompt_tokens if depth is None else depth
    prompts = {n: prompt if prompt is not None else _prompt(decoder, n) for n in {prompt_tokens, depth}}
    speculator = decoder.speculator
    if speculator is not None:
        speculator.drafted = speculator.accepted = speculator.steps = 0
    generations = repeats * (1 if depth == prompt_tokens else 2)  # the speculative ones
    prefill, decode, plain = [], [], []
    for i in range(repeats):
        if progress:
            progress(
                f"run {i + 1}/{repeats}: prefill {prompt_tokens} tokens, decode {new_tokens} after {depth}"
                + (", with and without speculation" if speculator else "")
            )
        first, steps = _timed_generation(decoder, prompts[prompt_tokens], new_tokens)
        prefill.append(first)
        if depth != prompt_tokens:
            _, steps = _timed_generation(decoder, prompts[depth], new_tokens)
        decode.append(steps)
        if speculator is not None:
            decoder.speculate(None)
            try:
                plain.append(_timed_generation(decoder, prompts[depth], new_tokens)[1])
            finally:
                decoder.speculate(speculator)
    result = {
        "prefill": {**_stats(prefill, prompt_tokens), "prompt_tokens": prompt_tokens},
        "decode": {**_stats(decode, new_tokens), "depth": depth},
        "prefill_tokens_per_s": prompt_tokens / min(prefill),
        "decode_tokens_per_s": new_tokens / min(decode),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if speculator is not None:
        result["acceptance"] = speculator.acceptance
        result["speculative"] = {
            "kind": speculator.kind,
            "draft_tokens": speculator.draft_tokens,
            "acceptance": speculator.acceptance,
            "tokens_per_step": generations * new_tokens / max(speculator.steps, 1),
            "plain_decode": _stats(plain, new_tokens),
            "speedup": min(plain) / min(decode),
        }
    return result


def profile_phases(
    model_dir, prompt_tokens: int = 128, new_tokens: int = 16, depth: int = 128, repeats: int = 3, **load_options
) -> dict[str, dict[str, Any]]:
    """Where a prefill and a decode step spend their time, from ONNX Runtime's profiler, on the
    generation path: `repeats` prefills of `prompt_tokens` tokens from an empty cache (distinct
    pseudo-random prompts), then `new_tokens` decode steps after `depth` cached tokens, after a
    warm-up. Returns {"prefill": ..., "decode": ...}, each per prefill or per decode step in
    milliseconds: `runs` (the model runs it covers), `step_ms` (the session's runs), `nodes_ms`
    (the kernels' sum), `framework_ms` (the rest: the executor between kernels), `operators` (op
    type -> ms and nodes), `layers` (layer index, or -1 for nodes outside the layers, -> ms),
    `node_ms` (node name -> ms), `operator_shares` (op type -> share of the kernel time); and
    `prompt_tokens` (prefill) or `steps` and `depth` (decode)."""
    from moepass.runtime import Decoder

    with tempfile.TemporaryDirectory(prefix="moepass-profile-") as tmp:
        decoder = Decoder(model_dir, profile_prefix=str(Path(tmp) / "run"), **load_options)
        rng = np.random.default_rng(1)
        # the runs of the session that runs prompts (a second one on WebGPU: Decoder.session_for)
        prompts = decoder.prompt_session is not None

        def prompt_runs() -> int:
            return decoder.prompt_runs if prompts else decoder.model_runs

        list(decoder.generate(_prompt(decoder, 8), 2, stop_ids=()))  # warm-up: the first runs pay for allocation
        first_prefill = prompt_runs()
        for _ in range(repeats):
            list(decoder.generate(rng.integers(0, decoder.vocab_size, size=prompt_tokens).tolist(), 1, stop_ids=()))
        last_prefill = prompt_runs()
        list(decoder.generate(_prompt(decoder, depth), new_tokens + 1, stop_ids=()))  # a prefill, then the steps
        events, runs = _session_runs(decoder.session, decoder.model_runs - decoder.prompt_runs)
        prompt_events, prompt_run_events = (
            _session_runs(decoder.prompt_session, decoder.prompt_runs) if prompts else (events, runs)
        )
    return {
        "prefill": {
            **_where(prompt_events, prompt_run_events[first_prefill:last_prefill], repeats),
            "prompt_tokens": prompt_tokens,
        },
        "decode": {**_where(events, runs[len(runs) - new_tokens :], new_tokens), "steps": new_tokens, "depth": depth},
    }


def _session_runs(session, made: int) -> tuple[list[dict], list[dict]]:
    """A session's profile events and its last `made` runs (the profiler counts the same runs as
    the decoder, from the session's start)."""
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) < made:
        raise MoepassError(f"ONNX Runtime's profile holds {len(runs)} runs of the {made} made: it dropped events")
    return events, runs[len(runs) - made :]


def _where(events: list[dict], runs: list[dict], units: int) -> dict[str, Any]:
    """The kernel time of the nodes inside `runs` (profiler events), per unit (a prefill or a step)."""
    spans = [(r["ts"], r["ts"] + r["dur"]) for r in runs]
    per = 1 / max(units, 1)
    operators: dict[str, dict[str, float]] = {}
    layers: dict[int, float] = {}
    node_ms: dict[str, float] = {}
    suffix = "_kernel_time"
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith(suffix):
            continue
        if not any(start <= e["ts"] <= stop for start, stop in spans):
            continue
        name = e["name"][: -len(suffix)]
        ms = e["dur"] / 1e3 * per
        op = operators.setdefault(e.get("args", {}).get("op_name", "?"), {"ms": 0.0, "nodes": 0.0})
        op["ms"] += ms
        op["nodes"] += per
        node_ms[name] = node_ms.get(name, 0.0) + ms
        layer = int(name.split(".")[1]) if name.startswith("blk.") and name.split(".")[1].isdigit() else -1
        layers[layer] = layers.get(layer, 0.0) + ms
    step_ms = sum(r["dur"] for r in runs) / 1e3 * per
    nodes_ms = sum(op["ms"] for op in operators.values())
    whole = nodes_ms or 1.0
    ordered = dict(sorted(operators.items(), key=lambda kv: -kv[1]["ms"]))
    return {
        "runs": len(runs),
        "step_ms": step_ms,
        "nodes_ms": nodes_ms,
        "framework_ms": step_ms - nodes_ms,
        "operators": ordered,
        "layers": dict(sorted(layers.items())),
        "node_ms": node_ms,
        "operator_shares": {op: v["ms"] / whole for op, v in ordered.items()},
    }
