"""The local tier: checkpoints in node-local storage (host memory, local NVMe) with copies on peer
nodes, restored from whatever survived, under any world size or layout (docs/tiers.md).

:class:`LocalTier` is what :class:`zarrckpt.CheckpointManager` takes as ``local=``; the saves are
:mod:`zarrckpt.tier.save`, the restores :mod:`zarrckpt.tier.restore`, the rules
:mod:`zarrckpt.tier.layout`, the directories :mod:`zarrckpt.tier.nodedir`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from zarrckpt.errors import ZarrckptError

NODE_ENV = "ZARRCKPT_NODE"


@dataclass(frozen=True)
class LocalTier:
    """Where and how often a :class:`~zarrckpt.CheckpointManager` saves to node-local storage.

    Args:
        path: each node's tier directory, on storage local to it (``/dev/shm/zarrckpt``: host memory;
            a local NVMe path). ``{node}`` in it is replaced by the node's name (several simulated
            nodes on one machine: ``/dev/shm/run/{node}``).
        every: save a local step when the step is a multiple of this (remote saves follow the
            manager's ``interval`` as before).
        keep: local steps a node holds at most (of its own shards and its replicas' copies, one of
            them possibly being written); the oldest are deleted before a new one is written.
        replicas: how many other nodes hold a copy of each node's shards (0: none; a lost node then
            loses the local steps).
        node: this process's node name; None: ``$ZARRCKPT_NODE``, else the host name. Ranks with the
            same name share ``path`` (a node); replicas always go to another name.
    """

    path: str
    every: int
    keep: int = 2
    replicas: int = 1
    node: str | None = None

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1 or self.replicas < 0:
            raise ZarrckptError(
                f"LocalTier: every and keep must be 1 or more and replicas 0 or more, not every={self.every}, "
                f"keep={self.keep}, replicas={self.replicas}"
            )
        if "://" in self.path and not self.path.startswith("file://"):
            raise ZarrckptError(f"LocalTier: path must be node-local (a directory), not {self.path!r}")

    def node_name(self) -> str:
        name = self.node or os.environ.get(NODE_ENV, "").strip() or socket.gethostname()
        if not name or "/" in name:
            raise ZarrckptError(f"LocalTier: {name!r} cannot name a node (set {NODE_ENV} or LocalTier(node=...))")
        return name

    def root(self) -> str:
        """This node's tier directory."""
        return self.path.removeprefix("file://").replace("{node}", self.node_name())


__all__ = ["NODE_ENV", "LocalTier"]
