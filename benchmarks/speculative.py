"""Where speculative decoding pays for a MoE model: step cost against draft length, and decode speed
with n-gram drafting against plain decoding.

    python benchmarks/speculative.py                  # 6 layers of Qwen3-30B-A3B's sizes, Q4_0
    python benchmarks/speculative.py --layers 2 --workdir /tmp/spec

A Qwen3-30B-A3B-sized file (hidden 2048, 128 experts, top-8, 151,936-token vocabulary; fewer
layers; fixtures/make_fixtures.py, fixed seed) converted with the defaults.

1. Step cost: one pass of the model over 1 + k positions (the last token and k drafts) after 256
   cached tokens, for k = 0, 1, 2, 4, 8, each with fresh pseudo-random tokens (so that the k + 1
   positions route to as many distinct experts as unrelated tokens do: a MoE verification step
   reads the union of its tokens' experts), best of --repeats. Its ratio to k = 0 is what a step
   that keeps no draft loses, and (1 + kept) / ratio what a step gains.
2. Decode: --new-tokens greedy tokens, plain and with n-gram drafting for each k, on two
   workloads: "repetitive" (a prompt that ends in the model's own greedy continuation of it, which
   this random-weight model goes on repeating, as an answer quoting its context does) and "free"
   (llama-server's default sampling, temperature 0.8, from a pseudo-random prompt: what n-gram
   lookup cannot guess). Each the best of two runs. Reported: tokens/s, speedup over plain on the
   same prompt, drafts per step, share of drafts kept, tokens per step; greedy output must equal
   plain decoding's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_family  # noqa: E402
from runtime import qwen3_sized_gguf  # noqa: E402

DRAFT_LENGTHS = (0, 1, 2, 4, 8)


def step_costs(decoder, repeats: int) -> dict[int, float]:
    """Best seconds of one pass over 1 + k new positions after 256 cached tokens, per k."""
    from moepass.runtime import KVCache

    rng = np.random.default_rng(1)
    cache = KVCache(decoder, capacity=512)
    cache.extend(rng.integers(0, decoder.vocab_size, 256).tolist())
    costs = {}
    for k in DRAFT_LENGTHS:
        times = []
        for _ in range(repeats):
            ids = rng.integers(0, decoder.vocab_size, k + 1).tolist()
            start = time.perf_counter()
            cache.run_rows(ids, keep=k + 1)
            times.append(time.perf_counter() - start)
            cache.truncate(256)
        costs[k] = min(times)
    return costs


def decode(decoder, prompt: list[int], new_tokens: int, sampling) -> tuple[float, list[int]]:
    """Seconds for the `new_tokens` after the first (the prefill left out) and the tokens."""
    from moepass.runtime import KVCache

    cache = KVCache(decoder, capacity=len(prompt) + new_tokens + 1)
    tokens = decoder.generate(prompt, new_tokens + 1, stop_ids=(), sampling=sampling, cache=cache)
    out = [next(tokens)]
    start = time.perf_counter()
    out.extend(tokens)
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the generated files here (default: a temp dir).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = ap.parse_args()

    import moepass
    from moepass.runtime import LLAMA_SERVER, Sampling, Speculator, load

    with tempfile.TemporaryDirectory(prefix="moepass-spec-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        gguf = qwen3_sized_gguf(work, "q4_0", args.layers)
        out = work / f"{gguf.stem}-onnx"
        if not out.exists():
            print(f"converting {gguf.name}", file=sys.stderr, flush=True)
            moepass.convert(gguf, out, echo=lambda line: None)
        decoder = load(out, threads=args.threads)
        print("step cost", file=sys.stderr, flush=True)
        costs = step_costs(decoder, args.repeats)

        rng = np.random.default_rng(0)
        start = rng.integers(0, decoder.vocab_size, 64).tolist()
        repetitive = [*start, *decoder.generate(start, 128, stop_ids=())]
        workloads = {"repetitive": (repetitive, Sampling()),
                     "free": (rng.integers(0, decoder.vocab_size, 192).tolist(), dataclasses.replace(LLAMA_SERVER,
                                                                                                    seed=0))}
        rows = []
        decode(decoder, start, 8, Sampling())  # warm-up
        for name, (prompt, sampling) in workloads.items():
            print(f"{name}: plain", file=sys.stderr, flush=True)
            plain = [decode(decoder, prompt, args.new_tokens, sampling) for _ in range(2)]
            plain_s, plain_tokens = min(s for s, _ in plain), plain[0][1]
            for k in DRAFT_LENGTHS[1:]:
                print(f"{name}: n-gram, k = {k}", file=sys.stderr, flush=True)
                speculator = Speculator("ngram", k)
                decoder.speculate(speculator)
                runs = [decode(decoder, prompt, args.new_tokens, sampling) for _ in range(2)]
                seconds, tokens = min(s for s, _ in runs), runs[0][1]
                decoder.speculate(None)
                rows.append({"workload": name, "k": k, "tokens_per_s": args.new_tokens / seconds,
                             "plain_tokens_per_s": args.new_tokens / plain_s, "speedup": plain_s / seconds,
                             "acceptance": speculator.acceptance,
                             "drafted_per_step": speculator.drafted / max(speculator.steps, 1),  # over both runs
                             "tokens_per_step": 2 * args.new_tokens / max(speculator.steps, 1),
                             "same_tokens": tokens == plain_tokens if sampling.temperature == 0 else None})
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_family.describe()}, {args.threads} threads, {args.layers} layers of "
          f"Qwen3-30B-A3B's sizes, Q4_0, moepass defaults\n")
    print("| draft tokens k | step over 1 + k positions | vs k = 0 |\n|---|---|---|")
    for k, seconds in costs.items():
        print(f"| {k} | {seconds * 1e3:.1f} ms | {seconds / costs[0]:.2f}x |")
    print("\n| workload | k | tokens/s | plain tokens/s | speedup | drafts per step | drafts kept | tokens per step "
          "| same tokens |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r["same_tokens"] is None else "yes" if r["same_tokens"] else "NO"
        print(f"| {r['workload']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['drafted_per_step']:.2f} | {r['acceptance']:.0%} | "
              f"{r['tokens_per_step']:.2f} | {same} |")
    if args.json:
        args.json.write_text(json.dumps({"step_seconds": costs, "decode": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
