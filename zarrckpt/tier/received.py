"""What a restoring rank reads a local step from, as one checkpoint: the objects its node's tier
holds of the step, where they are, and those a peer sent over the process group, kept in memory
where they arrived.

A received object is never written to the node's tier: a write to fresh pages of host memory and a
read back would cost more than the transfer itself. It is read, and checked against the step's
commit record, like any object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zarrckpt.storage.local import LocalBackend
from zarrckpt.storage.store import Storage


class Received(LocalBackend):
    """Local files, except the objects in ``objects`` (full path -> bytes), read from memory."""

    def __init__(self, fs: Any, objects: Mapping[str, memoryview]) -> None:
        super().__init__(fs)
        self.objects = objects

    def _range(self, full: str, start: int | None, end: int | None) -> memoryview | None:
        data = self.objects.get(full)
        return None if data is None else data[start or 0 : end].toreadonly()

    def get(self, full: str, start: int | None, end: int | None) -> Any:
        got = self._range(full, start, end)
        return super().get(full, start, end) if got is None else bytes(got)

    def stored(self, full: str) -> bytes | None:
        got = self._range(full, None, None)
        return super().stored(full) if got is None else bytes(got)

    def read_view(self, full: str, start: int | None, end: int | None) -> tuple[bytearray | None, memoryview]:
        got = self._range(full, start, end)
        return super().read_view(full, start, end) if got is None else (None, got)

    def read_into(self, full: str, offset: int, buffers: Sequence[memoryview]) -> int:
        data = self.objects.get(full)
        if data is None:
            return super().read_into(full, offset, buffers)
        at = offset
        for buf in buffers:
            if not buf.nbytes:
                continue
            dst = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
            n = max(0, min(len(dst), len(data) - at))
            dst[:n] = data[at : at + n]
            at += n
            if n < len(dst):
                break
        return at - offset


def with_received(root: str, received: Mapping[str, memoryview]) -> Storage:
    """The local directory ``root`` as a storage, with the objects in ``received`` (relative path ->
    the object's bytes) read from memory."""
    storage = Storage(root)
    storage.backend = Received(storage.fs, {f"{storage.root}/{p}": v for p, v in received.items()})
    return storage
