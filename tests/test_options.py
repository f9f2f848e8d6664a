"""Options declared once (moepass.core.options): the CLI's click options are made from the records and
the API's options dataclasses take their defaults from them, so neither can drift from the other."""

from __future__ import annotations

import dataclasses
import importlib

import click
import pytest
from click.testing import CliRunner

from moepass.cli import main
from moepass.core.options import CONVERT_OPTIONS, PARTITION_OPTIONS
from moepass.partition import PartitionOptions
from moepass.pipeline.conversion import ConvertOptions

# fields each command composes or shares rather than declares: --threads (every command's), and
# partition's bandwidths (three flags and a --gpu card's data sheet make one Bandwidths)
COMMANDS = {
    "convert": (CONVERT_OPTIONS, ConvertOptions, {"threads"}),
    "partition": (PARTITION_OPTIONS, PartitionOptions, {"threads", "bandwidths"}),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_field_is_its_options_record(command):
    records, options, composed = COMMANDS[command]
    fields = {f.name: f for f in dataclasses.fields(options)}
    assert set(records) == set(fields) - composed
    for name, record in records.items():
        assert fields[name].default == record.default, name


@pytest.mark.parametrize("command", COMMANDS)
def test_each_click_option_is_made_from_its_record(command):
    records, _, _ = COMMANDS[command]
    params = {p.name: p for p in main.commands[command].params if isinstance(p, click.Option)}
    for name, record in records.items():
        param = params[name]
        assert tuple(param.opts) == record.flags and param.help == record.help, name
        assert param.default == record.default, name
        if record.choices:
            assert tuple(param.type.choices) == tuple(record.choices), name


def test_switches_give_the_keywords_the_api_takes(converted, tmp_path, monkeypatch):
    """--no-calibrate, --ignore-kernel-table and --keep-form reach partition as calibrate=False,
    kernel_table=False and lower=False; without them, as the dataclass's defaults."""
    seen = []
    partitioning = importlib.import_module("moepass.partition")
    monkeypatch.setattr(partitioning, "partition", lambda *a, **k: seen.append(k) or (_ for _ in ()).throw(
        click.UsageError("stop here")))
    model = str(converted("q4_0"))
    CliRunner().invoke(main, ["partition", model, "--vram", "8G", "--no-calibrate", "--ignore-kernel-table",
                              "--keep-form"])
    CliRunner().invoke(main, ["partition", model, "--vram", "8G"])
    given, default = seen
    assert (given["calibrate"], given["kernel_table"], given["lower"]) == (False, False, False)
    assert (default["calibrate"], default["kernel_table"], default["lower"]) == (True, True, True)
    assert PartitionOptions.of(None, {k: v for k, v in given.items() if k in PARTITION_OPTIONS}).lower is False
