"""Generation speed beside llama.cpp on the same GGUF files: the benchmark users would trust.

    python benchmarks/runtime.py                       # Q4_0, Q4_K_M and Q8_0, 6 layers
    python benchmarks/runtime.py --presets q4_0 --layers 6 --rounds 2
    python benchmarks/runtime.py --presets q4_k_m --layers 48 --expert-format int4   # full size, streamed
    python benchmarks/runtime.py --presets q4_0 q4_k_m --ik-llama-bench PATH         # ik_llama.cpp beside
    python benchmarks/runtime.py --presets iq4_xs --llama-quantize PATH --ik-llama-bench PATH --profile

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
import re
import shutil
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
                "q4_k": "Q4_K, Q6_K down/attn_v/output", "q6_k": "Q6_K", "q8_0": "Q8_0",
                "iq4_xs": "IQ4_XS (llama-quantize's mix, from the Q8_0 file)"}
QUANTIZED = {"iq4_xs": ("q8_0", "IQ4_XS")}  # made by --llama-quantize from another preset's file (gguf-py cannot)

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


def qwen3_sized_gguf(work: Path, preset: str, layers: int, quantize: str | None = None) -> Path:
    """The benchmarks' file: Qwen3-30B-A3B's layer sizes and vocabulary, `layers` layers, `preset`
    (fixed seed), written into `work` unless it is there already; past WRITTEN_WHOLE_LAYERS, the
    3-layer file's layers repeated (in llama.cpp's Q4_K_M rule for `layers` where the preset has it).
    A QUANTIZED preset is made from its source preset's file by `quantize` (a llama-quantize binary:
    the type's own mix of tensor types, as published files of that type are made)."""
    gguf = work / f"qwen3moe-30b-sizes-{preset}-{layers}l.gguf"
    if not gguf.exists():
        print(f"writing {gguf.name}", file=sys.stderr, flush=True)
        if preset in QUANTIZED:
            source, ftype = QUANTIZED[preset]
            if not quantize:
                raise SystemExit(f"--presets {preset} needs --llama-quantize PATH (gguf-py cannot write {ftype})")
            part = gguf.with_suffix(".part")
            subprocess.run([quantize, "--allow-requantize", str(qwen3_sized_gguf(work, source, layers)), str(part),
                            ftype], check=True, capture_output=True)
            part.rename(gguf)
        elif layers > WRITTEN_WHOLE_LAYERS:
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


def bench_tests(stdout: str) -> list[dict]:
    """The tests of llama-bench's `-o json` output (after whatever it printed before the list)."""
    return json.loads(stdout[stdout.index("["):])


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
    for test in bench_tests(text):
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


MOE_OPS = ("QMoE", "MoE", "MoEPacked")


def bytes_per_decode_step(model_dir: Path) -> tuple[int, int]:
    """(expert bytes, other weight bytes) one decode step reads, as stored (operator_work)."""
    work = operator_work(model_dir, 1)
    expert = sum(w["decode_bytes"] for op, w in work.items() if op in MOE_OPS)
    return int(expert), int(sum(w["decode_bytes"] for w in work.values()) - expert)


LM_HEAD = "lm_head"  # the converter's name for the node that only sees the kept positions
OFFSET_NODES = (".block_sums", ".offsets")  # Q4_K's exact form: work of moepass's, not of the model
MATRIX_OPS = ("QMoE", "MoE", "MoEPacked", "MatMulNBits", "MatMulPacked", "MatMul", "Gemm")
ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention")


