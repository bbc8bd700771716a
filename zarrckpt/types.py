"""The names the public API is typed with: :data:`URL` and the :class:`~enum.StrEnum` s stored in a checkpoint.

Imports nothing heavy (no torch, no zarr), so the command line can use it and start fast. Each enum
member is a ``str`` equal to its value (``Role.MAIN_WEIGHT == "main_weight"``) and is written to
JSON as that string, so checkpoints hold exactly the strings they always held, and plain strings
are accepted wherever a member is.
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import TypeAlias

__all__ = ["URL", "ArrayKind", "Role", "SourceKind"]

URL: TypeAlias = str | os.PathLike[str]
"""Where a checkpoint is: a local path (``str`` or ``pathlib.Path``) or any fsspec URL (``s3://bucket/run/step_100``,
``gs://...``, ``file://...``, ``memory://...``)."""


class Role(StrEnum):
    """What a stored tensor is for, inferred from its key when it is saved (``zarrckpt ls`` shows it).

    Stored as the ``role`` attribute of each array's ``zarr.json``; ``export_safetensors(roles=...)``
    and ``zarrckpt export --role`` select by it.
    """

    MAIN_WEIGHT = "main_weight"
    """A model parameter (floating point, under the model's keys)."""
    FIRST_MOMENT = "first_moment"
    """An optimizer's first moment (Adam's ``exp_avg``, SGD's ``momentum_buffer``)."""
    SECOND_MOMENT = "second_moment"
    """An optimizer's second moment (Adam's ``exp_avg_sq``, ``max_exp_avg_sq``)."""
    OPTIMIZER_STEP = "optimizer_step"
    """An optimizer's step count."""
    BUFFER = "buffer"
    """A model buffer (``running_mean``, ``num_batches_tracked``, ...), or any non-floating model tensor."""
    OTHER = "other"
    """Anything else: other optimizer state, trainer / RNG / dataloader state, byte strings, numpy arrays."""


class ArrayKind(StrEnum):
    """What Python value a stored array restores to (the ``kind`` attribute of its ``zarr.json``)."""

    TENSOR = "tensor"
    """A ``torch.Tensor`` (a DTensor or :class:`~zarrckpt.LocalShard` is saved as the global tensor)."""
    BYTES = "bytes"
    """A ``bytes`` / ``bytearray`` / ``io.BytesIO`` value, stored as a 1-D ``uint8`` array."""
    NDARRAY = "ndarray"
    """A ``numpy.ndarray``."""


class SourceKind(StrEnum):
    """What kind of checkpoint :func:`zarrckpt.import_checkpoint` (``zarrckpt import --from``) converts."""

    DCP = "dcp"
    """A ``torch.distributed.checkpoint`` directory (with a ``.metadata`` file)."""
    TORCH = "torch"
    """A ``torch.save`` file."""
    SAFETENSORS = "safetensors"
    """A ``.safetensors`` file, a directory of them, or a ``*.safetensors.index.json``."""
