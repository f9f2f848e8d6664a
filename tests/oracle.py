"""The llama.cpp oracle (llama-cpp-python, built from source by the test setup) and what decides a
comparison with it.

llama.cpp quantizes activations inside its quantized dot products (as the converted models do by
default), so on quantized files neither side is the exact computation of the file's weights; the
reference is llama.cpp on the file's F32 dequantization (dequantized_copy). check_against_exact
holds the converted model to llama.cpp's own distance from it. A position is *decided* when the
exact computation's top-2 logit margin is at least NEAR_TIE times the spread (std) of its logits,
and a router *nearly ties* when its k-th and (k+1)-th logits are closer than ROUTER_TIE times their
spread: such routing can fall either way (a phimoe Q4_K fixture flips an expert at positions whose
2nd/3rd router logits differ by 0.016-0.046), and those positions are left out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

PROMPT = [5, 77, 200, 13, 99, 150, 7, 260, 31, 42, 318, 1, 64, 128]
NEAR_TIE = 0.1     # of the position's logit std
ROUTER_TIE = 0.05  # of the position's router logit std
DISTANCE_FACTOR, SPREAD_FLOOR = 2.0, 0.01  # ours from exact <= 2x llama.cpp's + 1 % of the logit spread


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


def routing_near_ties(model_dir, ids=PROMPT):
    """Positions where some MoE layer's k-th and (k+1)-th router logits are nearly tied."""
    from moepass.passes.expose_router import ExposeRouterLogitsPass
    from moepass.core.moe_nodes import moe_nodes
    from moepass.core.files import load_model
    from moepass.runtime import Decoder

    model = load_model(model_dir)
    top_k = {m.name: m.top_k for m in moe_nodes(model.graph)}
    expose = ExposeRouterLogitsPass()
    expose(model)
    decoder = Decoder(model_dir, graph=model)
    _, _, routers = decoder.forward_with(np.array([ids]), decoder.empty_cache(), list(expose.outputs.values()))
    ties = np.zeros(len(ids), dtype=bool)
    for node, output in expose.outputs.items():
        logits = routers[output]
        ordered = np.sort(logits, axis=-1)[:, ::-1]
        k = top_k[node]
        ties |= ordered[:, k - 1] - ordered[:, k] < ROUTER_TIE * logits.std(axis=-1)
    return ties


def check_against_exact(ours, exact, theirs, what, router_ties):
    """The converted model as close to the exact computation of the file's weights as llama.cpp is
    (max |logit - exact| <= DISTANCE_FACTOR x llama.cpp's + SPREAD_FLOOR of the logit spread), and
    the exact argmax wherever exact arithmetic decides (top-2 margin >= NEAR_TIE of the spread);
    positions where a router nearly ties are left out of both."""
    kept = ~router_ties
    spread = float(exact.std())
    our_distance = float(np.abs(ours - exact)[kept].max())
    their_distance = float(np.abs(theirs - exact)[kept].max())
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


def llama_quantize(source: Path, destination: Path, file_type: str, imatrix: dict[str, np.ndarray]) -> bool:
    """llama.cpp's quantizer (the one behind llama-quantize), with an importance matrix; False when
    it refuses."""
    import ctypes

    llama_cpp = llama_cpp_module()
    entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
    keep = []
    for entry, (name, values) in zip(entries, imatrix.items()):
        values, encoded = np.ascontiguousarray(values, dtype=np.float32), name.encode()
        keep += [values, encoded]  # the C struct points into these
        entry.name = encoded
        entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entry.size = values.size
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = 2
    params.imatrix = ctypes.cast(entries, type(params.imatrix))
    return llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params)) == 0
