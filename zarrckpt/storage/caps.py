"""What each kind of storage does well and allows: requests in flight per rank, how reads are
planned, how long names may be.

Pure (no I/O, no fsspec): :mod:`zarrckpt.storage.store` picks the values for a URL, the read planner
(:mod:`zarrckpt.plan.fetch`) and the scale model use them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REMOTE_CONCURRENCY = 16  # object stores are latency-bound: many requests in flight
LOCAL_WRITE_CONCURRENCY = 8  # local writes wait on fsync: overlap several
LOCAL_READ_CONCURRENCY = 4  # local reads are memcpy-bound: more threads than cores only contend


def default_concurrency(local: bool, writing: bool) -> int:
    """Requests in flight per rank: ``$ZARRCKPT_CONCURRENCY``, else a default per storage kind."""
    env = os.environ.get("ZARRCKPT_CONCURRENCY", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if not local:
        return REMOTE_CONCURRENCY
    return LOCAL_WRITE_CONCURRENCY if writing else min(LOCAL_READ_CONCURRENCY, os.cpu_count() or 1)


MiB = 1024 * 1024
# object stores: one GET moves at most this much (a rank holds at most concurrency x this in read
# buffers: 512 MiB at 16 in flight), so that the largest shard objects (26 MB at 1,000 ranks in the
# scale model) are one request each
OBJECT_REQUEST_BYTES = 32 * MiB
# object stores: a gap this small between needed chunks of one object is read through rather than
# paid for with another request (AWS sizes ranged GETs at 8-16 MB for a request's cost to amortize)
READ_THROUGH_BYTES = 8 * MiB
LOCAL_REQUEST_BYTES = 8 * MiB  # local files: one read moves at most this much (bounds read buffers)


@dataclass(frozen=True)
class ReadCaps:
    """What a storage does well, which decides how reads are planned (:mod:`zarrckpt.plan.fetch`)."""

    per_request_cost: bool  # a request costs more than moving a MiB (object stores): fetch small objects whole
    vectored: bool  # reads straight into the caller's buffers, several in one call (local files, preadv)
    max_request_bytes: int  # one read moves at most this much
    read_through_bytes: int  # a gap this small between needed byte ranges of one object is read, not skipped
    # a read this small runs on the planning thread: handing it to a thread costs more than the read
    # (20,000 reads of 1-64 KiB from the page cache: 1.9 s inline, 4.9 s on 2 threads, which contend for the GIL)
    inline_read_bytes: int = 0


OBJECT_STORE = ReadCaps(
    per_request_cost=True, vectored=False, max_request_bytes=OBJECT_REQUEST_BYTES, read_through_bytes=READ_THROUGH_BYTES
)
LOCAL_FILES = ReadCaps(
    per_request_cost=False,
    vectored=True,
    max_request_bytes=LOCAL_REQUEST_BYTES,
    read_through_bytes=0,
    inline_read_bytes=256 * 1024,
)


@dataclass(frozen=True)
class NameLimits:
    """How long object names may be on a storage, checked before a save writes anything (a name the
    storage refuses half-way would leave an incomplete checkpoint behind)."""

    kind: str  # for messages: "local files", "S3", ...
    base_bytes: int  # bytes the root itself takes of every name (its path, or its key below the bucket)
    component_bytes: int | None = None  # one path component (a key segment, say); None: no limit
    name_bytes: int | None = None  # a whole name: the root's part, "/" and the path below it
    temp_suffix_bytes: int = 0  # written first under a longer temporary name (local files: ".<12 hex>.tmp")
