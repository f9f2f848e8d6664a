"""Argmax agreement over a long sequence: the converted model, llama.cpp and an exact float64 forward.

    python benchmarks/agreement.py                   # every expert type, 200 positions
    python benchmarks/agreement.py --types Q4_K,Q6_K --positions 400

For each GGUF expert type: the qwen3moe test fixture (other matrices Q8_0) with experts of that type,
converted by moepass; one prefill of --positions random token ids (fixed seed) through ONNX Runtime
(the converted model), llama.cpp (llama-cpp-python, F32 KV cache) and the independent float64 numpy
forward of tests/reference_forward.py on the same GGUF. The table gives, per pair, the share of
positions with the same argmax. On random fixtures the top-2 logits are often close; where they are,
llama.cpp's quantized activations and ONNX Runtime's arithmetic can fall either way, and the exact
forward says which of them kept the GGUF's own answer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))

import make_fixtures  # noqa: E402
from gguf import GGMLQuantizationType as GT  # noqa: E402
from oracle import llama_logits  # noqa: E402
from reference_forward import Qwen3MoeReference  # noqa: E402

from moepass.convert import convert  # noqa: E402
from moepass.quants import QUANT_TYPES  # noqa: E402
from moepass.runtime import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(t.name for t, qt in QUANT_TYPES.items() if qt.storage != "float"))
    ap.add_argument("--positions", type=int, default=200)
    args = ap.parse_args()
    print(f"date {time.strftime('%Y-%m-%d')}, {args.positions} positions, qwen3moe fixture, other matrices Q8_0")
    print("| expert type | exact repack | ONNX = llama.cpp | ONNX = float64 | llama.cpp = float64 |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.types.split(","):
            ggml_type = GT[name]
            kwargs = {"types": {"gate_up": ggml_type, "down": ggml_type}}
            path = make_fixtures.write_moe_gguf(Path(tmp) / f"{name}.gguf", "q8_0", **kwargs)
            result = convert(path, Path(tmp) / f"{name}-onnx")
            reference = Qwen3MoeReference(path)
            vocab = reference.w["token_embd.weight"].shape[0]
            ids = np.random.default_rng(7).integers(0, vocab, args.positions).tolist()
            decoder = load(result.output_dir)
            ours = decoder.forward(np.array([ids]), decoder.empty_cache())[0][0].argmax(-1)
            llama = llama_logits(path, ids).argmax(-1)
            exact = reference.logits(np.array(ids)).argmax(-1)
            repacked = "yes" if QUANT_TYPES[ggml_type].exact_forms() else "no"
            share = lambda a, b: f"{np.mean(a == b) * 100:.1f} %"  # noqa: E731
            print(f"| {name} | {repacked} | {share(ours, llama)} | {share(ours, exact)} | {share(llama, exact)} |",
                  flush=True)


if __name__ == "__main__":
    main()
