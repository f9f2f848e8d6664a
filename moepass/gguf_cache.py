"""A GGUF where a converted model is expected (`moepass run model.gguf`, the llama.cpp habit): the
file is converted once with the defaults into a cache folder and that conversion is reused.

An entry is the converted folder `NAME-KEY/` and its record `NAME-KEY.json`, written after the
conversion completed, in the cache folder (`--cache-dir`, else $MOEPASS_CACHE, else
$XDG_CACHE_HOME/moepass, else ~/.cache/moepass). KEY digests the file's real path and moepass's
version: each file has its own entry, and a new moepass makes a new one. The record holds what the
entry was made from, and an entry is used only when all of it still holds:

- the file's identity, for each part of a split GGUF: its path, device, inode, size, mtime and
  ctime (a file rewritten in place changes its ctime even where `cp -p`, `rsync -t` or tar restore
  its mtime);
- a digest of its content: the whole GGUF header (metadata and tensor index) and SAMPLE_BLOCKS
  blocks of its tensor data, spread evenly;
- the entry's own files: their names and sizes, and a digest of each (whole up to
  WHOLE_DIGEST_BYTES, else SAMPLE_BLOCKS blocks), so that an entry cut short or damaged is rebuilt,
  never used;
- ownership: the record, the folder and every file in it are the user's own regular files.

Anything else is rebuilt; entries of the same file made by another moepass are removed once the new
one is complete. One conversion at a time per entry (a lock file), so that `serve` and `run`
started together convert once; the second says that it waits. In a cache folder shared by several
users nothing is followed or trusted that this user's moepass did not write: the lock, the record
and temporaries are created without following links (O_NOFOLLOW, O_EXCL), an entry another user
owns is refused, never used or removed, and a folder others can write to is refused unless it is
sticky (as /tmp is). `moepass cache list|prune|clear` shows and removes entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from moepass.core.choices import format_bytes
from moepass.core.errors import MoepassError, no_such_path, wording
from moepass.core.files import sampled_digest
from moepass.core.formats import plain_json, typed_from_json
from moepass.core.gguf_reader import is_gguf, split_parts
from moepass.core.version import __version__

CACHE_ENV = "MOEPASS_CACHE"
RECORD_FORMAT = "moepass-gguf-cache"
RECORD_VERSION = 2
SAMPLE_BLOCKS = 64  # blocks of the tensor data in the content digest
SAMPLE_BYTES = 64 << 10
WHOLE_DIGEST_BYTES = 64 << 20  # entry files up to this size are digested whole
MAX_RECORD_BYTES = 1 << 20
UNPARSED_HEADER_BYTES = 64 << 20  # a header that does not parse: this much is digested whole
ENTRY_NAME = re.compile(r"(?P<stem>[A-Za-z0-9_-][A-Za-z0-9._-]{0,79})-(?P<key>[0-9a-f]{16})")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted GGUF files are kept: `cache_dir`, $MOEPASS_CACHE, $XDG_CACHE_HOME/moepass or
    ~/.cache/moepass, the first given."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "moepass"


def entry_name(source: Path) -> str:
    """The entry of the GGUF file at real path `source` for this moepass."""
    key = hashlib.sha256(f"{__version__}\n{source}\n".encode()).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.stem)[:80].lstrip(".") or "model"
    return f"{stem}-{key[:16]}"


def file_identity(source: Path) -> list[dict[str, Any]]:
    """Path, device, inode, size, mtime and ctime of each part of the GGUF file `source`."""
    parts = []
    for part in split_parts(source):
        try:
            st = part.stat()
        except FileNotFoundError:
            raise no_such_path(part) from None
        except OSError as e:
            raise MoepassError(f"{part}: {e.strerror}") from None
        parts.append({"path": str(part), "device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
                      "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns})  # fmt: skip
    return parts


def content_digest(source: Path) -> str:
    """The whole header (metadata and tensor index) of each part of the GGUF file `source`, and
    SAMPLE_BLOCKS blocks of SAMPLE_BYTES spread evenly over its tensor data, digested."""
    digest = hashlib.sha256()
    for part in split_parts(source):
        with open(part, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                continue
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                start = min(_data_start(view), size)
                digest.update(f"{part.name}\n{size}\n{start}\n".encode())
                digest.update(view[:start])
                span = size - start
                for i in range(SAMPLE_BLOCKS):
                    at = start + span * i // SAMPLE_BLOCKS
                    digest.update(view[at : at + SAMPLE_BYTES])
    return digest.hexdigest()


# GGUF value types (gguf-py's GGUFValueType): fixed sizes; 8 is a string, 9 an array
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Header:
    """A GGUF header read in place, without decoding values: each read says where the next one
    starts, and raises ValueError where it would run past the file's end."""

    def __init__(self, view: mmap.mmap):
        self.view, self.end = view, len(view)

    def take(self, fmt: str, at: int) -> tuple[Any, int]:
        size = struct.calcsize(fmt)
        if at + size > self.end:
            raise ValueError
        return struct.unpack_from(fmt, self.view, at)[0], at + size

    def skip_string(self, at: int) -> tuple[bytes, int]:
        length, at = self.take("<Q", at)
        if at + length > self.end:
            raise ValueError
        return self.view[at : at + length], at + length

    def skip_value(self, kind: int, at: int) -> int:
        if kind in _VALUE_SIZES:
            return at + _VALUE_SIZES[kind]
        if kind == 8:
            return self.skip_string(at)[1]
        if kind == 9:
            item, at = self.take("<I", at)
            count, at = self.take("<Q", at)
            if item in _VALUE_SIZES:
                return at + count * _VALUE_SIZES[item]
            for _ in range(count):
                at = self.skip_value(item, at)
                if at > self.end:
                    raise ValueError
            return at
        raise ValueError


