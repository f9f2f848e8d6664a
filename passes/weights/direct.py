"""Large tensors written with O_DIRECT (`DirectSink`): from a reused, page-aligned staging buffer,
the unaligned head and tail (and file systems that refuse O_DIRECT) through the ordinary file, so
a model larger than its GGUF never passes through the page cache."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

# Tensors of at least this many bytes are written past the page cache (DirectSink)
DIRECT_MIN_BYTES = 64 << 20

_PAGE = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a multiple of every block size in use)

_STAGING_BYTES = 16 << 20

_staging = threading.local()


class DirectSink:
    """A large tensor's bytes written with O_DIRECT: staged in two reused, page-aligned buffers, one
    filled while a thread writes the other straight to the disk, not copied into the page cache. A
    model many GB larger than the file it came from would otherwise pass through the page cache
    whole: a kernel copy and a fresh page of memory for every 4 KiB written (on a VM whose host
    backs fresh pages lazily, most of a conversion's time), evicting what the user had cached. The
    unaligned head and tail (under 4 KiB each) go through the ordinary file; where the file system
    refuses O_DIRECT (tmpfs: the open; or the writes, EINVAL) the whole tensor or its rest does.
    `open` returns None for small tensors, or where there is no path to open."""

    def __init__(self, file, direct_fd: int, position: int):
        self.file, self.fd, self.direct_fd = file, file.fileno(), direct_fd
        buffers = getattr(_staging, "buffers", None)
        if buffers is None or len(buffers[0]) != _STAGING_BYTES:  # anonymous maps: page-aligned
            buffers = _staging.buffers = tuple(memoryview(mmap.mmap(-1, _STAGING_BYTES)) for _ in range(2))
        self.buffers, self.current, self.staged = buffers, 0, 0
        self.position = position  # where the bytes staged next go
        self.head = -position % _PAGE  # bytes the ordinary file takes before the first aligned offset
        self.disk = ThreadPoolExecutor(1)
        self.pending: Future | None = None

    @classmethod
    def open(cls, file, nbytes: int) -> DirectSink | None:
        name = getattr(file, "name", None)
        if nbytes < DIRECT_MIN_BYTES or not hasattr(os, "O_DIRECT") or not isinstance(name, (str, bytes, os.PathLike)):
            return None
        try:
            direct_fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            return None
        file.flush()  # what the ordinary file holds goes first
        return cls(file, direct_fd, file.tell())

    def write(self, data: memoryview) -> None:
        if self.head:
            taken = min(self.head, len(data))
            self._plain(data[:taken], self.position)
            data, self.head, self.position = data[taken:], self.head - taken, self.position + taken
        while len(data):
            staging = self.buffers[self.current]
            taken = min(len(data), _STAGING_BYTES - self.staged)
            staging[self.staged : self.staged + taken] = data[:taken]
            self.staged += taken
            data = data[taken:]
            if self.staged == _STAGING_BYTES:  # to the disk while the other buffer fills
                self._wait()
                self.pending = self.disk.submit(self._direct, staging, self.position)
                self.position += _STAGING_BYTES
                self.current, self.staged = 1 - self.current, 0

    def __enter__(self) -> DirectSink:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._wait()  # also after an error: no thread may still be reading a staging buffer
            if exc[0] is None:
                staging, aligned = self.buffers[self.current], self.staged - self.staged % _PAGE
                self._direct(staging[:aligned], self.position)
                self._plain(staging[aligned : self.staged], self.position + aligned)
                self.position += self.staged
                self.file.seek(self.position)
        finally:
            self.disk.shutdown()
            if self.direct_fd >= 0:
                os.close(self.direct_fd)

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _direct(self, data: memoryview, position: int) -> None:
        """data (a multiple of _PAGE bytes, page-aligned) to the disk at position."""
        try:
            while len(data) and self.direct_fd >= 0:
                written = os.pwrite(self.direct_fd, data, position)
                data, position = data[written:], position + written
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.close(self.direct_fd)  # the file system takes O_DIRECT opens but not these writes
            self.direct_fd = -1
        self._plain(data, position)

    def _plain(self, data: memoryview, position: int) -> None:
        """data through the ordinary file (and the page cache) at position."""
        while len(data):
            written = os.pwrite(self.fd, data, position)
            data, position = data[written:], position + written
