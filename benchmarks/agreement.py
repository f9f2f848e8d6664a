"""Quantization quality as llama.cpp users measure it: KL divergence from the unquantized model.

    python benchmarks/agreement.py                                   # both trained models, every file type
    python benchmarks/agreement.py --models text --file-types Q4_K_M,Q6_K --expert-formats auto,int4
    python benchmarks/agreement.py --random                          # argmax agreement on random fixtures

For each trained model and each llama.cpp file type: the unquantized (F32) model is quantized by
llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, with an importance matrix
gathered from the model's activations, which llama.cpp needs for its lowest-bit types); llama.cpp
runs the quantized file, and moepass converts it (with each of --expert-formats) and ONNX Runtime
runs the result, on the same held-out token windows. Against the F32 model's next-token
distribution (llama.cpp on the F32 file, F32 KV cache), as `llama-perplexity --kl-divergence`
reports it: mean and 99th-percentile KLD, "same top" (the share of positions whose most likely
token is the F32 model's), and perplexity of the windows' own next tokens. "ratio" is moepass's
mean KLD over llama.cpp's on the same file, with a 90 % paired bootstrap interval over windows.
"passes": ratio <= 1.1 and same top at least llama.cpp's minus 0.5 points, the bound the defaults
are held to (tests/test_trained_agreement.py).

The models:
- markov: fixtures/train_fixture.py, a small qwen3moe trained on a synthetic Markov language,
  written as GGUF by moepass's fixture writer (8 windows of 128 tokens sampled from the language);
- text: fixtures/hf_fixture.py, a Hugging Face Qwen3-MoE of other shapes trained briefly on English
  prose, written as GGUF by llama.cpp's own convert_hf_to_gguf.py (16 held-out windows of 128).

--random: the qwen3moe test fixture with experts of each type (other matrices Q8_0), random
weights; the share of 200 positions where ONNX Runtime (the converted model), llama.cpp and an
independent float64 numpy forward (tests/support/reference_forward.py) rank the same token first.
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

import cpu_family  # noqa: E402
import make_fixtures  # noqa: E402
from gguf import GGMLQuantizationType as GT, GGUFReader  # noqa: E402
from support.oracle import (kld_ratio, llama_logits, llama_quantize, llama_window_logits,  # noqa: E402
                            moepass_window_logits, next_token_quality)
from support.reference_forward import Qwen3MoeReference  # noqa: E402

from moepass.convert import convert  # noqa: E402
from moepass.core.quants import QUANT_TYPES  # noqa: E402
from moepass.runtime import load  # noqa: E402

FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS",
              "MXFP4_MOE", "Q3_K_M", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
RATIO_BOUND, TOP_MARGIN = 1.1, 0.005


def trained_models(names: list[str], work: Path) -> dict[str, tuple[Path, dict[str, np.ndarray], list[list[int]]]]:
    """name -> (F32 GGUF, importance matrix, token windows) of the trained models asked for."""
    import hf_fixture
    import train_fixture

    models = {}
    if "markov" in names:
        path = work / "markov-f32.gguf"
        if path.exists() and path.with_suffix(".imatrix.npz").exists():  # a --cache from an earlier run
            with np.load(path.with_suffix(".imatrix.npz")) as saved:
                imatrix = dict(saved)
        else:
            path, imatrix = train_fixture.train(path, echo=lambda line: None)
        models["markov"] = path, imatrix, train_fixture.heldout_windows()
    if "text" in names:
        models["text"] = hf_fixture.build(work / "text", "qwen3moe", echo=lambda line: None)
    return models


def kld_tables(args: argparse.Namespace) -> None:
    print(f"date {time.strftime('%Y-%m-%d')}; {cpu_family.describe()}")
    print("| model | file type | expert types | llama.cpp: mean KLD / 99 % / same top / PPL | --expert-format | "
          "QMoE form | moepass: mean KLD / 99 % / same top / PPL | KLD ratio [90 %] | ONNX / GGUF bytes | passes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = args.cache or work
        for model, (source, imatrix, windows) in trained_models(args.models.split(","), cache).items():
            reference = llama_window_logits(source, windows)
            imatrix_file = make_fixtures.write_imatrix_dat(work / f"{model}.imatrix.dat", imatrix)
            for file_type in args.file_types.split(","):
                path = work / f"{model}-{file_type}.gguf"
                if not llama_quantize(source, path, file_type, imatrix):
                    print(f"| {model} | {file_type} | llama.cpp refused | | | | | | | |", flush=True)
                    continue
                experts = sorted({t.tensor_type.name for t in GGUFReader(path).tensors if "_exps" in t.name})
                theirs = llama_window_logits(path, windows)
                their_quality = next_token_quality(reference, theirs, windows)
                for fmt in args.expert_formats.split(","):
                    expert_format, _, extra = fmt.partition("+")  # "int4+imatrix": with the model's imatrix
                    result = convert(path, work / f"{model}-{file_type}-{fmt}", expert_format=expert_format,
                                     imatrix=imatrix_file if extra == "imatrix" else None, overwrite=True,
                                     echo=lambda line: None)
                    ours = moepass_window_logits(result.output_dir, windows)
                    quality = next_token_quality(reference, ours, windows)
                    ratio, low, high = kld_ratio(reference, ours, theirs)
                    passes = ratio <= RATIO_BOUND and quality.top1 >= their_quality.top1 - TOP_MARGIN
                    forms = ", ".join(sorted({m["form"] for m in result.moe_layers}))
                    print(f"| {model} | {file_type} | {', '.join(experts)} | {_cells(their_quality)} | {fmt} | {forms} | "
                          f"{_cells(quality)} | {ratio:.3f} [{low:.3f}, {high:.3f}] | "
                          f"{result.output_bytes / path.stat().st_size:.2f} | {'yes' if passes else 'no'} |", flush=True)


def _cells(q) -> str:
    return f"{q.mean_kld:.2e} / {q.p99_kld:.2e} / {q.top1:.1%} / {q.perplexity:.3f}"


def random_fixtures(args: argparse.Namespace) -> None:
    print(f"date {time.strftime('%Y-%m-%d')}, {args.positions} positions, qwen3moe fixture, other matrices Q8_0; "
          f"{cpu_family.describe()}")
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
            experts = [r for r in result.weights if ".ffn_experts." in r["onnx_name"]]
            repacked = "yes" if experts and all(all(r["exact"]) for r in experts) else "no"
            share = lambda a, b: f"{np.mean(a == b) * 100:.1f} %"  # noqa: E731
            print(f"| {name} | {repacked} | {share(ours, llama)} | {share(ours, exact)} | {share(llama, exact)} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="markov,text", help="trained models: markov, text")
    ap.add_argument("--file-types", default=",".join(FILE_TYPES), help="llama.cpp file types")
    ap.add_argument("--expert-formats", default="auto",
                    help="the --expert-format values to convert with; FORMAT+imatrix converts with the importance "
                         "matrix llama.cpp's quantizer used (as published beside quantized models)")
    ap.add_argument("--cache", type=Path, help="where the trained models are kept between runs (default: made anew)")
    ap.add_argument("--random", action="store_true", help="argmax agreement on the random fixtures instead")
    ap.add_argument("--types", default=",".join(t.name for t, qt in QUANT_TYPES.items() if qt.storage != "float"),
                    help="--random: expert types")
    ap.add_argument("--positions", type=int, default=200, help="--random: positions")
    args = ap.parse_args()
    random_fixtures(args) if args.random else kld_tables(args)


if __name__ == "__main__":
    main()
