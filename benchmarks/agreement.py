"""Argmax agreement over a long sequence: the converted model, llama.cpp and an exact forward.

    python benchmarks/agreement.py                   # every expert type, 200 positions
    python benchmarks/agreement.py --types Q4_K,Q6_K --positions 400
    python benchmarks/agreement.py --trained         # a trained model, llama.cpp's own quantizer
    python benchmarks/agreement.py --trained --expert-formats int4,int8   # what auto decides from

--trained: the small qwen3moe of fixtures/train_fixture.py (trained on a synthetic language, so its
logits are decisive), quantized by llama.cpp's quantizer (llama_model_quantize) into each file type,
converted by moepass; the positions are a sample of that language. "Exact" is llama.cpp on the F32
dequantization of the quantized file (the same weights, no 8-bit activations). The very-low-bit
types (IQ3_XXS, IQ2_*, IQ1_*), which llama.cpp's quantizer refuses without an importance matrix, get
one gathered from the trained model's activations on the language.

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
from moepass.core.quants import QUANT_TYPES  # noqa: E402
from moepass.runtime import load  # noqa: E402


TRAINED_FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q5_1", "Q4_K_M", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS",
                      "Q3_K_M", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "MXFP4_MOE")


def trained(args: argparse.Namespace) -> None:
    """The trained model through llama.cpp's quantizer into every file type, converted with each of
    --expert-formats; per file type and form: argmax agreement with llama.cpp and with the exact
    computation, and the distance from exact against llama.cpp's own (the criteria --expert-format
    auto decides by: >= 99 % agreement with llama.cpp and at most 2x its distance from exact)."""
    import train_fixture
    from gguf import GGUFReader
    from oracle import dequantized_copy, llama_quantize

    print(f"date {time.strftime('%Y-%m-%d')}, {args.positions} positions of the synthetic language, trained "
          f"qwen3moe ({train_fixture.DIMS.n_layers} layers, hidden {train_fixture.DIMS.hidden}, "
          f"{train_fixture.DIMS.n_experts} experts), quantized by llama.cpp; default activations (int8)")
    print("| llama.cpp file type | expert types | --expert-format | QMoE form | ONNX = llama.cpp | ONNX = exact | "
          "llama.cpp = exact | max abs diff from exact: ONNX / llama.cpp | passes |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source, imatrix = train_fixture.train(work / "trained-f32.gguf", args.steps, echo=lambda line: None)
        successors = train_fixture.markov_chain(len(train_fixture.make_fixtures.tokenizer_vocab()[0]))
        ids = train_fixture.sample(successors, args.positions, np.random.default_rng(7)).tolist()
        types = ("F32", *TRAINED_FILE_TYPES) if args.file_types is None else args.file_types.split(",")
        for file_type in types:
            path = source if file_type == "F32" else work / f"{file_type}.gguf"
            if file_type != "F32" and not llama_quantize(source, path, file_type, imatrix):
                print(f"| {file_type} | llama.cpp refused | | | | | | | |", flush=True)
                continue
            experts = sorted({t.tensor_type.name for t in GGUFReader(path).tensors if "_exps" in t.name})
            llama_all = llama_logits(path, ids)
            exact_all = llama_logits(dequantized_copy(path, work / f"{file_type}-exact.gguf"), ids)
            llama, exact = llama_all.argmax(-1), exact_all.argmax(-1)
            their_distance = float(np.abs(llama_all - exact_all).max())
            for fmt in args.expert_formats.split(","):
                result = convert(path, work / f"{file_type}-{fmt}-onnx", expert_format=fmt, overwrite=True,
                                 echo=lambda line: None)
                decoder = load(result.output_dir)
                ours_logits = decoder.forward(np.array([ids]), decoder.empty_cache())[0][0]
                ours = ours_logits.argmax(-1)
                our_distance = float(np.abs(ours_logits - exact_all).max())
                agree = float(np.mean(ours == llama))
                passes = agree >= 0.99 and our_distance <= 2 * their_distance + 0.01 * float(exact_all.std())
                forms = ",".join(sorted({m["form"] for m in result.moe_layers}))
                share = lambda a, b: f"{np.mean(a == b) * 100:.1f} %"  # noqa: E731
                print(f"| {file_type} | {', '.join(experts)} | {fmt} | {forms} | {share(ours, llama)} | "
                      f"{share(ours, exact)} | {share(llama, exact)} | {our_distance:.3f} / {their_distance:.3f} | "
                      f"{'yes' if passes else 'no'} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(t.name for t, qt in QUANT_TYPES.items() if qt.storage != "float"))
    ap.add_argument("--positions", type=int, default=200)
    ap.add_argument("--trained", action="store_true", help="a trained model quantized by llama.cpp (see above)")
    ap.add_argument("--steps", type=int, default=400, help="training steps for --trained")
    ap.add_argument("--expert-formats", default="auto", help="--trained: the --expert-format values to compare")
    ap.add_argument("--file-types", default=None, help="--trained: llama.cpp file types (default: all)")
    args = ap.parse_args()
    if args.trained:
        trained(args)
        return
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
