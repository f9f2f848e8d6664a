"""The help a user reads: -h everywhere, bare `moepass` is the help (exit 0), every option says its
default, llama.cpp's short flags, and usage mistakes point to --help."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from moepass.cli import main

COMMANDS = sorted(main.commands)
# inputs a user may give or not, which have no default to state
OPTIONAL_INPUTS = {"prompt", "prompt_file", "prompt_ids", "prompts_file", "system", "imatrix", "print_after",
                   "profile", "report", "gpu_preset", "cpu_profile"}


def test_bare_moepass_is_the_help():
    result = CliRunner().invoke(main, [], prog_name="moepass")
    assert result.exit_code == 0 and "Usage: moepass" in result.stdout and "serve" in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_its_default(command):
    result = CliRunner().invoke(main, [command, "-h"], prog_name="moepass")
    assert result.exit_code == 0 and f"Usage: moepass {command}" in result.stdout
    cmd = main.commands[command]
    silent = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.is_flag and not p.required
              and not p.multiple and not p.hidden and p.name not in ("help", *OPTIONAL_INPUTS)
              and not (p.show_default and (p.default is not None or isinstance(p.show_default, str)))
              and "default" not in (p.help or "")]
    assert not silent, f"{command}: options that do not say their default: {silent}"


@pytest.mark.parametrize("command,short,long", [
    ("run", "-p", "--prompt"), ("run", "-n", "--max-new-tokens"), ("run", "-t", "--threads"),
    ("chat", "-n", "--max-new-tokens"), ("bench", "-p", "--prompt-tokens"), ("bench", "-n", "--new-tokens"),
    ("bench", "-r", "--repeats"), ("convert", "-c", "--context"), ("convert", "-t", "--threads"),
    ("partition", "-c", "--context"), ("serve", "-t", "--threads")])
def test_llama_cpp_short_flags(command, short, long):
    option = next(p for p in main.commands[command].params if long in getattr(p, "opts", ()))
    assert short in option.opts


def test_usage_mistakes_point_to_help(converted):
    result = CliRunner().invoke(main, ["run", str(converted("q4_0"))], prog_name="moepass")
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("(see 'moepass run --help')"), result.stderr
    result = CliRunner().invoke(main, ["run", str(converted("q4_0")), "-p", "x", "--top-p", "2"], prog_name="moepass")
    assert result.exit_code == 2 and "--top-p" in result.stderr and "--help" in result.stderr
    result = CliRunner().invoke(main, ["partition", "-h"], prog_name="moepass")
    assert "decimal" in result.stdout and "GiB" in result.stdout


def test_the_commands_are_listed_in_pipeline_order_with_whole_summaries():
    """`moepass --help`: convert, inspect, profile, partition, run, chat, serve, bench (and the rest
    after them), each with its whole first sentence, never cut mid-phrase."""
    from click.testing import CliRunner

    from moepass.cli import main

    text = CliRunner().invoke(main, ["--help"]).output
    listed = [line.split()[0] for line in text.split("Commands:")[1].splitlines() if line.startswith("  ") and
              not line.startswith("    ")]
    order = ["convert", "inspect", "profile", "partition", "run", "chat", "serve", "bench"]
    assert [c for c in listed if c in order] == order and set(listed) >= set(order), listed
    assert "..." not in text.split("Commands:")[1]


def test_convert_help_says_what_each_expert_format_is_and_exact_reads_as_a_sentence():
    from moepass.core.choices import EXPERT_FORMATS

    params = {p.name: p for p in main.commands["convert"].params}
    said = params["expert_format"].help or ""
    assert all(f"{name}: " in said for name in EXPERT_FORMATS), said
    exact = params["exact"].help or ""
    assert "exact exact" not in exact and "bit-exactly exact" not in exact, exact


def test_partition_host_bandwidth_shows_its_default_as_the_others_do(monkeypatch):
    """`[default: 60]`, not `[default: (60)]`; still None to partition where not given (the estimate
    then names only the figures given), the figure where given."""
    import importlib

    from moepass.core.gpus import Bandwidths

    module = importlib.import_module("moepass.partition")
    result = CliRunner().invoke(main, ["partition", "-h"], prog_name="moepass", terminal_width=200)
    line = next(line for line in result.stdout.splitlines() if "--host-bandwidth" in line)
    assert "[default: 60]" in line and "(60)" not in result.stdout, line
    seen = []
    monkeypatch.setattr(module, "partition", lambda *a, **k: seen.append(k["bandwidths"]) or 1 / 0)
    for extra in ([], ["--host-bandwidth", "30"], ["--gpu-bandwidth", "500"]):
        CliRunner().invoke(main, ["partition", "m", "--vram", "8G", *extra])
    default, host, gpu = seen
    assert default.host == 60 and default.source == Bandwidths().source
    assert host.host == 30 and host.source == default.source
    assert gpu.host == 60 and gpu.source == "from --gpu-bandwidth", gpu
