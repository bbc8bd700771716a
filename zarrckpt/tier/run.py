"""The local tier as a :class:`~zarrckpt.CheckpointManager` runs it: a save in flight at a time, its
failure raised once, and the restore of the newest local step when it is at least as new as the remote one."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from concurrent.futures import wait as wait_for
from typing import TYPE_CHECKING, Any

from zarrckpt.asyncsave import AsyncSave, Staging
from zarrckpt.engine.dist import Group
from zarrckpt.errors import CheckpointSaveError, TierSpaceError
from zarrckpt.tier import LocalTier
from zarrckpt.tier.layout import Nodes, check_replicas
from zarrckpt.tier.restore import restore, survey
from zarrckpt.tier.save import save_local

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")


class TierRunner:
    """Local-tier saves and restores for one manager (every rank makes one)."""

    def __init__(self, tier: LocalTier, process_group: ProcessGroup | None, staging: Staging) -> None:
        self.tier, self.process_group, self.staging = tier, process_group, staging
        self.root = tier.root()  # (checks the node's name now)
        self.nodes = Nodes.of(Group(process_group).all_gather_json(tier.node_name()))
        why = check_replicas(self.nodes, tier.replicas)
        if why is not None:
            raise TierSpaceError(f"LocalTier: {why}")
        self._saving: tuple[int, AsyncSave] | None = None
        self._first = True

    def due(self, step: int) -> bool:
        return step >= 0 and step % self.tier.every == 0

    def start(self, step: int, state_dict: Mapping[str, Any]) -> AsyncSave:
        """Start the local save of ``step`` (after the previous one ended; its failure raises first)."""
        self.check()
        future = save_local(
            self.tier,
            self.nodes,
            state_dict,
            step,
            process_group=self.process_group,
            staging=self.staging,
            first=self._first,
        )
        self._saving, self._first = (step, future), False
        return future

    def wait_staged(self) -> None:
        if self._saving is not None:
            step, future = self._saving
            try:
                future.wait_staged()
            except Exception as e:
                wait_for([future])
                self._saving = None
                raise self._failure(step, e) from e

    def check(self) -> None:
        """Wait for the local save in flight; raise its failure (once)."""
        if self._saving is None:
            return
        step, future = self._saving
        wait_for([future])
        self._saving = None
        error = future.exception()
        if error is not None:
            raise self._failure(step, error) from error

    def _failure(self, step: int, error: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"the local-tier save of step {step} under {self.tier.path} failed, it will never be restored: "
            f"{type(error).__name__}: {error}"
        )

    def restore_newest(self, state_dict: MutableMapping[str, Any], newer_than: int | None, **kwargs: Any) -> int | None:
        """Restore the newest local step every shard of which survives, when it is at least as new as
        ``newer_than`` (the newest remote step); returns its step, or None (nothing as new, or, when
        there is a remote step to fall back on, the restore failed: logged as a WARNING)."""
        self.check()
        group = Group(self.process_group)
        nodes = self.nodes
        choice = survey(self.tier, group, nodes, newer_than)
        if choice is None:
            return None
        try:
            restore(self.tier, group, nodes, choice, state_dict, **kwargs)
        except Exception as e:  # (raised on every rank alike: each read and transfer fails together)
            if newer_than is None:
                raise
            if group.rank == 0:
                log.warning("restoring local step %d failed (%s); restoring remote step %d", choice.step, e, newer_than)
            return None
        if group.rank == 0:
            log.info("restored local step %d from the tiers of %s", choice.step, ", ".join(choice.holders))
        return choice.step
