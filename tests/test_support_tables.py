"""The README's support tables are what moepass.support_tables writes from the code's tables."""

import dataclasses
import re
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as GT

from moepass import support_tables
from moepass.core.architectures import ARCHITECTURES
from moepass.core.quants import QUANT_TYPES

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_holds_the_generated_tables():
    text = README.read_text()
    assert support_tables.render(text) == text, "README.md is stale: python -m moepass.support_tables --write README.md"


def test_every_architecture_and_type_is_one_row():
    arch_rows = support_tables.architectures_table().splitlines()[2:]
    assert [re.match(r"\| `([^`]+)` \|", row).group(1) for row in arch_rows] == list(ARCHITECTURES)
    type_cells = [row.split(" | ")[0].lstrip("| ") for row in support_tables.quant_types_table().splitlines()[2:]]
    names = [name for cell in type_cells for name in cell.split(", ")]
    assert sorted(names) == sorted(qt.name for qt in QUANT_TYPES.values())


def test_a_changed_form_policy_changes_the_table(monkeypatch):
    q6_k = QUANT_TYPES[GT.Q6_K]
    kernels = "| Q6_K | the file's own blocks (moepass's kernels) |"
    assert f"{kernels} int8/b128, requantized" in support_tables.quant_types_table()
    monkeypatch.setitem(QUANT_TYPES, GT.Q6_K, dataclasses.replace(q6_k, int8_block=32))
    assert f"{kernels} int8/b32, requantized" in support_tables.quant_types_table()
    monkeypatch.setitem(QUANT_TYPES, GT.Q6_K, dataclasses.replace(q6_k, cpu_segments=()))
    assert "| Q6_K | as `qmoe` | int8/b128, requantized" in support_tables.quant_types_table()


def test_a_file_without_the_sections_is_refused():
    with pytest.raises(SystemExit, match="no generated section 'architectures'"):
        support_tables.render("# a README without generated tables\n")
