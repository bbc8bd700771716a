"""Small shards joined: the one exchange per save that hands each joined shard's writer the parts it lacks.

Where one shard per rank's box gives shards under ``small_tensor_bytes`` (an FSDP ``Shard(0)`` of
a norm weight over 128 ranks: 128 objects of 160 bytes; of a router: 128 of 20 KiB), the plan
joins them (:mod:`zarrckpt.plan.coarsen`): the whole tensor when it is smaller, else shards of at
least that size, each written by one of the ranks holding part of it. Before writing, every rank
sends each writer the parts it lacks, all of a save's in one all-to-all; the writer assembles its
shards, the other ranks drop their parts of those tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from zarrckpt.engine.dist import Group
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import dtypes
from zarrckpt.format.layout import Box, cell_box
from zarrckpt.plan.localstate import LocalState, LocalTensor
from zarrckpt.plan.save import ZarrSavePlan


def gather_small(group: Group, plan: ZarrSavePlan, local: LocalState) -> None:
    """Give the writer of every joined shard all of its region, in ``local`` (collective).

    Raises ZarrckptError on every rank when some rank cannot send what the plan expects of it.
    """
    if not plan.gathers:
        return
    outgoing = group.run_together(lambda: _outgoing(group, plan, local), "preparing the small tensors")
    received = group.exchange_bytes(outgoing)
    group.run_together(lambda: _assemble(group.rank, plan, local, received), "assembling the small tensors")


def _outgoing(group: Group, plan: ZarrSavePlan, local: LocalState) -> list[list[np.ndarray]]:
    """What this rank sends each rank: the pieces it is the sender of, in plan order."""
    out: list[list[np.ndarray]] = [[] for _ in range(group.size)]
    for key, shards in plan.gathers.items():
        for gather in shards.values():
            for box, sender in gather.pieces:
                if sender == group.rank:
                    out[gather.writer].append(_piece(local, key, box))
    return out


def _piece(local: LocalState, key: str, box: Box) -> np.ndarray:
    """The piece ``box`` of ``key``: a view of this rank's part (a copy where the view is not contiguous)."""
    part = local.part_holding(key, box)
    if part is None:
        raise ZarrckptError(f"{key}: this rank was to send {box} of it but holds no part with it (a bug)")
    data = dtypes.as_numpy(part.data.detach().cpu())[box.relative_to(part.box.offsets).slices()]
    return np.ascontiguousarray(data)


def _assemble(rank: int, plan: ZarrSavePlan, local: LocalState, received: list[memoryview]) -> None:
    """Build each joined shard this rank writes from its own parts and the pieces received; the
    parts of joined tensors are replaced by those shards (none, where others write them all)."""
    at = [0] * len(received)
    for key, shards in plan.gathers.items():
        parts = local.tensors.pop(key, [])
        meta = plan.arrays[key]
        stored = dtypes.storage_dtype(meta.dtype)
        for idx, gather in shards.items():
            if gather.writer != rank:
                continue
            region = cell_box(idx, meta.shard_shape, meta.shape)
            data = torch.empty(region.sizes, dtype=dtypes.torch_dtype(meta.dtype))
            view = dtypes.as_numpy(data)
            for part in parts:
                common = part.box.intersect(region)
                if common is not None:
                    own = dtypes.as_numpy(part.data.detach().cpu())[common.relative_to(part.box.offsets).slices()]
                    view[common.relative_to(region.offsets).slices()] = own
            for box, sender in gather.pieces:
                n = box.volume * stored.itemsize
                raw = received[sender][at[sender] : at[sender] + n]
                if len(raw) != n:
                    raise ZarrckptError(f"{key}: rank {sender} sent {len(raw)} bytes of {box}, expected {n}")
                view[box.relative_to(region.offsets).slices()] = np.frombuffer(raw, dtype=stored).reshape(box.sizes)
                at[sender] += n
            first = parts[0]
            local.add(LocalTensor(key, data, meta.shape, region, meta.dtype, first.kind, first.topology))
    extra = [r for r, (n, data) in enumerate(zip(at, received, strict=True)) if n != len(data)]
    if extra:
        raise ZarrckptError(f"small tensors: ranks {extra} sent more bytes than the plan expects (a bug)")
