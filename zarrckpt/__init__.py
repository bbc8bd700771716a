"""zarrckpt: topology-independent PyTorch checkpoints as Zarr v3 global tensors on any fsspec storage.

This module is the public face: every name in ``__all__``, and nothing else, is the API (the
documentation's reference lists them). The public names are imported on first use (PEP 562), so
that ``import zarrckpt`` (and the ``zarrckpt`` command) does not pay for torch, zarr and
ml_dtypes until they are needed.

The package is layered, each layer importing only those below it (``make lint`` checks it):
``cli`` / ``convert`` / ``transfer`` -> the face (``api``, ``asyncsave``, ``manager``, ``checkpoint``,
``tensorview``, ``lifecycle``, ``display``) -> ``dcp`` -> ``engine`` -> ``plan`` -> ``format`` |
``storage`` -> ``errors`` / ``types``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zarrckpt import errors
from zarrckpt._version import __version__
from zarrckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    InvalidKeyError,
    KeyNotFoundError,
    LayoutMismatchError,
    ModifiedCheckpointError,
    SaveLayoutError,
    StorageError,
    TierSpaceError,
    UnsupportedValueError,
    ZarrckptError,
)
from zarrckpt.format.zarrhook import register_with_zarr
from zarrckpt.types import URL, ArrayKind, Role, SourceKind

if TYPE_CHECKING:
    from zarrckpt.api import load, save
    from zarrckpt.asyncsave import AsyncSave, async_save
    from zarrckpt.checkpoint import Checkpoint, open
    from zarrckpt.convert.export import export_safetensors
    from zarrckpt.convert.importer import import_checkpoint
    from zarrckpt.dcp import ZarrReader, ZarrWriter, dcp_to_torch_save
    from zarrckpt.hostpool import release_staging
    from zarrckpt.lifecycle import collect_garbage, committed_steps, delete, latest_step, list_checkpoints
    from zarrckpt.manager import CheckpointManager
    from zarrckpt.plan.localstate import LocalShard
    from zarrckpt.plan.perrank import PerRank
    from zarrckpt.staging import StagingStats
    from zarrckpt.storage.clients import fsspec_filesystem
    from zarrckpt.tensorview import TensorView, UncheckedReadWarning
    from zarrckpt.tier import LocalTier
    from zarrckpt.transfer import copy_checkpoint
    from zarrckpt_dtypes.zarr_types import register_zarr_dtypes

# public name -> the module defining it, imported on first use
_LAZY = {
    "load": "zarrckpt.api",
    "save": "zarrckpt.api",
    "async_save": "zarrckpt.asyncsave",
    "AsyncSave": "zarrckpt.asyncsave",
    "StagingStats": "zarrckpt.staging",
    "release_staging": "zarrckpt.hostpool",
    "Checkpoint": "zarrckpt.checkpoint",
    "open": "zarrckpt.checkpoint",
    "TensorView": "zarrckpt.tensorview",
    "UncheckedReadWarning": "zarrckpt.tensorview",
    "ZarrReader": "zarrckpt.dcp",
    "ZarrWriter": "zarrckpt.dcp",
    "dcp_to_torch_save": "zarrckpt.dcp",
    "export_safetensors": "zarrckpt.convert.export",
    "import_checkpoint": "zarrckpt.convert.importer",
    "collect_garbage": "zarrckpt.lifecycle",
    "committed_steps": "zarrckpt.lifecycle",
    "latest_step": "zarrckpt.lifecycle",
    "delete": "zarrckpt.lifecycle",
    "list_checkpoints": "zarrckpt.lifecycle",
    "copy_checkpoint": "zarrckpt.transfer",
    "fsspec_filesystem": "zarrckpt.storage.clients",
    "LocalShard": "zarrckpt.plan.localstate",
    "PerRank": "zarrckpt.plan.perrank",
    "CheckpointManager": "zarrckpt.manager",
    "LocalTier": "zarrckpt.tier",
    "register_zarr_dtypes": "zarrckpt_dtypes.zarr_types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zarrckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_with_zarr()  # zarr.open_array() skips the entry points (zarrckpt_dtypes.zarr_types): register on import

__all__ = [
    "URL",
    "ArrayKind",
    "AsyncSave",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CorruptChunkError",
    "IncompleteCheckpointError",
    "InvalidCheckpointError",
    "InvalidKeyError",
    "KeyNotFoundError",
    "LayoutMismatchError",
    "LocalShard",
    "LocalTier",
    "ModifiedCheckpointError",
    "PerRank",
    "Role",
    "SaveLayoutError",
    "SourceKind",
    "StagingStats",
    "StorageError",
    "TensorView",
    "TierSpaceError",
    "UncheckedReadWarning",
    "UnsupportedValueError",
    "ZarrReader",
    "ZarrWriter",
    "ZarrckptError",
    "__version__",
    "async_save",
    "collect_garbage",
    "committed_steps",
    "copy_checkpoint",
    "dcp_to_torch_save",
    "delete",
    "errors",
    "export_safetensors",
    "fsspec_filesystem",
    "import_checkpoint",
    "latest_step",
    "list_checkpoints",
    "load",
    "open",
    "register_zarr_dtypes",
    "release_staging",
    "save",
]
