"""Generation speed beside llama.cpp on the same GGUF files: the benchmark users would trust.

    python benchmarks/runtime.py                       # Q4_0, Q4_K_M and Q8_0, 6 layers
    python benchmarks/runtime.py --presets q4_0 --layers 6 --rounds 2
    python benchmarks/runtime.py --presets q4_k_m --layers 48 --expert-format int4   # full size, streamed

Files: Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts, top-8, expert ffn 768, 32 q / 4 kv
heads x 128) and vocabulary (151,936 tokens: the LM head is a large share of a decode step), fewer
layers, written by fixtures/make_fixtures.py (fixed seed). Each is converted with moepass's
defaults (or --expert-format). For each file and side: prefill of 128 and of 512 tokens from an empty cache, decode of
--new-tokens steps after 128 and after 2,048 cached tokens. Each side runs in its own process
(moepass.runtime's generation path, as `moepass bench` measures it; llama-cpp-python with its
default settings: logits of the last token only, F16 KV cache, n_batch 512), same thread count,
after a short warm-up; the two alternate for --rounds rounds and each figure is the best of them,
so both sides see the same machine state. Peak RSS is GNU time's, per process, the largest over
the rounds.

The bandwidth floor: bytes of expert weights a decode step reads (top-k experts per layer) and of
the other weights (attention, router, LM head; one embedding row), over the measured memory
bandwidth (a 1 GiB numpy copy, read + write bytes as STREAM counts them), is the fastest a decode
step could be; the report gives it beside the measured step time and ONNX Runtime's profile of
where the step goes (`moepass bench --profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))

import cpu_family  # noqa: E402
import make_fixtures  # noqa: E402

PRESET_NAMES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M (llama.cpp's layer rule)",
                "q4_k": "Q4_K, Q6_K down/attn_v/output", "q6_k": "Q6_K", "q8_0": "Q8_0"}

LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np, llama_cpp
path, threads, new_tokens, depths, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
llm = llama_cpp.Llama(path, n_ctx=max(depths + prompts) + new_tokens + 8, n_threads=threads, n_threads_batch=threads, verbose=False)
def prompt(n):
    return np.random.default_rng(0).integers(0, llm.n_vocab(), size=n).tolist()
def greedy():  # the last position's logits, as llama.cpp computes them by default (scores stay empty)
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))
def run(ids, n_new):
    llm.reset()
    t = time.perf_counter(); llm.eval(ids); token = greedy(); first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_new):
        llm.eval([token]); token = greedy()
    return first, time.perf_counter() - t
run(prompt(8), 2)  # warm-up, as on the other side
out = {"prefill": {}, "decode": {}}
for n in prompts:
    out["prefill"][n] = n / run(prompt(n), 0)[0]
for n in depths:
    out["decode"][n] = new_tokens / run(prompt(n), new_tokens)[1]
print(json.dumps(out))
"""


# Files of more layers than this are streamed from the 3-layer one (make_fixtures.deepen_gguf): the
# generator holds a whole model in memory, and 48 layers are 17-19 GB
WRITTEN_WHOLE_LAYERS = 6


def qwen3_sized_gguf(work: Path, preset: str, layers: int) -> Path:
    """The benchmarks' file: Qwen3-30B-A3B's layer sizes and vocabulary, `layers` layers, `preset`
    (fixed seed), written into `work` unless it is there already; past WRITTEN_WHOLE_LAYERS, the
    3-layer file's layers repeated (in llama.cpp's Q4_K_M rule for `layers` where the preset has it)."""
    gguf = work / f"qwen3moe-30b-sizes-{preset}-{layers}l.gguf"
    if not gguf.exists():
        print(f"writing {gguf.name}", file=sys.stderr, flush=True)
        if layers > WRITTEN_WHOLE_LAYERS:
            make_fixtures.deepen_gguf(qwen3_sized_gguf(work, preset, 3), gguf, layers)
        else:
            dims = dataclasses.replace(make_fixtures.QWEN3_30B_DIMS, n_layers=layers)
            make_fixtures.write_moe_gguf(gguf, preset, dims, seed=0)
    return gguf


