""".ci/run stops at the first command that fails: its step 1 (the README's demo) run as written, with
stand-ins for python3, pip and moepass on the PATH, one of which fails. Under `set -e` bash goes on
after a failing command of an `&&` list that is not the list's last, so a demo written as one
`&&` list would leave CI running, and green, after a failed install or conversion."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CI = REPO / ".ci" / "run"
README = REPO / "README.md"

# a stand-in: records its name and arguments, fails where FAIL names it ("moepass convert", "pip")
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $*" in "$FAIL"*) exit 3;; esac
if [ "$(basename "$0")" = python3 ] && [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin" && : > "$3/bin/activate"
fi
exit 0
"""


def _step(number: int) -> str:
    """Step `number` of .ci/run: its lines from its comment to the next step's."""
    text = CI.read_text()
    start = re.search(rf"^# {number}\. ", text, re.M)
    end = re.search(rf"^# {number + 1}\. ", text, re.M)
    assert start and end, f"{CI}: no step {number}"
    return text[start.start() : end.start()]


def _run_step_one(tmp_path: Path, fail: str) -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "python", "pip", "moepass"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    script = tmp_path / "step1"
    header = next(line for line in CI.read_text().splitlines() if line.startswith("set -"))
    script.write_text(f"{header}\n{_step(1)}")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "FAIL": fail or "\x01", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, calls.read_text().splitlines()


def test_step_one_runs_every_command_when_all_succeed(tmp_path):
    code, calls = _run_step_one(tmp_path, "")
    assert code == 0, calls
    assert [c.split()[0:2] for c in calls if c.startswith("moepass")] == [
        ["moepass", "convert"], ["moepass", "inspect"], ["moepass", "run"]
    ]


@pytest.mark.parametrize("fail", ["pip install", "moepass convert", "moepass inspect"])
def test_step_one_stops_at_a_failing_command(tmp_path, fail):
    code, calls = _run_step_one(tmp_path, fail)
    assert code != 0, f"{CI}: step 1 went on after '{fail}' failed: {calls}"
    assert calls[-1].startswith(fail), calls  # nothing ran after it


def test_ci_runs_the_readmes_commands_one_command_a_line():
    """Each command of the README's two (split at `&&`) is a line of .ci/run's steps 1 and 2 of its
    own, not inside an `&&` list, where errexit would not stop at it."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2, f"{README}: the two commands"
    steps = _step(1) + _step(2)
    lines = {" ".join(line.split()) for line in steps.replace("\\\n", " ").splitlines()}
    for block in blocks[:2]:
        for command in block.replace("\\\n", " ").split("&&"):
            command = " ".join(command.split())
            assert command in lines or f"{command} | tee \"$suite_log\"" in lines, (command, sorted(lines))
    assert os.access(CI, os.X_OK)
