"""What a llama.cpp user met in the second week (issue 45's items 4-9), each as it is now: one rule
for byte sizes, summaries that say what a form is, bench's threads, the terminal kept safe from a
model's control bytes, the partition estimate saying whose GPU figures it assumed and its floor,
and a README whose first command installs what it shows."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_end_of_generation import preferring

from moepass.cli import main
from moepass.core.choices import BYTES_RULE, parse_bytes
from moepass.core.quants import BlockForm, speed_class
from moepass.core.terminal import terminal_safe

ROOT = Path(__file__).resolve().parents[1]


def test_one_rule_for_sizes_in_help_code_and_docs():
    assert parse_bytes("8G") == parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("7.5GB") == 7_500_000_000 and parse_bytes("8000M") == 8000 * 2**20
    help_text = " ".join(CliRunner().invoke(main, ["partition", "--help"]).stdout.split())
    assert " ".join(BYTES_RULE.split()) in help_text
    assert "decimal (8e9)" not in help_text  # the old, wrong sentence
    assert " ".join(BYTES_RULE.split()) in " ".join((ROOT / "docs" / "partition.md").read_text().split())


def test_a_requantized_form_is_not_called_exact():
    for form in (BlockForm(8, 128), BlockForm(4, 16), BlockForm(4, 32)):
        assert "exact" not in speed_class(form)
    assert speed_class(BlockForm(4, 32)) == "the fastest expert form on the CPU"


def test_terminal_safe_escapes_control_characters_only():
    assert terminal_safe("a\x1b[2Jb\x07\tc\nd\r\x9b") == "a\\x1b[2Jb\\x07\tc\nd\r\\x9b"
    assert terminal_safe("héllo ✓") == "héllo ✓"


def test_run_on_a_terminal_escapes_what_the_model_writes(tmp_path):
    """A model made to write ESC (0x1b): on a terminal `run` shows it as \\x1b; into a pipe the
    bytes go as they are."""
    _, out, _, _ = preferring(tmp_path, "ě")  # GPT-2's byte map writes byte 0x1b as U+011B
    command = [sys.executable, "-m", "moepass.cli", "run", str(out), "--prompt", "the other one", "-n", "3"]
    piped = subprocess.run(command, capture_output=True, cwd=tmp_path, check=True).stdout
    assert piped.startswith(b"\x1b\x1b\x1b")
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(command, stdout=follower, stderr=subprocess.DEVNULL, cwd=tmp_path, timeout=120)
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0 and b"\x1b" not in shown and b"\\x1b\\x1b\\x1b" in shown, shown


def test_bench_json_reports_the_threads_it_ran(converted):
    result = CliRunner().invoke(main, ["bench", str(converted("q4_0")), "-p", "4", "-n", "2", "--repeats", "1",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["threads"] >= 1
    given = CliRunner().invoke(main, ["bench", str(converted("q4_0")), "-p", "4", "-n", "2", "--repeats", "1",
                                      "--json", "--threads", "1"])  # fmt: skip
    assert json.loads(given.stdout)["threads"] == 1


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--vram", "8G"], "900 GB/s, link 25 GB/s (assumed, a desktop GDDR6X card: give --gpu NAME or --gpu-bandwidth)"),
        (["--gpu", "rtx4090-24g"], "1008 GB/s, link 31.5 GB/s (from --gpu rtx4090-24g's data sheet)"),
        (["--vram", "8G", "--gpu-bandwidth", "500"], "500 GB/s, link 25 GB/s (from --gpu-bandwidth)"),
    ],
)
def test_partition_says_whose_gpu_figures_and_the_step_floor(converted, tmp_path, args, says):
    result = CliRunner().invoke(main, ["partition", str(converted("q4_0")), "-o", str(tmp_path / "p"), *args])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.strip().startswith("GPU figures")]
    assert says in line
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    floor = plan["prediction"]["gpu_step_floor_ms"]
    # the tiny model's step is its launches: at least a launch per node and a synchronisation
    assert floor >= 0.03 and plan["prediction"]["decode_ms_per_token"]["cold_experts_on_cpu"] >= floor
    assert plan["inputs"]["bandwidths_from"] in line


def test_readme_first_command_installs_what_it_shows_and_ci_runs_both():
    readme = (ROOT / "README.md").read_text()
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in re.findall(r"```sh\n(.*?)```", readme, re.S)]
    demo, tests = commands[0], commands[1]
    shown = set(re.findall(r"moepass (chat|serve)\b", readme))
    installed = re.search(r"pip install -e '\.\[([a-z,]+)\]'", demo).group(1).split(",")
    assert shown <= set(installed), (shown, installed)
    ci = " ".join((ROOT / ".ci" / "run").read_text().replace("\\\n", " ").split())
    assert demo in ci and tests in ci
    long = [n for n, line in enumerate(readme.splitlines(), 1) if len(line) > 200 and not line.startswith("|")]
    assert not long, f"README lines over 200 characters outside tables: {long}"
