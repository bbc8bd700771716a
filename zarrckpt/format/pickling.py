"""The only module that pickles or unpickles (besides importer.py's restricted readers of foreign
formats). Two uses, both opt-in or in-process:

- values saved with ``allow_pickle=True`` (:mod:`zarrckpt.format.values`): unpickled only when the loader
  passes ``allow_pickle=True`` too; otherwise UnsupportedValueError, before anything is loaded;
- DCP planner hooks (:mod:`zarrckpt.dcp`): a planner hands byte items over as ``torch.save``
  bytes made in this process, and expects ``torch.save`` bytes back; nothing of it reaches storage.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

from zarrckpt.errors import UnsupportedValueError


def dumps(value: Any) -> str:
    """``value`` pickled, as base64 text for a JSON document."""
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def loads(text: str, key: str, allow_pickle: bool) -> Any:
    """Unpickle a value saved with ``allow_pickle=True`` — only when the loader allows it too."""
    if not allow_pickle:
        raise UnsupportedValueError(
            f"{key!r} was saved pickled (allow_pickle=True); loading it runs code from the checkpoint, "
            "so it needs load(..., allow_pickle=True) from a checkpoint you trust"
        )
    return pickle.loads(base64.b64decode(text))


def from_planner(stream: Any, key: str) -> Any:
    """The object behind a DCP byte item: the planner's own ``torch.save`` bytes, made in this process."""
    import torch

    if isinstance(stream, torch.Tensor) or not hasattr(stream, "read"):
        raise UnsupportedValueError(f"{key}: DCP resolved a byte item to {type(stream).__name__}, not a byte stream")
    stream.seek(0)
    return torch.load(stream, weights_only=False)


def to_planner(value: Any) -> io.BytesIO:
    """``value`` as the ``torch.save`` bytes a DCP planner's ``load_bytes`` expects."""
    import torch

    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream
