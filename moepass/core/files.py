"""Names of the files in a moepass model directory (what convert and partition write), reading a
text or JSON file beside a model, and the files a placed model shares with its source (hard link or
copy, their identity, paths relative to a folder). The typed JSON files are moepass.core.formats;
loading and saving the ONNX model, moepass.core.model_io."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepass.core.errors import MoepassError, no_such_path

if TYPE_CHECKING:
    pass

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"  # every weight, as ONNX external data
# partition: the source model's data file, hard-linked (or cloned) into the placed model's folder:
# the weights the placement leaves as they are, not copied
SHARED_DATA_FILE = "shared.onnx.data"
COPY_STEP = 256 << 20  # bytes a copy moves between progress reports
# a source data file is shared when the placed model still reads at least this share of its bytes
SHARE_MIN_SHARE = 0.5
INLINE_BYTES = 256  # initializers smaller than this stay inside model.onnx (onnx-ir's save's threshold)
REPORT_FILE = "moepass.json"  # hyperparameters, MoE layers, per-weight conversion report
PLAN_FILE = "plan.json"  # partition: memory breakdown, residency, predictions
OPTIONS_FILE = "onnxruntime_options.json"  # partition: session config entries for ONNX Runtime
TOKENIZER_FILE = "tokenizer.json"  # convert: Hugging Face tokenizers file rebuilt from the GGUF
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # convert: chat template, BOS/EOS
GENAI_CONFIG_FILE = "genai_config.json"  # convert: what onnxruntime-genai needs to load the model
# the decoder's optional input (an initializer a feed overrides): logits of the last N positions, 0 = all
LOGITS_TO_KEEP = "logits_to_keep"


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents; an unreadable file is a clear error naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise no_such_path(path) from None
    except OSError as e:
        raise MoepassError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise MoepassError(f"{path}: not a UTF-8 text file") from None


def read_json(path: Path, what: str | None = None) -> Any:
    """The JSON value of a file; an unreadable file or invalid JSON is a clear error naming it (and,
    when given, `what` the file should have been)."""
    import json

    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise no_such_path(path) from None
    except OSError as e:
        raise MoepassError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoepassError(
            f"{path}: not {what} (invalid JSON: {e})" if what else f"{path}: not valid JSON ({e})"
        ) from None


def read_json_object(path: Path) -> dict:
    """A JSON object file beside a model ({} when absent); anything else is a clear error naming it."""
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise MoepassError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def link_or_share(source: Path, destination: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """`destination` as a hard link to `source` (the same bytes, no copy: ONNX Runtime reads
    external data with several links; moepass's loader accepts the one partition records), else
    as share_file shares it. Says which."""
    try:
        os.link(source, destination)
        return "hard link"
    except OSError:
        return share_file(source, destination, progress)


def share_file(source: Path, destination: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """`destination` with `source`'s bytes, without copying them where the file system allows: a
    reflink (a copy-on-write clone: Btrfs, XFS, bcachefs), else a copy in the kernel; what
    link_or_share falls back to where no hard link can be made. Says which."""
    import fcntl

    ficlone = 0x40049409  # FICLONE (linux/fs.h)
    try:
        with open(source, "rb") as src, open(destination, "wb") as dst:
            fcntl.ioctl(dst.fileno(), ficlone, src.fileno())
        return "reflink"
    except OSError:
        pass
    total = source.stat().st_size
    in_kernel = True
    with open(source, "rb") as src, open(destination, "wb") as dst:
        done = 0
        while done < total:  # in the kernel where it can, in steps that can report progress
            size = min(COPY_STEP, total - done)
            if in_kernel:
                try:
                    step = os.copy_file_range(src.fileno(), dst.fileno(), size)
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY:
                        raise
                    in_kernel = False  # another file system (EXDEV) or none: read and write, from here
                    src.seek(done)
                    dst.seek(done)
                    continue
            else:
                step = dst.write(src.read(size))
            if step == 0:
                raise MoepassError(f"{source}: shrank while it was copied")
            done += step
            if progress is not None:
                progress(done, total)
    return "copy"


# copy_file_range's refusals that a plain read and write does not share: across file systems
# (EXDEV: partition -o /dev/shm/...), no such call or not for these files
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM)


def sampled_digest(path: Path, blocks: int, block_bytes: int, whole_up_to: int) -> str:
    """A digest of the file at `path`: all of it up to `whole_up_to` bytes, else its size and
    `blocks` blocks of `block_bytes` spread evenly from its start to its end. Cheap at any size;
    finds a file cut short, replaced, or damaged where it is read."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f"{size}\n".encode())
        if size <= whole_up_to:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            for i in range(blocks):
                digest.update(os.pread(f.fileno(), block_bytes, max(size - block_bytes, 0) * i // max(blocks - 1, 1)))
    return digest.hexdigest()


# the placed model's SHARED_DATA_FILE as plan.json records it: a hard link shares the source's file,
# so a rewrite of the source's data is a rewrite of the placed model's; its ctime is not kept (each
# link made or removed, another partition of the same source, changes it)
SHARED_DATA_BLOCKS = 16
SHARED_DATA_BLOCK_BYTES = 64 << 10


def shared_data_identity(path: Path) -> dict[str, Any]:
    """What identifies the shared data file at `path`: device, inode, size, mtime and a digest of
    SHARED_DATA_BLOCKS blocks."""
    st = path.stat()
    return {
        "device": st.st_dev,
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "digest": sampled_digest(path, SHARED_DATA_BLOCKS, SHARED_DATA_BLOCK_BYTES, 0),
    }


def refuse_linked(folder: Path, names: tuple[str, ...]) -> None:
    """Refuses `folder`'s files `names` (the tokenizer and config files convert wrote) where one is a
    link: moepass copies them into its outputs and does not follow a link to whatever it names."""
    for name in names:
        if (folder / name).is_symlink():
            raise MoepassError(
                f"{folder / name}: a symbolic link, not the file convert wrote; moepass does not copy what a "
                "link points to (replace it with the file)"
            )


def copy_companion(folder: Path, name: str, destination: Path) -> None:
    """`folder`/`name` (a tokenizer or config file convert wrote) copied into `destination`, where
    it is there; never through a link (refuse_linked)."""
    import shutil

    refuse_linked(folder, (name,))
    if (folder / name).is_file():
        shutil.copyfile(folder / name, destination / name)


def relative_to_folder(path: Path, folder: Path) -> str:
    """`path` as a written file records it: relative to the output `folder` it is recorded in (the
    same bytes wherever the input and output lie, no absolute path; found again while the two keep
    their places relative to each other)."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(folder))


def recorded_path(recorded: str, folder: Path) -> Path:
    """A path a file in `folder` records (relative_to_folder; an absolute one, as older moepass
    wrote them, as it is)."""
    return Path(recorded) if os.path.isabs(recorded) else folder / recorded
