"""What every framework adapter does before a save, as :class:`zarrckpt.CheckpointManager` does: a
restarted job saves where its predecessor may have died saving (the same step, maybe on another
host or in another container), so rank 0 first waits until a save there that died counts as dead
(its writer provably gone, or its heartbeat the lease late), and the save then takes it over. A save
that still runs there is never replaced: the save refuses it, on every rank, with
``IncompleteCheckpointError``."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

import zarrckpt
from zarrckpt.lifecycle import await_dead_save

log = logging.getLogger("zarrckpt")


def make_way(url: str, storage_options: dict[str, Any] | None) -> None:
    """Rank 0, before a save to ``url``: wait (at most the lease and a heartbeat) for a save or a
    deletion there that died to count as dead, so that the save takes it over."""
    try:
        why = await_dead_save(url, storage_options=storage_options)
    except zarrckpt.ZarrckptError as e:  # (the save meets the same trouble, and says it on every rank)
        log.debug("not waiting for a dead save at %s: %s", url, e)
        return
    if why is not None:
        log.info("taking over %s: the save there died (%s)", url, why)


def rank() -> int:
    """This process's rank in the default group (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def from_rank_0(value: Any) -> Any:
    """Rank 0's ``value``, on every rank (which checkpoint to resume from: decided once, alike)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