def elements(row_bytes: int, ggml_type: int) -> int:
    """The values a row of GGUF blocks of `ggml_type` holds."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return row_bytes // size * block


def operator_work(model_dir: Path, prompt_tokens: int) -> dict[str, dict[str, float]]:
    """Per operator type of model.onnx: the weight bytes (as stored: each node's initializer
    inputs, also through a Cast of one, which ONNX Runtime folds at load) and multiply-adds of a
    decode step and of a prefill of `prompt_tokens` tokens. A MoE node reads its top-k experts a
    step and, over a prefill, each expert some token routes to (expected share 1 - (1 - k/E)^P
    under even routing); a Gather one row a token; the LM head sees the last position alone."""
    import onnx

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    sizes, dims = {}, {}
    for t in model.graph.initializer:
        external = {e.key: e.value for e in t.external_data}
        sizes[t.name] = int(external["length"]) if "length" in external else len(t.raw_data)
        dims[t.name] = list(t.dims)
    cast_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in sizes}
    out: dict[str, dict[str, float]] = {}
    for n in model.graph.node:
        if n.op_type == "Cast":
            continue
        inputs = [cast_of.get(i, i) for i in n.input]
        stored = sum(sizes.get(i, 0) for i in inputs)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        rows = 1 if n.name == LM_HEAD else prompt_tokens
        step_bytes, prefill_bytes, macs = stored, stored, 0
        if n.op_type == "MoEPacked":  # inputs (x, router logits, gate, up, down blobs [E, rows, row bytes])
            experts, k = dims[inputs[2]][0], attrs["k"]
            macs = k * sum(dims[i][1] * elements(dims[i][2], attrs[f"{role}_type"])
                           for i, role in zip(inputs[2:5], ("gate", "up", "down")))
            step_bytes = stored * k // experts
            prefill_bytes = stored * (1 - (1 - k / experts) ** prompt_tokens)
        elif n.op_type == "MatMulPacked":  # inputs (A, B blocks [N, row bytes])
            macs = dims[inputs[1]][0] * elements(dims[inputs[1]][1], attrs["packed_type"])
        elif n.op_type in MOE_OPS:  # inputs (x, router logits, fc1 weights, scales, bias, fc2 weights, ...)
            experts, k = dims[inputs[2]][0], attrs["k"]
            per_byte = 8 // attrs.get("expert_weight_bits", 8) if n.op_type == "QMoE" else 1
            fc1, fc2 = dims[inputs[2]], dims[inputs[5] if n.op_type == "QMoE" else inputs[3]]
            macs = k * (fc1[1] * fc1[2] * per_byte + fc2[1] * fc2[2] * per_byte)
            step_bytes = stored * k // experts
            prefill_bytes = stored * (1 - (1 - k / experts) ** prompt_tokens)
        elif n.op_type == "MatMulNBits":
            macs = attrs["K"] * attrs["N"]
        elif n.op_type in ("MatMul", "Gemm") and len(inputs) > 1 and inputs[1] in dims:
            macs = dims[inputs[1]][0] * dims[inputs[1]][1]
        elif n.op_type.startswith("Gather") and inputs[0] in dims:
            step_bytes = stored // dims[inputs[0]][0]
            prefill_bytes = step_bytes * prompt_tokens
        if not (stored or macs):
            continue
        key = f"{n.op_type} ({LM_HEAD})" if n.name == LM_HEAD else \
            f"{n.op_type} (block offsets)" if n.name.endswith(OFFSET_NODES) else n.op_type
        w = out.setdefault(key, {"decode_bytes": 0, "prefill_bytes": 0, "decode_macs": 0, "prefill_macs": 0})
        w["decode_bytes"] += step_bytes
        w["prefill_bytes"] += prefill_bytes
        w["decode_macs"] += macs
        w["prefill_macs"] += macs * rows
    return out


def profile(model_dir: Path, args) -> dict:
    """ONNX Runtime's profile of three prefills of the first --prompts size and of 16 decode steps
    after the first --depths size (`moepass bench --profile`): {"prefill": ..., "decode": ...}."""
    text, _ = timed([sys.executable, "-m", "moepass.cli", "bench", str(model_dir), "--json", "--profile", "--threads",
                     str(args.threads), "--prompt-tokens", str(args.prompts[0]), "--depth", str(args.depths[0]),
                     "--new-tokens", "4", "--repeats", "1"])
    report = json.loads(text)
    return {phase: report[f"{phase}_profile"] for phase in ("prefill", "decode")}


def profile_table(row: dict, args, bandwidth: float) -> None:
    """Each phase by operator type: time, multiply-adds and weight bytes, and the rates they imply
    (GMAC/s; GB/s of the bytes as stored, beside the copy bandwidth); then the executor's share."""
    for phase, where in row["profile"].items():
        work = row["work"]
        unit = (f"a prefill of {args.prompts[0]} tokens" if phase == "prefill"
                else f"a decode step after {args.depths[0]}")
        print(f"\n{row['preset']}: {unit} under ONNX Runtime's profiler, {where['step_ms']:.1f} ms "
              f"({where['runs']} runs; the profiler adds its own cost to each node; copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s)")
        print("| operator | nodes | ms | share | GMAC | GMAC/s | weight MiB read | GB/s |")
        print("|---|---|---|---|---|---|---|---|")
        operators = dict(where["operators"])
        head = where["node_ms"].get(LM_HEAD)
        head_op = next((op for op in operators if f"{op} ({LM_HEAD})" in work), None)
        if head is not None and head_op is not None:  # the LM head apart: it sees one position of a prefill
            v = operators[head_op]
            operators[f"{head_op} ({LM_HEAD})"] = {"ms": head, "nodes": 1}
            operators[head_op] = {"ms": v["ms"] - head, "nodes": v["nodes"] - 1}
        for op, v in sorted(operators.items(), key=lambda kv: -kv[1]["ms"]):
            w = work.get(op, {})
            macs, nbytes = w.get(f"{phase}_macs", 0), w.get(f"{phase}_bytes", 0)
            rate = f"{macs / v['ms'] / 1e6:.0f}" if macs and v["ms"] else ""
            speed = f"{nbytes / v['ms'] / 1e6:.1f}" if nbytes and v["ms"] else ""
            if v["ms"] >= 0.01 * where["step_ms"]:
                print(f"| {op} | {v['nodes']:.0f} | {v['ms']:.2f} | {v['ms'] / where['step_ms']:.1%} | "
                      f"{macs / 1e9:.2f} | {rate} | {nbytes / 2**20:.0f} | {speed} |")
        print(f"| the executor between kernels | | {where['framework_ms']:.2f} | "
              f"{where['framework_ms'] / where['step_ms']:.1%} | | | | |")
        layers = sorted(ms for layer, ms in where["layers"].items() if int(layer) >= 0)
        if layers:
            print(f"layers: {len(layers)}, ms each min / median / max {layers[0]:.2f} / {layers[len(layers) // 2]:.2f}"
                  f" / {layers[-1]:.2f}; outside them (embedding, LM head) {where['layers'].get('-1', 0.0):.2f} ms")


