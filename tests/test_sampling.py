"""Sampling as llama.cpp samples: moepass's candidates (penalties, top-k, top-p, min-p, temperature)
against llama.cpp's own sampler chain (llama-cpp-python's low-level API, no model needed) on the
same logits and history; stop strings; and the settings reaching run, chat and serve alike."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from moepass import MoepassError
from moepass.core.sampling import LLAMA_SERVER
from moepass.runtime.sampling import Sampling, StopStrings, candidates, choose_token, likeliest, penalized

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")

CASES = [  # name -> settings; each runs on several logit vectors and histories
    Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),           # llama-server's defaults
    Sampling(temperature=1.0),
    Sampling(temperature=0.3, top_p=0.5),
    Sampling(temperature=1.5, min_p=0.2),
    Sampling(temperature=0.7, top_k=5),
    Sampling(temperature=1.0, repeat_penalty=1.3, repeat_last_n=8),
    Sampling(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.1, presence_penalty=0.6,
             frequency_penalty=0.4),
    Sampling(temperature=1.2, presence_penalty=-0.5, frequency_penalty=1.5, repeat_last_n=64),
]


def _llama_candidates(logits: np.ndarray, s: Sampling, history: list[int]) -> dict[int, float]:
    """token id -> final logit, after llama.cpp's chain penalties; top_k; top_p; min_p; temp."""
    n = len(logits)
    data = (llama_cpp.llama_token_data * n)()
    for i, x in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
    array = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        for sampler in (llama_cpp.llama_sampler_init_penalties(n, s.repeat_last_n, s.repeat_penalty,
                                                                s.frequency_penalty, s.presence_penalty),
                        llama_cpp.llama_sampler_init_top_k(s.top_k),
                        llama_cpp.llama_sampler_init_top_p(s.top_p, 1),
                        llama_cpp.llama_sampler_init_min_p(s.min_p, 1),
                        llama_cpp.llama_sampler_init_temp(s.temperature)):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        for token in history:
            llama_cpp.llama_sampler_accept(chain, token)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
        return {array.data[i].id: array.data[i].logit for i in range(array.size)}
    finally:
        llama_cpp.llama_sampler_free(chain)


