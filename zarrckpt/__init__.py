"""zarrckpt: topology-independent PyTorch checkpoints as Zarr v3 global tensors on any fsspec storage.

The public names are imported on first use (PEP 562), so that ``import zarrckpt`` (and the
``zarrckpt`` command) does not pay for torch, zarr and ml_dtypes until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._version import __version__
from ._zarr_hook import register_with_zarr
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    KeyNotFoundError,
    LayoutMismatchError,
    ModifiedCheckpointError,
    SaveLayoutError,
    StorageError,
    UnsupportedValueError,
    ZarrckptError,
)

if TYPE_CHECKING:
    from .api import load, save
    from .asyncsave import AsyncSave, StagingStats, async_save
    from .checkpoint import Checkpoint, open
    from .dcp import ZarrReader, ZarrWriter
    from .export import export_safetensors
    from .importer import import_checkpoint
    from .lifecycle import collect_garbage, delete, list_checkpoints
    from .localstate import LocalShard
    from .manager import CheckpointManager
    from .tensorview import TensorView
    from .zarr_dtypes import register_zarr_dtypes as register_zarr_dtypes

_LAZY = {
    "load": "api",
    "save": "api",
    "async_save": "asyncsave",
    "AsyncSave": "asyncsave",
    "StagingStats": "asyncsave",
    "Checkpoint": "checkpoint",
    "TensorView": "tensorview",
    "open": "checkpoint",
    "ZarrReader": "dcp",
    "ZarrWriter": "dcp",
    "export_safetensors": "export",
    "import_checkpoint": "importer",
    "collect_garbage": "lifecycle",
    "delete": "lifecycle",
    "list_checkpoints": "lifecycle",
    "LocalShard": "localstate",
    "CheckpointManager": "manager",
    "register_zarr_dtypes": "zarr_dtypes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zarrckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_with_zarr()  # zarr.open_array() skips the entry points (zarrckpt_dtypes.zarr_types): register on import

__all__ = [
    "AsyncSave",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CorruptChunkError",
    "IncompleteCheckpointError",
    "InvalidCheckpointError",
    "KeyNotFoundError",
    "LayoutMismatchError",
    "ModifiedCheckpointError",
    "LocalShard",
    "SaveLayoutError",
    "StagingStats",
    "StorageError",
    "TensorView",
    "UnsupportedValueError",
    "ZarrReader",
    "ZarrWriter",
    "ZarrckptError",
    "__version__",
    "async_save",
    "collect_garbage",
    "delete",
    "list_checkpoints",
    "errors",
    "export_safetensors",
    "import_checkpoint",
    "load",
    "open",
    "save",
]
