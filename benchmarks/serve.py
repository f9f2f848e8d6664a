"""Serving many at once beside llama-server: aggregate tokens/s, time to first token, per-client
rate and peak RSS, with 1, 2, 4 and 8 concurrent streaming clients.

    python benchmarks/serve.py --llama-server /path/to/llama-server             # Q4_0 and Q4_K_M, 6 layers
    python benchmarks/serve.py --llama-server build --rounds 3                  # builds it first (below)
    python benchmarks/serve.py --llama-server ... --presets q4_0 --clients 1 4 --rounds 1

Files: Qwen3-30B-A3B's layer sizes and vocabulary, 6 layers, Q4_0 and Q4_K_M (benchmarks/runtime.py's
files), moepass's default conversion. Both servers run with --slots slots (llama-server `-np N -t T
-tb T -c N*1024`, continuous batching as its default; `moepass serve --parallel N --threads T`),
each in its own process; every client is an OpenAI client streaming /v1/completions with a
128-token prompt of random token ids (a different one per client and round), 64 new tokens, greedy
(temperature 0: the same work on both sides, none of it in sampling). A client's time to first
token is from its request to its first streamed token; its rate is its tokens after the first over
the time they took; aggregate tokens/s is every client's tokens over the wall time from the first
request to the last token (prompts included), and decode tokens/s the tokens that came while every
client was decoding (from the last client's first token to the first client's last) over that time;
with more clients than slots, every token after each client's first over the time from the first
first token to the last token (the later clients' prompts computed within it). For each round the
two servers alternate (interleaved rounds; the table gives medians over the rounds), each started
once a round and warmed up with one request. Peak RSS is the server process's VmHWM.

llama-server: the llama.cpp that llama-cpp-python 0.3.36's source distribution vendors, built with
`cmake -B BUILD -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DCMAKE_BUILD_TYPE=Release && cmake --build BUILD --target llama-server` (the AVX2 kernels of the
llama-cpp-python build the other benchmarks use). `--llama-server build` downloads the source
distribution with pip and builds it under --work (about 5 minutes on 2 cores); a path uses that binary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import cpu_family  # noqa: E402
from support.serving import free_port  # noqa: E402

from runtime import bytes_per_decode_step, copy_bandwidth, qwen3_sized_gguf  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
PROMPT_TOKENS = 128
NEW_TOKENS = 64


def build_llama_server(work: Path) -> Path:
    """llama-server from llama-cpp-python's source distribution, built under `work` once."""
    binary = work / "llama-server-build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    source = work / "llama-src"
    source.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(source),
        ],
        check=True,
    )
    archive = next(source.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    vendored = source / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    build = work / "llama-server-build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(vendored),
            "-B",
            str(build),
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
            "-DCMAKE_BUILD_TYPE=Release",
        ],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], check=True
    )
    return binary


