"""How the next token is chosen, as llama.cpp's sampler chain chooses it.

The order is llama.cpp's (`penalties; top_k; top_p; min_p; temperature; dist`), so each setting
means what it means there: the repetition, frequency and presence penalties act on the logits of
tokens among the last `repeat_last_n` of the context (the prompt's included, as llama-server
counts them); top-k, top-p and min-p cut the candidates by the distribution at temperature 1;
the temperature then scales what is left, and temperature 0 is greedy (after the penalties).
The kept candidates and their probabilities are checked against llama.cpp's own samplers on the
same logits in the tests.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

from moepass.core.sampling import Sampling


def penalized(logits: np.ndarray, sampling: Sampling, history: Sequence[int]) -> np.ndarray:
    """The logits after the repetition, frequency and presence penalties for the last
    `repeat_last_n` tokens of `history` (a new array; `logits` itself when nothing changes)."""
    if not sampling.penalizes or not history:
        return logits
    counts = collections.Counter(history[-sampling.repeat_last_n :])
    ids = np.fromiter(counts, dtype=np.int64)
    n = np.fromiter(counts.values(), dtype=np.float32)
    out = logits.astype(np.float32, copy=True)
    seen = out[ids]
    seen = np.where(seen <= 0, seen * np.float32(sampling.repeat_penalty), seen / np.float32(sampling.repeat_penalty))
    # in float32 and in llama.cpp's order of operations: the same logits to the last bit
    out[ids] = seen - (n * np.float32(sampling.frequency_penalty) + np.float32(sampling.presence_penalty))
    return out


def candidates(logits: np.ndarray, sampling: Sampling, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) that a sampled step draws from, most likely first."""
    z = penalized(logits, sampling, history).astype(np.float64)
    order = likeliest(z, sampling.top_k)
    if sampling.top_p < 1:
        p = np.exp(z[order] - z[order[0]])
        keep = int(np.searchsorted(np.cumsum(p / p.sum()), sampling.top_p) + 1)
        order = order[:keep]
    if sampling.min_p > 0:
        order = order[z[order] >= z[order[0]] + math.log(sampling.min_p)]
    scaled = z[order] / sampling.temperature
    probs = np.exp(scaled - scaled[0])
    return order, probs / probs.sum()


def likeliest(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the `k` largest of `z` (all where k is 0), largest first, ties by id: the head of
    a stable argsort of -z, in a partial sort's time (a vocabulary of 150k sorts in 10 ms)."""
    if not k or k >= len(z):
        return np.argsort(-z, kind="stable")
    threshold = z[np.argpartition(-z, k - 1)[k - 1]]  # the k-th largest
    above = np.flatnonzero(z > threshold)
    chosen = np.sort(np.concatenate([above, np.flatnonzero(z == threshold)[: k - len(above)]]))
    return chosen[np.argsort(-z[chosen], kind="stable")]


def choose_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    """One token from a logits vector: argmax (temperature 0), or a draw from `candidates`;
    `history` is the context so far, for the penalties."""
    if sampling.temperature == 0:
        return int(np.argmax(penalized(logits, sampling, history)))
    ids, probs = candidates(logits, sampling, history)
    return int(ids[rng.choice(len(ids), p=probs)])


class StopStrings:
    """Text held back while it could still become one of `stops`, so that a stop string is never
    shown (the OpenAI API leaves it out of the answer)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """What may be shown of the text so far plus `piece`; after a stop string, `hit` is set and
        nothing more is shown."""
        if not self.stops:
            return piece
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        # keep the longest tail that is the beginning of a stop string
        hold = max(
            (n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1) if s.startswith(text[-n:])),
            default=0,
        )
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of a generation that met no stop string."""
        held, self._held = self._held, ""
        return held
