"""Speculative decoding: guess a few tokens cheaply, check them all in one pass of the model.

A step runs the last chosen token and up to K drafted tokens through the target model at once
(over the KV cache in place, logits of those K + 1 positions: `KVCache.run_rows`), keeps the drafts
the target agrees with, adds one token of its own (the correction at the first disagreement, or one
more after the last draft), and forgets the rejected positions by shortening the cache
(`KVCache.truncate`: in place nothing is copied, the next step writes over them). A step thus
yields between 1 and K + 1 tokens for the price of one pass over K + 1 positions, which on a
memory-bound CPU costs little more than a pass over one.

Drafts come from
- `ngram` (prompt lookup, no second model): the tokens that followed a recent earlier occurrence
  of the context's last 3 (else 2) tokens; pays where the answer repeats its context
  (code edits, summaries, quotes);
- `draft:PATH`: another moepass-converted model with the same vocabulary (a smaller one), decoding
  K tokens ahead with its own KV cache.

The choice is the target's: greedy decoding yields the tokens plain decoding yields (each kept
draft is the argmax of the target's logits at its position, penalties included), and sampled
decoding draws from the target's distribution by the standard rejection rule (Leviathan et al.
2023, Chen et al. 2023): a draft token x drafted with probability q(x) is kept with probability
min(1, p(x) / q(x)) under the target's p, and a rejected one is replaced by a draw from
max(0, p - q), renormalized; an n-gram draft is the case q = one-hot. Both p and q are llama.cpp's
sampler chain's (moepass.runtime.sampling.candidates) at that position.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from moepass.core.choices import DEFAULT_DRAFT_TOKENS, one_of
from moepass.core.choices import SPECULATIVE_KINDS as KINDS
from moepass.core.errors import MoepassError, wording
from moepass.runtime.kv_cache import Cache, KVCache
from moepass.runtime.sampling import Sampling, candidates, choose_token, penalized

Decoder = Any  # moepass.runtime.decoder.Decoder, which imports this module

NGRAM_SIZES = (3, 2)  # the longest context suffix looked up first; one-token matches guess too often wrong


def parse(spec: str) -> tuple[str, str | None]:
    """("ngram", None) or ("draft", PATH) from --speculative's value."""
    kind, _, path = spec.partition(":")
    if kind == "ngram" and not path:
        return kind, None
    if kind == "draft" and path:
        return kind, path
    raise MoepassError(
        f"{wording().option('--speculative', spec)}: give 'ngram' or 'draft:PATH' (PATH: a moepass-converted model "
        "with the same vocabulary)"
    )


def ngram_draft(history: Sequence[int], count: int, sizes: Sequence[int] = NGRAM_SIZES) -> list[int]:
    """Up to `count` tokens that followed an earlier occurrence of the last n tokens of `history`
    (n from `sizes`, longest first): the latest occurrence that `count` tokens follow, else the
    earliest (in a short loop the latest is followed by the suffix alone); none when nothing matches."""
    tokens = np.asarray(history, dtype=np.int64)
    for n in sizes:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        # starts i < len - n of windows tokens[i:i+n] equal to the suffix (the suffix itself excluded)
        starts = np.arange(len(tokens) - n)
        match = np.ones(len(starts), dtype=bool)
        for j in range(n):
            match &= tokens[starts + j] == suffix[j]
        found = np.flatnonzero(match)
        if len(found):
            followed = found[found + n + count <= len(tokens)]
            begin = int(followed[-1] if len(followed) else found[0]) + n
            return tokens[begin : begin + count].tolist()
    return []