def _data_start(view: mmap.mmap) -> int:
    """Where a GGUF's tensor data starts (the header's end, aligned), read without decoding values;
    where the header does not parse (convert then says what is wrong), UNPARSED_HEADER_BYTES."""
    header = _Header(view)
    end = header.end
    try:
        version, at = header.take("<I", 4)
        if version < 2:
            raise ValueError
        tensors, at = header.take("<Q", at)
        keys, at = header.take("<Q", at)
        alignment = 32
        for _ in range(keys):
            key, at = header.skip_string(at)
            kind, at = header.take("<I", at)
            if key == b"general.alignment" and kind == 4:
                alignment = header.take("<I", at)[0] or 32
            at = header.skip_value(kind, at)
        for _ in range(tensors):
            at = header.skip_string(at)[1]
            dims, at = header.take("<I", at)
            at += 8 * dims + 4 + 8
            if at > end:
                raise ValueError
        return -(-at // alignment) * alignment
    except (ValueError, struct.error):
        return min(end, UNPARSED_HEADER_BYTES)


@dataclasses.dataclass(frozen=True)
class CachedConversion:
    """Where a GGUF's conversion lies, and whether this call made it."""

    source: Path
    folder: Path
    built: bool
    seconds: float
    entry_bytes: int = 0  # what the entry's folder holds
    source_bytes: int = 0  # the GGUF file's own size (all its parts)

    def sizes(self) -> str:
        """The entry's bytes beside the GGUF file's: "1.90 GiB for a 1.19 GiB file, 1.60x"."""
        ratio = f", {self.entry_bytes / self.source_bytes:.2f}x" if self.source_bytes else ""
        return f"{format_bytes(self.entry_bytes)} for a {format_bytes(self.source_bytes)} file{ratio}"

    def line(self) -> str:
        if self.built:
            return (
                f"{self.source}: converted with the defaults into {self.folder} in {self.seconds:.1f} s, "
                f"{self.sizes()} (reused next time; `moepass convert` for other options)"
            )
        return f"{self.source}: using its conversion in {self.folder}, {self.sizes()} (rebuilt when the file changes)"


def converted(
    gguf: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    echo: Callable[[str], None] | None = None,
) -> CachedConversion:
    """The cached conversion of `gguf` (made now if there is none, or none that is whole and current)."""
    source = Path(gguf).resolve()
    if not is_gguf(source):
        raise MoepassError(f"{gguf}: not a GGUF file")
    root = _usable_root(cache_root(cache_dir))
    name = entry_name(source)
    folder = root / name
    with _locked(root / f"{name}.lock", source, echo):
        identity, content = file_identity(source), content_digest(source)
        source_bytes = sum(part["size"] for part in identity)
        if _current(root, name, source, identity, content):
            return CachedConversion(source, folder, False, 0.0, _tree_bytes(folder), source_bytes)
        from moepass.pipeline.conversion import ConvertOptions, convert_gguf

        start = time.perf_counter()
        _remove_entry(root, name)
        convert_gguf(source, folder, ConvertOptions(), progress=progress, echo=lambda line: None)
        if file_identity(source) != identity or content_digest(source) != content:
            _remove_entry(root, name)
            raise MoepassError(f"{source}: changed while it was converted; run again once it is written")
        _write_record(root, name, CacheRecord(__version__, str(source), tuple(identity), content, _entry_files(folder)))
        _remove_older(root, source, keep=name)
        seconds = time.perf_counter() - start
        return CachedConversion(source, folder, True, seconds, _tree_bytes(folder), source_bytes)


def resolve(
    model: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    echo: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """`model` itself, or for a GGUF file its cached conversion (echo: told which, in one line)."""
    path = Path(model)
    if not (path.is_file() and is_gguf(path)):
        return path
    entry = converted(path, cache_dir, progress, echo)
    if echo is not None:
        echo(entry.line())
    return entry.folder


def load(model: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, **options: Any):
    """moepass.runtime.load for a converted folder, or a GGUF file through the cache (converted with
    the defaults the first time; moepass.gguf_cache)."""
    from moepass.runtime import load as load_converted

    if options.get("speculative"):
        options["speculative"] = resolve_draft(options["speculative"], cache_dir)
    return load_converted(resolve(model, cache_dir), **options)


def resolve_draft(
    speculative: str, cache_dir: str | os.PathLike | None = None, echo: Callable[[str], None] | None = None
) -> str:
    """--speculative draft:PATH with a GGUF PATH as its cached conversion (anything else as it is:
    speculation.parse judges it)."""
    kind, _, path = speculative.partition(":")
    if kind != "draft" or not path:
        return speculative
    return f"draft:{resolve(path, cache_dir, echo)}"


# ---- the cache as a whole: moepass cache list | prune | clear


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the cache folder as `moepass cache` shows it."""

    name: str
    source: str | None  # the GGUF it was made from (None: no readable record)
    bytes: int
    state: str  # current, source changed, source gone, older moepass, incomplete, another user's

    @property
    def stale(self) -> bool:
        return self.state not in ("current", "another user's")

    @property
    def foreign(self) -> bool:
        """Another user's entry (never used or removed here)."""
        return self.state == "another user's"


def entries(cache_dir: str | os.PathLike | None = None) -> tuple[Path, list[Entry]]:
    """The cache folder and each entry in it (a folder, a record or both), with its state."""
    root = cache_root(cache_dir)
    if not root.is_dir():
        return root, []
    names = set()
    for child in os.listdir(root):
        m = ENTRY_NAME.fullmatch(child.removesuffix(".json").removesuffix(".lock"))
        if m:
            names.add(m.group(0))
    return root, [_describe(root, name) for name in sorted(names)]


def remove_entries(cache_dir: str | os.PathLike | None, which: Callable[[Entry], bool]) -> tuple[list[Entry], int]:
    """Removes the user's entries for which `which` holds, skipping any that another moepass is
    converting right now, and the temporaries a killed conversion left; the entries removed and
    the bytes freed."""
    root, found = entries(cache_dir)
    removed = []
    for entry in found:
        if entry.state != "another user's" and which(entry) and _remove_unless_busy(root, entry.name):
            removed.append(entry)
    freed = sum(e.bytes for e in removed)
    if root.is_dir():
        for child in os.listdir(root):
            path = root / child
            if child.startswith(".") and child.endswith(".tmp") and _own(path, stat.S_ISREG):
                freed += path.lstat().st_size
                path.unlink()
    return removed, freed


def _describe(root: Path, name: str) -> Entry:
    folder, record = root / name, root / f"{name}.json"
    owners = {p.lstat().st_uid for p in (folder, record) if os.path.lexists(p)}
    size = _tree_bytes(folder)
    if owners - {os.getuid()}:
        return Entry(name, None, size, "another user's")
    written = _read_record(record)
    if written is None:
        return Entry(name, None, size, "incomplete")
    source = written.source
    if written.moepass != __version__:
        return Entry(name, source, size, f"older moepass ({written.moepass})")
    if not Path(source).is_file():
        return Entry(name, source, size, "source gone")
    try:
        changed = file_identity(Path(source)) != list(written.parts)
    except MoepassError:
        changed = True
    if changed:
        return Entry(name, source, size, "source changed")
    return Entry(name, source, size, "current" if _files_match(folder, written) else "incomplete")


# ---- one entry


def _usable_root(root: Path) -> Path:
    """The cache folder, made if missing: the user's own, or one others may write to only when it
    is sticky (as /tmp)."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = root.stat()
    except OSError as e:
        raise MoepassError(
            f"{root}: cannot make the GGUF cache folder ({e.strerror}); name another with "
            f"{wording().name('--cache-dir')}"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise MoepassError(
            f"{root}: the GGUF cache folder is not a folder; name another with {wording().name('--cache-dir')}"
        )
    others = stat.S_IWOTH | (0 if _private_group(st.st_gid) else stat.S_IWGRP)
    if st.st_mode & others and not st.st_mode & stat.S_ISVTX:
        raise MoepassError(
            f"{root}: the GGUF cache folder is writable by other users and not sticky, so anyone could "
            f"plant a conversion in it; chmod go-w (or +t), or name another with {wording().name('--cache-dir')}"
        )
    return root


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's own group (a user private group, as Debian and Fedora make one
    per user with umask 002: group-writable folders that only the user can write)."""
    import grp
    import pwd

    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not set(group.gr_mem) - {user.pw_name}


@contextlib.contextmanager
def _locked(path: Path, source: Path, echo: Callable[[str], None] | None) -> Iterator[None]:
    fd = _open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if echo is not None:
                who = f"pid {holder}" if holder.isdigit() else "another process"
                echo(f"{source}: waiting for another moepass ({who}) converting it into {path.with_suffix('')}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _try_locked(path: Path) -> Iterator[bool]:
    """Whether the entry's lock was free (held for the block), without waiting or creating it."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _open_own(path: Path, flags: int, mode: int = 0o600) -> int:
    """A file of the cache opened without following a link, which must be the user's own regular
    file."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MoepassError(f"{path}: a symbolic link in the GGUF cache (moepass follows none); remove it") from None
        raise MoepassError(f"{path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise MoepassError(f"{path}: not a file of this user's in the GGUF cache (moepass trusts none); remove it")
    return fd


def _own(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether `path` is (not through a link) this user's own file or folder of that kind."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.getuid()


@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """An entry's record (NAME.json beside its folder), the one class that writes and reads it: the
    moepass that converted it, the GGUF's path and each part's identity, the content's digest, and
    each file of the folder with its size and digest."""

    moepass: str
    source: str
    parts: tuple[dict[str, Any], ...]
    content: str
    files: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "version": RECORD_VERSION, **plain_json(self)}

    @classmethod
    def from_json(cls, data: Any, path: Path) -> CacheRecord | None:
        """The record of the JSON `data`; None for another format or version, or a field of the wrong
        type (the entry is then incomplete, and converted anew)."""
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or data.get("version") != RECORD_VERSION:
            return None
        try:
            return typed_from_json(cls, {k: v for k, v in data.items() if k not in ("format", "version")}, path, "")
        except MoepassError:
            return None


def _read_record(record: Path) -> CacheRecord | None:
    """The record, where it is this user's regular file, in moepass's format, naming its source."""
    try:
        fd = os.open(record, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return CacheRecord.from_json(data, record)


def _current(root: Path, name: str, source: Path, identity: list, content: str) -> bool:
    record = _read_record(root / f"{name}.json")
    if record is None or record.moepass != __version__ or record.source != str(source):
        return False
    if list(record.parts) != identity or record.content != content:
        return False
    return _files_match(root / name, record)


def _entry_files(folder: Path) -> dict[str, dict[str, Any]]:
    """Each file of a converted folder: its size and digest (whole, or sampled past
    WHOLE_DIGEST_BYTES)."""
    files = {}
    for child in sorted(os.listdir(folder)):
        path = folder / child
        size = path.lstat().st_size
        files[child] = {"size": size, "digest": sampled_digest(path, SAMPLE_BLOCKS, SAMPLE_BYTES, WHOLE_DIGEST_BYTES)}
    return files


def _files_match(folder: Path, record: CacheRecord) -> bool:
    """Whether the entry's folder is this user's and holds just its recorded files, each whole."""
    if not _own(folder, stat.S_ISDIR):
        return False
    try:
        if sorted(os.listdir(folder)) != sorted(record.files):
            return False
        if not all(_own(folder / child, stat.S_ISREG) for child in record.files):
            return False
        return _entry_files(folder) == record.files
    except OSError:  # unreadable: rebuilt
        return False


def _write_record(root: Path, name: str, record: CacheRecord) -> None:
    data = record.to_json()
    tmp = root / f".{name}.json.{secrets.token_hex(8)}.tmp"
    fd = _open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, root / f"{name}.json")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise MoepassError(f"{root / f'{name}.json'}: cannot write the cache's record ({e.strerror})") from None


def _remove_entry(root: Path, name: str) -> None:
    """An entry's record and folder, where they are this user's own; anything else there is refused."""
    if not ENTRY_NAME.fullmatch(name):
        raise ValueError(name)
    for path, kind in ((root / f"{name}.json", stat.S_ISREG), (root / name, stat.S_ISDIR)):
        if not os.path.lexists(path):
            continue
        if _own(path, stat.S_ISLNK):  # the user's own link: removed itself, its target untouched
            path.unlink()
            continue
        if not _own(path, kind):
            raise MoepassError(
                f"{path}: in the GGUF cache, but not this user's {'folder' if kind is stat.S_ISDIR else 'file'} "
                "(moepass removes and follows nothing it did not write); remove it, or name another "
                f"{wording().name('--cache-dir')}"
            )
        if kind is stat.S_ISDIR:
            shutil.rmtree(path)
        else:
            path.unlink()


def _remove_older(root: Path, source: Path, keep: str) -> None:
    """The entries of the same file made by another moepass."""
    for entry in entries(root)[1]:
        if entry.name != keep and entry.source == str(source) and entry.state != "another user's":
            _remove_unless_busy(root, entry.name)


def _remove_unless_busy(root: Path, name: str) -> bool:
    """The entry `name` and its lock removed, unless another moepass holds the lock (converting it
    now); whether it was."""
    with _try_locked(root / f"{name}.lock") as free:
        if free:
            _remove_entry(root, name)
            (root / f"{name}.lock").unlink(missing_ok=True)
        return free


def _tree_bytes(folder: Path) -> int:
    if not _own(folder, stat.S_ISDIR):
        return 0
    return sum((folder / child).lstat().st_size for child in os.listdir(folder))
