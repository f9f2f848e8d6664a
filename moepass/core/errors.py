"""The one error type moepass raises for bad input, and the one place that words every expected failure.

A `MoepassError` message is a single line that names the file, tensor or key at fault; the CLI
prints it and exits with status 2. `expected_failure` turns the other failures that bad input or
a hostile environment cause (files, JSON, protobuf, ONNX Runtime, tokenizers, Jinja) into such a
line; anything it does not recognize is a bug in moepass and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import json
from collections.abc import Iterator

# errnos that mean "the destination cannot take what is written", whoever the writer was
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class MoepassError(Exception):
    """Bad input or an impossible request, with a one-line message for the user."""


# the flags whose Python keyword is not the flag's own name, the dashes made underscores
_KEYWORDS = {"--force": "overwrite", "-o": "output"}
# the switches whose Python form is not `keyword=True` (or `keyword=False` for a --no- flag)
_SWITCHES = {"--force": "overwrite=True", "--keep-form": "lower=False", "--ignore-kernel-table": "kernel_table=False"}


@dataclasses.dataclass(frozen=True)
class Wording:
    """How a message names the way out that its caller offers: the Python API's keywords (the
    default), or the command line's flags where the CLI is the caller (moepass.cli runs every command
    `worded_as(CLI_WORDING)`). A message names an option by its flag, through `option`, and a call by
    its command, through `call`; `overwrite`: what replaces an existing output; `output`: what names it."""

    cli: bool = False

    @property
    def overwrite(self) -> str:
        return self.option("--force")

    @property
    def output(self) -> str:
        return "-o" if self.cli else "output path"

    def name(self, flag: str) -> str:
        """The option `flag` named alone: `--kv-cache`, or `kv_cache`."""
        return flag if self.cli else _KEYWORDS.get(flag) or flag.lstrip("-").replace("-", "_")

    def option(self, flag: str, value: object = None) -> str:
        """The option `flag` (with `value`, if any) as the caller gives it: `--kv-cache int8` on the
        command line, `kv_cache='int8'` in Python. A value in capitals (N, FILE, SIZE) is a
        placeholder, not quoted; a flag without a value is a switch: `--exact` or `exact=True`,
        `--no-calibrate` or `calibrate=False`."""
        if self.cli:
            return flag if value is None else f"{flag} {value}"
        keyword = self.name(flag)
        if value is None:
            return _SWITCHES.get(flag) or (
                f"{keyword.removeprefix('no_')}=False" if keyword.startswith("no_") else f"{keyword}=True"
            )
        placeholder = isinstance(value, str) and value.isalpha() and value.isupper()
        return f"{keyword}={value if placeholder or not isinstance(value, str) else repr(value)}"

    def call(self, command: str, *options: str) -> str:
        """`command` given `options` (each worded by `option`): `convert --context N`, or
        `moepass.convert(..., context=N)`."""
        if self.cli:
            return " ".join((command, *options))
        return f"moepass.{command}({', '.join(('...', *options))})"


API_WORDING = Wording()
CLI_WORDING = Wording(cli=True)
_WORDING: contextvars.ContextVar[Wording] = contextvars.ContextVar("moepass_wording", default=API_WORDING)


def wording() -> Wording:
    """The caller's wording: the CLI's within `worded_as(CLI_WORDING)`, else the Python API's."""
    return _WORDING.get()


@contextlib.contextmanager
def worded_as(words: Wording) -> Iterator[None]:
    """Messages raised within the block name the ways out as `words` does."""
    token = _WORDING.set(words)
    try:
        yield
    finally:
        _WORDING.reset(token)


def no_such_path(path: object, what: str = "") -> MoepassError:
    """The one line for a path given that does not exist, whatever was to be there (a model folder,
    a GGUF, a file an option names) and whichever command or API call was given it: "PATH: no such
    file or directory", and `what` the path was for, where said."""
    return MoepassError(f"{path}: no such file or directory" + (f" ({what})" if what else ""))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _module_of(exc: BaseException) -> str:
    return type(exc).__module__ or ""


def expected_failure(exc: BaseException) -> str | None:
    """The one-line message for a failure bad input or the environment can cause, or None for a bug."""
    if isinstance(exc, MoepassError):
        return first_line(exc)
    if isinstance(exc, FileNotFoundError) and exc.filename is not None:
        return first_line(no_such_path(exc.filename))
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else "a file"
        return f"{where}: {exc.strerror or first_line(exc)}"
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"unreadable text or JSON ({first_line(exc)})"
    if isinstance(exc, MemoryError):
        return "out of memory (the model or a request is larger than this machine can hold)"
    module = _module_of(exc)
    if module.startswith("google.protobuf") or type(exc).__name__ == "DecodeError":
        return f"not a readable ONNX model ({first_line(exc)})"
    if module.startswith("onnxruntime"):
        return f"ONNX Runtime: {first_line(exc)}"
    if module.startswith("jinja2"):
        return f"chat template: {type(exc).__name__}: {first_line(exc)}"
    if module.startswith("onnx.") and type(exc).__name__ in ("ValidationError", "InferenceError"):
        return f"invalid ONNX model ({first_line(exc)})"
    return None
