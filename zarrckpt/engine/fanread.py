"""Run a fanned-out read (:mod:`zarrckpt.plan.fanout`): each region several ranks need is read from storage
once, by one of them, and sent to the others over the process group.

One all-gather of every rank's requests (array number, box) plans it on every rank alike. Without
a region that two ranks need, each rank reads its own requests as before. Otherwise, per round,
each rank reads what it reads (its own requests in the first round, and the items it reads for
others), then posts the round's messages, point to point; they move while the next round reads.
A failed read (a GET, a corrupt chunk) or transfer raises on every rank, once the transfers
already posted are over: the failing rank its own error, the others a
:class:`~zarrckpt.errors.ZarrckptError` naming it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import numpy as np

from zarrckpt.engine.dist import Group
from zarrckpt.engine.reader import Request, read_regions
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import dtypes
from zarrckpt.format.layout import Box
from zarrckpt.format.manifest import Manifest
from zarrckpt.plan import fanout
from zarrckpt.storage.store import Storage

# planning a fan-out sends each rank every rank's requests (~40 bytes each): past this many in all
# (~40 MB per rank; 8,192 ranks loading 6,000 arrays each would make it 2 GB), each rank reads its own
MAX_GATHERED_REQUESTS = 1_000_000
log = logging.getLogger("zarrckpt")


def read_shared(
    group: Group,
    storage: Storage,
    manifest: Manifest,
    requests: Sequence[Request],
    *,
    any_layout: bool = False,
    on_received: Callable[[int], None] | None = None,
) -> int:
    """Fill every request's ``dest`` (every rank calls it), reading regions that several ranks
    need once; returns the bytes this rank fetched from storage.

    Args:
        group: the ranks loading.
        storage: where the checkpoint is.
        manifest: the checkpoint's manifest, the same on every rank.
        requests: this rank's reads.
        any_layout: read shards any Zarr writer laid out (``allow_modified``).
        on_received: told the bytes of each round's messages from other ranks, once they arrived.

    Returns:
        The bytes this rank fetched from storage.

    Raises:
        ZarrckptError: a read failed on some rank (that rank raises its own error, such as
            ``CorruptChunkError`` or ``StorageError``), or a transfer between ranks failed.
    """

    def read(reqs: Sequence[Request], read_through: bool = True) -> int:
        def run() -> int:
            return read_regions(storage, reqs, any_layout=any_layout, read_through=read_through)

        return group.run_together(run, "reading")

    if not group.active:
        return read(requests)
    longest = -int(group.all_reduce_min(np.array([-len(requests)], dtype=np.int64))[0])
    if longest * group.size > MAX_GATHERED_REQUESTS:  # every rank alike
        if group.rank == 0:
            log.info(
                "not fanning out this load: planning it would send each of the %d ranks every rank's requests "
                "(up to %d each, over %d in all); each rank reads what it needs",
                group.size,
                longest,
                MAX_GATHERED_REQUESTS,
            )
        return read(requests)
    keys = sorted(manifest.arrays)
    number = {k: n for n, k in enumerate(keys)}
    views = group.all_gather_json([[number[r.meta.key], list(r.box.offsets), list(r.box.sizes)] for r in requests])
    infos = []
    for key in keys:
        meta = manifest.arrays[key]
        # a constant array is filled locally, unless a peer may have written chunks into it (any_layout)
        constant = meta.constant is not None and not any_layout
        infos.append(fanout.ArrayInfo(meta.shape, meta.shard_shape, meta.chunk_shape, meta.itemsize, constant))
    wants = [[(a, Box(tuple(o), tuple(s))) for a, o, s in view] for view in views]
    caps = storage.caps  # object stores: objects one request reads are read once for ranks needing parts in pieces
    plan = fanout.plan(
        wants,
        infos,
        piece_bytes=fanout.PIECE_BYTES,
        round_bytes=fanout.ROUND_BYTES,
        pack_bytes=fanout.PACK_BYTES,
        join_bytes=caps.max_request_bytes if caps.per_request_cost and not any_layout else 0,
    )
    if not plan.rounds:
        return read(requests)
    fetched = 0
    # the previous round's transfers: they move while this round reads (no element is in both)
    pending: Callable[[], None] | None = None
    try:
        for n, rnd in enumerate(plan.rounds):
            held: dict[int, np.ndarray] = {}  # item -> the array holding its region on this rank (once read)
            if n == 0:
                own = [requests[i] for i in plan.solo[group.rank]]
                if plan.solo_parts:
                    own += [_part(requests[i], region) for i, region in plan.solo_parts[group.rank]]
                fetched += read(own)
            reqs = []
            for i in plan.reads(group.rank, n):
                item = rnd.items[i]
                meta = manifest.arrays[keys[item.array]]
                if item.source >= 0:
                    held[i] = _view(requests[item.source], item.region)
                else:
                    held[i] = np.empty(item.region.sizes, dtype=dtypes.storage_dtype(meta.dtype))
                reqs.append(Request(meta, item.region, held[i]))
            # the planner chose what each rank reads: a gap between two of this rank's items may be
            # another reader's, so it is not read through
            fetched += read(reqs, read_through=False)
            for i in plan.reads(group.rank, n):  # another request of this rank with the same box
                item = rnd.items[i]
                for r, slot in item.targets:
                    if r == group.rank:
                        _view(requests[slot], item.region)[...] = held[i]
            if pending is not None:
                finish, pending = pending, None
                group.run_together(finish, RECEIVING)
            pending = _post(group, rnd, requests, held, on_received)
        last, pending = pending, None
        if last is not None:
            group.run_together(last, RECEIVING)
    finally:
        if pending is not None:  # failing: let the transfers every rank posted end before their buffers go
            with contextlib.suppress(ZarrckptError):
                pending()
    return fetched


RECEIVING = "sending what was read to other ranks"


def _part(req: Request, region: Box) -> Request:
    """The read of ``region`` of ``req``'s array into its place in ``req``'s destination."""
    return Request(req.meta, region, _view(req, region))


def _view(req: Request, region: Box) -> np.ndarray:
    """The part of ``req``'s destination that receives the global ``region``."""
    view: np.ndarray = req.dest[region.relative_to(req.box.offsets).slices()]
    return view


