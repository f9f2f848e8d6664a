"""Speculative decoding (moepass.runtime.speculative): n-gram and draft-model drafts give the
tokens plain greedy decoding gives, sampled drafts keep the target's distribution (checked by a
chi-square test against the distribution computed exactly), rolled-back positions are written
over, and the CLI, API and bench take it."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from moepass.cli import main
from moepass.core.errors import MoepassError
from moepass.runtime import KVCache, Sampling, Speculator, load
from moepass.runtime.speculative import ngram_draft, verify
from support.bounds import assert_same_greedy_tokens, assert_within, float_rounding_bound, sequential_logits

# a prompt that repeats itself, so that n-gram lookup finds drafts
REPEATING = [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13]


def test_ngram_draft_takes_the_latest_longest_match():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_draft(history, 2) == [7, 8]            # (2, 3) last seen before 7, 8; (5, 2, 3) never
    assert ngram_draft(history, 3) == [7, 8, 5]
    assert ngram_draft(history, 5) == [7, 8, 5, 2, 3]
    assert ngram_draft(history, 6) == [9, 9, 1, 2, 3, 7]  # the latest match that 6 tokens follow
    assert ngram_draft([4, 5, 6, 4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert ngram_draft(history, 1, sizes=(3,)) == []     # (5, 2, 3) occurs once: itself
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([7, 7, 7, 7, 7], 4) == [7, 7]     # no match is followed by 4: the earliest, by the most


@pytest.mark.parametrize("preset", ["f32", "q4_0"])
def test_ngram_speculation_gives_plain_greedy_tokens(converted, preset):
    decoder = load(converted(preset), threads=2)
    plain = list(decoder.generate(REPEATING, 40, stop_ids=()))
    for k in (1, 3, 8):
        speculator = Speculator("ngram", draft_tokens=k)
        decoder.speculate(speculator)
        ours = list(decoder.generate(REPEATING, 40, stop_ids=()))
        decoder.speculate(None)
        assert_same_greedy_tokens(decoder, REPEATING, plain, ours)
        assert speculator.drafted > 0 and speculator.steps < 39  # it drafted, and some were kept


def test_draft_model_speculation_gives_plain_greedy_tokens(converted):
    target = load(converted("f32"), threads=2)
    prompt = [5, 17, 33, 2, 90, 41]
    plain = list(target.generate(prompt, 32, stop_ids=()))
    # the same model as its own draft: every draft is the target's own choice, up to float rounding
    # (int8 activations would add near-ties: a batch quantizes its activations otherwise than a step)
    same = Speculator("draft", 4, load(converted("f32"), threads=2))
    target.speculate(same)
    ours = list(target.generate(prompt, 32, stop_ids=()))
    assert_same_greedy_tokens(target, prompt, plain, ours)
    assert same.acceptance >= 0.8 and same.steps < 16  # plain decoding: 31 steps after the first token
    # another model with the same vocabulary: fewer kept, the same tokens
    other = Speculator("draft", 3, load(converted("q4_0"), threads=2))
    target.speculate(other)
    ours = list(target.generate(prompt, 32, stop_ids=()))
    assert_same_greedy_tokens(target, prompt, plain, ours)
    assert other.drafted > 0


def test_stop_token_and_limit_inside_a_step(converted):
    decoder = load(converted("q4_0"), threads=2)
    plain = list(decoder.generate(REPEATING, 30, stop_ids=()))
    stop = plain[9]
    expected = plain[:plain.index(stop) + 1]
    decoder.speculate(Speculator("ngram", 8))
    assert list(decoder.generate(REPEATING, 30, stop_ids=[stop])) == expected
    for n in (1, 2, 5):  # never more than asked, never a step past the limit
        assert len(list(decoder.generate(REPEATING, n, stop_ids=()))) == n


def test_rejected_positions_are_written_over(converted):
    """After a speculative generation the cache holds exactly what was kept: a second prompt that
    extends it gives the logits of a fresh cache."""
    decoder = load(converted("f32"), threads=2)
    cache = KVCache(decoder, capacity=128)
    decoder.speculate(Speculator("ngram", 8))
    out = list(decoder.generate(REPEATING, 20, stop_ids=(), cache=cache))
    assert cache.tokens == [*REPEATING, *out[:-1]]
    follow = [*REPEATING, *out, 3, 4]
    again = cache.extend(follow)
    fresh = KVCache(decoder, capacity=64).extend(follow)
    assert_within(again, fresh, float_rounding_bound(fresh, stages=3), "after a speculative generation")


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of Pearson's chi-square statistic of `counts` against `probs` (Wilson-Hilferty's
    normal approximation of the chi-square tail: no scipy needed)."""
    n = counts.sum()
    keep = probs * n >= 5  # rare outcomes pooled
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep] * n, probs[~keep].sum() * n)
    observed, expected = observed[expected > 0], expected[expected > 0]
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_rule_keeps_the_target_distribution():
    """verify's first token, drawn under synthetic target logits and a draft distribution unlike
    them, follows the target's sampling distribution; an always-accepting rule would follow the draft's."""
    from moepass.runtime.sampling import candidates

    rng = np.random.default_rng(7)
    vocab = 8
    rows = rng.normal(0, 1.5, size=(3, vocab))
    sampling = Sampling(temperature=0.9, top_k=6)
    ids, p = candidates(rows[0], sampling, [])
    exact = np.zeros(vocab)
    exact[ids] = p
    q_probs = rng.dirichlet(np.ones(vocab))
    counts_draft, counts_ngram = np.zeros(vocab), np.zeros(vocab)
    for _ in range(6000):
        draft = int(rng.choice(vocab, p=q_probs))
        kept, extra = verify(rows, [draft, 1], [(np.arange(vocab), q_probs), None], [], sampling, rng)
        counts_draft[draft if kept else extra] += 1
        kept, extra = verify(rows, [3, 1], [None, None], [], sampling, rng)  # an n-gram draft of 3
        counts_ngram[3 if kept else extra] += 1
    assert _chi_square_p(counts_draft, exact) > 1e-3
    assert _chi_square_p(counts_ngram, exact) > 1e-3
    assert _chi_square_p(counts_draft, q_probs) < 1e-6  # the test can tell the two apart


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampled_speculation_draws_from_the_target(converted, kind):
    """Three tokens sampled (top-k 3) with speculation, 1500 seeds: their joint distribution is the
    target's own, computed exactly from its logits. The prompt ends in the model's own greedy
    continuation, so that n-gram lookup (of one token) drafts what the model tends to say."""
    decoder = load(converted("q4_0"), threads=2)
    start = [5, 17, 33, 2, 90, 41]
    prompt = [*start, *decoder.generate(start, 40, stop_ids=())]
    sampling = dict(temperature=1.0, top_k=3)
    from moepass.runtime.sampling import candidates

    cache = KVCache(decoder, capacity=64)
    exact: dict[tuple[int, ...], float] = {}
    first_ids, first_p = candidates(cache.extend(prompt), Sampling(**sampling), prompt)
    for t1, p1 in zip(first_ids.tolist(), first_p):
        ids2, p2 = candidates(cache.extend([*prompt, t1]), Sampling(**sampling), [*prompt, t1])
        for t2, pp2 in zip(ids2.tolist(), p2):
            ids3, p3 = candidates(cache.extend([*prompt, t1, t2]), Sampling(**sampling), [*prompt, t1, t2])
            for t3, pp3 in zip(ids3.tolist(), p3):
                exact[(t1, t2, t3)] = p1 * pp2 * pp3
    # the same weights with float activations: a draft close to the target but not equal to it
    draft = load(converted("q4_0", activations="float"), threads=2) if kind == "draft" else None
    speculator = Speculator(kind, 2, draft, ngram_sizes=(1,))
    decoder.speculate(speculator)
    outcomes = list(exact)
    counts = np.zeros(len(outcomes))
    for seed in range(1500):
        tokens = tuple(decoder.generate(prompt, 3, stop_ids=(), sampling=Sampling(**sampling, seed=seed), cache=cache))
        counts[outcomes.index(tokens)] += 1
    assert speculator.drafted > 0
    assert 0 < speculator.accepted < speculator.drafted  # both branches of the rule ran
    assert _chi_square_p(counts, np.array([exact[o] for o in outcomes])) > 1e-3


