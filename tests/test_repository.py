"""What the repository holds: sources and the few tiny fixtures the demo needs, no build artefacts,
wheels or downloads (a 10.6 MB ruff wheel once sat at its root, used by nothing)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 1 << 20  # a tracked file outside fixtures/ larger than this is a mistake
ARCHIVES = (".whl", ".tar.gz", ".tgz", ".zip", ".tar", ".gz", ".xz", ".bz2", ".7z", ".egg")


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.stdout.decode().split("\0") if name]


def test_no_large_file_outside_fixtures():
    large = [
        f"{p.relative_to(ROOT)} ({p.stat().st_size:,} bytes)"
        for p in tracked_files()
        if p.is_file() and p.stat().st_size > MAX_BYTES and p.relative_to(ROOT).parts[0] != "fixtures"
    ]
    assert not large, large


def test_no_wheel_or_archive_is_tracked():
    found = [str(p.relative_to(ROOT)) for p in tracked_files() if p.name.lower().endswith(ARCHIVES)]
    assert not found, found


def test_the_checks_fail_on_what_they_refuse(tmp_path, monkeypatch):
    """Not vacuous: a large file and a wheel among the tracked files are named."""
    big, wheel = tmp_path / "big.bin", tmp_path / "tool-1.0-py3-none-any.whl"
    big.write_bytes(b"\0" * (MAX_BYTES + 1))
    wheel.write_bytes(b"PK")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "tracked_files", lambda: [big, wheel])
    with pytest.raises(AssertionError, match="big.bin"):
        test_no_large_file_outside_fixtures()
    with pytest.raises(AssertionError, match="tool-1.0-py3-none-any.whl"):
        test_no_wheel_or_archive_is_tracked()
