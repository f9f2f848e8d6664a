"""`moepass bench`: prefill and decode throughput of a loaded model, and the process's peak RSS.

Prefill: one forward pass over `prompt_tokens` tokens from an empty cache. Decode: `new_tokens`
single-token steps through the KV cache after that prefill. Best of `repeats` for each; the prompt
is a fixed pseudo-random token sequence (seed 0) so runs compare.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np


def measure(decoder, prompt_tokens: int, new_tokens: int, repeats: int = 3) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, decoder.vocab_size, size=(1, prompt_tokens))
    prefill, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = decoder.forward(prompt, decoder.empty_cache())
        prefill.append(time.perf_counter() - start)
        token = int(np.argmax(logits[0, -1]))
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits, cache = decoder.forward(np.array([[token]]), cache)
            token = int(np.argmax(logits[0, -1]))
        decode.append(time.perf_counter() - start)
    return {
        "prefill_tokens_per_s": prompt_tokens / min(prefill),
        "decode_tokens_per_s": new_tokens / min(decode),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