class Server:
    """One server process, up once /health answers."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.port = name, port
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{name} did not start in 10 minutes; see {log}")

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def stream_one(port: int, prompt: list[int], start: threading.Barrier) -> dict:
    """One client's streamed completion: its times and token count."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    start.wait()
    sent = time.perf_counter()
    stamps: list[float] = []
    chunks = client.completions.create(model="m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps}


def drive(port: int, clients: int, rng: np.random.Generator, vocab: int, slots: int = 4) -> dict:
    """`clients` streaming clients at once: aggregate tokens/s, time to first token p50/p95, per-client rate."""
    prompts = [rng.integers(1000, vocab - 1000, PROMPT_TOKENS).tolist() for _ in range(clients)]
    start = threading.Barrier(clients)
    results: list[dict] = [{} for _ in range(clients)]

    def run(i: int) -> None:
        results[i] = stream_one(port, prompts[i], start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first_sent = min(r["sent"] for r in results)
    last = max(r["stamps"][-1] for r in results)
    tokens = sum(len(r["stamps"]) for r in results)
    ttft = sorted(r["stamps"][0] - r["sent"] for r in results)
    rates = [(len(r["stamps"]) - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in results if len(r["stamps"]) > 1]
    # decode: while every client decodes (from the last first token to the first last one), the
    # tokens that came then over that time; with more clients than slots, over the whole run
    everyone, someone_done = max(r["stamps"][0] for r in results), min(r["stamps"][-1] for r in results)
    if clients <= slots and someone_done > everyone:
        decode = sum(everyone < s <= someone_done for r in results for s in r["stamps"]) / (someone_done - everyone)
    else:
        decode = (tokens - clients) / (last - min(r["stamps"][0] for r in results))
    return {
        "aggregate": tokens / (last - first_sent),
        "decode_aggregate": decode,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p95": float(np.percentile(ttft, 95)),
        "per_client": statistics.median(rates),
        "tokens": tokens,
    }


ALONE_SCRIPT = r"""
import sys
from moepass.runtime import load
from moepass.runtime.bench import measure
decoder = load(sys.argv[1], device="cpu", threads=int(sys.argv[2]))
measure(decoder, 8, 2, repeats=1)  # warm-up, as the servers get one
print(measure(decoder, int(sys.argv[3]), int(sys.argv[4]), repeats=1)["decode_tokens_per_s"])
"""


def single_stream(model: Path, threads: int) -> float:
    """The decode tokens/s of one stream generated in-process (the path `moepass run` and `moepass
    bench` take, with no server around it): what one client should get from the server."""
    out = subprocess.run([sys.executable, "-c", ALONE_SCRIPT, str(model), str(threads), str(PROMPT_TOKENS),
                          str(NEW_TOKENS)], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def distinct_experts(experts: int, used: int, tokens: int) -> float:
    """The experts `tokens` tokens route to together, expected under uniform routing (what the
    fixtures' random routers give): each expert is missed by a token with probability 1 - used/experts."""
    return experts * (1 - (1 - used / experts) ** tokens)


def bytes_limit(model_dir: Path, batch: int, bandwidth: float) -> tuple[float, float]:
    """(weight bytes a decode step of `batch` sequences reads, the tokens/s that bandwidth allows
    it): the other weights once, each distinct expert once."""
    import onnx

    expert, other = bytes_per_decode_step(model_dir)
    graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph
    moe = next(n for n in graph.node if n.op_type == "QMoE")
    used = next(a.i for a in moe.attribute if a.name == "k")
    experts = next(t.dims[0] for t in graph.initializer if t.name == moe.input[2])
    step = other + expert * distinct_experts(experts, used, batch) / used
    return step, batch * bandwidth / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="its binary, or 'build' (see above)")
    parser.add_argument("--presets", nargs="+", default=["q4_0", "q4_k_m"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "moepass-bench")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    llama = build_llama_server(args.work) if args.llama_server == "build" else Path(args.llama_server)
    if not llama.exists():
        raise SystemExit(f"{llama}: no llama-server there (give its path, or 'build')")
    moepass = shutil.which("moepass") or str(Path(sys.executable).with_name("moepass"))
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_family.describe()}, {platform.python_version()}", flush=True)
    version = subprocess.run([str(llama), "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    print(f"# llama-server: {version[0] if version else '?'}; {args.threads} threads, {args.slots} slots", flush=True)
    rows: dict = {}
    singles: dict[str, list[float]] = {}
    for preset in args.presets:
        gguf = qwen3_sized_gguf(args.work, preset, args.layers)
        converted = args.work / f"{gguf.stem}-moepass"
        if not (converted / "model.onnx").exists():
            subprocess.run([moepass, "convert", str(gguf), "-o", str(converted), "--force"], check=True)
        sides = {
            "llama-server": [
                str(llama),
                "-m",
                str(gguf),
                "-t",
                str(args.threads),
                "-tb",
                str(args.threads),
                "-np",
                str(args.slots),
                "-c",
                str(args.slots * 1024),
                "--host",
                "127.0.0.1",
            ],
            "moepass": [
                moepass,
                "serve",
                str(converted),
                "--threads",
                str(args.threads),
                "--parallel",
                str(args.slots),
                "--host",
                "127.0.0.1",
            ],
        }
        rng = np.random.default_rng(3)
        for round_ in range(args.rounds):
            for side, cmd in sides.items():
                port = free_port()
                server = Server(side, [*cmd, "--port", str(port)], port, args.work / f"{side}-{preset}.log")
                try:
                    drive(port, 1, rng, 151936)  # warm-up
                    for clients in args.clients:
                        figures = drive(port, clients, rng, 151936, args.slots)
                        rows.setdefault((preset, side, clients), []).append(figures)
                        print(
                            f"{preset} round {round_ + 1} {side} {clients} clients: "
                            f"{figures['aggregate']:.1f} tok/s aggregate, {figures['decode_aggregate']:.1f} decode, "
                            f"TTFT p50 {figures['ttft_p50']:.2f} s",
                            flush=True,
                        )
                    rss = server.peak_rss()
                finally:
                    server.stop()
                for clients in args.clients:
                    rows[(preset, side, clients)][-1]["peak_rss"] = rss
            alone = single_stream(converted, args.threads)
            singles.setdefault(preset, []).append(alone)
            print(f"{preset} round {round_ + 1} moepass one stream in-process: {alone:.1f} decode tok/s", flush=True)
    print(
        "\n| file | server | clients | aggregate tok/s | decode tok/s | TTFT p50 / p95 s | "
        "per-client tok/s | peak RSS GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (preset, side, clients), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {preset.upper()} | {side} | {clients} | {med['aggregate']:.1f} | {med['decode_aggregate']:.1f} | "
            f"{med['ttft_p50']:.2f} / {med['ttft_p95']:.2f} | {med['per_client']:.1f} | "
            f"{med['peak_rss'] / 2**30:.2f} |"
        )
    bandwidth = copy_bandwidth()
    print(f"\nThe bytes-read limit at the copy bandwidth ({bandwidth / 1e9:.1f} GB/s): a decode step of B sequences "
          "reads the other weights once and each distinct expert once")
    print("| file | clients | sequences a step | weight MiB a step | limit tok/s | decode tok/s | of the limit |")
    print("|---|---|---|---|---|---|---|")
    for (preset, side, clients), runs in rows.items():
        if side != "moepass":
            continue
        batch = min(clients, args.slots)
        step, limit = bytes_limit(args.work / f"qwen3moe-30b-sizes-{preset}-{args.layers}l-moepass", batch, bandwidth)
        decode = statistics.median(r["decode_aggregate"] for r in runs)
        print(f"| {preset.upper()} | {clients} | {batch} | {step / 2**20:.0f} | {limit:.0f} | {decode:.1f} | "
              f"{decode / limit:.0%} |")
    for preset, rates in singles.items():
        print(f"\n{preset.upper()}: one stream in-process (moepass run's path), decode "
              f"{statistics.median(rates):.1f} tok/s (median of {len(rates)})")
    if args.json:
        args.json.write_text(json.dumps({" ".join(map(str, k)): v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
