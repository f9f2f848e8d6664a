"""A GGUF given to run, chat, serve, bench or moepass.load (the llama.cpp habit): converted once with
the defaults into the cache, reused, rebuilt when the file changes or the entry is not whole."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner
from make_fixtures import DEMO_FIXTURE

import moepass
from moepass.cli import main
from moepass.core.errors import MoepassError


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    shutil.copy(DEMO_FIXTURE, path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOEPASS_CACHE", str(folder))
    return folder


def _run(gguf, *extra):
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1,2,3", "-n", "4", *extra])
    assert result.exit_code == 0, result.output
    return result


def _entries(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def test_run_converts_once_then_reuses_and_matches_an_explicit_conversion(gguf, cache, tmp_path):
    first = _run(gguf)
    said = [line for line in first.stderr.splitlines() if str(gguf) in line]
    assert len(said) == 1 and "converted with the defaults into" in said[0], first.stderr
    (entry,) = _entries(cache)
    assert entry.startswith("tiny-") and str(cache / entry) in said[0]
    model_file = cache / entry / "model.onnx"
    written = model_file.stat().st_mtime_ns
    second = _run(gguf)
    assert "using its conversion in" in second.stderr and "converted with" not in second.stderr
    assert model_file.stat().st_mtime_ns == written and second.stdout == first.stdout
    assert CliRunner().invoke(main, ["convert", str(gguf), "-o", str(tmp_path / "explicit"), "-q"]).exit_code == 0
    explicit = CliRunner().invoke(main, ["run", str(tmp_path / "explicit"), "--prompt-ids", "1,2,3", "-n", "4"])
    assert explicit.stdout == first.stdout


def test_a_changed_file_is_converted_again_and_the_old_entry_removed(gguf, cache):
    _run(gguf)
    (old,) = _entries(cache)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place: same size
    result = _run(gguf)
    assert "converted with the defaults" in result.stderr
    (new,) = _entries(cache)
    assert new != old and not (cache / f"{old}.json").exists()


@pytest.mark.parametrize("damage", ["no record", "cut data", "foreign record", "empty folder"])
def test_an_entry_not_whole_is_rebuilt_never_used(gguf, cache, damage):
    _run(gguf)
    (entry,) = _entries(cache)
    record = cache / f"{entry}.json"
    if damage == "no record":  # killed between the conversion's rename and its record
        record.unlink()
    elif damage == "cut data":
        data = next(p for p in (cache / entry).iterdir() if p.name.endswith(".data"))
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "foreign record":
        record.write_text(json.dumps({"format": "something else"}))
    else:
        shutil.rmtree(cache / entry)
        (cache / entry).mkdir()
    result = _run(gguf)
    assert "converted with the defaults" in result.stderr, result.stderr
    assert _entries(cache) == [entry] and json.loads(record.read_text())["format"] == "moepass-gguf-cache"


def test_cache_dir_option_then_xdg_cache_home(gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPASS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _run(gguf, "--cache-dir", str(tmp_path / "mine"))
    assert len(_entries(tmp_path / "mine")) == 1 and not (tmp_path / "xdg").exists()
    _run(gguf)
    assert len(_entries(tmp_path / "xdg" / "moepass")) == 1


def test_bench_takes_a_gguf(gguf, cache):
    result = CliRunner().invoke(main, ["bench", str(gguf), "-p", "4", "-n", "2", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    (entry,) = _entries(cache)
    assert report["model"] == str(cache / entry) and report["decode"]["tokens_per_s"] > 0


def test_the_api_loads_a_gguf_and_the_runtime_alone_says_what_to_do(gguf, cache):
    decoder = moepass.load(gguf)
    assert len(list(decoder.generate([1, 2, 3], 3, stop_ids=()))) == 3
    assert decoder.model_dir.parent == cache
    from moepass.runtime import load

    with pytest.raises(MoepassError, match="a GGUF file, not a converted model: moepass.load"):
        load(gguf)


def test_an_unwritable_cache_is_one_line(gguf, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "--cache-dir", str(blocker / "c")])
    assert result.exit_code != 0 and "cannot make the GGUF cache folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_gguf_draft_model_goes_through_the_cache(gguf, cache):
    """--speculative draft:MODEL.gguf: the draft is the cached conversion too (here the model itself:
    greedy tokens are plain decoding's)."""
    plain = _run(gguf)
    drafted = _run(gguf, "--speculative", f"draft:{gguf}")
    assert drafted.stdout == plain.stdout and drafted.stderr.count("using its conversion in") == 2
    assert len(_entries(cache)) == 1
