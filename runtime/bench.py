"""`moepass bench`: prefill and decode throughput of a loaded model, and the process's peak RSS.

Measured on the generation path users get (`Decoder.generate`, greedy, KV cache through an IO
binding): prefill is the time to the first new token (one pass over `prompt_tokens` tokens from an
empty cache); decode is `new_tokens` single-token steps after it. Best of `repeats` for each; the
prompt is a fixed pseudo-random token sequence (seed 0) so runs compare.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np


def measure(decoder, prompt_tokens: int, new_tokens: int, repeats: int = 3) -> dict[str, Any]:
    prompt = np.random.default_rng(0).integers(0, decoder.vocab_size, size=prompt_tokens).tolist()
    prefill, decode = [], []
    for _ in range(repeats):
        tokens = decoder.generate(prompt, new_tokens + 1, stop_ids=())
        start = time.perf_counter()
        next(tokens)
        prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in tokens:
            pass
        decode.append(time.perf_counter() - start)
    return {
        "prefill_tokens_per_s": prompt_tokens / min(prefill),
        "decode_tokens_per_s": new_tokens / min(decode),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
