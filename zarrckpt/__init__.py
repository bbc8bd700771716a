"""zarrckpt: topology-independent PyTorch checkpoints as Zarr v3 global tensors on any fsspec storage."""

from __future__ import annotations

from . import errors
from ._version import __version__
from .api import load, save
from .asyncsave import async_save
from .checkpoint import Checkpoint, TensorView, open
from .dcp import ZarrReader, ZarrWriter
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    KeyNotFoundError,
    LayoutMismatchError,
    SaveLayoutError,
    StorageError,
    UnsupportedValueError,
    ZarrckptError,
)
from .export import export_safetensors
from .importer import import_checkpoint
from .lifecycle import collect_garbage, delete, list_checkpoints
from .localstate import LocalShard
from .manager import CheckpointManager
from .zarr_dtypes import register_zarr_dtypes

register_zarr_dtypes()  # so plain zarr-python reads our bfloat16 / float8 arrays

__all__ = [
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
    "LocalShard",
    "SaveLayoutError",
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
