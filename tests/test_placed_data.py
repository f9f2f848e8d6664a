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
