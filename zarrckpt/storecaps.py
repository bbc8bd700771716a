"""What each kind of storage does well: requests in flight per rank, and how reads are planned.

Pure (no I/O, no fsspec): :mod:`zarrckpt.storage` picks the values for a URL, the read planner
(:mod:`zarrckpt.fetch`) and the scale model use them.
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


@dataclass(frozen=True)
class ReadCaps:
    """What a storage does well, which decides how reads are planned (:mod:`zarrckpt.fetch`)."""

    per_request_cost: bool  # a request costs more than moving a MiB (object stores): fetch small objects whole
    vectored: bool  # reads straight into the caller's buffers, several in one call (local files, preadv)


OBJECT_STORE = ReadCaps(per_request_cost=True, vectored=False)
LOCAL_FILES = ReadCaps(per_request_cost=False, vectored=True)
