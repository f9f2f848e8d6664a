"""llama.cpp's flags as a llama.cpp user types them: --temp, -m/--model, -c/--ctx-size and -n -1 do
what they do in llama.cpp (the same output as moepass's own spelling), and the flags that place
layers as the model loads (-ngl, --n-cpu-moe, -ot, ...) are one line naming moepass's way: partition
the model ahead of time."""

from __future__ import annotations

import dataclasses
import json
import re
import socket

import pytest
from click.testing import CliRunner
from make_fixtures import TEST_DIMS

from moepass.cli import main
from support.turn_speed import TURN_SPEED, turn_counts

IDS = ("--prompt-ids", "1,2,3")  # three prompt tokens
SMALL_CONTEXT = 24


def _invoke(*args, stdin: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=stdin, prog_name="moepass")


def _ok(*args, stdin: str | None = None):
    result = _invoke(*args, stdin=stdin)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr, result.stderr
    return result


def _refused(*args) -> str:
    """The one line a mistake ends with (exit status 2), after what was done before it (loading)."""
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("moepass: error: ") and "moepass: error" not in "".join(lines[:-1]), result.stderr
    return lines[-1]


def _tokens(result) -> list[str]:
    return result.stdout.strip().split(",")


def _ended(result) -> str:
    return result.stderr.strip().splitlines()[-1].split("ended by ", 1)[1]


@pytest.fixture(scope="module")
def model(converted) -> str:
    return str(converted("q4_0"))


