"""The Python API's messages name its keywords (`vram='0'`, `kv_cache='int8'`, `moepass.convert(...,
context=N)`), the command line's its flags (`--vram 0`, `--kv-cache int8`, `convert --context N`):
the same failure through each, and a scan of the library's sources for a flag written into a
message in place of `moepass.core.errors.wording()`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import moepass
from moepass.cli import main
from moepass.core.errors import API_WORDING, CLI_WORDING, MoepassError, worded_as

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")
# the modules that only the command line reaches: serve (its flags are its only interface), the CLI,
# and the generator of docs/ tables
CLI_ONLY = {"moepass/serve/server.py", "moepass/support_tables.py",
            "moepass/core/options.py"}  # and the CLI, moepass/cli/; options.py: the options' --help texts


def _refused(call) -> str:
    with pytest.raises(MoepassError) as refused:
        call()
    return str(refused.value)


def _cli_refused(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    return result.stderr


def test_wording_of_each_kind_of_option():
    for words, expected in ((API_WORDING, ("kv_cache='int8'", "context=N", "calibrate=False", "exact=True",
                                           "lower=False", "overwrite=True", "moepass.convert(..., context=N)",
                                           "kv_cache", "draft_tokens=0")),
                            (CLI_WORDING, ("--kv-cache int8", "--context N", "--no-calibrate", "--exact",
                                           "--keep-form", "--force", "convert --context N", "--kv-cache",
                                           "--draft-tokens 0"))):
        said = (words.option("--kv-cache", "int8"), words.option("--context", "N"), words.option("--no-calibrate"),
                words.option("--exact"), words.option("--keep-form"), words.overwrite,
                words.call("convert", words.option("--context", "N")), words.name("--kv-cache"),
                words.option("--draft-tokens", 0))
        assert said == expected


def test_partition_budget_messages(converted, tmp_path):
    model = str(converted("q4_0"))
    api = _refused(lambda: moepass.partition(model, tmp_path / "a", "8G", reserve="9G", calibrate=False))
    assert api.startswith("reserve='9G' leaves nothing of vram='8G'"), api
    cli = _cli_refused(["partition", model, "--vram", "8G", "--reserve", "9G", "--no-calibrate", "-o",
                        str(tmp_path / "b")])
    assert "--reserve 9G leaves nothing of --vram 8G" in cli, cli
    api = _refused(lambda: moepass.partition(model, tmp_path / "a", "8G", kv_cache="int3", calibrate=False))
    assert "kv_cache" in api and "--" not in api, api


def test_convert_messages(make_gguf, tmp_path):
    gguf = str(make_gguf("q4_0"))
    api = _refused(lambda: moepass.convert(gguf, tmp_path / "a", print_after="nope"))
    assert api.startswith("print_after='nope': no such step for GGUF input"), api
    api = _refused(lambda: moepass.convert(gguf, tmp_path / "a", kv_calibration="calibration.txt"))
    assert api == "kv_calibration applies to kv_cache='int8'", api
    cli = _cli_refused(["convert", gguf, "-o", str(tmp_path / "b"), "--kv-calibration", gguf])
    assert cli.endswith("--kv-calibration applies to --kv-cache int8\n"), cli
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_convert_summary_names_the_keywords(make_gguf, tmp_path):
    """summary_lines() words its advice for whoever asks: the API's caller or the CLI."""
    result = moepass.convert(make_gguf("q4_0"), tmp_path / "out")
    api = "\n".join(result.summary_lines())
    assert "activations='float' for exact arithmetic" in api and not FLAG.search(api), api
    with worded_as(CLI_WORDING):
        cli = "\n".join(result.summary_lines())
    assert "--activations float for exact arithmetic" in cli


def test_runtime_messages(converted):
    model = converted("q4_0")
    api = _refused(lambda: moepass.load(model, speculative="ngrm"))
    assert api.startswith("speculative='ngrm': give 'ngram' or 'draft:PATH'"), api
    api = _refused(lambda: moepass.load(model, speculative="ngram", draft_tokens=0))
    assert api == "draft_tokens=0: at least 1", api
    cli = _cli_refused(["run", str(model), "--prompt-ids", "1", "--speculative", "ngrm"])
    assert "--speculative ngrm: give 'ngram'" in cli, cli
    decoder = moepass.load(model)
    api = _refused(lambda: list(decoder.generate([5] * (decoder.context_length + 1), 1)))
    assert api.endswith("(moepass.convert(..., context=N) builds it for more)"), api
    cli = _cli_refused(["run", str(model), "--prompt-ids", ",".join(["5"] * (decoder.context_length + 1)), "-n", "1"])
    assert "(convert --context N builds it for more)" in cli, cli


def test_the_bandwidths_advice(converted, tmp_path):
    from moepass.core.gpus import Bandwidths

    api = _refused(lambda: Bandwidths(gpu=0))
    assert api == "Bandwidths(gpu=0) is not a positive number of GB/s", api
    placed = moepass.partition(converted("q4_0"), tmp_path / "placed", "8G", calibrate=False)
    api = "\n".join(placed.summary_lines())
    assert "(assumed, a desktop GDDR6X card: give bandwidths=Bandwidths(gpu=...))" in api and not FLAG.search(api), api


def _message_strings(path: Path):
    """The string constants of a module that are not docstrings, nor a flag alone (a name looked up)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                and not FLAG.fullmatch(node.value)):
            yield node.lineno, node.value


def test_no_library_message_writes_a_flag_itself():
    """Every message the Python API can raise or print names its options through wording(): a flag
    written into the text would tell an API caller to type a command-line flag."""
    written = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
               for folder in ("moepass", "passes", "runtime", "cuda_ops")
               for path in sorted((ROOT / folder).rglob("*.py"))
               if str(path.relative_to(ROOT)) not in CLI_ONLY and path.parent != ROOT / "moepass" / "cli"
               for line, text in _message_strings(path) if FLAG.search(text)]
    assert not written, "\n".join(written)


def test_the_scan_finds_a_flag_written_into_a_message(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""--doc is fine"""\nLOOKUP = "--vram"\n'
                      'def f(x):\n    raise ValueError(f"{x}: pass --force to replace it")\n')
    assert [text for _, text in _message_strings(module)] == [": pass --force to replace it"]
