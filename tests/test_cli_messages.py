"""What the command line says to a person: summaries a person can read (convert, partition, run,
bench), messages that say what is true and point to the way out, progress a log file can follow,
one rule for byte sizes in the help, the code and the docs, the partition estimate saying whose GPU
figures it assumed and its floor, and a terminal kept safe from a model's control bytes."""

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
from support.vocabularies import preferring

from moepass.cli import main
from moepass.core.choices import BYTES_RULE, parse_bytes
from moepass.core.quants import BlockForm, speed_class
from moepass.core.terminal import terminal_safe

ROOT = Path(__file__).resolve().parents[1]


def _ok(args: list[str]):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result


def _fails(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    return result.stderr


def test_convert_summary_reads_as_words(make_gguf, tmp_path):
    native = _ok(["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "native")]).stdout
    assert "native Q4_0/Q4_0/Q4_0 in 2 layers" in native and "native Q4_0 " in native
    out = _ok(["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "out"), "--expert-format", "qmoe"]).stdout
    assert "int4/b32 in 2 layers (the fastest expert form on the CPU)" in out
    assert " x2 " not in out and "the time of int4/b32)" not in out
    # a 2 MB file converts in hundredths of a second: its rate in megabytes below 0.1 GB/s, never 0.00 GB/s
    rate = re.search(r"\(([0-9.]+) (GB|MB)/s of input\)", out)
    assert rate and float(rate[1]) > 0 and (float(rate[1]) >= 0.1 if rate[2] == "GB" else float(rate[1]) < 100), out


def test_partition_summary_names_no_zero_counts(converted, tmp_path):
    model = str(converted("q4_0"))
    everything = _ok(["partition", model, "--ignore-kernel-table", "--vram", "8G", "--target", "layers", "-o", str(tmp_path / "big")]).stdout
    assert "(per-layer placement: all of them)" in everything and "the other 0" not in everything
    nothing = _ok(["partition", model, "--ignore-kernel-table", "--vram", "1M", "--reserve", "0", "--target", "layers",
                   "-o", str(tmp_path / "small")]).stdout
    assert "(per-layer placement: every MoE layer runs on the CPU)" in nothing and "the other" not in nothing
    assert "(nothing fits beside the non-expert part)" in nothing


def test_run_says_how_it_ended(converted):
    result = _ok(["run", str(converted("q4_0")), "-p", "the other one", "-n", "3"])
    assert "3 tokens in" in result.stderr and "ended by the token limit" in result.stderr and "pieces" not in \
        result.stderr
    result = _ok(["run", str(converted("q4_0")), "--prompt-ids", "1 2 3", "-n", "3"])
    assert "ended by" in result.stderr


def test_messages_say_what_is_true(converted, make_gguf, tmp_path):
    assert "the prompt is empty: give some text" in _fails(["run", str(converted("q4_0")), "--prompt", ""])
    # the README's bench --depth 2048 on the demo's 512 positions: the way out is named
    said = _fails(["bench", str(converted("q4_0")), "--depth", "2048", "-n", "4", "-r", "1"])
    assert "context holds 512" in said and "convert --context" in said
    # a dense llama GGUF: inspect describes it, with convert's reason, instead of failing on a key
    dense = make_gguf("q4_0", arch="llama", omit_keys=("llama.expert_count",))
    info = json.loads(_ok(["inspect", str(dense), "--json"]).stdout)
    assert info["supported"] is False and "a dense llama model" in info["unsupported_reason"]
    assert "not converted by moepass: a dense llama model" in _ok(["inspect", str(dense)]).stdout


def test_the_cuda_refusal_names_the_way_out(converted):
    """The Python API's keyword, the command line's flag."""
    from moepass.runtime import load

    import moepass

    with pytest.raises(moepass.MoepassError) as refused:
        load(converted("q4_0"), device="cuda")
    message = str(refused.value)
    assert "(cuda_plugin=LIB or $MOEPASS_CUDA_PLUGIN)" in message and "moepass[gpu] in place of moepass[cpu]" in message
    said = _fails(["run", str(converted("q4_0")), "--prompt-ids", "1", "--device", "cuda"])
    assert "(--cuda-plugin LIB or $MOEPASS_CUDA_PLUGIN)" in said and "cuda_plugin" not in said


def test_an_interrupt_claims_cleanup_only_where_something_is_written():
    from moepass.cli import _writes

    assert _writes(["convert", "m.gguf", "-o", "out"]) and _writes(["partition", "m", "--vram", "8G", "-o", "p"])
    assert not _writes(["run", "m", "-p", "hi"]) and not _writes(["serve", "m"]) and not _writes(["--version"])


def test_missing_extras_are_named_before_the_model_loads(converted, monkeypatch):
    import importlib.util

    import moepass.runtime

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jinja2" else real(name, *a))
    monkeypatch.setattr(moepass.runtime, "load", lambda *a, **k: pytest.fail("the model loaded first"))
    said = _fails(["run", str(converted("q4_0")), "-p", "hi", "--chat"])
    assert "--chat needs jinja2: pip install 'moepass[chat]'" in said
    assert "moepass chat needs jinja2" in _fails(["chat", str(converted("q4_0"))])


def test_progress_without_a_terminal_is_lines_with_rate_and_time_left(make_gguf, converted, tmp_path, monkeypatch):
    """A log file gets a line every few seconds (here every report) and one at the end: what is done
    of what, the rate and the time left; convert, partition and profile all report."""
    from moepass.cli.common import Progress

    monkeypatch.setattr(Progress, "LOG_EVERY", 0.0)
    out = _ok(["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "out")]).stderr
    lines = [line for line in out.splitlines() if line.startswith("writing weights: ")]
    assert len(lines) > 2 and all(re.fullmatch(r"writing weights: [\d.]+ (?:B|[KM]iB) of [\d.]+ MiB \(\d+%\), [\d.]+ [MG]B/s, "
                                               r"(\d+ s left|time left unknown|done)", line) for line in lines), lines
    assert " s left" in lines[1] and lines[-1].endswith("(100%), " + lines[-1].split("(100%), ")[1])
    assert lines[-1].endswith("done") and sum(line.endswith("done") for line in lines) == 1
    placed = _ok(["partition", str(converted("q4_0")), "--ignore-kernel-table", "--vram", "8G", "--target", "layers", "-o",
                  str(tmp_path / "placed")]).stderr
    assert "writing the placed model: " in placed and placed.count("done") == 1
    profiled = _ok(["profile", str(converted("q4_0")), "--prompt-ids", "1,2,3", "-o", str(tmp_path / "p.json")])
    assert "profiling prompts: 1 of 1 prompts (100%)" in profiled.stderr


def test_the_cache_conversion_reports_to_a_log_too(make_gguf, tmp_path, monkeypatch):
    """`moepass run FILE.gguf` with stderr a log: the cache's conversion says how far it is (a line
    every LOG_EVERY seconds, here every report), not nothing for minutes."""
    from moepass.cli.common import Progress

    monkeypatch.setattr(Progress, "LOG_EVERY", 0.0)
    monkeypatch.setenv("MOEPASS_CACHE", str(tmp_path / "cache"))
    said = _ok(["run", str(make_gguf("q4_0")), "--prompt-ids", "1,2", "-n", "2"]).stderr.splitlines()
    lines = [line for line in said if line.startswith("converting q4_0.gguf: ")]
    assert len(lines) > 2 and lines[-1].endswith(", done") and "(100%)" in lines[-1], said
    assert said.index(lines[-1]) < next(i for i, line in enumerate(said) if "converted with the defaults" in line)


def test_the_terminal_bar_ends_its_line_at_its_last_update(monkeypatch):
    """After the bar's last update the next message starts on a line of its own; close() after it
    (the callers' finally) ends nothing twice, and a report of the whole again draws no second bar."""
    import io

    from moepass.cli.common import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = Progress("writing weights", enabled=True)
    for done in (0, 4 << 20, 8 << 20):
        progress(done, 8 << 20)
    terminal.write("next message\n")
    progress(8 << 20, 8 << 20)
    progress.close()
    text = terminal.getvalue()
    assert "writing weights" in text and text.endswith("\nnext message\n"), repr(text)
    assert text.count("\n") == 2, repr(text)


def test_a_path_that_does_not_exist_is_worded_one_way_everywhere(converted, tmp_path):
    """`moepass run FILE.ggu` (a typo) says what convert, inspect and the rest say of a missing path:
    "PATH: no such file or directory", the Python API too (not "no such model ... convert first")."""
    import moepass

    model = str(converted("q4_0"))
    for args in (["run", "{}.ggu", "-p", "hi"], ["run", "{}", "--prompt-ids", "1"], ["chat", "{}"],
                 ["bench", "{}"], ["convert", "{}.gguf", "-o", str(tmp_path / "o")],
                 ["convert", "{}.onnx", "-o", str(tmp_path / "o")], ["inspect", "{}.gguf"],
                 ["partition", "{}.gguf", "--vram", "1G"], ["profile", "{}", "--prompt-ids", "1", "-o", "p.json"],
                 ["run", model, "-p", "hi", "--speculative", "draft:{}"],
                 ["partition", model, "--vram", "1G", "--profile", "{}.json", "-o", str(tmp_path / "o")]):
        missing = str(tmp_path / "nope")
        given = [a.format(missing) for a in args]
        said = _fails(given).strip().splitlines()
        (path,) = [a.removeprefix("draft:") for a in given if missing in a]
        assert said[-1] == f"moepass: error: {path}: no such file or directory", (given, said)
        assert len(said) == 1 or "--speculative" in given, said  # a draft: once the model itself loads
    for call in (lambda: moepass.load(tmp_path / "nope.ggu"), lambda: moepass.inspect(tmp_path / "nope")):
        with pytest.raises(moepass.MoepassError, match=r"nope(\.ggu)?: no such file or directory$"):
            call()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: not a converted model (no model.onnx in it" in _fails(["run", str(empty), "-p", "hi"])


def test_folder_messages_say_what_the_folder_is(make_gguf, converted, tmp_path):
    import shutil

    folder = tmp_path / "gdir"
    folder.mkdir()
    shutil.copy(make_gguf("q4_0"), folder / "model.gguf")
    for command in (["convert", str(folder), "-o", str(tmp_path / "out")], ["run", str(folder), "-p", "hi"],
                    ["inspect", str(folder)]):
        said = _fails(command)
        assert f"{folder}: a folder of GGUF files (model.gguf), not a converted model" in said, command
        assert f"moepass convert {folder / 'model.gguf'} -o OUT" in said
    # a folder moepass wrote: its QMoE nodes are named (not 'MoE layers none found'), and its tokenizer,
    # genai config and what moepass.json knew of the model carry over, so that the copy runs as the original
    again = _ok(["convert", str(converted("q4_0")), "-o", str(tmp_path / "again")]).stdout
    assert "MoE layers    none to fuse; 2 QMoE/MoE nodes were there already, kept as they are" in again
    assert {"tokenizer.json", "tokenizer_config.json", "genai_config.json"} <= {
        p.name for p in (tmp_path / "again").iterdir()}
    assert _ok(["run", str(tmp_path / "again"), "-p", "the other one", "-n", "6"]).stdout == \
        _ok(["run", str(converted("q4_0")), "-p", "the other one", "-n", "6"]).stdout
    # someone else's ONNX model that has QMoE nodes already: they are named, not 'none found'
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(converted("q4_0") / name, foreign / name)
    out = _ok(["convert", str(foreign), "-o", str(tmp_path / "fused")]).stdout
    assert "MoE layers    none to fuse; 2 QMoE/MoE nodes were there already, kept as they are" in out


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


def test_a_seed_of_minus_one_is_a_random_seed_said_on_stderr(converted):
    """llama.cpp's `-s -1`: a random seed, said, and `-s` with it repeats the run token for token."""
    args = ["run", str(converted("q4_0")), "--prompt-ids", "1,2,3", "-n", "8", "--temp", "1.5", "--top-k", "0"]
    first = _ok([*args, "-s", "-1"])
    said = re.search(r"random seed (\d+) \(-s \1 repeats this run\)", first.stderr)
    assert said, first.stderr
    assert _ok([*args, "-s", said.group(1)]).stdout == first.stdout
    assert "-2 is not in the range" in _fails([*args, "-s", "-2"])


def test_a_quiet_convert_says_one_line(make_gguf, tmp_path):
    """`convert -q`: no bar and one line, what was written and in which form, not the summary."""
    out = _ok(["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "out"), "-q"]).stdout
    assert out.count("\n") == 1 and out.startswith("converted ") and "native Q4_0/Q4_0/Q4_0 in 2 layers" in out, out
