"""The documents a reader starts from stay short and current: the README within 120 lines (the two
commands, what moepass does, one table, links), docs/benchmarks.md within 500 lines, one section a
question, each saying the command that measures it and the machine, date and commit its table
ran on; the rows of its tables as JSON lines in benchmarks/results/."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def test_readme_and_benchmarks_page_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120
    assert len(BENCHMARKS.read_text().splitlines()) <= 500


def _sections() -> dict[str, str]:
    text = BENCHMARKS.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_section_says_its_command_machine_date_and_commit():
    sections = _sections()
    assert len(sections) >= 8, list(sections)
    for title, body in sections.items():
        if title == "How to read the tables":
            continue
        assert "benchmarks/" in body or "moepass " in body or "tests/" in body, f"{title}: no command"
        if "| " not in body:  # no table (the GPU section: nothing measured yet): nothing to date
            continue
        assert re.search(r"[Mm]achine", body), f"{title}: no machine"
        assert "commit" in body, f"{title}: no commit (or 'commit: not recorded')"
        assert re.search(r"20\d\d-\d\d-\d\d|date", body), f"{title}: no date"
    assert "this VM" not in BENCHMARKS.read_text()


def test_the_rows_are_json_lines_with_their_provenance():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.jsonl"))
    assert files
    for path in files:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines, path
        for number, line in enumerate(lines, 1):
            row = json.loads(line)
            missing = {"date", "machine", "commit", "command"} - set(row)
            assert not missing, f"{path.name}:{number}: no {sorted(missing)}"


def test_links_into_the_benchmarks_page_land_on_a_section():
    anchors = {re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-") for title in _sections()}
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for anchor in re.findall(r"benchmarks\.md#([A-Za-z0-9_-]+)", doc.read_text()):
            assert anchor in anchors, f"{doc.name}: benchmarks.md#{anchor} names no section"
