"""A GGUF where a converted model is expected (`moepass run model.gguf`, the llama.cpp habit): the
file is converted once with the defaults into a cache folder and that conversion is reused.

An entry is the converted folder `NAME-KEY/` and its record `NAME-KEY.json`, written after the
conversion completed, in the cache folder (`--cache-dir`, else $MOEPASS_CACHE, else
$XDG_CACHE_HOME/moepass, else ~/.cache/moepass). KEY digests the file's size, mtime, its first
HEADER_BYTES (the metadata and tensor index of any GGUF moepass converts whole) and moepass's
version: a file changed, touched or re-quantized, or a new moepass, gives another key. An entry
whose record is missing, is not moepass's or does not match the files beside it (an interrupted
conversion, a file cut short) is rebuilt, never used; entries of the same file under older keys
are removed once the new one is complete. One conversion at a time per entry (a lock file), so that
`serve` and `run` started together convert once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import is_gguf, split_parts
from moepass.core.version import __version__

CACHE_ENV = "MOEPASS_CACHE"
HEADER_BYTES = 1 << 20
RECORD_FORMAT = "moepass-gguf-cache"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted GGUF files are kept: `cache_dir`, $MOEPASS_CACHE, $XDG_CACHE_HOME/moepass or
    ~/.cache/moepass, the first given."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "moepass"


def cache_key(gguf: Path) -> str:
    """The size, mtime and first HEADER_BYTES of the file (of each part of a split one) and
    moepass's version, digested."""
    digest = hashlib.sha256(f"{__version__}\n".encode())
    for part in split_parts(gguf):
        stat = part.stat()
        digest.update(f"{part.name}\n{stat.st_size}\n{stat.st_mtime_ns}\n".encode())
        with open(part, "rb") as f:
            digest.update(f.read(HEADER_BYTES))
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CachedConversion:
    """Where a GGUF's conversion lies, and whether this call made it."""

    source: Path
    folder: Path
    built: bool
    seconds: float

    def line(self) -> str:
        if self.built:
            return (
                f"{self.source}: converted with the defaults into {self.folder} in {self.seconds:.1f} s "
                "(reused next time; `moepass convert` for other options)"
            )
        return f"{self.source}: using its conversion in {self.folder} (rebuilt when the file changes)"


def converted(
    gguf: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CachedConversion:
    """The cached conversion of `gguf` (made now if there is none, or none that is whole and current)."""
    source = Path(gguf).resolve()
    if not is_gguf(source):
        raise MoepassError(f"{gguf}: not a GGUF file")
    root = cache_root(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoepassError(
            f"{root}: cannot make the GGUF cache folder ({e.strerror}); name another with --cache-dir"
        ) from None
    key = cache_key(source)
    name = f"{_safe(source.stem)}-{key[:16]}"
    folder, record = root / name, root / f"{name}.json"
    with _locked(root / f"{name}.lock"):
        if _whole(folder, record, key):
            return CachedConversion(source, folder, built=False, seconds=0.0)
        from moepass.convert import convert

        start = time.perf_counter()
        _remove_entry(folder, record)
        convert(source, folder, progress=progress, echo=lambda line: None)
        _write_record(record, key, source, folder)
        _remove_older(root, source, keep=name)
        return CachedConversion(source, folder, built=True, seconds=time.perf_counter() - start)


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
    entry = converted(path, cache_dir, progress)
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


def _safe(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80] or "model"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def _read_record(record: Path) -> dict | None:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == RECORD_FORMAT else None


def _whole(folder: Path, record: Path, key: str) -> bool:
    data = _read_record(record)
    if data is None or data.get("key") != key or not folder.is_dir():
        return False
    try:
        return data.get("files") == _files(folder)
    except OSError:
        return False


def _write_record(record: Path, key: str, source: Path, folder: Path) -> None:
    data = {"format": RECORD_FORMAT, "key": key, "source": str(source), "moepass": __version__,
            "files": _files(folder)}  # fmt: skip
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, record)


def _remove_entry(folder: Path, record: Path) -> None:
    record.unlink(missing_ok=True)
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    elif folder.exists() or folder.is_symlink():
        folder.unlink()


def _remove_older(root: Path, source: Path, keep: str) -> None:
    """The entries of the same file under other keys (it changed, or moepass did)."""
    for record in root.glob("*.json"):
        data = _read_record(record)
        if data is not None and data.get("source") == str(source) and record.stem != keep:
            _remove_entry(root / record.stem, record)
            (root / f"{record.stem}.lock").unlink(missing_ok=True)
