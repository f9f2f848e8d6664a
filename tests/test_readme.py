"""The README's commands: its Python example runs as written on the demo fixture; its first shell
command installs the extras of every command the README shows, and CI runs its shell commands as
written; no line outside a table is over 200 characters."""

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_python_example_runs(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    code = code.replace('"model.gguf"', repr(str(ROOT / "fixtures" / "qwen3moe-tiny-q4_0.gguf")))
    monkeypatch.chdir(tmp_path)  # out/ and placed/ are made here
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().strip(), "the example prints the generated text"
    assert (tmp_path / "out" / "model.onnx").is_file() and (tmp_path / "placed" / "plan.json").is_file()


def test_readme_first_command_installs_what_it_shows_and_ci_runs_both():
    readme = (ROOT / "README.md").read_text()
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in re.findall(r"```sh\n(.*?)```", readme, re.S)]
    demo, tests = commands[0], commands[1]
    shown = set(re.findall(r"moepass (chat|serve)\b", readme))
    installed = re.search(r"pip install -e '\.\[([a-z,]+)\]'", demo).group(1).split(",")
    assert shown <= set(installed), (shown, installed)
    ci = " ".join((ROOT / ".ci" / "run").read_text().replace("\\\n", " ").split())
    # each command of the two, one a line in .ci/run (an && list would hide a failure: tests/test_ci.py)
    parts = [" ".join(part.split()) for command in (demo, tests) for part in command.split("&&")]
    assert all(part in ci for part in parts), [part for part in parts if part not in ci]
    long = [n for n, line in enumerate(readme.splitlines(), 1) if len(line) > 200 and not line.startswith("|")]
    assert not long, f"README lines over 200 characters outside tables: {long}"
