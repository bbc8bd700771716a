"""Write this rank's shards (and the array metadata it is responsible for) for a save plan."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from . import dtypes
from .format import ArrayMeta
from .layout import Shape, cell_box
from .localstate import LocalState
from .plan import SavePlan
from .shard import encode_shard
from .storage import Storage

log = logging.getLogger("zarrckpt")


def write_rank(storage: Storage, plan: SavePlan, local: LocalState, rank: int) -> int:
    """Write every shard ``rank`` owns and the ``zarr.json`` of arrays it is first writer of.

    Returns the number of bytes written. The shard objects are written concurrently.
    """
    start = time.perf_counter()
    host: dict[str, Any] = {}  # key -> numpy view of the local part, on the host

    def host_view(key: str) -> Any:
        if key not in host:
            host[key] = dtypes.as_numpy(local.tensors[key].data.detach().cpu())
        return host[key]

    jobs: list[tuple[ArrayMeta, Shape | None]] = [(m, idx) for m, idx in plan.shards_of(rank)]
    jobs += [(m, None) for k, m in plan.arrays.items() if plan.metadata_writer(k) == rank]
    for meta, idx in jobs:  # stage on the host first (GPU -> CPU copies stay on this thread)
        if idx is not None:
            host_view(meta.key)

    def write_one(job: tuple[ArrayMeta, Shape | None]) -> int:
        meta, idx = job
        if idx is None:
            doc = json.dumps(meta.to_json(), allow_nan=False).encode()
            storage.write(f"{meta.path}/zarr.json", [doc])
            return len(doc)
        cell = cell_box(idx, meta.shard_shape, meta.shape)
        origin = local.tensors[meta.key].box.offsets
        data = host_view(meta.key)[cell.relative_to(origin).slices()]
        parts = encode_shard(data, meta.shard_shape, meta.chunk_shape)
        storage.write(meta.shard_path(idx), parts)
        return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)

    written = sum(storage.run_all(write_one, jobs))
    elapsed = time.perf_counter() - start
    log.info("rank %d wrote %d shard objects, %.1f MB in %.2fs", rank, len(jobs), written / 1e6, elapsed)
    return written