def llama_build(python: str) -> str:
    """llama-cpp-python's version and llama.cpp's system info line, from the Python that runs it."""
    return subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__, "
                           "llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def timed(cmd: list[str]) -> tuple[str, int]:
    """stdout and peak RSS (bytes) of cmd, run under GNU time."""
    with tempfile.NamedTemporaryFile("r") as report:
        proc = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%M", *cmd], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return proc.stdout, int(report.read().split()[-1]) * 1024


OURS_SCRIPT = r"""
import json, sys
from moepass.runtime import load
from moepass.runtime.bench import measure
path, threads, new_tokens, depths, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
decoder = load(path, device="cpu", threads=threads)
measure(decoder, 8, 2, repeats=1)  # warm-up, as on the other side
out = {"prefill": {}, "decode": {}}
for n in prompts:
    out["prefill"][n] = measure(decoder, n, 1, repeats=1)["prefill_tokens_per_s"]
for n in depths:
    out["decode"][n] = measure(decoder, n, new_tokens, repeats=1)["decode_tokens_per_s"]
print(json.dumps(out))
"""


def ours(model_dir: Path, args) -> tuple[dict, int]:
    """Every figure from one process (the generation path of `moepass bench`); (results, peak RSS)."""
    text, rss = timed([sys.executable, "-c", OURS_SCRIPT, str(model_dir), str(args.threads), str(args.new_tokens),
                       json.dumps(args.depths), json.dumps(args.prompts)])
    raw = json.loads(text.strip().splitlines()[-1])
    return {kind: {int(n): v for n, v in values.items()} for kind, values in raw.items()}, rss


def theirs(gguf: Path, args) -> tuple[dict, int]:
    text, rss = timed([args.llama_python, "-c", LLAMA_SCRIPT, str(gguf), str(args.threads), str(args.new_tokens),
                       json.dumps(args.depths), json.dumps(args.prompts)])
    raw = json.loads(text.strip().splitlines()[-1])
    return {kind: {int(n): v for n, v in values.items()} for kind, values in raw.items()}, rss


def best(runs: list[dict]) -> dict:
    return {kind: {n: max(r[kind][n] for r in runs) for n in runs[0][kind]} for kind in runs[0]}


