"""A GGUF given to run, chat, serve, bench or moepass.load (the llama.cpp habit): converted once with
the defaults into the cache, reused, rebuilt when the file changes or the entry is not whole."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from click.testing import CliRunner
from gguf import GGUFWriter
from make_fixtures import DEMO_DIMS, DEMO_FIXTURE, write_moe_gguf

import moepass
from moepass.cli import main
from moepass.core.errors import MoepassError
from moepass.gguf_cache import CacheRecord


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


def test_a_touched_file_is_converted_again(gguf, cache):
    _run(gguf)
    (entry,) = _entries(cache)
    before = json.loads((cache / f"{entry}.json").read_text())
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place: same size
    result = _run(gguf)
    assert "converted with the defaults" in result.stderr
    assert _entries(cache) == [entry]
    assert json.loads((cache / f"{entry}.json").read_text())["parts"] != before["parts"]


def _tokens(result) -> str:
    return result.stdout.strip()


MIB = 1 << 20
LARGER = dataclasses.replace(DEMO_DIMS, n_layers=8)  # past the first MiB: the key moepass had read no further


def _past_first_mib(path, seed, tmp_path):
    """The bytes `path` would hold past its first MiB had it been written with another seed (the
    same header: same sizes, other weights)."""
    other = tmp_path / f"other-{seed}.gguf"
    write_moe_gguf(other, "q4_0", LARGER, seed=seed)
    assert other.stat().st_size == path.stat().st_size > 2 * MIB
    return other.read_bytes()[MIB:]


def _converted_now(gguf, tmp_path) -> str:
    fresh = tmp_path / f"fresh-{gguf.parent.name}"
    assert CliRunner().invoke(main, ["convert", str(gguf), "-o", str(fresh), "-q"]).exit_code == 0
    return _tokens(CliRunner().invoke(main, ["run", str(fresh), "--prompt-ids", "1,2,3", "-n", "4"]))


def test_a_file_rewritten_in_place_with_its_mtime_restored_gets_its_own_conversion(tmp_path, cache):
    """cp -p, rsync -t and tar keep size and mtime: the bytes past the first MiB changed, the cache
    must see it (ctime, and the sampled data blocks)."""
    gguf = tmp_path / "m" / "model.gguf"
    gguf.parent.mkdir()
    write_moe_gguf(gguf, "q4_0", LARGER, seed=0)
    first = _run(gguf)
    rest = _past_first_mib(gguf, 7, tmp_path)
    stat = gguf.stat()
    with open(gguf, "r+b") as f:
        f.seek(MIB)
        f.write(rest)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = _run(gguf)
    assert "converted with the defaults" in second.stderr, second.stderr
    assert _tokens(second) == _converted_now(gguf, tmp_path) != _tokens(first)


def test_two_files_of_the_same_name_size_and_mtime_each_get_their_own(tmp_path, cache):
    x, y = tmp_path / "x" / "model.gguf", tmp_path / "y" / "model.gguf"
    x.parent.mkdir()
    y.parent.mkdir()
    write_moe_gguf(x, "q4_0", LARGER, seed=0)
    y.write_bytes(x.read_bytes()[:MIB] + _past_first_mib(x, 7, tmp_path))  # the same first MiB
    os.utime(y, ns=(x.stat().st_atime_ns, x.stat().st_mtime_ns))
    from_x, from_y = _run(x), _run(y)
    assert "converted with the defaults" in from_y.stderr and len(_entries(cache)) == 2
    assert _tokens(from_y) == _converted_now(y, tmp_path) != _tokens(from_x)


def test_content_digest_covers_the_whole_header_past_the_first_mib(tmp_path):
    """A 151,936-token vocabulary puts the tensor index past 3.9 MB: a change there is seen."""
    import numpy as np

    from moepass.gguf_cache import content_digest

    path = tmp_path / "big-vocab.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_token_list([f"tok{i:06d}" for i in range(151_936)])
    writer.add_tensor("a", np.zeros(64, np.float32))
    writer.add_tensor("b", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    view = path.read_bytes()
    name_at = view.rindex(b"b\x01\x00\x00\x00")  # the last tensor's entry in the index
    assert name_at > 1 << 20
    before = content_digest(path)
    patched = bytearray(view)
    patched[name_at] = ord("c")  # another tensor name, deep in the index
    path.write_bytes(bytes(patched))
    assert content_digest(path) != before


@pytest.mark.parametrize(
    "damage", ["no record", "cut data", "foreign record", "empty folder", "damaged data", "record of another source",
               "record with a field of the wrong type"]
)
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
    elif damage == "damaged data":  # the same size, other bytes
        data = next(p for p in (cache / entry).iterdir() if p.name.endswith(".data"))
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(b"\x7f" * 64)
    elif damage == "record of another source":
        forged = json.loads(record.read_text())
        record.write_text(json.dumps({**forged, "source": "/elsewhere/tiny.gguf"}))
    elif damage == "record with a field of the wrong type":
        forged = json.loads(record.read_text())
        record.write_text(json.dumps({**forged, "files": {name: {**f, "size": str(f["size"])}
                                                          for name, f in forged["files"].items()}}))
    else:
        shutil.rmtree(cache / entry)
        (cache / entry).mkdir()
    result = _run(gguf)
    assert "converted with the defaults" in result.stderr, result.stderr
    assert _entries(cache) == [entry] and json.loads(record.read_text())["format"] == "moepass-gguf-cache"


def test_the_record_is_its_class_written_out(gguf, cache):
    """An entry's record holds exactly CacheRecord's fields, as the class writes them: the file as JSON
    reads equals the record read back and written out again."""
    _run(gguf)
    (entry,) = _entries(cache)
    path = cache / f"{entry}.json"
    written = json.loads(path.read_text())
    record = CacheRecord.from_json(written, path)
    assert record is not None and record.to_json() == written
    assert record.source == str(gguf.resolve()) and set(record.files) == {p.name for p in (cache / entry).iterdir()}


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


# ---- a cache folder others can write to: nothing followed, nothing trusted that moepass did not write


def test_a_planted_lock_link_is_refused_and_its_target_not_made(gguf, cache, tmp_path):
    from moepass.gguf_cache import entry_name

    cache.mkdir()
    name = entry_name(gguf.resolve())
    victim = tmp_path / "victim"
    (cache / f"{name}.lock").symlink_to(victim)
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "-n", "1"])
    assert result.exit_code != 0 and "a symbolic link in the GGUF cache" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not victim.exists()


def test_a_planted_record_link_is_replaced_not_followed(gguf, cache, tmp_path):
    from moepass.gguf_cache import entry_name

    cache.mkdir()
    name = entry_name(gguf.resolve())
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own\n")
    (cache / f"{name}.json").symlink_to(victim)
    _run(gguf)
    assert victim.read_text() == "the victim's own\n"
    assert not (cache / f"{name}.json").is_symlink() and json.loads((cache / f"{name}.json").read_text())["source"]


def test_a_lock_of_another_user_is_refused(gguf, cache, monkeypatch):
    """A lock planted by someone else (here: our own, seen from another uid)."""
    import moepass.gguf_cache as gguf_cache

    _run(gguf)
    (entry,) = _entries(cache)
    monkeypatch.setattr(gguf_cache.os, "getuid", lambda: os.geteuid() + 4242)
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "-n", "1"])
    assert result.exit_code != 0 and "not a file of this user's in the GGUF cache" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and _entries(cache) == [entry]


def test_planted_temporaries_are_never_written_through(gguf, cache, tmp_path):
    """The record's temporary has an unguessable name and is created O_EXCL|O_NOFOLLOW: links
    planted under the names moepass once used (.NAME.json.PID.tmp) and any other are left alone."""
    from moepass.gguf_cache import entry_name

    cache.mkdir()
    name = entry_name(gguf.resolve())
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own\n")
    for pid in range(os.getpid() - 5, os.getpid() + 50):
        (cache / f".{name}.json.{pid}.tmp").symlink_to(victim)
    _run(gguf)
    assert victim.read_text() == "the victim's own\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_an_entry_of_another_user_is_neither_used_nor_removed(gguf, cache):
    """A forged entry planted by someone else in a shared (sticky) cache folder."""
    _run(gguf)
    (entry,) = _entries(cache)
    for path in (cache / entry, cache / f"{entry}.json", *(cache / entry).iterdir()):
        os.lchown(path, 4242, 4242)
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "-n", "1"])
    assert result.exit_code != 0 and "not this user's" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and _entries(cache) == [entry]
    listed = CliRunner().invoke(main, ["cache", "list"]).stdout
    assert "another user's" in listed and " 0 B " not in listed, listed
    assert CliRunner().invoke(main, ["cache", "clear"]).exit_code == 0 and _entries(cache) == [entry]


def test_a_record_named_dot_dot_json_removes_nothing(gguf, cache):
    _run(gguf)
    (entry,) = _entries(cache)
    forged = json.loads((cache / f"{entry}.json").read_text())
    (cache / "..json").write_text(json.dumps({**forged, "moepass": "0.0.1"}))  # an "older" entry of the file
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _run(gguf)  # rebuilt: older entries of the same source removed
    assert CliRunner().invoke(main, ["cache", "prune"]).exit_code == 0
    assert cache.is_dir() and _entries(cache) == [entry] and (cache / "..json").exists()


@pytest.mark.parametrize("sticky", [False, True])
def test_a_cache_folder_others_can_write_is_used_only_when_sticky(gguf, tmp_path, sticky):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777 if sticky else 0o777)
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "-n", "1", "--cache-dir", str(shared)])
    if sticky:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code != 0 and "writable by other users and not sticky" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not os.listdir(shared)


def test_a_run_waiting_on_another_conversion_says_so(gguf, cache):
    import fcntl
    import threading

    from moepass.gguf_cache import converted, entry_name

    converted(gguf)
    lock = cache / f"{entry_name(gguf.resolve())}.lock"
    said = []
    with open(lock, "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("12345\n")
        held.flush()
        threading.Timer(1.0, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        entry = converted(gguf, echo=said.append)
    assert not entry.built and len(said) == 1 and "waiting for another moepass (pid 12345)" in said[0], said


def test_cache_list_prune_clear(gguf, cache, tmp_path):
    _run(gguf)
    gone = tmp_path / "gone" / "gone.gguf"
    gone.parent.mkdir()
    shutil.copy(gguf, gone)
    _run(gone)
    gone.unlink()
    (cache / ".left-by-a-killed-run.json.0123.tmp").write_text("{}")
    listed = CliRunner().invoke(main, ["cache", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    states = {e["source"]: e["state"] for e in json.loads(listed.stdout)["entries"]}
    assert states == {str(gguf.resolve()): "current", str(gone.resolve()): "source gone"}
    text = CliRunner().invoke(main, ["cache", "list"]).stdout
    assert "2 entries" in text and "source gone" in text and str(gone.resolve()) in text
    rows = text.splitlines()[1:]  # columns aligned: each entry's state starts where the others' do
    assert len(rows) == 2 and len({row.index("current" if "current" in row else "source gone") for row in rows}) == 1, text
    pruned = CliRunner().invoke(main, ["cache", "prune"])
    assert pruned.exit_code == 0 and "removed 1 stale entry" in pruned.stdout, pruned.output
    assert len(_entries(cache)) == 1 and not (cache / ".left-by-a-killed-run.json.0123.tmp").exists()
    assert "using its conversion" in _run(gguf).stderr
    cleared = CliRunner().invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 entry" in cleared.stdout and _entries(cache) == []
    assert [p.name for p in cache.iterdir()] == []


def test_an_entry_whose_files_cannot_be_read_is_rebuilt(gguf, cache, monkeypatch):
    """Was: ONNX Runtime's `SystemError : 13` at load. An unreadable entry file (here: reading it
    raises EACCES, as for a file another user made private) is found at the check and rebuilt."""
    import errno

    import moepass.gguf_cache as gguf_cache

    _run(gguf)
    real = gguf_cache.sampled_digest
    refused: list = []

    def unreadable(path, *args):
        if not refused and path.name.endswith(".data"):
            refused.append(path)
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args)

    monkeypatch.setattr(gguf_cache, "sampled_digest", unreadable)
    result = _run(gguf)
    assert "converted with the defaults" in result.stderr, result.stderr


def test_a_group_writable_cache_folder_of_the_users_own_group_is_used(gguf, tmp_path):
    """umask 002 with a user private group (Debian, Fedora) makes group-writable folders only the
    user can write: used. A group with other members would be refused."""
    from moepass.gguf_cache import _private_group

    folder = tmp_path / "grouped"
    folder.mkdir()
    folder.chmod(0o775)
    result = CliRunner().invoke(main, ["run", str(gguf), "--prompt-ids", "1", "-n", "1", "--cache-dir", str(folder)])
    own = _private_group(folder.stat().st_gid)
    assert (result.exit_code == 0) == own, result.output
    if not own:
        assert "writable by other users and not sticky" in result.stderr


def test_the_cache_line_says_the_entrys_bytes_beside_the_files(gguf, cache):
    """Converted and reused alike: "N GiB for a M GiB file, R.RRx" (format_bytes, the summaries' own)."""
    from moepass.core.choices import format_bytes

    for result, said in ((_run(gguf), "converted with the defaults"), (_run(gguf), "using its conversion")):
        (entry,) = _entries(cache)
        held, size = sum(p.lstat().st_size for p in (cache / entry).iterdir()), gguf.stat().st_size
        sizes = f"{format_bytes(held)} for a {format_bytes(size)} file, {held / size:.2f}x"
        (line,) = [line for line in result.stderr.splitlines() if said in line]
        assert sizes in line, line
