"""Decode after a long context, by KV cache type, beside llama.cpp's F16 and q8_0 caches.

    python benchmarks/long_context.py                              # Q4_0, 6 layers, after 2,048 and 8,192
    python benchmarks/long_context.py --depths 2048 8192 32768 --presets q4_0 q4_k_m

Files: Qwen3-30B-A3B's layer sizes and vocabulary, fewer layers (fixtures/make_fixtures.py, seed 0),
converted with `--context` large enough and each `--kv-cache` type. Each side and cache type runs
in its own process: one pseudo-random prompt (seed 0) is prefilled up to the first depth, then one
untimed step (moepass allocates 8,192 positions first and grows the cache by one copy past them:
430 ms for a float32 cache of this size) and --new-tokens greedy tokens decoded and timed, the
cache is cut back to the prompt and the
prompt prefilled on to the next depth, and so on (moepass: KVCache, chunks of 512 tokens as
llama.cpp's n_ubatch; llama.cpp: llama-cpp-python, n_batch 512, its default settings, with
`type_k`/`type_v` F16 or q8_0; q8_0 with flash attention, which its quantized V cache needs).
Reported: decode tokens/s after each depth, the prefill's tokens/s to the last depth, peak RSS
(GNU time), KV cache bytes at the last depth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_family  # noqa: E402
import make_fixtures  # noqa: E402
from runtime import llama_build, qwen3_sized_gguf, timed  # noqa: E402

OURS = r"""
import json, sys, time
import numpy as np
from moepass.runtime import KVCache, load
path, threads, new_tokens, depths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
decoder = load(path, device="cpu", threads=threads)
prompt = np.random.default_rng(0).integers(0, decoder.vocab_size, max(depths)).tolist()
cache = KVCache(decoder, capacity=max(depths) + new_tokens + 1)
cache.run(prompt[:8]); cache.truncate(0)  # warm-up, as on the other side
out, prefill = {}, 0.0
for depth in depths:
    start = time.perf_counter(); logits = cache.extend(prompt[:depth]); prefill += time.perf_counter() - start
    logits = cache.run([int(np.argmax(logits))])  # untimed: the first step may grow the cache (one copy)
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = cache.run([int(np.argmax(logits))])
    out[depth] = new_tokens / (time.perf_counter() - start)
    cache.truncate(depth)
print(json.dumps({"decode": out, "prefill": max(depths) / prefill}))
"""

THEIRS = r"""
import json, sys, time
import numpy as np, llama_cpp
path, threads, new_tokens, depths, cache_type = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(path, n_ctx=max(depths) + new_tokens + 8, n_threads=threads, n_threads_batch=threads, type_k=cache_type,
                      type_v=cache_type, flash_attn=cache_type != 1, verbose=False)
prompt = np.random.default_rng(0).integers(0, llm.n_vocab(), max(depths)).tolist()
def greedy():
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))
llm.eval(prompt[:8]); llm.reset()  # warm-up
out, prefill = {}, 0.0
for depth in depths:
    start = time.perf_counter(); llm.eval(prompt[llm.n_tokens:depth]); token = greedy(); prefill += time.perf_counter() - start
    llm.eval([token]); token = greedy()  # untimed, as on the other side
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token]); token = greedy()
    out[depth] = new_tokens / (time.perf_counter() - start)
    llm.n_tokens = depth  # eval drops the cache past n_tokens before it runs
print(json.dumps({"decode": out, "prefill": max(depths) / prefill}))
"""

KV_BYTES = {"float32": 4, "float16": 2, "int8": 1, "F16": 2, "q8_0": 34 / 32}
LLAMA_TYPES = {"F16": 1, "q8_0": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["q4_0"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--kv-caches", nargs="+", default=["float32", "int8"])
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the generated files here (default: a temp dir).")
    ap.add_argument("--llama-python", default=sys.executable)
    args = ap.parse_args()
    build = llama_build(args.llama_python)
    dims = make_fixtures.QWEN3_30B_DIMS
    kv_heads, head, layers = dims.n_kv_heads, dims.head_dim, args.layers
    rows = []
    with tempfile.TemporaryDirectory(prefix="moepass-long-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for preset in args.presets:
            gguf = qwen3_sized_gguf(work, preset, args.layers)
            context = max(args.depths) + args.new_tokens + 8
            for kind in args.kv_caches:
                out = work / f"{gguf.stem}-ctx{context}-kv-{kind}"
                if not out.exists():
                    print(f"converting {gguf.name} (--kv-cache {kind})", file=sys.stderr, flush=True)
                    subprocess.run([sys.executable, "-m", "moepass.cli", "convert", str(gguf), "-o", str(out), "-q",
                                    "--context", str(context), "--kv-cache", kind], check=True, capture_output=True)
                print(f"{preset}: moepass, {kind} cache", file=sys.stderr, flush=True)
                text, rss = timed([sys.executable, "-c", OURS, str(out), str(args.threads), str(args.new_tokens),
                                   json.dumps(args.depths)])
                rows.append({"preset": preset, "side": "moepass", "cache": kind, "rss": rss,
                             **json.loads(text.strip().splitlines()[-1])})
            for label, ggml in LLAMA_TYPES.items():
                print(f"{preset}: llama.cpp, {label} cache", file=sys.stderr, flush=True)
                text, rss = timed([args.llama_python, "-c", THEIRS, str(gguf), str(args.threads), str(args.new_tokens),
                                   json.dumps(args.depths), str(ggml)])
                rows.append({"preset": preset, "side": "llama.cpp", "cache": label, "rss": rss,
                             **json.loads(text.strip().splitlines()[-1])})
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_family.describe()}, {os.cpu_count()} cores, {args.threads} threads, "
          f"{args.layers} layers of Qwen3-30B-A3B's sizes; llama.cpp: {build}\n")
    last = max(args.depths)
    print("| file | side | KV cache | " + " | ".join(f"decode after {d}" for d in args.depths)
          + f" | prefill to {last} | KV bytes at {last} | peak RSS |")
    print("|---|---|---|" + "---|" * len(args.depths) + "---|---|---|")
    for r in rows:
        baseline = next(b for b in rows if b["preset"] == r["preset"] and b["cache"] == "q8_0")
        cells = [f"{r['decode'][str(d)]:.1f} ({r['decode'][str(d)] / baseline['decode'][str(d)]:.2f}x)"
                 for d in args.depths]
        kv = 2 * layers * kv_heads * head * last * KV_BYTES[r["cache"]]
        print(f"| {r['preset']} | {r['side']} | {r['cache']} | " + " | ".join(cells)
              + f" | {r['prefill']:.0f} tokens/s | {kv / 2**20:.0f} MiB | {r['rss'] / 2**20:.0f} MiB |")
    print("\ntokens/s (and against llama.cpp with its q8_0 cache, same file)")


if __name__ == "__main__":
    main()
