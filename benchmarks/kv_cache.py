"""The KV cache's type: what it costs in fidelity, beside llama.cpp's own quantized caches.

    python benchmarks/kv_cache.py                     # both trained models
    python benchmarks/kv_cache.py --models text
    python benchmarks/kv_cache.py --length 512       # positions past the 256-token calibration

For each trained model (benchmarks/agreement.py's: "markov" and "text"), on its F32 GGUF, so
that the cache is all that differs: moepass converts it with each --kv-cache type and decodes
each held-out window one token per step (each position attends to the cache as stored), and
llama.cpp runs the same file with its default F16 cache and with `-ctk q8_0 -ctv q8_0` (flash
attention, which its quantized V cache needs). Each is compared, as `llama-perplexity
--kl-divergence` compares, with its own side's float32 cache: mean and 99th-percentile KLD of the
next-token distribution, and the share of positions whose most likely token stays the same.
`--length` measures longer windows than the 128 tokens of agreement.py's (the markov model's own,
sampled anew; the text model's consecutive held-out windows joined), whose later positions lie
past the int8 cache's calibration.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_family  # noqa: E402
from agreement import trained_models  # noqa: E402
from support.oracle import (GGML_F16, GGML_F32, GGML_Q8_0, llama_window_logits,  # noqa: E402
                            moepass_step_logits, next_token_quality)

from moepass.convert import convert  # noqa: E402
from moepass.core.choices import KV_CACHE_TYPES  # noqa: E402

def longer_windows(model: str, windows: list[list[int]], length: int) -> list[list[int]]:
    """The model's held-out windows at `length` tokens, as many tokens in all as it has (at least 2
    windows): the markov model's sampled at that length, the text model's joined in order."""
    import train_fixture

    if length == len(windows[0]):
        return windows
    if length % len(windows[0]):
        raise SystemExit(f"--length must be a multiple of {len(windows[0])}")
    count = max(2, len(windows) * len(windows[0]) // length)
    if model == "markov":
        return train_fixture.heldout_windows(count, length)
    group = length // len(windows[0])
    if len(windows) < 2 * group:
        raise SystemExit(f"the {model} model has {len(windows)} windows of {len(windows[0])} tokens: "
                         f"too few for --length {length}")
    return [sum(windows[i * group:(i + 1) * group], []) for i in range(len(windows) // group)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="markov,text")
    ap.add_argument("--length", type=int, default=128, help="tokens per window (a multiple of 128; default 128)")
    ap.add_argument("--cache", type=Path, default=None, help="Keep the trained models here (default: a temp dir).")
    args = ap.parse_args()
    print(f"date {time.strftime('%Y-%m-%d')}; {cpu_family.describe()}")
    print("| model | side | KV cache | bytes a value | mean KLD | 99 % KLD | same top |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="moepass-kv-bench-") as tmp:
        work = args.cache or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, (gguf, _imatrix, windows) in trained_models(args.models.split(","), work).items():
            windows = longer_windows(name, windows, args.length)
            ours = {}
            for kind in KV_CACHE_TYPES:
                out = work / f"{name}-kv-{kind}"
                if not out.exists():
                    convert(gguf, out, kv_cache=kind, echo=lambda line: None)
                ours[kind] = moepass_step_logits(out, windows)
            for kind in list(KV_CACHE_TYPES)[1:]:
                q = next_token_quality(ours["float32"], ours[kind], windows)
                print(f"| {name} | moepass | {kind} | {KV_CACHE_TYPES[kind]} | {q.mean_kld:.2e} | {q.p99_kld:.2e} | "
                      f"{q.top1:.1%} |", flush=True)
            theirs = {t: llama_window_logits(gguf, windows, t) for t in (GGML_F32, GGML_F16, GGML_Q8_0)}
            for t, label, size in ((GGML_F16, "F16 (default)", 2), (GGML_Q8_0, "q8_0", 34 / 32)):
                q = next_token_quality(theirs[GGML_F32], theirs[t], windows)
                print(f"| {name} | llama.cpp | {label} | {size:.3g} | {q.mean_kld:.2e} | {q.p99_kld:.2e} | "
                      f"{q.top1:.1%} |", flush=True)


if __name__ == "__main__":
    main()
