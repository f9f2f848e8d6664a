"""The package passes ruff with the rules and line length of pyproject.toml's [tool.ruff]."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ["moepass", "passes", "runtime", "cuda_ops"]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is not installed: the test extra brings it (pip install -e '.[cpu,test]')"
    return [found]


def test_package_is_ruff_clean():
    result = subprocess.run([*_ruff(), "check", "--no-cache", *PACKAGE], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_finds_a_long_line(tmp_path):
    """The same configuration fails a file with a line over the limit and unsorted imports."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = '" + "y" * 130 + "'\nprint(os, sys)\n")
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "E501" in result.stdout and "I001" in result.stdout, result.stdout