def test_cli_run_and_bench_take_speculation(converted):
    model = str(converted("q4_0"))
    runner = CliRunner()
    ids = ",".join(map(str, REPEATING))
    plain = runner.invoke(main, ["run", model, "--prompt-ids", ids, "-n", "24", "-t", "2"])
    spec = runner.invoke(main, ["run", model, "--prompt-ids", ids, "-n", "24", "-t", "2",
                                "--speculative", "ngram", "--draft-tokens", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert "speculative decoding: n-gram lookup, 3 draft tokens per step" in spec.stderr
    assert spec.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    exact = str(converted("f32"))  # its own draft: kept but for float rounding's near-ties
    bench = runner.invoke(main, ["bench", exact, "-p", "16", "-n", "24", "-r", "1", "-t", "2", "--json",
                                 "--speculative", f"draft:{exact}"])
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.stdout)
    assert 0.8 <= result["acceptance"] <= 1 and result["speculative"]["kind"] == "draft"
    assert result["speculative"]["tokens_per_step"] > 2 and result["speculative"]["plain_decode"]["tokens"] == 24


@pytest.mark.parametrize("spec, message", [
    ("lookahead", "give 'ngram' or 'draft:PATH'"),
    ("draft:", "give 'ngram' or 'draft:PATH'"),
    ("ngram:3", "give 'ngram' or 'draft:PATH'"),
])
def test_bad_speculative_values_are_one_line(converted, spec, message):
    result = CliRunner().invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", "1,2", "--speculative", spec])
    assert result.exit_code != 0 and message in result.stderr
    assert "Traceback" not in result.output


def test_an_unknown_kind_is_refused_as_every_option_value_is():
    with pytest.raises(MoepassError, match="^speculative decoding must be one of ngram, draft, not 'beam'$"):
        Speculator("beam")


def test_draft_model_with_another_vocabulary_is_refused(converted):
    import make_fixtures

    target = load(converted("q4_0"), threads=2)
    larger = load(converted("q4_0", dims=make_fixtures.Dims(vocab=400)), threads=2)
    with pytest.raises(MoepassError, match="the draft model has 400 tokens, the model 320"):
        target.speculate(Speculator("draft", 4, larger))
    spm = load(converted("q4_0", tokenizer="llama"), threads=2)  # as many tokens, other ones
    assert spm.vocab_size == target.vocab_size
    with pytest.raises(MoepassError, match="tokenizer has other tokens than the model's"):
        target.speculate(Speculator("draft", 4, spm))
    with pytest.raises(MoepassError, match="needs the draft model"):
        Speculator("draft", 4)


def test_outputs_for_many_drafts_fit_one_chunk(converted):
    """run_rows: logits of the last `keep` positions, also when the tokens span several prefill chunks."""
    from moepass.runtime import kv_cache

    decoder = load(converted("f32"), threads=2)
    tokens = list(itertools.islice(itertools.cycle(range(3, 40)), 40))
    whole = KVCache(decoder, capacity=64)
    rows = whole.run_rows(tokens, keep=5)
    chunk = kv_cache.PREFILL_CHUNK
    try:
        kv_cache.PREFILL_CHUNK = 16
        split = KVCache(decoder, capacity=64).run_rows(tokens, keep=12)
    finally:
        kv_cache.PREFILL_CHUNK = chunk
    assert rows.shape == (5, decoder.vocab_size) and split.shape == (12, decoder.vocab_size)
    bound = float_rounding_bound(rows, stages=3)
    assert_within(split[-5:], rows, bound, "in chunks of 16")
    assert_within(rows, sequential_logits(decoder, tokens, len(tokens) - 4), bound, "one token per step")


def _genai_tokens(folder, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
    """onnxruntime-genai's greedy tokens after `prompt` from the converted folder, and its
    speculative decoding counters."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):], generator.get_speculative_stats()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_onnxruntime_genai_takes_the_speculative_config(make_gguf, converted, tmp_path, kind):
    """convert --genai-speculative writes what onnxruntime-genai 0.18 reads: it drafts, keeps
    drafts, and gives moepass's plain greedy tokens."""
    draft = converted("q4_0", activations="float")  # close to the target, not equal: some drafts rejected
    spec = "ngram" if kind == "ngram" else f"draft:{draft}"
    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q",
                                       "--genai-speculative", spec, "--draft-tokens", "4"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "genai_config.json").read_text())
    assert config["speculative"]["max_draft_tokens"] == 4
    plain = list(load(out, threads=2).generate(REPEATING, 40, stop_ids=()))
    tokens, stats = _genai_tokens(out, REPEATING, 40)
    assert tokens == plain
    assert stats["draft_tokens_accepted"] > 0 and stats["target_forward_passes"] < 40


def test_genai_speculative_refusals(make_gguf, converted, tmp_path):
    import make_fixtures

    gguf = str(make_gguf("q4_0"))
    runner = CliRunner()
    for spec, message in [(f"draft:{tmp_path}", "not a converted model folder"),
                          (f"draft:{converted('q4_0', dims=make_fixtures.Dims(vocab=400))}",
                           "the draft model has 400 tokens, the model 320")]:
        result = runner.invoke(main, ["convert", gguf, "-o", str(tmp_path / "m"), "-q", "--genai-speculative", spec])
        assert result.exit_code != 0 and message in result.stderr, result.output
        assert not (tmp_path / "m").exists()  # nothing left behind
    onnx_input = runner.invoke(main, ["convert", str(converted("q4_0")), "-o", str(tmp_path / "o"),
                                      "--genai-speculative", "ngram"])
    assert onnx_input.exit_code != 0 and "--genai-speculative applies to GGUF input" in onnx_input.stderr