@pytest.mark.parametrize("settings", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_candidates_are_llama_cpps(settings):
    """The same tokens survive, with the probabilities of llama.cpp's remaining logits to float32
    rounding (llama.cpp scales by the temperature in float32; moepass in float64)."""
    rng = np.random.default_rng(11)
    for trial in range(12):
        vocab = int(rng.integers(20, 3000))
        logits = (rng.normal(0, 2.5, vocab) * rng.choice([0.3, 1.0, 3.0])).astype(np.float32)
        history = rng.integers(0, vocab, int(rng.integers(0, 80))).tolist()
        history += [int(np.argmax(logits))] * int(rng.integers(0, 3))  # penalize the likeliest too
        theirs = _llama_candidates(logits, settings, history)
        ids, probs = candidates(logits, settings, history)
        assert sorted(ids.tolist()) == sorted(theirs), f"trial {trial}: other candidates than llama.cpp's"
        z = np.array([theirs[int(i)] for i in ids], dtype=np.float64)
        expected = np.exp(z - z.max())
        expected /= expected.sum()
        bound = 4 * np.finfo(np.float32).eps * (np.abs(z).max() + 1)  # relative: float32 rounding of z
        np.testing.assert_allclose(probs, expected, rtol=bound, atol=0, err_msg=f"trial {trial}")


def test_the_partial_sort_is_the_head_of_a_stable_sort():
    """top-k's candidates by a partial sort: the first k of a stable argsort of -z, ties (many, at
    the k-th value too) in the order of their ids, for every k from none to past the vocabulary."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(1, 200))
        z = rng.integers(-4, 4, n).astype(np.float64) if trial % 2 else rng.standard_normal(n)
        for k in {0, 1, int(rng.integers(1, n + 1)), n, n + 3}:
            assert likeliest(z, k).tolist() == np.argsort(-z, kind="stable")[: k or None].tolist(), (n, k)


def test_penalties_are_llama_cpps_to_the_bit_and_greedy_takes_them():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, 500).astype(np.float32)
    history = rng.integers(0, 500, 100).tolist() + [int(np.argmax(logits))] * 4
    s = Sampling(temperature=1.0, repeat_penalty=1.25, repeat_last_n=32, presence_penalty=0.3, frequency_penalty=0.7)
    theirs = _llama_candidates(logits, s, history)
    ours = penalized(logits, s, history)
    assert np.array_equal(np.array([theirs[i] for i in range(500)], dtype=np.float32), ours)
    greedy = Sampling(repeat_penalty=1.25, repeat_last_n=32, presence_penalty=0.3, frequency_penalty=0.7)
    assert choose_token(logits, greedy, np.random.default_rng(0), history) == int(np.argmax(ours))
    assert choose_token(logits, greedy, np.random.default_rng(0), history) != int(np.argmax(logits))
    assert penalized(logits, Sampling(), history) is logits  # nothing to do: no copy


def test_sampled_draws_follow_the_candidates():
    logits = np.array([0.0, 2.0, 1.9, -5.0, 1.0], dtype=np.float32)
    s = Sampling(temperature=1.0, min_p=0.3)
    ids, probs = candidates(logits, s)
    assert sorted(ids.tolist()) == [1, 2, 4]   # exp(-1) ~ 0.37 >= 0.3 of the likeliest; token 0 is not
    rng = np.random.default_rng(0)
    draws = np.bincount([choose_token(logits, s, rng) for _ in range(3000)], minlength=5) / 3000
    expected = np.zeros(5)
    expected[ids] = probs
    # binomial standard error of 3000 draws, five of them
    assert np.all(np.abs(draws - expected) <= 5 * np.sqrt(expected * (1 - expected) / 3000) + 1e-12)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repeat_penalty=0), dict(repeat_last_n=-1),
                                 dict(top_p=0), dict(temperature=float("nan")), dict(presence_penalty=float("inf"))])
def test_invalid_settings_are_refused(bad):
    with pytest.raises(MoepassError, match="invalid sampling settings"):
        Sampling(**bad)


def test_llama_server_defaults():
    assert (LLAMA_SERVER.temperature, LLAMA_SERVER.top_k, LLAMA_SERVER.top_p, LLAMA_SERVER.min_p,
            LLAMA_SERVER.repeat_penalty, LLAMA_SERVER.repeat_last_n) == (0.8, 40, 0.95, 0.05, 1.0, 64)


@pytest.mark.parametrize("pieces,stops,shown,hit", [
    (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),
    (["a", "b", "c"], ["bc"], "a", True),
    (["a", "b", "x"], ["bc"], "abx", False),            # held "b", then released
    (["ab", "c", "d"], ["cd", "bcd"], "a", True),       # the earliest stop string wins
    (["no stop here"], [], "no stop here", False),
    (["<|end", "|>tail"], ["<|end|>"], "", True),
    (["x\n\n", "User:"], ["\n\nUser:"], "x", True),
])
def test_stop_strings_are_never_shown(pieces, stops, shown, hit):
    stop = StopStrings(stops)
    text = ""
    for piece in pieces:
        text += stop.feed(piece)
        if stop.hit:
            break
    if not stop.hit:
        text += stop.flush()
    assert (text, stop.hit) == (shown, hit)


def test_stop_strings_end_a_generation(converted):
    from moepass.runtime import load

    decoder = load(converted("q4_0"))
    whole = decoder.generate_text("the other one", 12)
    text = "".join(whole)
    assert whole.finish_reason == "length" and whole.completion_tokens == 12
    stop = text[5:7]
    cut = decoder.generate_text("the other one", 12, stop=[stop])
    assert "".join(cut) == text[:text.index(stop)] and cut.finish_reason == "stop"
    assert cut.completion_tokens < 12
