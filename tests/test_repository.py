"""What the repository holds: sources and the few tiny fixtures the demo needs, no build artefacts,
wheels or downloads (a 10.6 MB ruff wheel once sat at its root, used by nothing); and how its tests
are laid out: test files named by the capability they check (not by the day or week they were
written), what several of them share in tests/support/, and no test module importing another."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 1 << 20  # a tracked file outside fixtures/ larger than this is a mistake
ARCHIVES = (".whl", ".tar.gz", ".tgz", ".zip", ".tar", ".gz", ".xz", ".bz2", ".7z", ".egg")
TESTS = ROOT / "tests"
# a word of a file name that says when it was written, not what it checks (test_second_day.py)
WHEN = re.compile(r"(^|_)(days?|daily|weeks?|weekly)(_|$)")


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


def _imported_test_modules(path: Path) -> list[str]:
    """The test modules (test_*) that the Python file `path` imports: by import statements, and by
    importlib.import_module or __import__ of a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "__import__") or
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{path.relative_to(TESTS)}:{node.lineno} imports {name}"
                  for name in names if name.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """What several test files share lives in tests/support/ (imported as `support.X`); a test
    module imported by another would be collected once and imported twice, its module-level work
    done in both, and its tests could not be moved or renamed alone."""
    found = [line for path in sorted(TESTS.rglob("*.py")) for line in _imported_test_modules(path)]
    assert not found, f"move what is shared into tests/support/: {found}"


def test_test_files_are_named_by_capability_not_by_day():
    dated = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py")) if WHEN.search(p.stem)]
    assert not dated, f"name test files after what they check, not after a day or week: {dated}"


def test_the_layout_checks_fail_on_what_they_refuse(tmp_path, monkeypatch):
    """Not vacuous: a test module importing another (each way of importing) and files named after
    a day or a week are named."""
    (tmp_path / "support").mkdir()
    (tmp_path / "test_a.py").write_text("import os\nfrom test_b import helper\n")
    (tmp_path / "test_c.py").write_text("import test_b.inner as b\n")
    (tmp_path / "support" / "shared.py").write_text("import importlib\nimportlib.import_module('test_b')\n")
    for name in ("test_second_day.py", "test_second_week.py", "test_weekly.py", "test_today.py"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(__import__(__name__), "TESTS", tmp_path)
    with pytest.raises(AssertionError) as refused:
        test_no_test_module_imports_another()
    for where in ("test_a.py:2 imports test_b", "test_c.py:1 imports test_b.inner", "shared.py:2 imports test_b"):
        assert where in str(refused.value)
    with pytest.raises(AssertionError) as refused:
        test_test_files_are_named_by_capability_not_by_day()
    said = str(refused.value)
    assert all(name in said for name in ("test_second_day.py", "test_second_week.py", "test_weekly.py"))
    assert "test_today.py" not in said and "test_a.py" not in said  # a word of the name, not a substring
