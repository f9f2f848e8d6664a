"""Large tensors are written past the page cache (passes.weights.direct.DirectSink): the bytes on disk must
be those of the ordinary buffered write, whatever the tensor's offset in the file, the chunk sizes
and the staging buffer's fill, and where the file system refuses O_DIRECT (tmpfs)."""

from __future__ import annotations

import errno
import filecmp
import os
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

import moepass
from moepass.passes.weights import direct, streaming

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _model(sizes: list[int], chunk: int) -> tuple[ir.Model, list[np.ndarray]]:
    """A graph of streamed uint8 initializers of these sizes, each produced in chunks of `chunk` bytes."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    inits = []
    for i, a in enumerate(arrays):

        def chunks(a=a):
            return (a[j : j + chunk] for j in range(0, len(a), chunk))

        tensor = streaming.StreamedTensor(chunks, ir.DataType.UINT8, (len(a),), f"w{i}")
        inits.append(ir.Value(name=f"w{i}", const_value=tensor, type=ir.TensorType(ir.DataType.UINT8)))
    out = ir.Value(name="y", type=ir.TensorType(ir.DataType.UINT8), shape=ir.Shape([sizes[0]]))
    node = ir.Node("", "Identity", [inits[0]], outputs=[out])
    graph = ir.Graph([], [out], nodes=[node], initializers=inits, opset_imports={"": 21})
    return ir.Model(graph, ir_version=10), arrays


def _save(folder: Path, sizes: list[int], chunk: int) -> bytes:
    folder.mkdir()
    model, arrays = _model(sizes, chunk)
    ir.save(model, folder / "model.onnx", external_data="model.onnx.data", max_workers=1)
    data = (folder / "model.onnx.data").read_bytes()
    assert data == b"".join(a.tobytes() for a in arrays)  # onnx-ir lays them end to end, unaligned
    return data


# a small tensor first, so that the large ones start at offsets that are not multiples of a page
# (onnx-ir keeps tensors under 1 KiB in model.onnx)
SIZES = [1031, 70_001, 3 * 4096 + 17, 100_000, 4096, 2053]


def _direct_fds(monkeypatch) -> list[int]:
    """The descriptors opened with O_DIRECT from now on, one entry an open (os.open watched)."""
    fds: list[int] = []
    real_open = os.open

    def spy_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            fds.append(fd)
        return fd

    monkeypatch.setattr(os, "open", spy_open)
    return fds


def _skip_unless_opened(opened: list[int], folder: Path) -> None:
    """Skip, saying so, where no file was opened with O_DIRECT: the test would test nothing."""
    if not opened:
        pytest.skip(f"{folder}: this file system refuses O_DIRECT (the buffered path ran)")


def _refuse_direct_writes(monkeypatch, fds: list[int], code: int) -> None:
    """Every write to these descriptors fails with errno `code`; the others go through."""
    real_pwrite = os.pwrite

    def refusing_pwrite(fd, data, offset):
        if fd in fds:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)


@pytest.mark.parametrize("chunk", [1, 999, 4096, 50_000])
def test_direct_writes_give_the_buffered_bytes(tmp_path, monkeypatch, chunk):
    buffered = _save(tmp_path / "buffered", SIZES, chunk)
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    monkeypatch.setattr(direct, "_STAGING_BYTES", 2 * 4096)  # several flushes per tensor
    monkeypatch.setattr(direct._staging, "buffers", None, raising=False)
    opened = _direct_fds(monkeypatch)
    assert _save(tmp_path / "direct", SIZES, chunk) == buffered
    _skip_unless_opened(opened, tmp_path)
    assert len(opened) == sum(n >= 4096 for n in SIZES)


def test_a_file_system_without_o_direct_gets_the_buffered_bytes(tmp_path, monkeypatch):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    folder = Path(os.path.join(shm, f"moepass-test-{os.getpid()}"))
    try:
        assert _save(folder, SIZES, 999)  # tmpfs refuses the open (EINVAL): written buffered
    finally:
        for f in folder.glob("*"):
            f.unlink()
        folder.rmdir()


def test_writes_refused_after_the_open_fall_back(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT but refuses the writes (EINVAL: an alignment it
    wants larger) gets the rest of the tensor through the ordinary file."""
    buffered = _save(tmp_path / "buffered", SIZES, 999)
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    opened = _direct_fds(monkeypatch)
    _refuse_direct_writes(monkeypatch, opened, errno.EINVAL)
    assert _save(tmp_path / "refused", SIZES, 999) == buffered
    _skip_unless_opened(opened, tmp_path)


def test_a_conversion_written_directly_is_the_same(tmp_path, make_gguf, converted, monkeypatch):
    """A whole conversion with every tensor of 4 KiB or more written past the page cache."""
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    opened = _direct_fds(monkeypatch)
    moepass.convert(make_gguf("q4_k"), tmp_path / "direct", expert_format="qmoe")
    _skip_unless_opened(opened, tmp_path)
    assert filecmp.cmp(tmp_path / "direct" / "model.onnx.data", converted("q4_k") / "model.onnx.data", shallow=False)
    assert filecmp.cmp(tmp_path / "direct" / "model.onnx", converted("q4_k") / "model.onnx", shallow=False)


def test_a_full_disk_in_the_background_write_is_raised(tmp_path, monkeypatch):
    """The staging buffers go to the disk on a thread: its error (ENOSPC) reaches the writer."""
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    monkeypatch.setattr(direct, "_STAGING_BYTES", 2 * 4096)
    monkeypatch.setattr(direct._staging, "buffers", None, raising=False)
    opened = _direct_fds(monkeypatch)
    _refuse_direct_writes(monkeypatch, opened, errno.ENOSPC)
    try:
        _save(tmp_path / "full", SIZES, 999)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        _skip_unless_opened(opened, tmp_path)
        pytest.fail("the full disk was not raised")