@pytest.fixture(scope="module")
def small(converted) -> str:
    """The same model converted for a context of SMALL_CONTEXT positions."""
    return str(converted("q4_0", dims=dataclasses.replace(TEST_DIMS, context_length=SMALL_CONTEXT)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --temp


@pytest.mark.parametrize("value", ["0", "0.7"])
def test_temp_is_temperature(model, value):
    llama = _ok("run", model, *IDS, "-n", "8", "--temp", value, "--seed", "3")
    ours = _ok("run", model, *IDS, "-n", "8", "--temperature", value, "--seed", "3")
    assert llama.stdout == ours.stdout and len(_tokens(llama)) >= 1


def test_temp_and_temperature_are_one_option():
    """Wherever moepass takes --temperature (run and chat; serve's requests carry their own)."""
    options = {name: [p for p in command.params if "--temperature" in getattr(p, "opts", ())]
               for name, command in main.commands.items()}  # fmt: skip
    assert {name for name, found in options.items() if found} == {"run", "chat"}
    for [option] in (found for found in options.values() if found):
        assert option.opts == ["--temperature", "--temp"] and option.name == "temperature"


def test_chat_takes_temp(model):
    turns = "the other one\n/exit\n"
    llama = _ok("chat", model, "-n", "6", "--temp", "0", stdin=turns)
    ours = _ok("chat", model, "-n", "6", "--temperature", "0", stdin=turns)
    assert llama.stdout == ours.stdout and TURN_SPEED.search(llama.stderr)


# -m/--model


def test_m_is_the_model_argument(model, make_gguf, tmp_path):
    assert _ok("run", "-m", model, *IDS, "-n", "4").stdout == _ok("run", model, *IDS, "-n", "4").stdout
    assert _ok("run", *IDS, "--model", model, "-n", "4").stdout == _ok("run", model, *IDS, "-n", "4").stdout
    assert json.loads(_ok("inspect", "-m", model, "--json").stdout) == json.loads(
        _ok("inspect", model, "--json").stdout
    )
    _ok("convert", "-m", make_gguf("q4_0"), "-o", tmp_path / "out", "-q")
    assert (tmp_path / "out" / "model.onnx").is_file()
    bench = _ok("bench", "-m", model, "-p", "4", "-n", "2", "-r", "1", "--json")
    assert json.loads(bench.stdout)["model"] == model


@pytest.mark.parametrize(
    "command,extra",
    [("run", ()), ("chat", ()), ("serve", ()), ("bench", ()), ("inspect", ()), ("profile", ("-o", "p.json")),
     ("partition", ()), ("convert", ("-o", "out"))],
)  # fmt: skip
def test_the_model_once(command, extra):
    """Exactly one of MODEL and -m MODEL: both, or neither, is one line."""
    both = _refused(command, "a.gguf", "-m", "b.gguf", *extra)
    assert "not both" in both and "a.gguf" in both and "b.gguf" in both and f"moepass {command} --help" in both
    neither = _refused(command, *extra)
    assert "missing" in neither and "-m" in neither


def test_the_usage_line_stays_readable():
    result = _ok("run", "-h")
    assert result.stdout.splitlines()[0] == "Usage: moepass run [OPTIONS] MODEL"
    assert re.search(r"-m, --model MODEL\s", result.stdout)
    assert _ok("inspect", "-h").stdout.splitlines()[0] == "Usage: moepass inspect [OPTIONS] PATH"


# -c/--ctx-size


def test_ctx_size_bounds_prompt_and_generation(model):
    """-c 8 after a prompt of 3 tokens: generation stops at the context, after 5 tokens (or at the
    stop token before them), as -n 5 without it."""
    bounded = _invoke("run", model, *IDS, "-n", "16", "-c", "8")
    assert bounded.exit_code == 0, bounded.output
    assert bounded.stdout == _ok("run", model, *IDS, "-n", "5").stdout and len(_tokens(bounded)) <= 5
    assert "at this run's context of 8 (-c 8)" in bounded.stderr  # the runtime's warning that 16 were asked
    assert _ok("run", model, *IDS, "-n", "5", "--ctx-size", "8").stdout == bounded.stdout
    assert _ok("run", model, *IDS, "-n", "5", "-c", "0").stdout == bounded.stdout  # 0: the model's own
    refused = _refused("run", model, "--prompt-ids", ",".join(["1"] * 8), "-c", "8")
    # the user's own -c limits: said, not "convert --context N"
    assert "this run's context holds 8 (-c 8 limits this run; give more, up to the 512" in refused
    assert "--context" not in refused


def test_ctx_size_in_chat(model):
    """A turn's prompt and answer within -c."""
    result = _invoke("chat", model, "-c", "20", "--temp", "0", "-n", "64", stdin="hi\n/exit\n")
    assert result.exit_code == 0, result.output
    new, prompt, _ = turn_counts(result.stderr)
    assert new + prompt <= 20 and "context of 20 (-c 20)" in result.stderr  # the runtime's: 64 were asked


def test_ctx_size_in_bench(model):
    """bench's prompt and -n tokens (and the one after them) within -c: else one line."""
    refused = _refused("bench", model, "-p", "4", "-n", "2", "-r", "1", "-c", "6")
    assert "context holds 6" in refused and "-c" in refused
    assert json.loads(_ok("bench", model, "-p", "4", "-n", "2", "-r", "1", "-c", "7", "--json").stdout)["decode"]


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_a_larger_ctx_size_points_at_convert(model, command):
    """More than the model was converted for (512): one line naming `moepass convert --context N`."""
    extra = {"run": IDS, "serve": ("--port", _free_port())}.get(command, ())
    line = _refused(command, model, *extra, "-c", "600")
    assert "512" in line and "moepass convert" in line and "--context 600" in line


# -n -1


def test_n_minus_one_runs_until_the_context_is_full(small):
    """-n -1 on a model converted for 24 positions: the 21 tokens after a prompt of 3 (or up to the
    stop token), the same tokens as -n 21, without a warning."""
    llama = _ok("run", small, *IDS, "-n", "-1")
    assert llama.stdout == _ok("run", small, *IDS, "-n", SMALL_CONTEXT - 3).stdout
    count = len(_tokens(llama))
    if _ended(llama).startswith("the stop token"):
        assert count <= SMALL_CONTEXT - 3
    else:
        assert count == SMALL_CONTEXT - 3 and _ended(llama) == f"the context ({SMALL_CONTEXT} tokens)"


def test_n_minus_one_within_ctx_size(model):
    llama = _ok("run", model, *IDS, "-n", "-1", "-c", "12")
    assert llama.stdout == _ok("run", model, *IDS, "-n", "9").stdout
    assert len(_tokens(llama)) == 9 or _ended(llama).startswith("the stop token")
    text = _ok("run", model, "-p", "the other one", "-n", "-1", "-c", "16")
    assert re.search(r"ended by (the context \(16 tokens\)|the stop token)", text.stderr)


def test_n_minus_one_in_chat(small):
    """Each answer until the stop token or the context: as long as run --chat's answer."""
    chat = _ok("chat", small, "-n", "-1", "--temp", "0", stdin="hi\n/exit\n")
    new, prompt, _ = turn_counts(chat.stderr)
    run = _ok("run", small, "--chat", "-p", "hi", "-n", "-1", "--temp", "0")
    assert f"{new} tokens in" in run.stderr and new + prompt <= SMALL_CONTEXT
    assert new + prompt == SMALL_CONTEXT or _ended(run).startswith("the stop token")


@pytest.mark.parametrize("command,value", [("run", "-2"), ("run", "-100"), ("chat", "-2"), ("chat", "0")])
def test_other_negative_counts_are_refused(model, command, value):
    line = _refused(command, model, "-n", value)
    assert "--max-new-tokens" in line and "-1" in line


# -ngl, --n-cpu-moe, -ot: placed ahead of time by partition

PLACEMENT = [("-ngl", "99"), ("--n-gpu-layers", "99"), ("--gpu-layers", "99"), ("-ngl=99",), ("--n-cpu-moe", "8"),
             ("-ncmoe", "8"), ("-ot", r"blk\.[0-9]+\.ffn_.*_exps=CPU"), ("--override-tensor", "exps=CPU"),
             ("-cmoe",), ("--cpu-moe",)]  # fmt: skip


@pytest.mark.parametrize("typed", PLACEMENT, ids=lambda t: t[0])
@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_gpu_placement_flags_name_partition(model, command, typed):
    """One line naming the flag typed and the moepass way; -ngl 99 matched whole (not as -n gl)."""
    extra = IDS if command == "run" else ()
    line = _refused(command, model, *extra, *typed)
    flag = typed[0].split("=")[0]
    assert f"{flag}" in line and "partition" in line and "--target layers" in line, line
    assert f"moepass {command} PLACED/" in line and "valid integer" not in line and "'gl'" not in line


def test_placement_flags_are_hidden_and_n_is_still_n(model):
    help_text = _ok("run", "-h").stdout
    assert not re.search(r"\s(-ngl|--n-gpu-layers|--n-cpu-moe|-ot|--override-tensor|--cpu-moe)\b", help_text)
    assert len(_tokens(_ok("run", model, *IDS, "-n", "2"))) <= 2  # -n beside -ngl and -ncmoe
    assert len(_tokens(_ok("run", model, *IDS, "-n2"))) <= 2
