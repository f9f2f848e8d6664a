"""The ONNX model in a moepass folder: found (`model_file`), loaded with its external data checked
(`load_model`), saved with its weights streamed (`save_model`), or taken from what a pipeline hands in
(`as_ir_model`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepass.core.errors import MoepassError, first_line, no_such_path
from moepass.core.files import (
    DATA_FILE,
    INLINE_BYTES,
    MODEL_FILE,
    SHARE_MIN_SHARE,
    SHARED_DATA_FILE,
    link_or_share,
)
from moepass.core.formats import check_shared_data
from moepass.core.onnx_format import stamp

if TYPE_CHECKING:
    import onnx_ir


def model_file(model_dir: str | os.PathLike) -> Path:
    """The model.onnx of a model directory (or the path itself when it names a file), which must exist."""
    path = Path(model_dir)
    if not path.exists():
        raise no_such_path(path)
    if path.is_dir() and not (path / MODEL_FILE).is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        others = sorted(p.name for p in path.glob("*.onnx"))
        if ggufs:
            shown = ", ".join(ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise MoepassError(
                f"{path}: a folder of GGUF files ({shown}),"
                f" not a converted model: convert the file, `moepass convert {path / ggufs[0]} -o OUT`"
            )
        if others:
            raise MoepassError(f"{path}: has no {MODEL_FILE}; it holds {', '.join(others[:3])}: give that file's path")
        raise MoepassError(f"{path}: not a converted model (no {MODEL_FILE} in it; `moepass convert` makes one)")
    path = path / MODEL_FILE if path.is_dir() else path
    if not path.is_file():
        raise MoepassError(f"{path}: not a converted model (not a file or folder moepass reads)")
    from moepass.core.gguf_reader import is_gguf

    if is_gguf(path):
        raise MoepassError(
            f"{path}: a GGUF file, not a converted model: moepass.load (and run, chat, serve, bench) "
            "convert it into a cache; moepass.runtime.load takes a converted folder"
        )
    return path


def load_model(model_dir: str | os.PathLike) -> onnx_ir.Model:
    """A model (directory or model.onnx) as onnx-ir, its weights left on disk (read lazily).

    The model file is untrusted: it must hold a graph, and every external data reference must name
    a file inside the model's folder (no absolute path, no `..`, no symbolic link out of it) that is
    long enough for the bytes it promises. Nothing is read before those checks pass."""
    import onnx_ir

    path = model_file(model_dir)
    try:
        model = onnx_ir.load(path)
    except Exception as e:  # noqa: BLE001 - onnx raises many decode error types; report one line
        raise MoepassError(f"{path}: not a readable ONNX model ({type(e).__name__}: {first_line(e)})") from None
    if not model.graph.outputs or not len(model.graph):
        raise MoepassError(f"{path}: not an ONNX model with a graph (empty or not ONNX)")
    check_external_data(model, path)
    check_shared_data(path.parent)
    _accept_shared_data(model, path)
    return model


def _accept_shared_data(model: onnx_ir.Model, path: Path) -> None:
    """partition shares a source model's data file with the placed model by a hard link
    (SHARED_DATA_FILE there), so both files have more than one link, which onnx-ir refuses to read
    (its guard against a hard link planted to a file outside the folder, which no containment check
    can see). moepass accepts its own two data file names with several links, inside the folder (the
    containment check_external_data made); ONNX Runtime 1.32 reads them as well. Their tensors are
    then read past onnx-ir's link check; any other file with several links stays refused by it."""
    import onnx_ir

    folder = path.parent
    linked = {
        name
        for name in (DATA_FILE, SHARED_DATA_FILE)
        if (folder / name).is_file() and (folder / name).stat().st_nlink > 1
    }
    if not linked:
        return
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, onnx_ir.ExternalTensor) and str(tensor.location) in linked:
            value.const_value = _SharedExternalTensor(
                tensor.location,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=tensor.shape,
                name=tensor.name,
                base_dir=tensor.base_dir,
            )


@functools.cache
def _shared_tensor_class():  # made once, on first use (onnx-ir is imported lazily here)
    import onnx_ir

    class SharedExternalTensor(onnx_ir.ExternalTensor):
        """An external tensor in a placed model's SHARED_DATA_FILE (see _accept_shared_data)."""

        def _check_path_containment(self) -> None:  # checked by check_external_data and the plan's record
            return None

    return SharedExternalTensor


def _SharedExternalTensor(*args, **kwargs):
    return _shared_tensor_class()(*args, **kwargs)


