"""partition's CPU-side decode estimate against `moepass bench` on the same model and machine.

    python benchmarks/estimate.py                      # 2, 6 and 24 layers of Qwen3-30B-A3B's sizes, Q4_0
    python benchmarks/estimate.py --layers 2,6 --preset q4_k_m

For each size: a file of Qwen3-30B-A3B's layer sizes and vocabulary (fixtures/make_fixtures.py,
fixed seed), converted with the defaults; `moepass partition` times pieces of it on this CPU
(moepass.runtime.calibrate: one MoE layer of each form, the LM head's read rate) and predicts a
decode step with every layer on the CPU (plan.json `prediction.decode_ms_per_token.cpu_only`);
`moepass bench` then measures decode after 128 prompt tokens (best of 3). Same thread count.
Files are written to --work and removed after each size. 48 layers (17.4 GB in Q4_0) need more
than 24 GiB of memory to bench: the 2-core machine of docs/benchmarks.md stops at 24.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

import make_fixtures  # noqa: E402

from moepass.core.formats import read_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,6,24")
    ap.add_argument("--preset", default="q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT)
    args = ap.parse_args()
    moepass = [sys.executable, "-m", "moepass.cli"]
    print(f"{'layers':>6} {'estimate ms':>12} {'(MoE + rest)':>16} {'bench ms':>9} {'estimate/bench':>15}")
    for n in (int(x) for x in args.layers.split(",")):
        with tempfile.TemporaryDirectory(dir=args.work) as scratch:
            work = Path(scratch)
            dims = dataclasses.replace(make_fixtures.QWEN3_30B_DIMS, n_layers=n)
            gguf = make_fixtures.write_moe_gguf(work / "m.gguf", args.preset, dims=dims)
            subprocess.run([*moepass, "convert", str(gguf), "-o", str(work / "out"), "-q", "-t", str(args.threads)],
                           check=True, cwd=work, stdout=subprocess.DEVNULL)
            gguf.unlink()  # the disk holds one copy at a time
            subprocess.run([*moepass, "partition", str(work / "out"), "--vram", "8G", "--target", "layers", "-o",
                            str(work / "placed"), "-q", "-t", str(args.threads), "--ignore-kernel-table"],
                           check=True, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            plan = read_plan(work / "placed")
            shutil.rmtree(work / "placed")
            estimate, cpu = plan.prediction.decode_ms_per_token.cpu_only, plan.prediction.cpu
            assert estimate is not None and cpu is not None, "partition did not time the CPU"
            bench = json.loads(subprocess.run([*moepass, "bench", str(work / "out"), "--json", "-t", str(args.threads),
                                               "--device", "cpu"], check=True, cwd=work, capture_output=True,
                                              text=True).stdout)
            measured = 1e3 / bench["decode"]["tokens_per_s"]
            print(f"{n:>6} {estimate:>12.2f} {cpu.moe_ms:>7.2f} + {cpu.non_expert_ms:>6.2f} {measured:>9.2f} "
                  f"{estimate / measured:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
