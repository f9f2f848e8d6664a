"""The llama.cpp oracle (llama-cpp-python, built from source by the test setup) and what decides a
comparison with it.

llama.cpp quantizes activations inside its quantized dot products (as the converted models do by
default), so on quantized files neither side is the exact computation of the file's weights; the
reference is llama.cpp on the file's F32 dequantization (dequantized_copy). check_against_exact
holds the converted model to llama.cpp's own distance from it. A position is *decided* when the
exact computation's top-2 logit margin is at least NEAR_TIE times the spread (std) of its logits,
and a router *nearly ties* when its k-th and (k+1)-th logits are closer than ROUTER_TIE times their
spread: such routing can fall either way (a phimoe Q4_K fixture flips an expert at positions whose
2nd/3rd router logits differ by 0.016-0.046), and those positions are left out. deepseek2's routing
ties where its selection scores (gating probabilities plus the selection bias) or, group-limited,
its group scores nearly tie.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

PROMPT = [5, 77, 200, 13, 99, 150, 7, 260, 31, 42, 318, 1, 64, 128]
NEAR_TIE = 0.1     # of the position's logit std
ROUTER_TIE = 0.05  # of the position's router logit std
DISTANCE_FACTOR, SPREAD_FLOOR = 2.0, 0.01  # ours from exact <= 2x llama.cpp's + 1 % of the logit spread
F32_TOLERANCE = 1e-4  # max |logit difference| from llama.cpp on an F32 file with an F32 KV cache


def llama_cpp_module():
    """llama-cpp-python, or a skip saying how to get it (the suite runs without the oracle)."""
    return pytest.importorskip("llama_cpp", reason="the llama.cpp oracle (llama-cpp-python) is not installed; "
                                                    "the README's test command builds it")


def llama_logits(gguf_path, ids=PROMPT):
    """llama.cpp's logits [len(ids), vocab] for one prefill, F32 KV cache."""
    llama_cpp = llama_cpp_module()
    n_ctx = max(64, len(ids))
    llm = llama_cpp.Llama(str(gguf_path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, type_k=0, type_v=0,
                          n_threads=2, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def three_ways(decoder):
    """A converted model's logits of PROMPT by one prefill, token by token through the KV cache, and
    in two chunks."""
    prefill, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    cache, steps = decoder.empty_cache(), []
    for token in PROMPT:
        logits, cache = decoder.forward(np.array([[token]]), cache)
        steps.append(logits[0, -1])
    first, cache = decoder.forward(np.array([PROMPT[:5]]), decoder.empty_cache())
    rest, _ = decoder.forward(np.array([PROMPT[5:]]), cache)
    return {"prefill": prefill[0], "token-by-token decode": np.array(steps),
            "chunked prefill": np.concatenate([first[0], rest[0]])}


@dataclasses.dataclass(frozen=True)
class Quality:
    """A quantized model's next-token distributions against the unquantized model's, as
    `llama-perplexity --kl-divergence` reports them: mean and 99th-percentile KL divergence
    KL(P_reference || P_quantized) per position, "same top p" (the share of positions where both
    rank the same token first), and the perplexity of the text's next tokens."""

    mean_kld: float
    p99_kld: float
    top1: float
    perplexity: float
    positions: int

    def __str__(self) -> str:
        return (f"mean KLD {self.mean_kld:.3e}, 99 % KLD {self.p99_kld:.3e}, same top {self.top1:.1%}, "
                f"PPL {self.perplexity:.3f} over {self.positions} positions")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _window_klds(reference, logits) -> tuple[np.ndarray, np.ndarray]:
    """(KL(P_reference || P) per predicting position, log P) of one window's logits."""
    ref, ours = _log_softmax(reference)[:-1], _log_softmax(logits)[:-1]
    return (np.exp(ref) * (ref - ours)).sum(axis=-1), ours


def next_token_quality(reference_logits, logits, windows) -> Quality:
    """Quality of `logits` against `reference_logits`, each a list of [positions, vocab] arrays, one
    per token window of `windows` (position i predicts window[i + 1]; a window's last position
    predicts nothing and is left out), pooled over every position as llama-perplexity does."""
    kld, nll, same = [], [], []
    for ref, logs, ids in zip(reference_logits, logits, windows, strict=True):
        window_kld, ours = _window_klds(ref, logs)
        kld.append(window_kld)
        nll.append(-ours[np.arange(len(ids) - 1), np.asarray(ids)[1:]])
        same.append(np.argmax(ref[:-1], -1) == ours.argmax(-1))
    kld, nll, same = (np.concatenate(a) for a in (kld, nll, same))
    return Quality(float(kld.mean()), float(np.percentile(kld, 99)), float(same.mean()), float(np.exp(nll.mean())),
                   len(kld))


def top_disagreements(reference_logits, ours, theirs) -> tuple[int, int]:
    """(positions only `ours` ranks the reference's most likely token first, positions only
    `theirs` does), over every predicting position of every window."""
    only_ours = only_theirs = 0
    for ref, o, t in zip(reference_logits, ours, theirs, strict=True):
        best = np.argmax(ref[:-1], -1)
        mine, their = np.argmax(o[:-1], -1) == best, np.argmax(t[:-1], -1) == best
        only_ours += int((mine & ~their).sum())
        only_theirs += int((their & ~mine).sum())
    return only_ours, only_theirs


def kld_ratio(reference_logits, ours, theirs, samples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Mean KLD of `ours` over that of `theirs` (both against `reference_logits`, lists of windows),
    with a 90 % paired bootstrap interval over windows: (ratio, low, high)."""
    a = np.array([_window_klds(r, o)[0].sum() for r, o in zip(reference_logits, ours, strict=True)])
    b = np.array([_window_klds(r, t)[0].sum() for r, t in zip(reference_logits, theirs, strict=True)])
    picks = np.random.default_rng(seed).integers(0, len(a), (samples, len(a)))
    ratios = a[picks].sum(axis=1) / b[picks].sum(axis=1)
    return float(a.sum() / b.sum()), float(np.percentile(ratios, 5)), float(np.percentile(ratios, 95))


GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8  # llama.cpp's KV cache types (type_k / type_v)


def llama_window_logits(gguf_path, windows, cache_type: int = GGML_F32) -> list[np.ndarray]:
    """llama.cpp's logits for each token window, each its own prefill from an empty cache (one
    context, reset between windows; K and V caches of `cache_type`, flash attention on for a
    quantized one, which llama.cpp's quantized V cache needs)."""
    llama_cpp = llama_cpp_module()
    n_ctx = max(64, max(len(ids) for ids in windows))
    llm = llama_cpp.Llama(str(gguf_path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, type_k=cache_type,
                          type_v=cache_type, flash_attn=cache_type not in (GGML_F32, GGML_F16), n_threads=2,
                          verbose=False)
    try:
        out = []
        for ids in windows:
            llm.reset()
            llm.eval(list(ids))
            out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
        return out
    finally:
        llm.close()


def moepass_window_logits(model_dir, windows) -> list[np.ndarray]:
    """A converted model's logits for each token window, each its own prefill."""
    from moepass.runtime import load

    decoder = load(model_dir)
    return [decoder.forward(np.array([list(ids)]), decoder.empty_cache())[0][0] for ids in windows]


def moepass_step_logits(model_dir, windows) -> list[np.ndarray]:
    """A converted model's logits for each token window decoded one token per step through the KV
    cache (each position attends to the cache as it is stored: a quantized cache's own values)."""
    from moepass.runtime import load

    from .bounds import sequential_logits

    decoder = load(model_dir, threads=2)
    return [sequential_logits(decoder, list(ids), 1) for ids in windows]


def _tied(scores: np.ndarray, k: int, spread: np.ndarray | None = None) -> np.ndarray:
    """Rows whose k-th and (k+1)-th largest scores are closer than ROUTER_TIE times `spread` (by
    default the std of the row's scores)."""
    ordered = np.sort(scores, axis=-1)[:, ::-1]
    return ordered[:, k - 1] - ordered[:, k] < ROUTER_TIE * (scores.std(axis=-1) if spread is None else spread)


def _deepseek_ties(logits: np.ndarray, hparams: dict, bias: np.ndarray | None, k: int) -> np.ndarray:
    """Near ties of deepseek2's routing (passes/lower/routing.py deepseek_routing, llama.cpp's
    build_moe_ffn), whose MoE node gets -inf for every expert not selected: of the selection
    scores (gating probabilities plus the bias exp_probs_b) at the k-th expert within the groups
    used, and with group-limited routing of the group scores (a group's best two) at the last
    group used."""
    if hparams.get("gating_func") == 2:
        probs = 1 / (1 + np.exp(-logits.astype(np.float64)))
    else:
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    selection = probs + (0 if bias is None else bias)
    ties = np.zeros(len(selection), dtype=bool)
    groups = hparams.get("n_expert_groups", 0)
    if groups > 1:
        used = hparams["n_group_used"]
        grouped = selection.reshape(len(selection), groups, -1)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        ties |= _tied(group_scores, used)
        kept = np.zeros(group_scores.shape, dtype=bool)
        np.put_along_axis(kept, np.argsort(-group_scores, axis=-1)[:, :used], True, axis=-1)
        within = np.where(kept[..., None], grouped, -np.inf).reshape(selection.shape)
        return ties | _tied(within, k, selection.std(axis=-1))
    return ties | _tied(selection, k)


def routing_near_ties(model_dir, ids=PROMPT):
    """Positions where some MoE layer's k-th and (k+1)-th router logits are nearly tied (deepseek2:
    its selection scores, or its group scores: _deepseek_ties)."""
    import json

    from moepass.passes.expose_router import ExposeRouterLogitsPass
    from moepass.core.moe_nodes import moe_nodes
    from moepass.core.model_io import load_model
    from moepass.runtime import Decoder

    report = json.loads((Path(model_dir) / "moepass.json").read_text())
    deepseek = report["architecture"] == "deepseek2"
    model = load_model(model_dir)
    top_k = {m.name: m.top_k for m in moe_nodes(model.graph)}
    expose = ExposeRouterLogitsPass()
    expose(model)
    outputs = dict(expose.outputs)
    if deepseek:  # the router's own logits, before the routing that the node's input already holds
        layers = {m["node"]: m["layer"] for m in report["moe_layers"]}
        routers = {n.name: n.outputs[0] for n in model.graph if n.name.endswith(".router")}
        for node in outputs:
            value = routers[f"blk.{layers[node]}.router"]
            model.graph.outputs.append(value)
            outputs[node] = value.name
    decoder = Decoder(model_dir, graph=model)
    _, _, values = decoder.forward_with(np.array([ids]), decoder.empty_cache(), list(outputs.values()))
    ties = np.zeros(len(ids), dtype=bool)
    for node, output in outputs.items():
        logits = values[output]
        if deepseek:
            bias = model.graph.initializers.get(f"blk.{layers[node]}.exp_probs_b.bias")
            ties |= _deepseek_ties(logits, report["hparams"], None if bias is None else
                                   bias.const_value.numpy().astype(np.float64), top_k[node])
        else:
            ties |= _tied(logits, top_k[node])
    return ties


def check_against_exact(ours, exact, theirs, what, router_ties, their_exact=None):
    """The converted model as close to the exact computation of its weights as llama.cpp is to that
    of the file's (max |logit - exact| <= DISTANCE_FACTOR x llama.cpp's + SPREAD_FLOOR of the logit
    spread), and the exact argmax wherever exact arithmetic decides (top-2 margin >= NEAR_TIE of the
    spread); positions where a router nearly ties are left out of both. `exact` is the exact
    computation of the converted model's weights, `their_exact` that of the file's where they differ
    (a requantization; default: the same)."""
    kept = ~router_ties
    # a comparison needs positions to compare: a model whose routers tie everywhere proves nothing
    assert kept.sum() >= (len(kept) + 1) // 2, f"{what}: {int(router_ties.sum())} of {len(kept)} positions are " \
        "router near-ties; too few are left to compare"
    spread = float(exact.std())
    our_distance = float(np.abs(ours - exact)[kept].max())
    their_distance = float(np.abs(theirs - (exact if their_exact is None else their_exact))[kept].max())
    assert our_distance <= DISTANCE_FACTOR * their_distance + SPREAD_FLOOR * spread, \
        f"{what}: max |logit - exact| {our_distance:.4f}, llama.cpp's {their_distance:.4f} (spread {spread:.3f})"
    top2 = np.sort(exact, axis=-1)[:, -2:]
    decided = kept & (top2[:, 1] - top2[:, 0] >= NEAR_TIE * exact.std(axis=-1))
    wrong = decided & (ours.argmax(-1) != exact.argmax(-1))
    assert not wrong.any(), f"{what}: argmax differs from the exact computation at {np.flatnonzero(wrong).tolist()}"


def dequantized_copy(gguf_path, out_path):
    """The same model with every tensor as F32, dequantized by the gguf package: llama.cpp on this
    copy computes the quantized file's weights exactly (no activation quantization in its dot
    products), the reference for conversions whose ONNX Runtime kernels are exact too."""
    from make_fixtures import rewrite_gguf

    return rewrite_gguf(gguf_path, out_path)


def llama_quantize(source: Path, destination: Path, file_type: str, imatrix: dict[str, np.ndarray] | None) -> bool:
    """llama.cpp's quantizer (the one behind llama-quantize), with an importance matrix or, where
    `imatrix` is None, without one (llama-quantize without --imatrix); False when it refuses."""
    import ctypes

    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = 2
    keep = []
    if imatrix is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for entry, (name, values) in zip(entries, imatrix.items()):
            values, encoded = np.ascontiguousarray(values, dtype=np.float32), name.encode()
            keep += [values, encoded]  # the C struct points into these
            entry.name = encoded
            entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = values.size
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    return llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params)) == 0


def llama_tool(target: str = "llama-imatrix") -> Path:
    """llama.cpp's tool `target`, built from the installed llama-cpp-python's own source distribution
    (the oracle's source, hf_fixture.llama_cpp_sdist, which fetches the converter too),
    with the flags the README builds llama-cpp-python with, once per version: kept in the temporary
    directory, so that CI's later passes reuse it (3 minutes on 2 cores)."""
    import os
    import subprocess
    import tarfile
    import tempfile
    from importlib import metadata

    import hf_fixture

    llama_cpp_module()
    version = metadata.version("llama_cpp_python")
    root = Path(tempfile.gettempdir()) / f"moepass-llama.cpp-tools-{version}"
    binary = root / "build" / "bin" / target
    if binary.exists():
        return binary
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(hf_fixture.llama_cpp_sdist(Path(scratch))) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = "source/" + m.name[len(prefix):]
            archive.extractall(scratch, members=members, filter="data")
        build = Path(scratch) / "build"
        # -O1: the tool runs a second on a test model, and builds in 3 minutes where -O3 takes twice that
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS_RELEASE=-O1", "-DCMAKE_CXX_FLAGS_RELEASE=-O1",
                 "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                 "-DGGML_BMI2=ON"]
        subprocess.run(["cmake", "-S", str(Path(scratch) / "source"), "-B", str(build), *flags], check=True,
                       capture_output=True, timeout=600)
        subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", "2"], check=True,
                       capture_output=True, timeout=2400)
        (root / "build" / "bin").mkdir(parents=True, exist_ok=True)
        os.replace(build / "bin" / target, binary)  # the tool alone: its libraries are linked in
    return binary
