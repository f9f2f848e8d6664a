"""Fusing an exported ONNX MoE model: time and peak memory against `cp` of the same files, side by side.

    python benchmarks/fuse.py                 # hidden 2048, 8 experts, ffn 2048, 2 layers
    python benchmarks/fuse.py --layers 3 --ffn 1024

It exports a random Hugging Face Qwen3-MoE model of the given sizes with torch.onnx.export (weights
as external data), quantizes a copy with ONNX Runtime's MatMulNBits quantizer (4 bits, block 32;
saved with external data too, as models of real size are),
then for each alternates `cp -r` of the model's folder and `moepass convert MODEL.onnx` (each in
its own process, best of --repeats) and prints the input size, GB/s, peak RSS and the ratios.
Target: peak RSS well under the model's size (weights are read lazily and written expert by expert).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from convert import best, measure  # noqa: E402  (same timing and peak-RSS measurement)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)  # deeper random HF models starve experts
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import onnx

    import make_onnx_fixtures

    moepass = [sys.executable, "-m", "moepass.cli"]
    with tempfile.TemporaryDirectory(prefix="moepass-fuse-bench-") as tmp:
        work = Path(tmp)
        exported = work / "float"
        exported.mkdir()
        for seed in range(8):  # a random router at initialization can starve an expert: try another seed
            try:
                raw = make_onnx_fixtures.export_hf_moe(work / "raw.onnx", "qwen3moe", seed, layers=args.layers,
                                                       hidden=args.hidden, experts=args.experts, ffn=args.ffn,
                                                       example_length=32 * args.experts)
                break
            except RuntimeError as why:
                print(f"seed {seed}: {why}", file=sys.stderr)
        else:
            raise SystemExit("no seed gave an example input that reaches every expert")
        onnx.save(onnx.load(str(raw)), str(exported / "model.onnx"), save_as_external_data=True,
                  location="model.onnx.data", size_threshold=1024)
        quantized = work / "q4"
        quantized.mkdir()
        make_onnx_fixtures.quantize_matmul_nbits(exported / "model.onnx", work / "q4.onnx")
        onnx.save(onnx.load(str(work / "q4.onnx")), str(quantized / "model.onnx"), save_as_external_data=True,
                  location="model.onnx.data", size_threshold=1024)
        rows = []
        for label, folder in (("float experts -> MoE", exported), ("MatMulNBits int4 -> QMoE", quantized)):
            size = folder_bytes(folder)
            cp_runs, fuse_runs = [], []
            for _ in range(args.repeats):
                target = work / "copy"
                cp_runs.append(measure(["cp", "-r", str(folder), str(target)]))
                shutil.rmtree(target)
                out = work / "out"
                fuse_runs.append(measure([*moepass, "convert", str(folder / "model.onnx"), "-o", str(out), "--quiet"]))
                shutil.rmtree(out)
            cp, fuse = best(cp_runs), best(fuse_runs)
            check = subprocess.run([*moepass, "inspect", str(folder / "model.onnx"), "--json"], capture_output=True,
                                   text=True, check=True)
            candidates = __import__("json").loads(check.stdout)["fusion_candidates"]
            if not candidates or not all(c["fused"] for c in candidates):
                raise SystemExit(f"{label}: not every MoE layer fuses: {candidates}")
            rows.append((label, size, cp, fuse))
    print(f"machine: {platform.node()} {platform.machine()}, {platform.python_version()}; "
          f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts, ffn {args.ffn}")
    print(f"{'input':<26}{'bytes':>14}{'cp GB/s':>9}{'fuse GB/s':>11}{'speed vs cp':>13}{'cp RSS':>9}{'fuse RSS':>10}")
    for label, size, cp, fuse in rows:
        print(f"{label:<26}{size:>14,}{size / cp.seconds / 1e9:>9.2f}{size / fuse.seconds / 1e9:>11.2f}"
              f"{cp.seconds / fuse.seconds:>12.2f}x{cp.peak_rss / 2**20:>8.0f}M{fuse.peak_rss / 2**20:>9.0f}M")


if __name__ == "__main__":
    main()