IK_GROUPS = (  # ik_llama.cpp's kernels (perf symbols, in order of precedence) -> what they do
    (re.compile(r"iqk_convert"), "weights converted on the fly (to Q8_0_R8)"),
    (re.compile(r"fa4|Flash|flash"), "attention (flash)"),
    (re.compile(r"mul_mat_qX_q8_Helper<[^>]*?(Q\w+?)_1_Unpacker"), "matrix multiply, {} weights"),
    (re.compile(r"mul_mat_(i?q\w+?)_q8"), "matrix multiply, {} weights"),
    (re.compile(r"mul_mat_Qx_Qy|mul_mat_up_gate|iqk_mul_mat|mul_mat"), "matrix multiply, float or other"),
    (re.compile(r"quantize_row"), "activations quantized"),
    (re.compile(r"rms_norm"), "norms"),
    (re.compile(r"rope"), "rope"),
    (re.compile(r"ggml_barrier"), "threads waiting (barrier)"),
)


def ik_group(symbol: str, kernel: bool) -> str:
    """What one of ik_llama.cpp's perf symbols does (IK_GROUPS; a kernel-mode sample: the system)."""
    if kernel:
        return "operating system (page faults, scheduling)"
    for pattern, what in IK_GROUPS:
        match = pattern.search(symbol)
        if match:
            return what.format(*(g.lower() for g in match.groups()))
    return "other"


