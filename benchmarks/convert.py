"""Conversion throughput and peak memory against `cp` of the same file, measured side by side.

    python benchmarks/convert.py                       # Q8_0, Q4_0, Q4_K_M and Q6_K, Qwen3-30B-A3B layer sizes, >= 1 GB each
    python benchmarks/convert.py --preset q4_0 --layers 6
    python benchmarks/convert.py --preset q4_k_m --marginal   # also at twice the layers: the rate per further GB
    python benchmarks/convert.py --preset q4_k_m --expert-format int4   # the 4-bit requantizer's search

For each preset it generates a GGUF with Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts,
top-8, expert ffn 768; fewer layers), warms the page cache, then alternates `cp FILE` and
`moepass convert FILE` (each in its own process, best of --repeats; `dd bs=8M` as well, a copy
through user space as the converter's own I/O is), and prints GB/s of GGUF bytes, peak RSS of
each process (from wait4), and the speed ratios. q4_k_m is llama.cpp's Q4_K_M layer rule (Q4_K
requantized into int8 experts, Q6_K output); q6_k is K-quant throughout.

A whole process includes a fixed cost that a real model's size dwarfs: Python start-up and
imports, the GGUF's metadata and the 151,936-token vocabulary, the tokenizer (about 2 s here).
`--marginal` converts a second file with twice the layers and reports the rate of the extra
bytes, (bytes2 - bytes1) / (time2 - time1): what each further GB of an 18.6 GB file costs.
Targets: >= 0.5x the speed of cp for exact repacks, >= 0.3 GB/s for requantizing ones; peak RSS
under 1 GB whatever the model size.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Layers per preset that give a file of at least 1 GB at Qwen3-30B-A3B sizes.
DEFAULT_LAYERS = {"q8_0": 2, "q4_0": 3, "q4_k_m": 3, "q6_k": 2}


@dataclasses.dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes


def measure(cmd: list[str]) -> Run:
    """Run cmd in its own process; wall time and that process's peak RSS, as GNU time reports them.

    Dirty pages are flushed first, so every command starts from the same writeback state (on this
    kind of VM a command that starts behind another's 1 GB of dirty pages runs several times
    slower). GNU time measures its own child, so this process's memory never shows in the peak.
    """
    os.sync()
    with tempfile.NamedTemporaryFile("r") as report:
        proc = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%e %M", *cmd],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr}")
        seconds, kib = report.read().split()[-2:]
    return Run(float(seconds), int(kib) * 1024)


def best(runs: list[Run]) -> Run:
    return Run(min(r.seconds for r in runs), max(r.peak_rss for r in runs))


def bench_preset(preset: str, layers: int, repeats: int, workdir: Path, convert_args: list[str]) -> dict:
    src = workdir / f"qwen3moe-30b-sizes-{preset}-{layers}l.gguf"
    t0 = time.perf_counter()
    # In a child process: the generator holds the whole model in memory, and a big parent would
    # inflate the peak RSS that wait4 reports for the measured children (forked before exec).
    subprocess.run([sys.executable, "-c", "import sys, dataclasses; sys.path.insert(0, sys.argv[1]); import make_fixtures as m; "
                    "m.write_moe_gguf(sys.argv[2], sys.argv[3], dataclasses.replace(m.QWEN3_30B_DIMS, "
                    "n_layers=int(sys.argv[4])), seed=0)", str(ROOT / "fixtures"), str(src), preset, str(layers)],
                   check=True)
    print(f"[{preset}] generated {src.name}: {src.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s",
          flush=True)
    with open(src, "rb") as f:  # warm the page cache so both sides read from memory
        while f.read(64 << 20):
            pass
    size = src.stat().st_size
    cp_runs, dd_runs, cv_runs = [], [], []
    dst, out = workdir / "copy.gguf", workdir / "out"
    for i in range(repeats):
        cp_runs.append(measure(["cp", str(src), str(dst)]))
        dst.unlink()
        dd_runs.append(measure(["dd", f"if={src}", f"of={dst}", "bs=8M", "status=none"]))
        dst.unlink()
        cv_runs.append(measure([sys.executable, "-m", "moepass.cli", "convert", str(src), "-o", str(out), "-q",
                                *convert_args]))
        out_bytes = sum(p.stat().st_size for p in out.iterdir())
        shutil.rmtree(out)
        print(f"[{preset}] run {i + 1}: cp {cp_runs[-1].seconds:.2f} s, dd {dd_runs[-1].seconds:.2f} s, "
              f"convert {cv_runs[-1].seconds:.2f} s (peak RSS {cv_runs[-1].peak_rss / 2**20:.0f} MiB)", flush=True)
    src.unlink()
    cp, dd, cv = best(cp_runs), best(dd_runs), best(cv_runs)
    return {"preset": preset, "layers": layers, "gguf_bytes": size, "onnx_bytes": out_bytes,
            "cp_gbps": size / cp.seconds / 1e9, "dd_gbps": size / dd.seconds / 1e9,
            "convert_gbps": size / cv.seconds / 1e9, "ratio": cp.seconds / cv.seconds,
            "dd_ratio": dd.seconds / cv.seconds, "cp_rss": cp.peak_rss, "convert_rss": cv.peak_rss,
            "convert_s": cv.seconds, "cp_s": cp.seconds, "dd_s": dd.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(DEFAULT_LAYERS), help="repeatable; default: all")
    ap.add_argument("--layers", type=int, default=None, help="layers of the generated model (default: >= 1 GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="where to put the generated files (default: a temp dir)")
    ap.add_argument("--marginal", action="store_true", help="also convert twice the layers: the rate of the extra bytes")
    ap.add_argument("--expert-format", default=None, help="passed to convert (default: convert's own choice)")
    args = ap.parse_args()
    convert_args = ["--expert-format", args.expert_format] if args.expert_format else []
    workdir = Path(tempfile.mkdtemp(prefix="moepass-bench-", dir=args.workdir))
    rows, marginal = [], []
    try:
        for preset in args.preset or sorted(DEFAULT_LAYERS):
            layers = args.layers or DEFAULT_LAYERS[preset]
            rows.append(bench_preset(preset, layers, args.repeats, workdir, convert_args))
            if args.marginal:
                rows.append(bench_preset(preset, 2 * layers, args.repeats, workdir, convert_args))
                small, large = rows[-2:]
                marginal.append((preset, small, large, (large["gguf_bytes"] - small["gguf_bytes"])
                                 / (large["convert_s"] - small["convert_s"]) / 1e9))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"date {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}" + (f", convert {' '.join(convert_args)}" if convert_args else ""))
    print("| preset | layers | GGUF | cp | dd bs=8M | moepass convert | convert / cp | convert / dd | "
          "peak RSS cp | peak RSS convert |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['layers']} | {r['gguf_bytes'] / 1e9:.2f} GB | {r['cp_gbps']:.2f} GB/s "
              f"({r['cp_s']:.2f} s) | {r['dd_gbps']:.2f} GB/s ({r['dd_s']:.2f} s) | {r['convert_gbps']:.2f} GB/s "
              f"({r['convert_s']:.2f} s) | {r['ratio']:.2f}x | {r['dd_ratio']:.2f}x | "
              f"{r['cp_rss'] / 2**20:.1f} MiB | {r['convert_rss'] / 2**20:.0f} MiB |")
    if marginal:
        print()
        print("| preset | layers | GGUF | convert | rate of the extra bytes |")
        print("|---|---|---|---|---|")
        for preset, small, large, rate in marginal:
            print(f"| {preset} | {small['layers']} -> {large['layers']} | {small['gguf_bytes'] / 1e9:.2f} -> "
                  f"{large['gguf_bytes'] / 1e9:.2f} GB | {small['convert_s']:.2f} -> {large['convert_s']:.2f} s | "
                  f"{rate:.2f} GB/s |")


if __name__ == "__main__":
    main()
