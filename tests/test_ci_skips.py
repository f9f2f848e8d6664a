"""CI fails on a skip that .ci/skips.py does not allow: a planted one is refused, an allowed one
passes, and a log without pytest's summary (a suite that did not finish) fails too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / ".ci" / "skips.py"


def _suite(tmp_path: Path, reason: str) -> Path:
    (tmp_path / "test_planted.py").write_text(
        "import pytest\n\n\ndef test_ok():\n    pass\n\n\n"
        f"def test_planted():\n    pytest.skip({reason!r})\n"
    )
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    log = tmp_path / "suite.log"
    log.write_text(run.stdout)
    return log


@pytest.mark.parametrize("reason,allowed", [
    ("the converter refused q4_k_m", False),
    ("every prompt's greedy answer meets a stop token within 1500 tokens on this CPU", False),
    ("no AVX2-only run here: this CPU has no AVX-512", True),
])
def test_a_planted_skip_is_judged(tmp_path, reason, allowed):
    checked = subprocess.run([sys.executable, str(CHECKER), str(_suite(tmp_path, reason))], capture_output=True,
                             text=True)
    assert (checked.returncode == 0) == allowed, checked.stdout
    assert ("not allowed" in checked.stdout) != allowed and reason in checked.stdout


def test_a_log_without_a_summary_fails(tmp_path):
    log = tmp_path / "cut.log"
    log.write_text("....F..\n")
    checked = subprocess.run([sys.executable, str(CHECKER), str(log)], capture_output=True, text=True)
    assert checked.returncode == 1 and "did not finish" in checked.stdout
