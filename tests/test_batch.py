"""Sequences decoded together (moepass.runtime.batch.Slots, Decoder.generate_batch): each stream is
the one the same request gives alone, while the decode steps really run several rows at once; a
cancelled sequence frees its slot; a slot keeps its tokens for a later prompt; the cache grows.

How exact: the machinery is tested on the float-activation conversion, where a row computed in a
batch differs from the row alone by float rounding at most (measured 1.5e-6 with AVX2 kernels, 0
with AVX-512's), so every stream equals its alone form token for token. With int8 activations (the
default) ONNX Runtime's kernels may order a row's sums differently at another batch size, and a
value near an int8 rounding boundary then lands on the neighbouring code (measured 0.02 with AVX2
kernels, 0 with AVX-512's): there each step's logits are held to tests/support/bounds.py's int8
rerun bound, and a greedy stream may part from its alone form only where the alone step's two best
logits are within the difference seen."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from support.bounds import float_rounding_bound, int8_rerun_bound, sequential_logits

from moepass.core.errors import MoepassError
from moepass.runtime import KVCache, Sampling, load
from moepass.runtime.batch import Cancelled, Slots

GREEDY = Sampling(temperature=0)
SAMPLED = Sampling(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=7)


@pytest.fixture(scope="module")
def decoder(converted):
    return load(Path(converted("q4_0", activations="float")), device="cpu", threads=1)


def prompts_of(decoder, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, decoder.vocab_size, n).tolist() for n in lengths]


def alone(decoder, prompt: list[int], new_tokens: int, sampling: Sampling = GREEDY, stop=()):
    stream = decoder.generate_text(prompt, new_tokens, sampling, stop)
    text = "".join(stream)
    return stream.token_ids, text, stream.finish_reason


def on_own_threads(slots: Slots, prompts: list[list[int]], work) -> list:
    """work(prompt, slot cache) for every prompt, each on a thread of its own with a slot of
    `slots`, all started at once; the results in the prompts' order."""
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        cache = slots.open(prompts[i])
        try:
            results[i] = work(prompts[i], cache)
        finally:
            slots.release(cache)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def together(slots: Slots, prompts: list[list[int]], new_tokens: int, sampling: Sampling = GREEDY, stop=()):
    """Each prompt's (tokens, text, finish reason), generated together through `slots`."""

    def answer(prompt: list[int], cache) -> tuple:
        stream = slots.decoder.generate_text(prompt, new_tokens, sampling, stop, cache=cache)
        return stream.token_ids, "".join(stream), stream.finish_reason

    return on_own_threads(slots, prompts, answer)


def steps_alone(decoder, prompt: list[int], new_tokens: int, sampling: Sampling) -> tuple[list[int], np.ndarray]:
    steps = list(decoder.generate_steps(prompt, new_tokens, (), sampling, KVCache(decoder, 128)))
    return [t for t, _ in steps], np.stack([logits for _, logits in steps])


def steps_together(slots: Slots, prompts: list[list[int]], new_tokens: int, sampling: Sampling) -> list:
    """(tokens, logits of each step) of every prompt, generated together through `slots`."""

    def steps(prompt: list[int], cache) -> tuple:
        taken = list(slots.decoder.generate_steps(prompt, new_tokens, (), sampling, cache))
        return [t for t, _ in taken], np.stack([logits for _, logits in taken])

    return on_own_threads(slots, prompts, steps)


def test_streams_decoded_together_are_each_the_one_alone(decoder):
    """Four greedy streams of different prompt lengths, decoded in one batch: each the tokens and
    text the same request gives alone (float activations: rows differ by float rounding at most)."""
    prompts = prompts_of(decoder, (3, 17, 40, 9))
    expected = [alone(decoder, p, 24) for p in prompts]
    slots = Slots(decoder, 4)
    try:
        got = together(slots, prompts, 24)
        assert slots.decode_steps and slots.batched_rows > slots.decode_steps  # steps of several rows ran
    finally:
        slots.close()
    assert got == expected


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_step_together_is_within_the_bound_of_the_step_alone(converted, decoder, activations, sampling):
    """Each decode step of a stream in the batch is within its bound of the same step alone, up to
    where the streams part: float rounding over the steps (float activations), or the int8 rerun
    bound (twice the alone run's distance from the float-activation run of the same tokens, plus
    that rounding). A greedy stream parts only at a near tie, a sampled one (the same seed) only
    where the logits differ at all."""
    model = load(Path(converted("q4_0", activations=activations)), device="cpu", threads=1)
    prompts = prompts_of(model, (3, 17, 40, 9))
    new = 24
    lone = [steps_alone(model, p, new, sampling) for p in prompts]
    slots = Slots(model, 4)
    try:
        batched = steps_together(slots, prompts, new, sampling)
        assert slots.batched_rows > slots.decode_steps
    finally:
        slots.close()
    for prompt, (tokens, logits), (b_tokens, b_logits) in zip(prompts, lone, batched):
        as_float = sequential_logits(decoder, [*prompt, *tokens[:-1]], len(prompt))
        bound = float_rounding_bound(as_float, stages=new)
        if activations == "int8":
            bound = int8_rerun_bound(logits, as_float, bound)
        parted = next((i for i, (a, b) in enumerate(zip(tokens, b_tokens)) if a != b), len(tokens))
        shared = min(parted + 1, len(tokens), len(b_tokens))
        distance = float(np.abs(b_logits[:shared] - logits[:shared]).max())
        assert distance <= bound, f"a batched step {distance:.3g} from its alone form, above the bound {bound:.3g}"
        if parted < min(len(tokens), len(b_tokens)):
            assert distance > 0, "the streams parted where their logits were the same"
            if sampling is GREEDY:
                best = np.sort(logits[parted])[-2:]
                assert best[1] - best[0] <= 2 * distance, f"parted at token {parted} without a near tie"


