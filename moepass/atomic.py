"""Outputs that appear whole or not at all, and never replace what a user had unless asked.

Every command that writes (convert, partition, profile) builds its output under a temporary
name beside the destination and renames it at the end; on any error the temporary is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from moepass.errors import MoepassError


def _check_destination(path: Path, overwrite: bool, is_dir: bool) -> None:
    if path.exists() and not overwrite:
        empty_dir = is_dir and path.is_dir() and not any(path.iterdir())
        if not empty_dir:
            raise MoepassError(f"{path}: already exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise MoepassError(f"{path}: parent directory {path.parent} does not exist")


def _ordinary_permissions(path: Path, mode: int) -> None:
    """mkstemp/mkdtemp make private files; the output is an ordinary one (umask applies)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def _replace(tmp: Path, destination: Path) -> None:
    old = None
    if destination.exists() and destination.is_dir():
        old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
        destination.rename(old)
    tmp.replace(destination)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `destination`; it becomes `destination` if the block succeeds."""
    destination = Path(destination)
    _check_destination(destination, overwrite, is_dir=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    except OSError as e:
        raise MoepassError(f"{destination}: cannot write there ({e.strerror})") from None
    try:
        _ordinary_permissions(tmp, 0o777)
        yield tmp
        _replace(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(destination: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary file path beside `destination`; it becomes `destination` if the block succeeds."""
    destination = Path(destination)
    _check_destination(destination, overwrite, is_dir=False)
    if destination.is_dir():
        raise MoepassError(f"{destination}: is a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{destination.name}.tmp-", dir=destination.parent)
    except OSError as e:
        raise MoepassError(f"{destination}: cannot write there ({e.strerror})") from None
    os.close(fd)
    tmp = Path(name)
    try:
        _ordinary_permissions(tmp, 0o666)
        yield tmp
        _replace(tmp, destination)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
