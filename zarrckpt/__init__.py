"""zarrckpt: topology-independent PyTorch checkpoints as Zarr v3 global tensors on any fsspec storage."""

from __future__ import annotations

from . import errors
from .api import load, save
from .dcp import ZarrReader, ZarrWriter
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    LayoutMismatchError,
    SaveLayoutError,
    StorageError,
    ZarrckptError,
)
from .localstate import LocalShard
from .zarr_dtypes import register_zarr_dtypes

__version__ = "0.1.0"

register_zarr_dtypes()  # so plain zarr-python reads our bfloat16 / float8 arrays

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "IncompleteCheckpointError",
    "InvalidCheckpointError",
    "LayoutMismatchError",
    "LocalShard",
    "SaveLayoutError",
    "StorageError",
    "ZarrReader",
    "ZarrWriter",
    "ZarrckptError",
    "__version__",
    "errors",
    "load",
    "save",
]
