"""The GPU install route docs/gpu.md gives (route (a), onnxruntime-gpu with its CUDA and cuDNN
wheels), run as written in a throwaway venv with the real wheels: one ONNX Runtime package
installed, the CUDA EP's libraries in place (no GPU here: the session gets as far as the driver),
and a venv holding both packages refused by moepass in one line. Skipped, saying why, where the
package index cannot be reached or the disk cannot hold the wheels (about 3 GB installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_DOC = ROOT / "docs" / "gpu.md"
# where the doc's route (a) commands stand, each block one shell command line
BEGIN, END = "<!-- route (a): commands, tests/test_gpu_install.py -->", "<!-- end of route (a) -->"
DISK_NEEDED = 8 << 30


def route_commands() -> dict[str, str]:
    """The doc's route (a) blocks: "fresh" (a new venv) and "replace" (the README's CPU venv)."""
    text = GPU_DOC.read_text()
    section = text[text.index(BEGIN) + len(BEGIN): text.index(END)]
    blocks = re.findall(r"```sh\n# (\w+)\n(.*?)```", section, re.S)
    return {name: " && ".join(line for line in body.strip().splitlines() if not line.startswith("#"))
            for name, body in blocks}


def _run(command: str, cwd: Path, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_doc_states_both_ways_and_the_sizes():
    commands = route_commands()
    assert set(commands) == {"fresh", "replace"}
    assert "pip uninstall -y onnxruntime" in commands["replace"] and "'.[gpu]'" in commands["fresh"]
    section = GPU_DOC.read_text()
    assert re.search(r"1\.\d GB of NVIDIA's wheels", section)


@pytest.fixture(scope="module")
def gpu_route(tmp_path_factory):
    """A copy of the repository with route (a)'s "replace" commands run in a venv that first had
    the README's CPU install: (the copy, its venv's python)."""
    work = tmp_path_factory.mktemp("gpu-route")
    if shutil.disk_usage(work).free < DISK_NEEDED:
        pytest.skip(f"{shutil.disk_usage(work).free >> 30} GiB free: the GPU wheels need about 8 GiB to install")
    repo = work / "moepass"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "out", "*.egg-info", "__pycache__"))
    cpu = _run(f"{sys.executable} -m venv .venv && . .venv/bin/activate && pip install -q -e '.[cpu]'", repo)
    if cpu.returncode:
        pytest.skip(f"the CPU install could not run here: {cpu.stderr.strip().splitlines()[-1:]}")
    done = _run(". .venv/bin/activate && " + route_commands()["replace"], repo)
    if done.returncode:
        pytest.skip(f"the GPU wheels could not be installed here: {done.stderr.strip().splitlines()[-1:]}")
    yield repo, repo / ".venv" / "bin" / "python"
    shutil.rmtree(work, ignore_errors=True)  # 3 GB of wheels: not kept to the session's end


def test_the_route_leaves_one_onnxruntime_with_its_cuda_libraries(gpu_route, converted, tmp_path):
    repo, python = gpu_route
    listed = subprocess.run([str(python), "-c", "from moepass.runtime.decoder import installed_onnxruntimes as i;"
                             "print(i())"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert listed.returncode == 0 and "onnxruntime-gpu" in listed.stdout and "'onnxruntime " not in listed.stdout
    run = [str(python), "-m", "moepass.cli", "run", str(converted("q4_0")), "--prompt-ids", "1,2",
           "--max-new-tokens", "1", "--device", "cuda"]
    refused = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    line = [x for x in refused.stderr.splitlines() if x.startswith("moepass: error:")]
    # NVIDIA's wheels in place: no CUDA or cuDNN library is missing, the driver is (no GPU here)
    assert refused.returncode == 2 and line, refused.stderr
    assert "libcuda.so.1" in line[0] and "no NVIDIA driver" in line[0], line[0]
    assert "libcublasLt" not in line[0] and "libcudnn" not in line[0], line[0]


def test_both_packages_are_refused_in_one_line(gpu_route, converted, tmp_path):
    repo, python = gpu_route
    both = _run(f"{python} -m pip install -q onnxruntime==1.32.0", repo)
    if both.returncode:
        pytest.skip(f"onnxruntime could not be installed beside it: {both.stderr.strip().splitlines()[-1:]}")
    try:
        run = [str(python), "-m", "moepass.cli", "run", str(converted("q4_0")), "--prompt-ids", "1,2",
               "--max-new-tokens", "1"]
        refused = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        lines = [x for x in refused.stderr.splitlines() if x.startswith("moepass: error:")]
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert "onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1 are both installed" in lines[0]
        assert "pip uninstall -y onnxruntime onnxruntime-gpu" in lines[0]
    finally:  # the fixture's venv as the route left it
        _run(f"{python} -m pip uninstall -q -y onnxruntime onnxruntime-gpu && {python} -m pip install -q "
             "'onnxruntime-gpu[cuda,cudnn]==1.31.1'", repo)
