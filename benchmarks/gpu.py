"""Hybrid CPU/GPU placement on a CUDA machine: per-layer (and, with the plugin EP, per-expert) plans
at three budgets, checked against the CPU and timed.

    python benchmarks/gpu.py                          # 8 layers, budgets 25 / 50 / 100 % of the experts
    python benchmarks/gpu.py --layers 8 --new-tokens 64 --cuda-plugin /path/libonnxruntime_cuda_plugin.so

The file: Qwen3-30B-A3B layer sizes (hidden 2048, 128 experts, top-8, expert ffn 768, 32 q / 4 kv
heads x 128, 151,936-token vocabulary), --layers layers, Q4_0 (fixtures/make_fixtures.py, fixed
seed), converted with --expert-format offload (int4 block 32 prepacked, float16 graph: what both
targets need on the GPU). Budgets: the non-expert weights, KV cache and buffers, plus 25 %, 50 %
and 100 % of the expert bytes. For each target and budget: partition, load with device="cuda",
check that ONNX Runtime put each MoE layer where the plan says (its graph assignment record),
that greedy tokens equal the CPU run's and logits stay within float16 rounding of it, and measure
prefill of --prompt-tokens and decode of --new-tokens (best of --repeats). llama.cpp with
--n-cpu-moe at the same split runs too when the installed llama-cpp-python was built with CUDA.

Refuses with one line and exit status 2 where ONNX Runtime has no CUDA EP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

BUDGET_SHARES = (0.25, 0.5, 1.0)


def refuse(message: str) -> None:
    print(f"benchmarks/gpu.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def greedy_run(decoder, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens, and the logits of the prompt's last position (a forward without the cache binding)."""
    from moepass.runtime import Sampling

    tokens = list(decoder.generate(prompt, new_tokens, stop_ids=(), sampling=Sampling()))
    logits, _ = decoder.forward(np.array([prompt]), decoder.empty_cache())
    return tokens, logits[0, -1].astype(np.float32)


def llama_cpp_row(gguf: Path, n_cpu_layers: int, args) -> dict | None:
    """llama.cpp with the experts of the first n_cpu_layers layers on the CPU, if it has CUDA here."""
    try:
        import llama_cpp
    except ImportError:
        return None
    if not llama_cpp.llama_supports_gpu_offload():
        return None
    overrides = ",".join(f"blk\\.{i}\\.ffn_(up|down|gate)_exps=CPU" for i in range(n_cpu_layers))
    try:
        llm = llama_cpp.Llama(str(gguf), n_gpu_layers=-1, n_ctx=args.prompt_tokens + args.new_tokens + 8,
                              verbose=False, **({"override_tensor": overrides} if overrides else {}))
    except TypeError:  # a llama-cpp-python without tensor overrides
        return None
    prompt = np.random.default_rng(0).integers(0, llm.n_vocab(), size=args.prompt_tokens).tolist()
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(args.new_tokens):
        llm.eval([0])
    decode = time.perf_counter() - t
    return {"prefill_tokens_per_s": args.prompt_tokens / prefill, "decode_tokens_per_s": args.new_tokens / decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-plugin", default=None, help="CUDA plugin EP library: also measure --target offload")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        refuse(f"ONNX Runtime {ort.__version__} here has no CUDA EP ({', '.join(ort.get_available_providers())}); "
               "this benchmark needs onnxruntime-gpu on a CUDA machine")

    import make_fixtures
    from moepass.convert import convert
    from moepass.core.model_io import load_model
    from moepass.partition import partition
    from moepass.pipeline.placement import MemoryModel
    from moepass.runtime import load
    from moepass.runtime.bench import measure

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="moepass-gpu-"))
    gguf = workdir / f"qwen3-30b-layers{args.layers}-q4_0.gguf"
    if not gguf.exists():
        make_fixtures.write_moe_gguf(gguf, "q4_0", dataclasses.replace(make_fixtures.QWEN3_30B_DIMS,
                                                                       n_layers=args.layers))
    model = workdir / "converted"
    if not model.exists():
        convert(gguf, model, expert_format="offload")
    memory = MemoryModel.of(load_model(model))
    context = args.prompt_tokens + args.new_tokens + 8
    fixed = memory.non_expert_bytes + memory.kv_bytes(context, 1) + memory.work_bytes(context, 1, 512)
    prompt = np.random.default_rng(0).integers(0, memory.dims["vocab"], size=args.prompt_tokens).tolist()
    cpu_tokens, cpu_logits = greedy_run(load(model, device="cpu"), prompt, 16)

    targets = ["layers"] + (["offload"] if args.cuda_plugin else [])
    rows = []
    for target in targets:
        for share in BUDGET_SHARES:
            vram = fixed + int(share * memory.expert_bytes) + (1 << 20)
            out = workdir / f"{target}-{int(share * 100)}"
            result = partition(model, out, vram, reserve=0, context=context, target=target, overwrite=True,
                               cuda_plugin=args.cuda_plugin)
            decoder = load(out, device="cuda", cuda_plugin=args.cuda_plugin, mode="required")
            tokens, logits = greedy_run(decoder, prompt, 16)
            speed = measure(decoder, args.prompt_tokens, args.new_tokens, args.repeats)
            on_gpu = sum(1 for n in result.plan.nodes if n.device == "gpu")
            row = {"target": target, "budget_share": share, "vram_bytes": vram,
                   "moe_layers_on_gpu": on_gpu, "moe_layers": len(result.plan.nodes),
                   "placement": decoder.moe_placement, "tokens_equal_cpu": tokens == cpu_tokens,
                   "max_abs_logit_difference": float(np.abs(logits - cpu_logits).max()),
                   "prefill_tokens_per_s": speed["prefill_tokens_per_s"],
                   "decode_tokens_per_s": speed["decode_tokens_per_s"]}
            if target == "layers":
                row["llama_cpp_n_cpu_moe"] = llama_cpp_row(gguf, len(result.plan.nodes) - on_gpu, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, ONNX Runtime {ort.__version__}")
    print("| target | budget (share of experts) | MoE layers on GPU | tokens = CPU | max |logit diff| | "
          "prefill tok/s | decode tok/s | llama.cpp --n-cpu-moe decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        theirs = r.get("llama_cpp_n_cpu_moe")
        print(f"| {r['target']} | {r['budget_share']:.0%} | {r['moe_layers_on_gpu']}/{r['moe_layers']} | "
              f"{r['tokens_equal_cpu']} | {r['max_abs_logit_difference']:.3g} | {r['prefill_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s']:.1f} | {theirs['decode_tokens_per_s']:.1f} |" if theirs else
              f"| {r['target']} | {r['budget_share']:.0%} | {r['moe_layers_on_gpu']}/{r['moe_layers']} | "
              f"{r['tokens_equal_cpu']} | {r['max_abs_logit_difference']:.3g} | {r['prefill_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s']:.1f} | (no CUDA llama.cpp) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