def ik_perf(gguf: Path, args, repack: int) -> dict[str, dict[str, float]]:
    """ik_llama.cpp's llama-bench under `perf record` (user and kernel samples of its threads,
    after a 4 s delay that skips the model's load and repacking), one run a phase: a prefill of the
    first --prompts size (-p, 60 repetitions) and decode (-n 128, 10 repetitions); per phase the ms
    a prefill or a step of each kernel group (its share of the samples times llama-bench's own
    time for the phase)."""
    out = {}
    for phase, bench_args in (("prefill", ["-p", str(args.prompts[0]), "-n", "0", "-r", "60"]),
                              ("decode", ["-p", "0", "-n", "128", "-r", "10"])):
        with tempfile.TemporaryDirectory(prefix="moepass-ik-perf-") as tmp:
            data = str(Path(tmp) / "perf.data")
            proc = subprocess.run(["perf", "record", "-F", "1999", "-D", "4000", "-o", data, args.ik_llama_bench,
                                   "-m", str(gguf), "-t", str(args.threads), *bench_args, "-rtr", str(repack),
                                   "-o", "json"], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"perf record of {args.ik_llama_bench} failed:\n{proc.stderr[-2000:]}")
            test = bench_tests(proc.stdout)[0]
            unit_ms = 1e3 / float(test["avg_ts"]) * (args.prompts[0] if phase == "prefill" else 1)
            report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "symbol", "-g", "none",
                                     "--stdio", "--percent-limit", "0.05"], capture_output=True, text=True,
                                    check=True).stdout
        groups: dict[str, float] = {}
        for line in report.splitlines():
            match = re.match(r"\s*([\d.]+)%\s+\[(.)\]\s+(.*\S)", line)
            if match:
                what = ik_group(match[3], match[2] == "k")
                groups[what] = groups.get(what, 0.0) + float(match[1]) / 100 * unit_ms
        out[phase] = {"unit_ms": unit_ms, "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}
    return out


def profile_summary(row: dict) -> None:
    """The two engines side by side, ms a prefill and a step: matrices (every weight matrix), their
    rate in the model's multiply-adds (Q4_K's block offsets not counted), attention, the rest."""
    macs = sum(w["prefill_macs"] for key, w in row["work"].items()
               if key.split(" ")[0] in MATRIX_OPS and "offsets" not in key)
    print(f"\n{row['preset']}: moepass / ik_llama.cpp -rtr 1, ms (each under its profiler)")
    print("| phase | matrices | their GMAC/s | attention | rest | whole |")
    print("|---|---|---|---|---|---|")
    for phase in ("prefill", "decode"):
        ours, theirs = row["profile"][phase], row["ik_profile"][phase]
        ours_m = sum(v["ms"] for op, v in ours["operators"].items() if op in MATRIX_OPS)
        ours_a = sum(v["ms"] for op, v in ours["operators"].items() if op in ATTENTION_OPS)
        groups = theirs["groups"]
        theirs_m = sum(ms for what, ms in groups.items() if what.startswith(("matrix multiply", "weights converted")))
        theirs_a = groups.get("attention (flash)", 0.0)
        rate = f"{macs / ours_m / 1e6:.0f} / {macs / theirs_m / 1e6:.0f}" if phase == "prefill" else ""
        print(f"| {phase} | {ours_m:.1f} / {theirs_m:.1f} | {rate} | {ours_a:.1f} / {theirs_a:.1f} | "
              f"{ours['step_ms'] - ours_m - ours_a:.1f} / {theirs['unit_ms'] - theirs_m - theirs_a:.1f} | "
              f"{ours['step_ms']:.1f} / {theirs['unit_ms']:.1f} |")


def ik_profile_table(row: dict, args) -> None:
    for phase, where in row["ik_profile"].items():
        unit = (f"a prefill of {args.prompts[0]} tokens" if phase == "prefill"
                else "a decode step (from an empty context)")
        print(f"\n{row['preset']}: ik_llama.cpp -rtr 1, {unit} under perf, {where['unit_ms']:.1f} ms")
        print("| kernels | ms | share |")
        print("|---|---|---|")
        for what, ms in where["groups"].items():
            if ms >= 0.005 * where["unit_ms"]:
                print(f"| {what} | {ms:.2f} | {ms / where['unit_ms']:.1%} |")


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
                    help="Also profile a prefill and a decode step: time by operator beside its multiply-adds and "
                         "weight bytes and the rates they imply, the layers' spread, the executor's share; with "
                         "--ik-llama-bench and perf installed, ik_llama.cpp -rtr 1's kernels under perf beside")
    ap.add_argument("--expert-format", default="auto", help="moepass convert --expert-format (default: auto)")
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the generated files here (default: a temp dir).")
    ap.add_argument("--ik-llama-bench", default=None,
                    help="ik_llama.cpp's llama-bench binary: a third side, run without and with -rtr 1 (its "
                         "build: docs/benchmarks.md, Decode)")
    ap.add_argument("--llama-quantize", default=None,
                    help="llama.cpp's (or ik_llama.cpp's) llama-quantize binary: makes the iq4_xs file from the "
                         "q8_0 one (--allow-requantize; its IQ4_XS mix of tensor types)")
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
            gguf = qwen3_sized_gguf(work, preset, args.layers, args.llama_quantize)
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
                         "model_dir": out, "gguf": gguf, "ik_runs": ik_runs, "ik_rss": ik_rss})
        report(rows, args, bandwidth)  # before the profiles: a profile that fails loses no timing
        if args.profile:
            for row in rows:
                row.update(profile=profile(row["model_dir"], args),
                           work=operator_work(row["model_dir"], args.prompts[0]))
                profile_table(row, args, bandwidth)
                if args.ik_llama_bench and shutil.which("perf"):
                    row["ik_profile"] = ik_perf(row["gguf"], args, 1)
                    ik_profile_table(row, args)
                    profile_summary(row)


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
