"""ONNX Runtime on the converted model against llama.cpp (llama-cpp-python) on the same GGUF file.

F32 fixture with an F32 KV cache: max |logit difference| <= 1e-4. Quantized fixtures: <= 0.1 and the
same argmax at every position (llama.cpp quantizes activations inside its quantized dot products;
ONNX Runtime's 8-bit QMoE does too, differently). Prefill of the whole prompt, token-by-token
decode through the KV cache, and a prompt fed in two chunks must all match.
"""

from __future__ import annotations

import numpy as np
import pytest

import llama_cpp  # noqa: E402  the oracle; .ci/run builds it from source

from moepass.runtime import load  # noqa: E402

pytestmark = pytest.mark.llama

PROMPT = [5, 77, 200, 13, 99, 150, 7, 260, 31, 42, 318, 1, 64, 128]
TOLERANCE = {"f32": 1e-4, "q8_0": 0.1, "q4_0": 0.1, "q4_k": 0.1, "q6_k": 0.1}


def llama_logits(gguf_path, ids):
    llm = llama_cpp.Llama(str(gguf_path), logits_all=True, n_ctx=64, n_batch=64, type_k=0, type_v=0,
                          n_threads=2, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def _check(ours, ref, preset, what):
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOLERANCE[preset], f"{preset} {what}: max |logit diff| {diff}"
    if preset != "f32":
        same = ours.argmax(-1) == ref.argmax(-1)
        assert same.all(), f"{preset} {what}: argmax differs at positions {np.flatnonzero(~same).tolist()}"


@pytest.mark.parametrize("preset", sorted(TOLERANCE))
def test_matches_llama_cpp(preset, make_gguf, converted):
    ref = llama_logits(make_gguf(preset), PROMPT)
    decoder = load(converted(preset))

    prefill, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    _check(prefill[0], ref, preset, "prefill")

    cache, steps = decoder.empty_cache(), []
    for token in PROMPT:
        logits, cache = decoder.forward(np.array([[token]]), cache)
        steps.append(logits[0, -1])
    _check(np.array(steps), ref, preset, "token-by-token decode")

    first, cache = decoder.forward(np.array([PROMPT[:5]]), decoder.empty_cache())
    rest, _ = decoder.forward(np.array([PROMPT[5:]]), cache)
    _check(np.concatenate([first[0], rest[0]]), ref, preset, "chunked prefill")


def test_split_gguf_matches_llama_cpp(make_gguf, converted):
    """A split model (name-0000i-of-0000N.gguf) is read as one, by llama.cpp and by moepass alike."""
    ref = llama_logits(make_gguf("f32", split_max_tensors=8), PROMPT)
    decoder = load(converted("f32", split_max_tensors=8))
    logits, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    _check(logits[0], ref, "f32", "split prefill")


def test_greedy_generation_matches_llama_cpp(make_gguf, converted):
    llm = llama_cpp.Llama(str(make_gguf("f32")), n_ctx=64, type_k=0, type_v=0, n_threads=2, verbose=False)
    try:
        theirs = []
        for token in llm.generate(PROMPT[:4], top_k=1, temp=0.0, reset=True):
            theirs.append(int(token))
            if len(theirs) == 24:
                break
    finally:
        llm.close()
    ours = list(load(converted("f32")).generate(PROMPT[:4], max_new_tokens=24))
    assert ours == theirs