class Speculator:
    """How drafts are made (`kind` "ngram", looking up context suffixes of `ngram_sizes` tokens, or
    "draft" with a `draft` Decoder), how many per step, and counters of what was drafted and kept
    over its lifetime (`acceptance`)."""

    def __init__(
        self,
        kind: str,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        draft: Decoder | None = None,
        ngram_sizes: Sequence[int] = NGRAM_SIZES,
    ):
        one_of(kind, KINDS, "speculative decoding")
        if draft_tokens < 1:
            raise MoepassError(f"{wording().option('--draft-tokens', draft_tokens)}: at least 1")
        if kind == "draft" and draft is None:
            raise MoepassError("speculative decoding with a draft model needs the draft model (draft:PATH)")
        if kind != "draft" and draft is not None:
            raise MoepassError(f"a draft model drafts for kind 'draft', not '{kind}'")
        self.kind = kind
        self.draft_tokens = draft_tokens
        self.draft = draft
        self.ngram_sizes = tuple(ngram_sizes)  # context suffix lengths looked up, longest first
        self._counting = threading.Lock()  # sequences decoding together count from their own threads
        self._checked_for: Decoder | None = None  # the target check_target passed
        self.drafted = 0  # draft tokens checked by the target
        self.accepted = 0  # of them, kept
        self.steps = 0  # passes of the target model after the prompt

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens the target kept (0 before any was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def count(self, drafted: int, kept: int) -> None:
        """One step of the target checked `drafted` drafts and kept `kept`."""
        with self._counting:
            self.steps += 1
            self.drafted += drafted
            self.accepted += kept

    def describe(self) -> str:
        what = "n-gram lookup" if self.draft is None else f"draft model {self.draft.model_dir}"
        return f"speculative decoding: {what}, {self.draft_tokens} draft tokens per step"

    def check_target(self, target: Decoder) -> None:
        """A draft model must speak the target's vocabulary: the same size and, where both have a
        tokenizer, the same tokens (checked once per target: bench switches speculation off and on)."""
        if self.draft is None or self._checked_for is target:
            return
        if self.draft.vocab_size != target.vocab_size:
            raise MoepassError(
                f"{self.draft.model_dir}: the draft model has {self.draft.vocab_size} tokens, the model "
                f"{target.vocab_size}; a draft model needs the same vocabulary"
            )
        if (
            self.draft.has_tokenizer
            and target.has_tokenizer
            and self.draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
        ):
            raise MoepassError(
                f"{self.draft.model_dir}: the draft model's tokenizer has other tokens than "
                "the model's; "
                "a draft model needs the same vocabulary"
            )
        self._checked_for = target

    def propose(
        self, history: list[int], count: int, sampling: Sampling, rng: np.random.Generator, target: Any
    ) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray] | None]]:
        """Up to `count` draft tokens after `history`, each with the draft's distribution
        (candidate ids, probabilities) where it sampled, None where the draft is certain (n-gram,
        greedy). `target`: the target's cache (a KVCache or a batch's SlotCache), whose
        `draft_cache` the draft model decodes in."""
        draft = self.draft
        if draft is None:  # n-gram lookup
            looked_up = ngram_draft(history, count, self.ngram_sizes)
            return looked_up, [None] * len(looked_up)
        if target.draft_cache is None:
            target.draft_cache = KVCache(draft, capacity=len(history) + count)
        draft_cache = target.draft_cache
        logits = draft_cache.extend(history)  # computes only what it does not hold yet
        tokens: list[int] = []
        dists: list[tuple[np.ndarray, np.ndarray] | None] = []
        context = list(history)
        for i in range(count):
            if sampling.temperature == 0:
                token, dist = int(np.argmax(penalized(logits, sampling, context))), None
            else:
                ids, probs = dist = candidates(logits, sampling, context)
                token = int(ids[rng.choice(len(ids), p=probs)])
            tokens.append(token)
            dists.append(dist)
            context.append(token)
            if i < count - 1:
                logits = draft_cache.run([token])
        return tokens, dists


def verify(
    rows: np.ndarray,
    drafts: Sequence[int],
    dists: Sequence[tuple[np.ndarray, np.ndarray] | None],
    history: Sequence[int],
    sampling: Sampling,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """(how many drafts to keep, the token that follows them) from the target's logits `rows`
    (row i: after `history` and the first i drafts; len(drafts) + 1 rows)."""
    context = list(history)
    for i, token in enumerate(drafts):
        if sampling.temperature == 0:
            best = int(np.argmax(penalized(rows[i], sampling, context)))
            if best != token:
                return i, best
        else:
            ids, probs = candidates(rows[i], sampling, context)
            p = dict(zip(ids.tolist(), probs.tolist()))
            drafted = dists[i]
            q = {token: 1.0} if drafted is None else dict(zip(drafted[0].tolist(), drafted[1].tolist()))
            if rng.random() >= min(1.0, p.get(token, 0.0) / q[token]):
                return i, _draw_residual(p, q, rng)
        context.append(token)
    last = rows[len(drafts)]
    if sampling.temperature == 0:
        return len(drafts), int(np.argmax(penalized(last, sampling, context)))
    ids, probs = candidates(last, sampling, context)
    return len(drafts), int(ids[rng.choice(len(ids), p=probs)])


def _draw_residual(p: dict[int, float], q: dict[int, float], rng: np.random.Generator) -> int:
    """A draw from max(0, p - q), renormalized (from p itself if rounding leaves nothing)."""
    ids = list(p)
    residual = np.array([max(0.0, p[t] - q.get(t, 0.0)) for t in ids])
    if residual.sum() <= 0:
        residual = np.array([p[t] for t in ids])
    return ids[rng.choice(len(ids), p=residual / residual.sum())]


def generate(
    speculator: Speculator,
    cache: Cache,
    history: list[int],
    first_logits: np.ndarray,
    max_new_tokens: int,
    stops: set[int],
    sampling: Sampling,
    rng: np.random.Generator,
) -> Iterator[tuple[int, np.ndarray]]:
    """The tokens after `history` (whose next-token logits are `first_logits`; `cache` holds it),
    each with the model's logits it was chosen from: the first as plain decoding chooses it, then
    speculative steps."""
    token = choose_token(first_logits, sampling, rng, history)
    produced = 1
    yield token, first_logits
    if token in stops or produced == max_new_tokens:
        return
    history.append(token)  # the cache holds history[:-1]: each step runs the last token with the drafts
    while True:
        count = min(speculator.draft_tokens, max_new_tokens - produced - 1)  # no draft past the limit
        drafts, dists = speculator.propose(history, count, sampling, rng, cache) if count > 0 else ([], [])
        rows = cache.run_rows([history[-1], *drafts], keep=len(drafts) + 1)
        kept, extra = verify(rows, drafts, dists, history, sampling, rng)
        speculator.count(len(drafts), kept)
        cache.truncate(len(history) + kept)  # the rejected drafts' positions are written over next
        for row, token in enumerate((*drafts[:kept], extra)):
            produced += 1
            yield token, rows[row]
            if token in stops or produced == max_new_tokens:
                return
            history.append(token)
