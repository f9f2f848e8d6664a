"""The same input gives the same bytes wherever it lies: a GGUF converted (and partitioned in one
step) from two folders gives byte-identical output folders; a placed model's plan.json differs only
in its shared data file's identity (inode, mtime: what the load checks), and no written file holds
an absolute path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from make_fixtures import DEMO_FIXTURE
from moepass.cli import main


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _made_in(folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(DEMO_FIXTURE, folder / "model.gguf")
    for args in (["convert", folder / "model.gguf", "-o", folder / "out", "-q"],
                 ["partition", folder / "out", "--vram", "8G", "--no-calibrate", "-o", folder / "placed"],
                 ["partition", folder / "model.gguf", "--vram", "8G", "--no-calibrate", "-o", folder / "one-step"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return folder


def test_the_same_gguf_from_two_folders_gives_the_same_bytes(tmp_path):
    a = _made_in(tmp_path / "first" / "deeper")
    b = _made_in(tmp_path / "second")
    for output in ("out", "placed", "one-step"):
        ours, theirs = _tree(a / output), _tree(b / output)
        assert list(ours) == list(theirs), output
        for name in ours:
            if (output, name) == ("placed", "plan.json"):
                mine, other = json.loads(ours[name]), json.loads(theirs[name])
                shared = mine.get("shared_data"), other.get("shared_data")  # none where the data is written anew
                identities = [s.pop("identity") if s else None for s in shared]
                assert (identities[0] or {}).get("digest") == (identities[1] or {}).get("digest") and mine == other
            else:
                assert ours[name] == theirs[name], f"{output}/{name} differs between the two folders"
            assert str(tmp_path).encode() not in ours[name], f"{output}/{name} holds an absolute path"