def _flat(a: np.ndarray) -> np.ndarray | None:
    """The bytes of ``a`` as a 1-d uint8 view, when it is contiguous (else None)."""
    if not a.flags.c_contiguous:
        return None
    return a.reshape(-1).view(np.uint8)


def _post(
    group: Group,
    rnd: fanout.Round,
    requests: Sequence[Request],
    held: dict[int, np.ndarray],
    on_received: Callable[[int], None] | None = None,
) -> Callable[[], None]:
    """Post one round's messages (send what this rank read, receive what others read for it);
    returns what completes them and copies packed data into place."""
    sends: list[tuple[int, np.ndarray]] = []
    recvs: list[tuple[int, np.ndarray]] = []
    unpack: list[tuple[np.ndarray, list[int]]] = []
    rank = group.rank
    for msg in rnd.messages:
        if msg.src == rank:
            parts = [held[i] for i in msg.items]
            flat = _flat(parts[0]) if len(parts) == 1 else None
            buf = (
                flat
                if flat is not None
                else np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts])
            )
            sends.extend((dst, buf) for dst in msg.dsts)
        elif rank in msg.dsts:
            item = rnd.items[msg.items[0]]
            mine = [i for r, i in item.targets if r == rank]
            direct = _flat(_view(requests[mine[0]], item.region)) if len(msg.items) == 1 and len(mine) == 1 else None
            if direct is not None:
                recvs.append((msg.src, direct))
            else:
                buf = np.empty(msg.nbytes, dtype=np.uint8)
                recvs.append((msg.src, buf))
                unpack.append((buf, list(msg.items)))
    transfers = group.start_exchange(sends, recvs)

    def finish() -> None:
        transfers.wait()
        _unpack(rank, rnd, requests, unpack)
        if on_received is not None and recvs:
            on_received(sum(buf.nbytes for _, buf in recvs))

    return finish


def _unpack(
    rank: int, rnd: fanout.Round, requests: Sequence[Request], unpack: list[tuple[np.ndarray, list[int]]]
) -> None:
    """Copy received packed messages into the requests' destinations."""
    for buf, members in unpack:
        at = 0
        for i in members:
            item = rnd.items[i]
            for r, slot in item.targets:
                if r != rank:
                    continue
                dest = _view(requests[slot], item.region)
                dest[...] = buf[at : at + item.nbytes].view(dest.dtype).reshape(dest.shape)
            at += item.nbytes
        if at != len(buf):
            raise ZarrckptError(f"rank {rank}: received {len(buf)} bytes, the plan says {at}")
