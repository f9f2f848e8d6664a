"""How far two runs of one computation may lie apart, derived from the arithmetic, not from one machine.

Exact claims (experts reordered by a partition, a prompt prefilled in chunks) are tested twice:

- in float arithmetic (`--activations float`): bit for bit where both runs add the same terms in
  the same order, else within float32 rounding of the sums whose order changed
  (`float_rounding_bound`: measured at most 2.5 units in the last place of the logits);
- with int8 activations (the default, accuracy_level 4): ONNX Runtime's kernels quantize every
  activation block to 8 bits inside each quantized matmul. A value that float rounding moves across
  an int8 rounding boundary lands on the neighbouring code: one step away where each run's own
  rounding error is at most half a step. So the two runs differ by at most the sum of their
  rounding effects, twice one run's distance from the float computation of the same model, plus
  the float rounding above (`int8_rerun_bound`). Which values lie near a boundary depends on the
  kernels MLAS picks for the CPU (AVX2 or AVX-512/VNNI), so a bound below that fails on some CPU:
  measured for qwen2moe with reordered experts, 6e-6 apart with AVX-512 kernels and 3.6e-3 with
  AVX2 kernels (an AMD EPYC, and tests/cpu_family.py's AVX2-only run), against a bound of 0.040.
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


ULPS_PER_STAGE = 16


def float_rounding_bound(logits: np.ndarray, stages: int) -> float:
    """Float32 rounding between two computations that add some sums in another order, in `stages`
    layers (or steps) one after the other: ULPS_PER_STAGE units in the last place of the logits'
    magnitude per stage (a unit per term of a sum of up to 16 terms, carried to the logits)."""
    return ULPS_PER_STAGE * stages * EPS32 * float(np.abs(logits).max())


def int8_rerun_bound(int8_logits: np.ndarray, float_logits: np.ndarray, float_bound: float = 0.0) -> float:
    """How far another int8-activation run of the same computation may be from `int8_logits`: twice
    this run's distance from the float-activation run of the same model (`float_logits`), plus the
    float rounding (`float_bound`) between the two computations."""
    return 2 * float(np.abs(int8_logits - float_logits).max()) + float_bound


def assert_within(actual: np.ndarray, expected: np.ndarray, bound: float, what: str) -> None:
    distance = float(np.abs(np.asarray(actual, np.float64) - expected).max())
    assert distance <= bound, f"{what}: max |difference| {distance:.3g} above the bound {bound:.3g}"


def sequential_logits(decoder, tokens: list[int], start: int) -> np.ndarray:
    """Next-token logits after each of tokens[start - 1:], one decode step at a time."""
    from moepass.runtime import KVCache

    cache = KVCache(decoder, capacity=len(tokens) + 1)
    rows = [cache.extend(tokens[:start])]
    rows += [cache.run([t]) for t in tokens[start:]]
    return np.stack(rows)


def assert_same_greedy_tokens(decoder, prompt: list[int], plain: list[int], speculative: list[int]) -> None:
    """`speculative` is `plain`, or first differs where plain decoding's two best logits are closer
    than the model's own difference between one pass over many positions and one step per position
    (the batched verification's rounding; measured on plain's tokens)."""
    if speculative == plain:
        return
    j = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), min(len(plain), len(speculative)))
    assert j < min(len(plain), len(speculative)), f"lengths differ: {len(plain)} vs {len(speculative)}"
    tokens = [*prompt, *plain]
    from moepass.runtime import KVCache

    one_by_one = sequential_logits(decoder, tokens, len(prompt))[:len(plain)]
    batched = KVCache(decoder, capacity=len(tokens))
    batched.extend(prompt[:-1])
    rows = batched.run_rows(tokens[len(prompt) - 1:len(prompt) + len(plain) - 1], keep=len(plain))
    rounding = float(np.abs(rows - one_by_one).max())
    top = np.sort(one_by_one[j])[-2:]
    assert top[1] - top[0] <= 2 * rounding, (
        f"token {j}: speculative {speculative[j]} vs plain {plain[j]}, a margin of {top[1] - top[0]:.3g} "
        f"between the two best logits, above twice the batched computation's rounding {rounding:.3g}")
