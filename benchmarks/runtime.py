"""Generation speed beside llama.cpp on the same GGUF files: the benchmark users would trust.

    python benchmarks/runtime.py                       # Q4_0, Q4_K_M and Q8_0, 6 layers
    python benchmarks/runtime.py --presets q4_0 --layers 6 --rounds 2
    python benchmarks/runtime.py --presets q4_k_m --layers 48 --expert-format int4   # full size, streamed
    python benchmarks/runtime.py --presets q4_0 q4_k_m --ik-llama-bench PATH         # ik_llama.cpp beside

ik_llama.cpp (github:ikawrakow/ik_llama.cpp, a checkout outside this repository) is built with
`cmake -B BUILD -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release &&
cmake --build BUILD --target llama-bench` (12 minutes on 2 cores of an AMD EPYC); its llama-bench runs
each round without and with `-rtr 1` (run-time repacking), prefill from `-p`, decode after a depth from
`-gp depth,n`.

Files: Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts, top-8, expert ffn 768, 32 q / 4 kv
heads x 128) and vocabulary (151,936 tokens: the LM head is a large share of a decode step), fewer
layers, written by fixtures/make_fixtures.py (fixed seed). Each is converted with moepass's
defaults (or --expert-format). For each file and side: prefill of 128 and of 512 tokens from an empty cache, decode of
--new-tokens steps after 128 and after 2,048 cached tokens. Each side runs in its own process
(moepass.runtime's generation path, as `moepass bench` measures it; llama-cpp-python with its
default settings: logits of the last token only, F16 KV cache, n_batch 512), same thread count,
after a short warm-up; the two alternate for --rounds rounds; the table gives each figure's best
over the rounds, and the lines below it each round's pair and the median of the rounds' ratios
(this VM is noisy: the paired ratio is the figure to quote). Peak RSS is GNU time's, per process, the largest over
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


def ik_llama(gguf: Path, args, repack: int) -> tuple[dict, int]:
    """ik_llama.cpp's llama-bench (`--ik-llama-bench`) on the same file and threads, with `-rtr
    repack` (its run-time repacking into row-interleaved blocks): prefill of each prompt size from
    an empty context (`-p`), decode of --new-tokens after each depth (`-gp depth,n`), one
    repetition a round after its own warm-up; (results in tokens/s, peak RSS)."""
    cmd = [args.ik_llama_bench, "-m", str(gguf), "-t", str(args.threads), "-p", ",".join(map(str, args.prompts)),
           "-n", "0", *[a for d in args.depths for a in ("-gp", f"{d},{args.new_tokens}")], "-r", "1",
           "-rtr", str(repack), "-o", "json"]
    text, rss = timed(cmd)
    out: dict = {"prefill": {}, "decode": {}}
    for test in json.loads(text[text.index("["):]):
        if test.get("n_gen", 0) == 0:
            out["prefill"][int(test["n_prompt"])] = float(test["avg_ts"])
        else:
            out["decode"][int(test["n_prompt"])] = float(test["avg_ts"])
    return out, rss


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


MOE_OPS = ("QMoE", "MoE")


def bytes_per_decode_step(model_dir: Path) -> tuple[int, int]:
    """(expert bytes, other weight bytes) one decode step reads (weight_bytes_by_operator)."""
    by_op = weight_bytes_by_operator(model_dir)
    expert = sum(by_op.get(op, 0) for op in MOE_OPS)
    return expert, sum(by_op.values()) - expert


def weight_bytes_by_operator(model_dir: Path) -> dict[str, int]:
    """Weight bytes a decode step reads per operator type of model.onnx, as stored: each node's
    initializer inputs (also through a Cast of one, which ONNX Runtime folds at load); of a MoE
    node its top-k experts; of a Gather one row of its table."""
    import onnx

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    sizes = {}
    for t in model.graph.initializer:
        external = {e.key: e.value for e in t.external_data}
        sizes[t.name] = int(external["length"]) if "length" in external else len(t.raw_data)
    cast_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in sizes}
    rows_of = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    out: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type == "Cast":
            continue
        read = sum(sizes.get(cast_of.get(i, i), 0) for i in n.input)
        if n.op_type in MOE_OPS:  # inputs (x, router logits, fc1 weights, ...): experts on the first axis
            k = next(a.i for a in n.attribute if a.name == "k")
            read = read * k // rows_of[n.input[2]]
        elif n.op_type.startswith("Gather") and cast_of.get(n.input[0], n.input[0]) in rows_of:
            read //= rows_of[cast_of.get(n.input[0], n.input[0])]
        if read:
            out[n.op_type] = out.get(n.op_type, 0) + read
    return out


def profile(model_dir: Path, args) -> dict:
    """ONNX Runtime's profile of 16 decode steps after 128 tokens (`moepass bench --profile`)."""
    text, _ = timed([sys.executable, "-m", "moepass.cli", "bench", str(model_dir), "--json", "--profile", "--threads",
                     str(args.threads), "--prompt-tokens", "128", "--new-tokens", "4", "--repeats", "1"])
    return json.loads(text)["decode_profile"]


def profile_table(row: dict, bandwidth: float) -> None:
    """The step by operator type beside the weight bytes each reads and their floor at the copy
    bandwidth; then the layers' spread and the executor's share."""
    where, op_bytes = row["profile"], row["op_bytes"]
    print(f"\n{row['preset']}: a decode step after 128 tokens under ONNX Runtime's profiler, "
          f"{where['step_ms']:.1f} ms ({where['steps']} steps; the profiler adds its own cost to each node)")
    print("| operator | nodes a step | ms a step | share of the step | weight MiB a step | floor at copy bandwidth | "
          "ms over the floor |")
    print("|---|---|---|---|---|---|---|")
    for op, v in where["operators"].items():
        nbytes = op_bytes.get(op, 0)
        floor = nbytes / bandwidth * 1e3
        cells = (f"{nbytes / 2**20:.0f} | {floor:.1f} ms | {v['ms'] - floor:+.1f}") if nbytes else "0 | | "
        if v["ms"] >= 0.05:
            print(f"| {op} | {v['nodes']:.0f} | {v['ms']:.2f} | {v['ms'] / where['step_ms']:.1%} | {cells} |")
    print(f"| the executor between kernels | | {where['framework_ms']:.2f} | "
          f"{where['framework_ms'] / where['step_ms']:.1%} | | | |")
    total = sum(op_bytes.values())
    print(f"| **step** | {sum(v['nodes'] for v in where['operators'].values()):.0f} | {where['step_ms']:.2f} | | "
          f"{total / 2**20:.0f} | {total / bandwidth * 1e3:.1f} ms | {where['step_ms'] - total / bandwidth * 1e3:+.1f} |")
    layers = sorted(ms for layer, ms in where["layers"].items() if int(layer) >= 0)
    if layers:
        print(f"layers: {len(layers)}, ms a step each min / median / max {layers[0]:.2f} / "
              f"{layers[len(layers) // 2]:.2f} / {layers[-1]:.2f}; outside them (embedding, LM head) "
              f"{where['layers'].get('-1', 0.0):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["q4_0", "q4_k_m", "q8_0"], choices=sorted(PRESET_NAMES))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--depths", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true",
                    help="Also profile 16 decode steps after 128 tokens: time by operator beside its weight bytes "
                         "and their floor at the copy bandwidth, the layers' spread, the executor's share")
    ap.add_argument("--expert-format", default="auto", help="moepass convert --expert-format (default: auto)")
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the generated files here (default: a temp dir).")
    ap.add_argument("--ik-llama-bench", default=None,
                    help="ik_llama.cpp's llama-bench binary: a third side, run without and with -rtr 1 (its "
                         "build: docs/benchmarks.md, Decode)")
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
            ik_runs: dict[int, list] = {0: [], 1: []}
            ik_rss = {0: 0, 1: 0}
            for r in range(args.rounds):
                print(f"{preset}: round {r + 1}/{args.rounds}: moepass", file=sys.stderr, flush=True)
                result, rss = ours(out, args)
                our_runs.append(result)
                our_rss = max(our_rss, rss)
                print(f"{preset}: round {r + 1}/{args.rounds}: llama.cpp", file=sys.stderr, flush=True)
                result, rss = theirs(gguf, args)
                their_runs.append(result)
                their_rss = max(their_rss, rss)
                for repack in (0, 1) if args.ik_llama_bench else ():
                    print(f"{preset}: round {r + 1}/{args.rounds}: ik_llama.cpp -rtr {repack}", file=sys.stderr,
                          flush=True)
                    result, rss = ik_llama(gguf, args, repack)
                    ik_runs[repack].append(result)
                    ik_rss[repack] = max(ik_rss[repack], rss)
            expert_bytes, other_bytes = bytes_per_decode_step(out)
            rows.append({"preset": preset, "gguf_bytes": gguf.stat().st_size,
                         "onnx_bytes": sum(f.stat().st_size for f in out.iterdir()),
                         "ours": best(our_runs), "theirs": best(their_runs), "our_runs": our_runs,
                         "their_runs": their_runs, "ours_rss": our_rss,
                         "theirs_rss": their_rss, "expert_bytes": expert_bytes, "other_bytes": other_bytes,
                         "model_dir": out, "ik_runs": ik_runs, "ik_rss": ik_rss})
        report(rows, args, bandwidth)  # before the profiles: a profile that fails loses no timing
        if args.profile:
            for row in rows:
                row.update(profile=profile(row["model_dir"], args), op_bytes=weight_bytes_by_operator(row["model_dir"]))
                profile_table(row, bandwidth)


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
    print("\nPer round (moepass / llama.cpp of the same round), and the median of those ratios:")
    for r in rows:
        for kind, sizes in (("prefill", prompts), ("decode after", depths)):
            key = kind.split()[0]
            for n in sizes:
                ratios = [o[key][n] / t[key][n] for o, t in zip(r["our_runs"], r["their_runs"])]
                rounds = ", ".join(f"{o[key][n]:.2f} / {t[key][n]:.2f}" for o, t in zip(r["our_runs"], r["their_runs"]))
                print(f"- {r['preset']} {kind} {n}: {rounds}; median ratio **{float(np.median(ratios)):.2f}x**")
    if args.ik_llama_bench:
        ik_report(rows, args)
    print(f"\nmoepass / llama.cpp, tokens/s. A decode step (after {depths[0]} tokens) against the memory-bandwidth "
          "floor, the weight bytes it reads over the copy bandwidth:")
    print("| file | expert bytes / other bytes per step | floor at copy bandwidth | moepass step | llama.cpp step |")
    print("|---|---|---|---|---|")
    for r in rows:
        floor = (r["expert_bytes"] + r["other_bytes"]) / bandwidth
        print(f"| {r['preset']} | {r['expert_bytes'] / 2**20:.0f} / {r['other_bytes'] / 2**20:.0f} MiB | "
              f"{floor * 1e3:.1f} ms | {1e3 / r['ours']['decode'][depths[0]]:.1f} ms | "
              f"{1e3 / r['theirs']['decode'][depths[0]]:.1f} ms |")


def ik_report(rows: list[dict], args) -> None:
    """moepass against ik_llama.cpp's better of -rtr 0 and 1, as medians of the rounds (the
    rounds interleaved: moepass, llama.cpp, ik_llama.cpp -rtr 0, -rtr 1)."""
    prompts, depths = args.prompts, args.depths
    print(f"\nmoepass / ik_llama.cpp ({args.ik_llama_bench}), medians of {args.rounds} interleaved rounds; "
          "ik_llama.cpp's -rtr 0 and -rtr 1 beside, then the ratio to the better of them:")
    print("| file | phase | moepass | llama.cpp | ik_llama.cpp | ik_llama.cpp -rtr 1 | moepass / best ik | peak RSS moepass / "
          "ik -rtr 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for kind, sizes in (("prefill", prompts), ("decode", depths)):
            for n in sizes:
                ours_, theirs_ = (float(np.median([run[kind][n] for run in runs]))
                                  for runs in (r["our_runs"], r["their_runs"]))
                ik0, ik1 = (float(np.median([run[kind][n] for run in r["ik_runs"][k]])) for k in (0, 1))
                what = f"prefill {n}" if kind == "prefill" else f"decode after {n}"
                print(f"| {r['preset']} | {what} | {ours_:.1f} | {theirs_:.1f} | {ik0:.1f} | {ik1:.1f} | "
                      f"**{ours_ / max(ik0, ik1):.2f}x** | {r['ours_rss'] / 2**20:.0f} / {r['ik_rss'][1] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
