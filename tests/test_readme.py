"""The README's Python example runs as written, on the demo fixture."""

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
