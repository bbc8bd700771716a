"""zarrckpt's exception types. Every error zarrckpt raises on purpose derives from ZarrckptError."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CorruptChunkError",
    "IncompleteCheckpointError",
    "InvalidCheckpointError",
    "InvalidKeyError",
    "KeyNotFoundError",
    "LayoutMismatchError",
    "ModifiedCheckpointError",
    "SaveLayoutError",
    "StorageError",
    "TierSpaceError",
    "UnsupportedValueError",
    "ZarrckptError",
    "causes",
]


class ZarrckptError(Exception):
    """Base class of every error zarrckpt raises on purpose."""


class CheckpointNotFoundError(ZarrckptError):
    """Nothing (no checkpoint, not even a partial one) exists at the URL."""


class IncompleteCheckpointError(ZarrckptError):
    """The URL holds objects of a save that never committed (or is being overwritten)."""


class CheckpointExistsError(ZarrckptError, RuntimeError):
    """A committed checkpoint already exists at the URL and ``overwrite=False``; also a
    ``RuntimeError`` with "Checkpoint already exists" in its message, as DCP's ``FileSystemWriter`` raises."""


class CheckpointSaveError(ZarrckptError):
    """A save the CheckpointManager started failed; its cause is chained (``__cause__``).

    ``skipped_step``: the step whose ``save()`` call raised this failure of an earlier (asynchronous)
    save instead of saving it (None when that step was not due, or the failure is the step's own)."""

    skipped_step: int | None = None


class InvalidCheckpointError(ZarrckptError):
    """The checkpoint's metadata is malformed, of an unknown format version, or inconsistent."""


class KeyNotFoundError(ZarrckptError, KeyError):
    """No tensor with this key in the checkpoint; the message suggests the closest keys."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class LayoutMismatchError(ZarrckptError):
    """The state dict being loaded does not match the checkpoint (keys, shapes or dtypes)."""

    def __init__(self, message: str, differences: list[str] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or [])


class SaveLayoutError(ZarrckptError):
    """The ranks' tensors do not describe each global tensor exactly once, or ranks disagree."""


class CorruptChunkError(ZarrckptError):
    """A stored chunk or shard failed its checksum, is truncated, or is missing."""

    def __init__(self, message: str, key: str | None = None, chunk: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.chunk = chunk


class ModifiedCheckpointError(CorruptChunkError):
    """Chunks or metadata differ from what the commit recorded: another writer or tool changed the
    checkpoint after it was committed. ``allow_modified=True`` reads it as it is now."""


class StorageError(ZarrckptError):
    """The storage refused or failed a request (missing bucket, permissions, network)."""


class InvalidKeyError(ZarrckptError):
    """A state-dict key cannot be stored (empty segment, '..', reserved name, prefix clash)."""


class UnsupportedValueError(ZarrckptError):
    """A state-dict value cannot be stored without pickle (or has an unsupported dtype)."""


def causes(error: BaseException, limit: int = 20) -> Iterator[BaseException]:
    """``error`` and what led to it, nearest first: each exception's ``__cause__`` (else its
    ``__context__``) and, for DCP's ``CheckpointException``, every rank's failure (``.failures``).
    Each exception once, at most ``limit`` in all."""
    seen: set[int] = set()
    queue: deque[BaseException] = deque([error])
    while queue and len(seen) < limit:
        e = queue.popleft()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback summary)}
        if isinstance(failures, dict):
            for f in failures.values():
                inner = f[0] if isinstance(f, tuple) and f else f
                if isinstance(inner, BaseException):
                    queue.append(inner)
        inner = e.__cause__ or e.__context__
        if inner is not None:
            queue.append(inner)


class TierSpaceError(ZarrckptError):
    """A node's local tier (:class:`zarrckpt.LocalTier`) has no room for the next local step, or its
    replicas cannot be placed; raised before anything of that step is written."""
