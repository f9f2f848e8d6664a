"""Requantization throughput beside the gguf package's plain dequantization of the same tensors.

    python benchmarks/requantize.py [--types Q4_K,Q5_K,Q2_K,IQ4_XS] [--experts 32]

K-quant (and other non-exact) expert tensors of Qwen3-30B-A3B's shape ([E, 768, 2048], fewer
experts), random valid blocks (fixed seed). Both sides work in 8 MiB chunks on 2 threads, as convert
does: "dequantize" runs the gguf package's dequantizer; "requantize" runs moepass's pack into the
type's default requantized form (quants.requantized_form: the compiled dequantizer, then the
compiled quantizer, codes and scales written). MB/s of GGUF bytes, best of 3. Target: requantizing
costs at most 2x dequantizing with gguf.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

import make_fixtures  # noqa: E402
from moepass.core.quants import QUANT_TYPES, pack, requantized_form  # noqa: E402

CHUNK = 8 << 20


def chunks(raw: np.ndarray) -> list[np.ndarray]:
    rows = max(1, CHUNK // raw.shape[-1])
    return [raw[i:i + rows] for i in range(0, len(raw), rows)]


def best(fn, parts, repeats=3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(fn, parts))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_K,Q2_K,Q3_K,IQ3_XXS,IQ2_XXS")
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"date {time.strftime('%Y-%m-%d')}, tensors [{args.experts}, 768, 2048], 2 threads, 8 MiB chunks")
    print("| type | GGUF MB | dequantize (gguf) | requantize (moepass) | into | cost ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.types.split(","):
        ggml_type = GT[name]
        raw = make_fixtures._tensor_data(rng, (args.experts * 768, 2048), ggml_type, 0.05)[0]
        parts = chunks(raw)
        mb = raw.nbytes / 1e6
        t_deq = best(lambda p: dequantize(p, ggml_type), parts)
        qt = QUANT_TYPES[ggml_type]
        form = requantized_form([qt], [2048])
        t_req = best(lambda p: pack(p, qt, form), parts)
        print(f"| {name} | {mb:.0f} | {mb / t_deq:.0f} MB/s | {mb / t_req:.0f} MB/s | {form} | {t_req / t_deq:.2f}x |")


if __name__ == "__main__":
    main()
