"""Generation speed: `moepass bench` (ONNX Runtime, CPU) beside llama.cpp on the same GGUF, same threads.

    python benchmarks/runtime.py                    # the demo fixture and a Qwen3-30B-A3B-layer model
    python benchmarks/runtime.py --layers 4 --threads 2

For each model: prefill of --prompt-tokens tokens from an empty cache and --new-tokens single-token
decode steps (best of --repeats), each side in its own process, peak RSS from GNU time. llama.cpp
runs through llama-cpp-python with an F16 KV cache (its default), the same thread count, and
logits for every prompt position, as the converted model computes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np, llama_cpp
path, threads, n_prompt, n_new, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(path, n_ctx=n_prompt + n_new + 8, n_batch=n_prompt, n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
prompt = np.random.default_rng(0).integers(0, llm.n_vocab(), size=n_prompt).tolist()
prefill, decode = [], []
for _ in range(repeats):
    llm.reset()
    t = time.perf_counter(); llm.eval(prompt); prefill.append(time.perf_counter() - t)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(n_new):
        llm.eval([token]); token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode.append(time.perf_counter() - t)
print(json.dumps({"prefill": n_prompt / min(prefill), "decode": n_new / min(decode)}))
"""


def timed(cmd: list[str]) -> tuple[str, int]:
    """stdout and peak RSS (bytes) of cmd, run under GNU time."""
    with tempfile.NamedTemporaryFile("r") as report:
        proc = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%M", *cmd], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        return proc.stdout, int(report.read().split()[-1]) * 1024


def bench(gguf: Path, workdir: Path, args) -> dict:
    out = workdir / (gguf.stem + "-onnx")
    subprocess.run([sys.executable, "-m", "moepass.cli", "convert", str(gguf), "-o", str(out), "-q", "--force"],
                   check=True, capture_output=True)
    text, ours_rss = timed([sys.executable, "-m", "moepass.cli", "bench", str(out), "--prompt-tokens",
                            str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--repeats",
                            str(args.repeats), "--threads", str(args.threads)])
    ours = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if "tokens/s" in line}
    text, theirs_rss = timed([sys.executable, "-c", LLAMA_SCRIPT, str(gguf), str(args.threads),
                              str(args.prompt_tokens), str(args.new_tokens), str(args.repeats)])
    theirs = json.loads(text.strip().splitlines()[-1])
    return {"model": gguf.name, "gguf_bytes": gguf.stat().st_size, "ours": ours, "theirs": theirs,
            "ours_rss": ours_rss, "theirs_rss": theirs_rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-30B-A3B-sized model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moepass-runtime-bench-") as tmp:
        workdir = Path(tmp)
        big = workdir / f"qwen3moe-30b-sizes-q4_0-{args.layers}l.gguf"
        subprocess.run([sys.executable, "-c", "import sys, dataclasses; sys.path.insert(0, sys.argv[1]); "
                        "import make_fixtures as m; m.write_moe_gguf(sys.argv[2], 'q4_0', "
                        "dataclasses.replace(m.QWEN3_30B_DIMS, n_layers=int(sys.argv[3])), seed=0)",
                        str(ROOT / "fixtures"), str(big), str(args.layers)], check=True)
        rows = [bench(ROOT / "fixtures" / "qwen3moe-tiny-q4_0.gguf", workdir, args), bench(big, workdir, args)]
    print(f"\ndate {time.strftime('%Y-%m-%d')}, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} decode steps, best of {args.repeats}")
    print("| model | GGUF | prefill moepass / llama.cpp (tok/s) | decode moepass / llama.cpp (tok/s) | "
          "peak RSS moepass / llama.cpp |")
    print("|---|---|---|---|---|")
    for r in rows:
        o, t = r["ours"], r["theirs"]
        print(f"| {r['model']} | {r['gguf_bytes'] / 2**20:.1f} MiB | {o['prefill']:.0f} / {t['prefill']:.0f} "
              f"({o['prefill'] / t['prefill']:.2f}x) | {o['decode']:.1f} / {t['decode']:.1f} "
              f"({o['decode'] / t['decode']:.2f}x) | {r['ours_rss'] / 2**20:.0f} / {r['theirs_rss'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