def save_model(
    model: onnx_ir.Model,
    path: Path,
    progress: Callable[[int, int], None] | None = None,
    share_from: Path | None = None,
) -> str:
    """`model` as model.onnx at `path` with every weight in DATA_FILE beside it, one writer thread;
    `progress(bytes written, total bytes)` as the tensors go out. `share_from`: a data file whose
    tensors the model still reads unchanged (partition's source): it is hard-linked into the folder
    as SHARED_DATA_FILE (a reflink, else a copy, where no link can be made) and those tensors point
    into it; only the others are written. Says how the weights came to be."""
    import onnx
    import onnx_ir
    from onnx_ir.external_data import convert_tensors_to_external

    stamp(model, str(path))  # an IR version every supported ONNX Runtime loads
    tensors = {v: v.const_value for v in model.graph.initializers.values() if v.const_value is not None}
    source = os.path.realpath(share_from) if share_from is not None else ""
    shared = {
        v: t for v, t in tensors.items() if source and isinstance(t, onnx_ir.ExternalTensor) and _lies_in(t, source)
    }
    declined = bool(shared) and sum(t.nbytes for t in shared.values()) < SHARE_MIN_SHARE * os.path.getsize(source)
    if declined:  # most of the file is no longer read: a link would keep it all alive; copy what is
        shared = {}
    # small tensors stay inside model.onnx, as onnx-ir's save keeps them (ONNX Runtime's shape
    # inference reads constants such as a ReduceSum's axes only from there)
    written = {v: t for v, t in tensors.items() if v not in shared and t.nbytes >= INLINE_BYTES}
    total = sum(t.nbytes for t in written.values())
    callback = None
    if progress is not None:

        def callback(_tensor, info) -> None:  # called as each tensor starts: what lies before it is written
            progress(info.offset, total)

    if not shared:
        onnx_ir.save(
            model, path, external_data=DATA_FILE, callback=callback, max_workers=1, size_threshold_bytes=INLINE_BYTES
        )
        how = "copied" if declined else "written"
    else:
        how = link_or_share(Path(source), path.parent / SHARED_DATA_FILE)
        for value, tensor in shared.items():
            value.const_value = onnx_ir.ExternalTensor(
                SHARED_DATA_FILE,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=onnx_ir.Shape(tensor.shape),
                name=tensor.name or value.name or "",
                base_dir=path.parent,
            )
        if written:
            externals = convert_tensors_to_external(
                list(written.values()), path.parent, DATA_FILE, callback=callback, max_workers=1
            )
            for value, external in zip(written, externals):
                value.const_value = external
        onnx.save(onnx_ir.to_proto(model), path)
    if progress is not None:
        progress(total, total)
    return how


def _lies_in(tensor: onnx_ir.ExternalTensor, data_file: str) -> bool:
    """Whether an external tensor's bytes are in `data_file` (a real path)."""
    return os.path.realpath(tensor.path) == data_file


def check_external_data(model: onnx_ir.Model, path: Path) -> None:
    """Every external tensor of `model` (loaded from `path`) lies inside the model's folder, whole."""
    import onnx_ir

    folder = Path(os.path.realpath(path.parent))
    sizes: dict[str, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, onnx_ir.ExternalTensor):
            continue
        location = os.fspath(tensor.location)
        where = f"{path}: initializer '{value.name}' keeps its data in '{location}'"
        if not location or os.path.isabs(location) or ".." in Path(location).parts:
            raise MoepassError(f"{where}, outside the model's folder; refused")
        target = Path(os.path.realpath(folder / location))
        if folder not in target.parents:
            raise MoepassError(f"{where}, which leads outside the model's folder; refused")
        if location not in sizes:
            if not target.is_file():
                raise MoepassError(f"{where}, which does not exist")
            sizes[location] = target.stat().st_size
        end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
        if end > sizes[location]:
            raise MoepassError(f"{where} up to byte {end}, but the file has {sizes[location]} bytes (truncated?)")


def as_ir_model(source: Any) -> tuple[onnx_ir.Model, str]:
    """An onnx-ir model and a label for it, from a path (model.onnx or a model directory), an
    onnx.ModelProto, an onnx-ir model or an onnx-graphsurgeon graph (what pipelines hand in)."""
    import onnx
    import onnx_ir as ir

    if isinstance(source, ir.Model):
        return source, "<onnx_ir.Model>"
    if isinstance(source, onnx.ModelProto):
        return ir.from_proto(source), "<onnx.ModelProto>"
    if type(source).__module__.startswith("onnx_graphsurgeon"):
        import onnx_graphsurgeon as gs

        return ir.from_proto(gs.export_onnx(source)), "<onnx_graphsurgeon.Graph>"
    path = model_file(source)
    return load_model(path), str(path)
