"""Small tensors written whole: the one exchange per save that hands each writer the parts it lacks.

A tensor of fewer than ``small_tensor_bytes`` bytes held in parts by several ranks (an FSDP
``Shard(0)`` of a norm weight over 128 ranks: 128 objects of 160 bytes) is planned as one shard
written by one of its holders (:class:`zarrckpt.plan.Gather`). Before writing, every rank sends
each writer the parts it lacks, all tensors of the save in one all-to-all; the writer assembles
the whole tensor, the other holders drop their parts of it.
"""

from __future__ import annotations

import numpy as np
import torch

from . import dtypes
from .dist import Group
from .errors import ZarrckptError
from .layout import Box
from .localstate import LocalState, LocalTensor
from .plan import ZarrSavePlan


def gather_small(group: Group, plan: ZarrSavePlan, local: LocalState) -> None:
    """Give the writer of every small tensor the whole of it, in ``local`` (collective).

    Raises ZarrckptError on every rank when some rank cannot send what the plan expects of it.
    """
    if not plan.gathers:
        return
    outgoing = group.run_together(lambda: _outgoing(group, plan, local), "preparing the small tensors")
    received = group.exchange_bytes(outgoing)
    group.run_together(lambda: _assemble(group.rank, plan, local, received), "assembling the small tensors")


def _outgoing(group: Group, plan: ZarrSavePlan, local: LocalState) -> list[bytes]:
    """What this rank sends each rank: the bytes of the pieces it is the sender of, in plan order."""
    out: list[list[bytes]] = [[] for _ in range(group.size)]
    for key, gather in plan.gathers.items():
        for box, sender in gather.pieces:
            if sender == group.rank:
                out[gather.writer].append(_piece(local, key, box))
    return [b"".join(parts) for parts in out]


def _piece(local: LocalState, key: str, box: Box) -> bytes:
    part = local.part_holding(key, box)
    if part is None:
        raise ZarrckptError(f"{key}: this rank was to send {box} of it but holds no part with it (a bug)")
    data = dtypes.as_numpy(part.data.detach().cpu())[box.relative_to(part.box.offsets).slices()]
    return np.ascontiguousarray(data).tobytes()


def _assemble(rank: int, plan: ZarrSavePlan, local: LocalState, received: list[bytes]) -> None:
    """Build each tensor this rank writes from its own parts and the pieces received; drop the
    parts of small tensors others write."""
    at = [0] * len(received)
    for key, gather in plan.gathers.items():
        parts = local.tensors.pop(key, [])
        if gather.writer != rank:
            continue
        meta = plan.arrays[key]
        whole = torch.empty(meta.shape, dtype=dtypes.torch_dtype(meta.dtype))
        view = dtypes.as_numpy(whole)
        for part in parts:
            view[part.box.slices()] = dtypes.as_numpy(part.data.detach().cpu())
        stored = dtypes.storage_dtype(meta.dtype)
        for box, sender in gather.pieces:
            n = box.volume * stored.itemsize
            raw = received[sender][at[sender] : at[sender] + n]
            if len(raw) != n:
                raise ZarrckptError(f"{key}: rank {sender} sent {len(raw)} bytes of {box}, expected {n}")
            view[box.slices()] = np.frombuffer(raw, dtype=stored).reshape(box.sizes)
            at[sender] += n
        first = parts[0]
        local.add(LocalTensor(key, whole, meta.shape, Box.full(meta.shape), meta.dtype, first.kind, first.topology))
    extra = [r for r, (n, data) in enumerate(zip(at, received, strict=True)) if n != len(data)]
    if extra:
        raise ZarrckptError(f"small tensors: ranks {extra} sent more bytes than the plan expects (a bug)")
