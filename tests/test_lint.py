"""The package passes ruff's lint and format check (pyproject.toml's [tool.ruff]: rules, line length)
and mypy ([tool.mypy]), the latter on the package as it is installed: passes/, runtime/ and cuda_ops/
as moepass.passes, ..."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ["moepass", "passes", "runtime", "cuda_ops", "cpu_ops"]


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


def test_the_check_finds_a_complex_function(tmp_path):
    """The same configuration fails a function of 16 branches and one of 9 parameters (C901 at 15,
    PLR0913 at 8: pyproject.toml), and passes the same at 15 and 8."""

    def module(branches: int, parameters: int) -> str:
        body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(branches - 1))
        names = ", ".join(f"a{i}" for i in range(parameters - 1))
        return f"def branchy(x):\n{body}    return -1\n\n\ndef wide(x, {names}):\n    return x\n"

    def findings(text: str) -> str:
        path = tmp_path / "f.py"
        path.write_text(text)
        found = subprocess.run([*_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(path)],
                               capture_output=True, text=True)
        return found.stdout

    over = findings(module(16, 9))
    assert "C901" in over and "PLR0913" in over, over
    within = findings(module(15, 8))
    assert "C901" not in within and "PLR0913" not in within, within


def test_package_is_ruff_formatted():
    result = subprocess.run([*_ruff(), "format", "--check", "--no-cache", *PACKAGE], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, "run `ruff format moepass passes runtime cuda_ops cpu_ops`:\n" + result.stdout


def test_the_format_check_finds_a_misformatted_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = {'a':1,\n  'b':2}\n")
    result = subprocess.run([*_ruff(), "format", "--check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                             str(bad)], capture_output=True, text=True)
    assert result.returncode == 1 and "bad.py" in result.stdout, result.stdout + result.stderr


def _installed_layout(where: Path, package: Path, subpackages: tuple[str, ...] = tuple(PACKAGE[1:])) -> Path:
    """A tree of links laid out as pip installs the package (setuptools package-dir), for mypy,
    which reads a package from one folder: moepass/ with passes/, runtime/ and cuda_ops/ inside."""
    top = where / "moepass"
    top.mkdir()
    for entry in package.iterdir():
        (top / entry.name).symlink_to(entry)
    for sub in subpackages:
        (top / sub).symlink_to(ROOT / sub)
    return where


def _mypy(where: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "moepass"],
                          cwd=where, capture_output=True, text=True)


def test_package_is_mypy_clean(tmp_path):
    result = _mypy(_installed_layout(tmp_path, ROOT / "moepass"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_type_check_finds_a_none_dereference(tmp_path):
    """The same configuration fails code that reads an attribute of an onnx-ir value that may be
    None (the mistake the package's ir_values helpers exist for)."""
    package = tmp_path / "src"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text("import onnx_ir as ir\n\n\ndef first_input_name(node: ir.Node) -> str:\n"
                                    "    return node.inputs[0].name or ''\n")
    (tmp_path / "layout").mkdir()
    result = _mypy(_installed_layout(tmp_path / "layout", package, subpackages=()))
    assert result.returncode == 1 and 'Item "None" of "Value | None" has no attribute "name"' in result.stdout, \
        result.stdout + result.stderr