def test_generate_batch_is_continuous_batching(decoder):
    """More prompts than slots: a finished sequence's slot takes the next prompt at once, and the
    answers come back in the prompts' order, each the one alone (a stop string too)."""
    prompts = prompts_of(decoder, (5, 30, 2, 11, 19, 7), seed=1)
    expected = [alone(decoder, p, 16, GREEDY, stop=["e"]) for p in prompts]
    streams = decoder.generate_batch(prompts, 16, GREEDY, stop=["e"], parallel=3)
    assert [(s.token_ids, s.text, s.finish_reason) for s in streams] == expected


def test_a_cancelled_sequence_frees_its_slot_and_the_others_go_on(decoder):
    prompts = prompts_of(decoder, (8, 12), seed=2)
    expected = alone(decoder, prompts[1], 40)
    slots = Slots(decoder, 2)
    outcome: dict = {}
    try:
        first = slots.open(prompts[0])

        def cancelled_one() -> None:
            try:
                for i, _ in enumerate(decoder.generate_text(prompts[0], 400, GREEDY, cache=first)):
                    if i == 3:
                        first.cancel()
            except Cancelled:
                outcome["cancelled"] = True
            finally:
                slots.release(first)

        thread = threading.Thread(target=cancelled_one)
        thread.start()
        second = slots.open(prompts[1])
        try:
            stream = decoder.generate_text(prompts[1], 40, GREEDY, cache=second)
            outcome["other"] = (stream.token_ids, "".join(stream), stream.finish_reason)
        finally:
            slots.release(second)
        thread.join(60)
        assert outcome == {"cancelled": True, "other": expected}
        assert slots.active == 0
        with pytest.raises(MoepassError, match="released"):  # a released cache takes no more steps
            first.run([1])
    finally:
        slots.close()


def test_a_slot_keeps_its_prompt_for_the_next_request(decoder):
    """A free slot keeps its tokens: a prompt that continues them takes that slot (not the one
    unused longest) and computes only what is new, with the answer it gets alone."""
    base, other = prompts_of(decoder, (30, 25), seed=3)
    slots = Slots(decoder, 3)
    try:
        for prompt in (base, other):
            cache = slots.open(prompt)
            list(decoder.generate_text(prompt, 4, GREEDY, cache=cache))
            slots.release(cache)
        longer = base + [5, 6, 7]
        cache = slots.open(longer)
        assert cache.tokens[: len(base)] == base
        stream = decoder.generate_text(longer, 8, GREEDY, cache=cache)
        text = "".join(stream)
        assert stream.prefilled_tokens == 3
        slots.release(cache)
        assert (stream.token_ids, text, stream.finish_reason) == alone(decoder, longer, 8)
        fresh = slots.open(longer, reuse=False)  # cache_prompt false: a slot's tokens forgotten
        assert fresh.tokens == []
        slots.release(fresh)
    finally:
        slots.close()


def test_the_cache_grows_past_its_first_size(decoder, monkeypatch):
    import moepass.runtime.batch as batch

    monkeypatch.setattr(batch, "FIRST_CAPACITY", 16)
    prompts = prompts_of(decoder, (10, 4), seed=4)
    expected = [alone(decoder, p, 50) for p in prompts]
    slots = Slots(decoder, 2)
    try:
        assert slots.capacity == 16
        assert together(slots, prompts, 50) == expected
        assert slots.capacity >= 60
    finally:
        slots.close()


def test_speculative_decoding_runs_per_sequence(converted):
    """n-gram drafts checked per sequence in its own step: the tokens of plain greedy decoding."""
    model = Path(converted("q4_0", activations="float"))
    decoder = load(model, device="cpu", threads=1, speculative="ngram")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], prompts_of(decoder, (20,), seed=5)[0]]
    plain = load(model, device="cpu", threads=1)
    expected = [alone(plain, p, 20) for p in prompts]
    streams = decoder.generate_batch(prompts, 20, GREEDY, parallel=2)
    assert [(s.token_ids, s.text, s.finish_reason) for s in streams] == expected
    assert decoder.speculator.steps > 0


def test_what_cannot_batch_is_refused_in_one_line(decoder):
    from moepass.runtime.decoder import _batch_refusal

    reason = _batch_refusal(Path("m/model.onnx"), "CUDAExecutionProvider", ["past_key_values.0.key"], None)
    assert "CPU EP only" in reason and "CUDAExecutionProvider" in reason
    assert "no KV cache" in _batch_refusal(Path("m/model.onnx"), "CPUExecutionProvider", [], None)
    with pytest.raises(MoepassError, match="at least 1"):
        Slots(decoder, 0)
    slots = Slots(decoder, 1)
    try:
        held = slots.open([1, 2])
        with pytest.raises(MoepassError, match="all 1 slots are taken"):
            slots.open([3])
        slots.release(held)
    finally:
        slots.close()
    with pytest.raises(MoepassError, match="closed"):
        slots.open([1])