def copy_bandwidth() -> float:
    """Memory bandwidth as STREAM's copy counts it: bytes read plus bytes written per second, by a
    1 GiB numpy copy on one thread (best of 3)."""
    src = np.ones(2**30 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / min(times)


def bytes_per_decode_step(model_dir: Path) -> tuple[int, int]:
    """(expert bytes, other weight bytes) one decode step reads: top-k of each MoE layer's experts;
    every other weight except the embedding table (one row of it)."""
    report = json.loads((model_dir / "moepass.json").read_text())
    layers = {m["node"].rsplit(".", 1)[0]: m for m in report["moe_layers"]}
    expert = other = 0
    for w in report["weights"]:
        name = w["onnx_name"]
        layer = name.split(".ffn_experts")[0] if ".ffn_experts" in name else None
        if layer in layers:
            expert += w["bytes"] * layers[layer]["top_k"] // layers[layer]["experts"]
        elif not name.startswith("token_embd"):
            other += w["bytes"]
    return expert, other


def profile(model_dir: Path, args) -> dict:
    text, _ = timed([sys.executable, "-m", "moepass.cli", "bench", str(model_dir), "--json", "--profile", "--threads",
                     str(args.threads), "--prompt-tokens", "128", "--new-tokens", "4", "--repeats", "1"])
    return json.loads(text)["decode_operator_shares"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["q4_0", "q4_k_m", "q8_0"], choices=sorted(PRESET_NAMES))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--depths", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--expert-format", default="auto", help="moepass convert --expert-format (default: auto)")
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the generated files here (default: a temp dir).")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="Python whose llama_cpp runs the llama.cpp side (default: this one; the tests' oracle is "
                         "an AVX2 build, a benchmark wants the best build the CPU runs)")
    args = ap.parse_args()
    args.llama_build = llama_build(args.llama_python)
    bandwidth = copy_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory(prefix="moepass-runtime-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for preset in args.presets:
            gguf = qwen3_sized_gguf(work, preset, args.layers)
            out = work / f"{gguf.stem}-onnx" if args.expert_format == "auto" else \
                work / f"{gguf.stem}-{args.expert_format}-onnx"
            if not out.exists():
                print(f"converting {gguf.name}", file=sys.stderr, flush=True)
                subprocess.run([sys.executable, "-m", "moepass.cli", "convert", str(gguf), "-o", str(out), "-q",
                                "--expert-format", args.expert_format], check=True, capture_output=True)
            our_runs, their_runs, our_rss, their_rss = [], [], 0, 0
            for r in range(args.rounds):
                print(f"{preset}: round {r + 1}/{args.rounds}: moepass", file=sys.stderr, flush=True)
                result, rss = ours(out, args)
                our_runs.append(result)
                our_rss = max(our_rss, rss)
                print(f"{preset}: round {r + 1}/{args.rounds}: llama.cpp", file=sys.stderr, flush=True)
                result, rss = theirs(gguf, args)
                their_runs.append(result)
                their_rss = max(their_rss, rss)
            expert_bytes, other_bytes = bytes_per_decode_step(out)
            rows.append({"preset": preset, "gguf_bytes": gguf.stat().st_size,
                         "onnx_bytes": sum(f.stat().st_size for f in out.iterdir()),
                         "ours": best(our_runs), "theirs": best(their_runs), "ours_rss": our_rss,
                         "theirs_rss": their_rss, "expert_bytes": expert_bytes, "other_bytes": other_bytes,
                         "profile": profile(out, args)})
    report(rows, args, bandwidth)


def report(rows: list[dict], args, bandwidth: float) -> None:
    print(f"\ndate {time.strftime('%Y-%m-%d')}, {cpu_family.describe()}, {os.cpu_count()} cores, {args.threads} threads each, "
          f"{args.layers} layers, vocabulary 151,936, best of {args.rounds} alternating rounds; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; llama.cpp: {args.llama_build}")
    prompts, depths = args.prompts, args.depths
    print("| file | GGUF / ONNX | " + " | ".join(f"prefill {n}" for n in prompts) + " | "
          + " | ".join(f"decode after {n}" for n in depths) + " | peak RSS |")
    print("|---|---|" + "---|" * (len(prompts) + len(depths)) + "---|")
    for r in rows:
        o, t = r["ours"], r["theirs"]
        cells = [f"{o['prefill'][n]:.0f} / {t['prefill'][n]:.0f} (**{o['prefill'][n] / t['prefill'][n]:.2f}x**)"
                 for n in prompts]
        cells += [f"{o['decode'][n]:.1f} / {t['decode'][n]:.1f} (**{o['decode'][n] / t['decode'][n]:.2f}x**)"
                  for n in depths]
        print(f"| {PRESET_NAMES[r['preset']]} | {r['gguf_bytes'] / 2**30:.2f} / {r['onnx_bytes'] / 2**30:.2f} GiB | "
              + " | ".join(cells) + f" | {r['ours_rss'] / 2**20:.0f} / {r['theirs_rss'] / 2**20:.0f} MiB |")
    print("\nmoepass / llama.cpp, tokens/s. Where a decode step goes (moepass, ONNX Runtime profiler, after 128 "
          "tokens) and the memory-bandwidth floor of a step:")
    print("| file | expert bytes / other bytes per step | floor at copy bandwidth | measured step (after 128) | "
          "kernel time by operator |")
    print("|---|---|---|---|---|")
    for r in rows:
        floor = (r["expert_bytes"] + r["other_bytes"]) / bandwidth
        step = 1 / r["ours"]["decode"][depths[0]]
        shares = ", ".join(f"{op} {s:.0%}" for op, s in r["profile"].items() if s >= 0.02)
        print(f"| {r['preset']} | {r['expert_bytes'] / 2**20:.0f} / {r['other_bytes'] / 2**20:.0f} MiB | "
              f"{floor * 1e3:.1f} ms | {step * 1e3:.1f} ms | {shares} |")


if __name__ == "__main__":
    main()
