"""What a restoring rank reads a local step from, as one checkpoint: the objects its node's tier
holds of the step, where they are, and the byte ranges of others a peer sent over the process group
(the ranges its read plan fetches), kept in memory where they arrived.

A received range is never written to the node's tier: a write to fresh pages of host memory and a
read back would cost more than the transfer itself. It is read, and checked against the step's
commit record, like any object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zarrckpt.errors import ZarrckptError
from zarrckpt.storage.local import LocalBackend
from zarrckpt.storage.store import Storage

Pieces = Mapping[str, Sequence[tuple[int, memoryview]]]  # object -> (its first byte, the bytes from there)


class Received(LocalBackend):
    """Local files, except the objects in ``pieces`` (full path -> the ranges received), read from memory."""

    def __init__(self, fs: Any, pieces: Pieces) -> None:
        super().__init__(fs)
        self.pieces = pieces

    def _range(self, full: str, start: int | None, end: int | None) -> memoryview | None:
        """Bytes ``[start, end)`` of a received object (None: not received, a local file)."""
        got = self.pieces.get(full)
        if got is None:
            return None
        lo = start or 0
        for first, data in got:
            if first <= lo and end is not None and end <= first + len(data):
                return data[lo - first : end - first].toreadonly()
        raise ZarrckptError(
            f"{full}: bytes {lo}-{end} of it were not received from its node (a restore receives the ranges "
            "its read plan fetches, and reads nothing else)"
        )

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
        if full not in self.pieces:
            return super().read_into(full, offset, buffers)
        data = self._range(full, offset, offset + sum(b.nbytes for b in buffers))
        assert data is not None
        at = 0
        for buf in buffers:
            if buf.nbytes:
                (buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf)[:] = data[at : at + buf.nbytes]
                at += buf.nbytes
        return at


def with_received(root: str, received: Pieces) -> Storage:
    """The local directory ``root`` as a storage, with the ranges in ``received`` (relative path ->
    (first byte, bytes) of each) read from memory."""
    storage = Storage(root)
    storage.backend = Received(storage.fs, {f"{storage.root}/{p}": v for p, v in received.items()})
    return storage
