"""Where a placed model's data lives: partition shares the source's unchanged weights by a hard link,
else a reflink, else a copy; onto another file system (EXDEV for the link and for the kernel's
copy_file_range: `partition -o /dev/shm/...`) it copies, and says so."""

from __future__ import annotations

import errno
import os

import pytest

from moepass.core import files


def _exdev(*args, **kwargs):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


@pytest.mark.parametrize("size", [0, 1, files.COPY_STEP + 12345])
def test_a_copy_across_file_systems(tmp_path, monkeypatch, size):
    """Neither a link nor the kernel's copy across file systems: the bytes are copied all the same."""
    source = tmp_path / "model.onnx.data"
    data = os.urandom(size)
    source.write_bytes(data)
    monkeypatch.setattr(os, "link", _exdev)
    monkeypatch.setattr(os, "copy_file_range", _exdev)
    seen = []
    how = files.link_or_share(source, tmp_path / "shared.onnx.data", lambda done, total: seen.append((done, total)))
    assert how == "copy"
    assert (tmp_path / "shared.onnx.data").read_bytes() == data
    assert not seen or seen[-1] == (size, size)


def test_a_copy_that_fails_otherwise_still_says_so(tmp_path, monkeypatch):
    """An error that a plain copy would share (the disk full) is not hidden by the fallback."""
    source = tmp_path / "a"
    source.write_bytes(b"x" * 100)
    monkeypatch.setattr(os, "link", _exdev)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    with pytest.raises(OSError, match="No space left"):
        files.link_or_share(source, tmp_path / "b")


def test_partition_onto_another_file_system(converted, tmp_path, monkeypatch):
    """The whole command: the placed model's shared data is a copy, it runs, and it says so."""
    from moepass.partition import partition

    monkeypatch.setattr(os, "link", _exdev)
    monkeypatch.setattr(os, "copy_file_range", _exdev)
    result = partition(converted("q4_0"), tmp_path / "placed", "8G", calibrate=False, target="layers")
    assert "(copy)" in result.weights
    assert (tmp_path / "placed" / files.SHARED_DATA_FILE).is_file()


def _run(model, *extra):
    from click.testing import CliRunner

    from moepass.cli import main

    return CliRunner().invoke(main, ["run", str(model), "--prompt-ids", "1,2,3", "-n", "4", *extra])


def test_a_placed_model_whose_shared_data_was_rewritten_is_refused_at_load(converted, tmp_path):
    """`cp newer/model.onnx.data src/model.onnx.data` rewrites the hard-linked file in place: the
    placed model's shared weights would be another model's. Refused, naming the file."""
    import shutil

    from moepass.partition import partition

    source = tmp_path / "src"
    shutil.copytree(converted("q4_0"), source)
    other = converted("q4_0", seed=5)
    partition(source, tmp_path / "placed", "8G", calibrate=False, target="layers")
    assert (tmp_path / "placed" / files.SHARED_DATA_FILE).stat().st_ino == (source / files.DATA_FILE).stat().st_ino
    before = _run(tmp_path / "placed")
    assert before.exit_code == 0, before.output
    assert (other / files.DATA_FILE).stat().st_size == (source / files.DATA_FILE).stat().st_size
    shutil.copyfile(other / files.DATA_FILE, source / files.DATA_FILE)  # as cp does: the same inode, rewritten
    after = _run(tmp_path / "placed")
    errors = [line for line in after.stderr.splitlines() if line.startswith("moepass: error:")]
    assert after.exit_code != 0 and len(errors) == 1 and "Traceback" not in after.output, after.output
    assert f"{tmp_path / 'placed' / files.SHARED_DATA_FILE}: changed since partition wrote this model" in after.stderr
    assert "partition the source again" in after.stderr


def test_a_second_partition_of_the_same_source_leaves_the_first_loadable(converted, tmp_path):
    """Each hard link made or removed changes the shared file's ctime: the record does not keep it."""
    import shutil

    from moepass.partition import partition

    source = tmp_path / "src"
    shutil.copytree(converted("q4_0"), source)
    partition(source, tmp_path / "a", "8G", calibrate=False, target="layers")
    partition(source, tmp_path / "b", "8G", calibrate=False, target="layers")
    shutil.rmtree(tmp_path / "b")
    assert _run(tmp_path / "a").exit_code == 0


def test_partition_force_replaces_a_folder_partition_wrote(converted, tmp_path):
    from click.testing import CliRunner

    from moepass.cli import main

    args = ["partition", str(converted("q4_0")), "--vram", "8G", "--no-calibrate", "-o", str(tmp_path / "p")]
    assert CliRunner().invoke(main, args).exit_code == 0
    again = CliRunner().invoke(main, [*args, "--force"])
    assert again.exit_code == 0, again.output


def test_a_linked_tokenizer_config_is_refused_not_copied(converted, tmp_path):
    """partition copies the source's tokenizer files: a link is not followed to whatever it names."""
    import shutil

    from click.testing import CliRunner

    from moepass.cli import main

    source = tmp_path / "src"
    shutil.copytree(converted("q4_0"), source)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer\n")
    (source / files.TOKENIZER_CONFIG_FILE).unlink()
    (source / files.TOKENIZER_CONFIG_FILE).symlink_to(secret)
    result = CliRunner().invoke(main, ["partition", str(source), "--vram", "8G", "--no-calibrate",
                                       "-o", str(tmp_path / "p")])  # fmt: skip
    assert result.exit_code != 0 and "a symbolic link, not the file convert wrote" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()
