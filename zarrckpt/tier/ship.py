"""Ship whole objects between ranks over the process group (point to point): a replica's copies
after a local save, a restore's missing objects.

Between a sender and a receiver: the length of a header, the header (every object's path and
size, JSON), then the objects in batches of at most :data:`BATCH_BYTES` (an object larger than that
goes alone), cut alike on both sides from the header. Every rank posts its round ``k`` at once
(batch ``k`` of each of its pairs), so a rank never waits on a transfer its peer has not posted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from zarrckpt.engine.dist import Group
from zarrckpt.errors import ZarrckptError

BATCH_BYTES = 64 * 2**20

Read = Callable[[str, memoryview], None]  # fill the view with the object's bytes
Land = Callable[[str, memoryview], None]  # store a received object


def ship(
    group: Group,
    sends: Mapping[int, Sequence[str]],
    sources: Sequence[int],
    size: Callable[[str], int],
    read: Read,
    land: Land,
) -> int:
    """Send ``sends[dst]`` (object paths) to each ``dst``; receive from each of ``sources`` what it
    sends (every rank calls it, with matching pairs); returns the bytes received.

    Raises:
        ZarrckptError: a transfer failed, a received header is malformed, or a rank could not read
            an object it sends (on every rank: it sends zeros in its place, so no peer waits for
            bytes that never come, and one all-gather at the end tells every rank).
    """
    if not group.active:
        return 0
    outgoing = {dst: [(p, size(p)) for p in paths] for dst, paths in sends.items()}
    heads = {dst: json.dumps(items).encode() for dst, items in outgoing.items()}
    lengths = {src: np.zeros(8, dtype=np.uint8) for src in sources}
    group.start_exchange(
        [(dst, np.frombuffer(len(h).to_bytes(8, "little"), dtype=np.uint8).copy()) for dst, h in heads.items()],
        list(lengths.items()),
    ).wait()
    raw = {src: np.empty(int.from_bytes(n.tobytes(), "little"), dtype=np.uint8) for src, n in lengths.items()}
    group.start_exchange(
        [(dst, np.frombuffer(h, dtype=np.uint8).copy()) for dst, h in heads.items()], list(raw.items())
    ).wait()
    incoming = {src: _header(src, buf) for src, buf in raw.items()}
    out_batches = {dst: _batches(items) for dst, items in outgoing.items()}
    in_batches = {src: _batches(items) for src, items in incoming.items()}
    rounds = max([len(b) for b in [*out_batches.values(), *in_batches.values()]], default=0)
    received = 0
    failures: list[str] = []
    for k in range(rounds):
        send_bufs = [(dst, _pack(b[k], read, failures)) for dst, b in out_batches.items() if k < len(b)]
        recv_bufs = [
            (src, b[k], np.empty(sum(n for _, n in b[k]), dtype=np.uint8))
            for src, b in in_batches.items()
            if k < len(b)
        ]
        group.start_exchange(send_bufs, [(src, buf) for src, _, buf in recv_bufs]).wait()
        for _, batch, buf in recv_bufs:
            at = 0
            view = memoryview(buf.data)
            for path, n in batch:
                land(path, view[at : at + n])
                at += n
            received += at
    mine = [f"rank {group.rank} could not read {failures[0]}"] if failures else []
    problems = [p for theirs in group.all_gather_json(mine) for p in theirs]
    if problems:
        raise ZarrckptError(f"shipping objects between ranks: {problems[0]}")
    return received


def _header(src: int, buf: np.ndarray) -> list[tuple[str, int]]:
    try:
        items = json.loads(buf.tobytes())
        return [(str(p), int(n)) for p, n in items]
    except (ValueError, TypeError) as e:
        raise ZarrckptError(f"rank {src} sent a malformed list of objects: {e}") from e


def _batches(items: Sequence[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``items`` cut in order into batches of at most :data:`BATCH_BYTES` (a larger object alone)."""
    out: list[list[tuple[str, int]]] = []
    total = 0
    for path, n in items:
        if not out or total + n > BATCH_BYTES:
            out.append([])
            total = 0
        out[-1].append((path, n))
        total += n
    return out


def _pack(batch: Sequence[tuple[str, int]], read: Read, failures: list[str]) -> np.ndarray:
    """The batch's objects back to back; one that cannot be read goes as zeros, noted in ``failures``."""
    buf = np.empty(sum(n for _, n in batch), dtype=np.uint8)
    view, at = memoryview(buf.data), 0
    for path, n in batch:
        try:
            read(path, view[at : at + n])
        except Exception as e:  # (raised on every rank after the last round: a peer never waits in vain)
            buf[at : at + n] = 0
            failures.append(f"{path} to send it: {type(e).__name__}: {e}")
        at += n
    return buf
