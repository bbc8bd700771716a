"""Import a checkpoint from another format into zarrckpt: DCP directories, ``torch.save`` files,
safetensors files or sharded safetensors directories.

Nothing here unpickles arbitrary objects: ``torch.save`` files and DCP's non-tensor values are
read with ``torch.load(weights_only=True)``, and DCP's pickled ``.metadata`` with an unpickler
that only admits DCP's own metadata classes. Safetensors headers are parsed and checked here,
and the tensors are memory-mapped, so importing them holds no copy of the data in memory;
``torch.save`` files are memory-mapped too (zip format). DCP checkpoints are read whole into
memory first (DCP reads into allocated tensors), so importing one needs RAM for its tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zarrckpt.api import save
from zarrckpt.checkpoint import open as open_checkpoint
from zarrckpt.convert.safetensors import MAX_HEADER, read_safetensors
from zarrckpt.display import ProgressOption
from zarrckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    UnsupportedValueError,
    ZarrckptError,
    causes,
)
from zarrckpt.format.keys import flat_key, iter_leaves
from zarrckpt.types import URL, SourceKind

__all__ = ["SOURCE_KINDS", "SourceKind", "detect_kind", "import_checkpoint", "read_safetensors"]

SOURCE_KINDS: tuple[str, ...] = tuple(kind.value for kind in SourceKind)  # what import_checkpoint(kind=) takes


def import_checkpoint(
    src: str | os.PathLike[str],
    url: URL,
    *,
    kind: SourceKind | str | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: ProgressOption = False,
) -> dict[str, Any]:
    """Convert the checkpoint at local path ``src`` into a zarrckpt checkpoint at ``url``.

    Keys are the source's keys, flattened the way :func:`zarrckpt.save` flattens nested dicts
    (dotted paths). Runs in one process, no process group. Nothing is unpickled beyond what
    ``torch.load(weights_only=True)`` admits.

    Args:
        src: a local file or directory holding the source checkpoint.
        url: where to save the zarrckpt checkpoint: a local path or any fsspec URL.
        kind: the source's kind (a :class:`~zarrckpt.types.SourceKind` or its name): ``"dcp"`` (a
            ``torch.distributed.checkpoint`` directory), ``"torch"`` (a ``torch.save`` file) or
            ``"safetensors"`` (a ``.safetensors`` file, a directory of them, or a
            ``*.safetensors.index.json``). None: detected from the files.
        storage_options: passed to fsspec for ``url``.
        overwrite: replace a committed checkpoint at ``url`` (as ``save(..., overwrite=True)``).
        progress: the writing's progress, as for :func:`zarrckpt.save`.

    Returns:
        A summary: ``{"source", "kind", "url", "tensors", "values", "bytes", "seconds"}``
        (``tensors`` counts every stored array, byte strings included; ``values`` the plain JSON
        values).

    Raises:
        ZarrckptError: ``src`` does not exist, is of an unknown or undetectable kind, or is not a
            valid checkpoint of its kind (a damaged file, a bad safetensors header or index).
        UnsupportedValueError: the source holds objects ``torch.load(weights_only=True)`` refuses,
            is not a dict, or has a tensor of a dtype zarrckpt cannot store.
        CheckpointExistsError: a committed checkpoint exists at ``url`` and ``overwrite`` is
            False (checked before the source is read).
        SaveLayoutError, InvalidKeyError, IncompleteCheckpointError, StorageError: as for
            :func:`zarrckpt.save`.
    """
    start = time.perf_counter()
    path = Path(os.fspath(src))
    if not path.exists():
        raise ZarrckptError(f"import source {str(path)!r} does not exist (expected a local file or directory)")
    found = kind or detect_kind(path)
    if found not in SOURCE_KINDS:
        raise ZarrckptError(f"unknown source kind {found!r}: choose one of {', '.join(SOURCE_KINDS)}")
    kind = SourceKind(found)
    try:  # fail on a bad URL or an existing checkpoint before reading a large source
        open_checkpoint(url, storage_options=storage_options)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        pass  # nothing there, or a failed save that save() replaces
    else:
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: a committed checkpoint is at {os.fspath(url)!r}; pass overwrite=True "
                "(--overwrite) to replace it"
            )
    if kind == SourceKind.DCP:
        state = _read_dcp(path)
    elif kind == SourceKind.TORCH:
        state = _read_torch(path)
    else:
        state = read_safetensors(path)
    tensors = values = nbytes = 0
    for _, leaf in iter_leaves(state):
        if isinstance(leaf, torch.Tensor):
            tensors += 1
            nbytes += leaf.numel() * leaf.element_size()
        elif isinstance(leaf, (bytes, bytearray, np.ndarray)):  # stored as arrays too
            tensors += 1
            nbytes += leaf.nbytes if isinstance(leaf, np.ndarray) else len(leaf)
        else:
            values += 1
    save(state, url, storage_options=storage_options, overwrite=overwrite, progress=progress)
    return {
        "source": str(path),
        "kind": kind,
        "url": os.fspath(url),
        "tensors": tensors,
        "values": values,
        "bytes": nbytes,
        "seconds": time.perf_counter() - start,
    }


def detect_kind(path: Path) -> SourceKind:
    """``"dcp"``, ``"torch"`` or ``"safetensors"`` from the files at ``path``."""
    if path.is_dir():
        if (path / ".metadata").is_file():
            return SourceKind.DCP
        if any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")):
            return SourceKind.SAFETENSORS
        if (path / "zarr.json").is_file():
            raise ZarrckptError(f"{str(path)!r} is a Zarr checkpoint already; open it with zarrckpt.open")
        raise ZarrckptError(
            f"cannot tell what kind of checkpoint the directory {str(path)!r} holds: expected a DCP checkpoint "
            "(.metadata) or safetensors files (*.safetensors, *.safetensors.index.json); force one with --from"
        )
    if path.name.endswith((".safetensors", ".safetensors.index.json")):
        return SourceKind.SAFETENSORS
    try:
        with path.open("rb") as f:
            head = f.read(9)
    except OSError as e:
        raise ZarrckptError(f"cannot read import source {str(path)!r}: {e}") from e
    if zipfile.is_zipfile(path) or head.startswith(b"\x80\x02\x8a\x0a"):
        return SourceKind.TORCH
    if len(head) == 9 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= MAX_HEADER:
        return SourceKind.SAFETENSORS
    raise ZarrckptError(
        f"cannot tell what kind of checkpoint {str(path)!r} is: not a torch.save file (zip or legacy pickle) "
        "nor a safetensors file; force one with --from dcp|torch|safetensors"
    )


# --- torch.save -------------------------------------------------------------------------------


def _read_torch(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ZarrckptError(f"{str(path)!r} is a directory, not a torch.save file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise UnsupportedValueError(
            f"{str(path)!r} holds objects that torch.load(weights_only=True) refuses to load ({e}); only tensors "
            "and plain values (dicts, lists, numbers, strings) are imported, never arbitrary pickles"
        ) from None
    except Exception as e:  # torch.load fails in many ways on a damaged file (KeyError, RuntimeError, ...)
        raise ZarrckptError(f"cannot read {str(path)!r} as a torch.save file: {type(e).__name__}: {e}") from e
    if isinstance(state, torch.Tensor):
        return {"tensor": state}
    if not isinstance(state, dict):
        raise UnsupportedValueError(
            f"{str(path)!r} holds a {type(state).__name__}; expected a (nested) dict of tensors and plain values"
        )
    return state


# --- safetensors --------------------------------------------------------------------------------


# --- DCP --------------------------------------------------------------------------------------

_DCP_META = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    (_DCP_META, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only DCP's metadata classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


def _dcp_reader(path: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = path / ".metadata"
            try:
                with where.open("rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
                raise ZarrckptError(f"{str(where)!r} is not DCP metadata zarrckpt can read safely: {e}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _dcp_planner() -> Any:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsupportedValueError(
                    f"DCP value {fqn!r} is an object torch.load(weights_only=True) refuses ({e}); "
                    "only tensors and plain values are imported"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


def _read_dcp(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if not (path / ".metadata").is_file():
        raise ZarrckptError(f"{str(path)!r} is not a DCP checkpoint: it has no .metadata file")
    reader = _dcp_reader(path)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        state[fqn] = (
            torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            dcp_load(state, storage_reader=reader, planner=_dcp_planner(), no_dist=True)
    except ZarrckptError:
        raise
    except Exception as e:  # DCP wraps reader failures in CheckpointException
        for inner in causes(e):
            if isinstance(inner, ZarrckptError):
                raise inner from None
        raise ZarrckptError(f"cannot read the DCP checkpoint {str(path)!r}: {e}") from e
    # DCP's keys are already flat (dotted); keep them exactly
    return {flat_key((k,)): v for k, v in state.items()}
