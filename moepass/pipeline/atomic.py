"""Outputs that appear whole or not at all, and never replace what a user had unless asked.

Every command that writes (convert, partition, profile) builds its output under a temporary
name beside the destination (`.NAME.tmp-PID-*`) and renames it at the end. On any error or
interrupt the temporary is removed; one left by a killed process is swept, and said in one line,
when the next write to the same destination starts (only the user's own, whose process is gone).
Messages name the way out as the caller offers it (moepass.core.errors.Wording: `overwrite=True`
from Python, --force from the command line). Without `overwrite` the final rename itself refuses
to replace what appeared at the destination meanwhile (a concurrent run), so two runs never both
"succeed".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from moepass.core.errors import WRITE_ERRNOS, MoepassError, Wording, wording
from moepass.core.files import (
    DATA_FILE,
    GENAI_CONFIG_FILE,
    MODEL_FILE,
    OPTIONS_FILE,
    PLAN_FILE,
    REPORT_FILE,
    SHARED_DATA_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from moepass.core.formats import read_report

log = logging.getLogger("moepass")

# what convert and partition write into an output folder: --force replaces a folder of these only
OUTPUT_FILES = frozenset(
    {
        MODEL_FILE,
        DATA_FILE,
        SHARED_DATA_FILE,
        REPORT_FILE,
        PLAN_FILE,
        OPTIONS_FILE,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE,
        GENAI_CONFIG_FILE,
    }
)


def foreign_entry(folder: Path) -> str | None:
    """Why `folder` is not an output of moepass that --force may replace (None: it is one, or empty):
    it must hold moepass's report (moepass.json with its version) and nothing but moepass's files."""

    entries = sorted(os.listdir(folder))
    if not entries:
        return None
    for name in entries:
        entry = folder / name
        if name not in OUTPUT_FILES or entry.is_symlink() or not entry.is_file():
            return f"it holds {name!r}, which moepass does not write"
    if not (folder / REPORT_FILE).is_file():
        return f"it has no readable {REPORT_FILE} of moepass's"
    try:
        read_report(folder)
    except MoepassError:
        return f"its {REPORT_FILE} is not moepass's"
    return None


def check_destination(
    path: str | os.PathLike,
    overwrite: bool,
    is_dir: bool,
    inputs: Iterable[str | os.PathLike] = (),
    words: Wording | None = None,
) -> None:
    """Refuse an output path before any work (atomic_directory / atomic_file check it again when
    they start writing): one that would replace an input, what is there without `overwrite`, a
    folder not of moepass's with it. `words`: how the messages name the ways out, the caller's
    (default: moepass.core.errors.wording(), the Python API's keywords unless the CLI runs)."""
    path, words = Path(path), words or wording()
    absolute = Path(os.path.abspath(path))
    here = Path.cwd()
    if absolute == Path(absolute.anchor):
        raise MoepassError(f"'{absolute}': the file system root cannot be an output")
    if absolute == here or absolute in here.parents:
        raise MoepassError(f"{path}: is the current directory (or one above it); name a new folder for the output")
    real = Path(os.path.realpath(absolute))
    for source in inputs:
        source = Path(os.path.realpath(source))
        if source == real or real in source.parents:
            raise MoepassError(f"{path}: writing there would replace the input {source}")
    ancestor = path.parent  # missing folders above the output are created (and removed again on failure)
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise MoepassError(f"{path}: {ancestor} is a file, not a directory")
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        if overwrite:
            raise MoepassError(f"{path}: is a symbolic link; give the real path, or remove the link")
        raise MoepassError(f"{path}: already exists (a symbolic link); pass {words.overwrite} to replace it")
    if is_dir and not path.is_dir():  # a file of the user's is never replaced by a folder, --force or not
        raise MoepassError(f"{path}: is a file, and the output is a folder; name another {words.output}")
    if not is_dir and path.is_dir():
        raise MoepassError(f"{path}: is a directory")
    if is_dir and overwrite:
        _refuse_foreign(path, words)
    if not overwrite and not (is_dir and not any(path.iterdir())):
        raise MoepassError(f"{path}: already exists; pass {words.overwrite} to replace it")


def _refuse_foreign(folder: Path, words: Wording) -> None:
    why = foreign_entry(folder)
    if why:
        raise MoepassError(
            f"{folder}: {words.overwrite} replaces only a folder that moepass wrote, and {why}; "
            "remove it yourself or name another output"
        )


def _prefix(destination: Path, kind: str) -> str:
    return f".{destination.name}.{kind}-{os.getpid()}-"


def _sweep_stale(destination: Path) -> None:
    """Remove the temporaries of this destination that a killed run left (SIGKILL, a crash): those
    whose process is gone and that are the user's own, each said in one line (the library's warning,
    logger "moepass"); never one whose process runs, nor another user's."""
    pattern = re.compile(rf"^\.{re.escape(destination.name)}\.(?:tmp|old)-(\d+)-")
    try:
        entries = list(destination.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if not match or not _own(entry) or _alive(int(match[1])):
            continue
        size = _bytes_of(entry)
        try:
            _remove(entry)
        except OSError:
            continue
        if not os.path.lexists(entry):
            log.warning("removed a leftover of a killed run: %s (%s bytes)", entry, f"{size:,}")


def _own(path: Path) -> bool:
    """Whether `path` itself (not a link's target) is the user's."""
    try:
        return path.lstat().st_uid == os.getuid()
    except OSError:
        return False


def _bytes_of(path: Path) -> int:
    """The bytes a file, or a folder with all it holds, takes (links not followed)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _remove(temporary: Path) -> None:
    """Remove a temporary: a folder with all it holds, else the file (or link) itself."""
    if temporary.is_dir() and not temporary.is_symlink():
        shutil.rmtree(temporary, ignore_errors=True)
    elif os.path.lexists(temporary):
        temporary.unlink()


def _sweep_own(destination: Path) -> None:
    """Remove this process's temporaries of this destination: one an interrupt (SIGINT, SIGTERM)
    caught after the file system made it and before its name came back to be cleaned up."""
    prefix = _prefix(destination, "tmp")
    with contextlib.suppress(OSError):
        for entry in destination.parent.iterdir():
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):
                    _remove(entry)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _ordinary_permissions(path: Path, mode: int) -> None:
    """mkstemp/mkdtemp make private files; the output is an ordinary one (umask applies)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def _appeared(destination: Path, words: Wording) -> MoepassError:
    return MoepassError(
        f"{destination}: appeared while this run was writing (another run?); it was left as it is "
        f"and nothing was written; pass {words.overwrite} to replace it"
    )


def _replace(tmp: Path, destination: Path, overwrite: bool, words: Wording) -> None:
    if not overwrite:
        try:
            if tmp.is_dir():
                if os.path.lexists(destination) and (destination.is_symlink() or not destination.is_dir()):
                    raise _appeared(destination, words)
                os.rename(tmp, destination)  # refused by the kernel when destination is a non-empty directory
            else:
                os.link(tmp, destination)  # refused when destination exists
                tmp.unlink()
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise _appeared(destination, words) from None
            raise
        return
    old = None
    if destination.is_dir() and not destination.is_symlink():
        _refuse_foreign(destination, words)  # again: it may have changed while this run was writing
        old = Path(tempfile.mkdtemp(prefix=_prefix(destination, "old"), dir=destination.parent))
        destination.rename(old / destination.name)
    tmp.replace(destination)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def _writing(destination: Path, make: Callable[[str], Path], overwrite: bool, words: Wording) -> Iterator[Path]:
    """The temporary `make` creates beside `destination` (given its name prefix), removed whatever
    ends the block, from the moment the file system holds it."""
    tmp = None
    try:
        try:
            tmp = make(_prefix(destination, "tmp"))
        except OSError as e:
            raise MoepassError(f"{destination}: cannot write there ({e.strerror})") from None
        yield tmp
        _replace(tmp, destination, overwrite, words)
    except OSError as e:
        if e.errno in WRITE_ERRNOS:
            raise MoepassError(f"{destination}: {e.strerror}; nothing was written") from None
        raise
    finally:
        if tmp is None:  # interrupted while it was being made
            _sweep_own(destination)
        else:
            _remove(tmp)


@contextlib.contextmanager
def _parents(destination: Path) -> Iterator[None]:
    """The missing folders above `destination`, made for the block and removed again if it fails."""
    made = []
    folder = destination.parent
    while not os.path.lexists(folder):
        made.append(folder)
        folder = folder.parent
    try:
        for folder in reversed(made):
            folder.mkdir()
    except OSError as e:
        raise MoepassError(f"{destination}: cannot create {folder} ({e.strerror})") from None
    try:
        yield
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


@contextlib.contextmanager
def atomic_directory(
    destination: str | os.PathLike,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
    words: Wording | None = None,
) -> Iterator[Path]:
    """Yield a temporary directory beside `destination`; it becomes `destination` if the block succeeds.
    `inputs`: files the block reads, which the output must never replace; `words`: as check_destination."""
    destination, words = Path(destination), words or wording()
    check_destination(destination, overwrite, is_dir=True, inputs=inputs, words=words)

    def make(prefix: str) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=destination.parent))
        _ordinary_permissions(tmp, 0o777)
        return tmp

    with _parents(destination):
        _sweep_stale(destination)
        with _writing(destination, make, overwrite, words) as path:
            yield path


@contextlib.contextmanager
def atomic_file(
    destination: str | os.PathLike,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
    words: Wording | None = None,
) -> Iterator[Path]:
    """Yield a temporary file path beside `destination`; it becomes `destination` if the block succeeds
    (`inputs`, `words`: as atomic_directory)."""
    destination, words = Path(destination), words or wording()
    check_destination(destination, overwrite, is_dir=False, inputs=inputs, words=words)

    def make(prefix: str) -> Path:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=destination.parent)
        os.close(fd)
        _ordinary_permissions(Path(name), 0o666)
        return Path(name)

    with _parents(destination):
        _sweep_stale(destination)
        with _writing(destination, make, overwrite, words) as path:
            yield path
