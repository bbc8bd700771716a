"""The local tier's pure rules: names, which nodes hold whose copies, which step a restore can
assemble, and who sends each missing object (no I/O; :mod:`zarrckpt.tier.nodedir` does that).

A *node* is the set of ranks that share one tier directory (host memory such as ``/dev/shm``, or
local NVMe). Nodes are ordered by their lowest rank. Node ``i``'s objects are copied to nodes
``i+1 .. i+replicas`` (mod the node count); a rank's objects go to the rank of the same local index
there (modulo that node's rank count).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STEP_DIR = re.compile(r"^step_(\d{10})\.([0-9a-f]{32})$")
TIER_DIR = ".zarrckpt-tier"  # in a step directory: the held markers and the committed marker
COMMITTED = f"{TIER_DIR}/committed.json"
RESTORING = ".restore-"  # an older zarrckpt's restore scratch directory in the tier root (pruned)
FORMAT = "zarrckpt-tier/1"


def step_dir(step: int, save_id: str) -> str:
    """A local step's directory name in a node's tier root (its save id keeps saves of one step apart)."""
    return f"step_{step:010d}.{save_id}"


def held_marker(rank: int) -> str:
    """The marker saying this node's directory holds every object saving rank ``rank`` wrote."""
    return f"{TIER_DIR}/held-{rank:06d}.json"


@dataclass(frozen=True)
class Nodes:
    """Which ranks share a node, in node order (by lowest rank)."""

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, node_of_rank: Sequence[str]) -> Nodes:
        """From every rank's node name, in rank order."""
        members: dict[str, list[int]] = {}
        for rank, name in enumerate(node_of_rank):
            members.setdefault(name, []).append(rank)
        return cls(tuple(members), tuple(tuple(r) for r in members.values()))

    def index(self, rank: int) -> int:
        for i, ranks in enumerate(self.ranks):
            if rank in ranks:
                return i
        raise KeyError(rank)

    def lead(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest rank (the one that writes the node's shared files)."""
        return self.ranks[self.index(rank)][0] == rank

    def replica_ranks(self, rank: int, replicas: int) -> list[int]:
        """The ranks that receive copies of what ``rank`` wrote (one per replica node)."""
        i = self.index(rank)
        local = self.ranks[i].index(rank)
        out = []
        for k in range(1, replicas + 1):
            target = self.ranks[(i + k) % len(self.ranks)]
            out.append(target[local % len(target)])
        return out

    def replica_sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose objects ``rank`` receives copies of."""
        return [r for ranks in self.ranks for r in ranks if rank in self.replica_ranks(r, replicas)]

    def to_json(self) -> list[list[object]]:
        return [[name, list(ranks)] for name, ranks in zip(self.names, self.ranks, strict=True)]


def check_replicas(nodes: Nodes, replicas: int) -> str | None:
    """Why ``replicas`` copies cannot be placed on ``nodes`` (None: they can)."""
    if replicas < 0:
        return f"replicas must be 0 or more, not {replicas}"
    if replicas >= len(nodes.names) and replicas > 0:
        return (
            f"replicas={replicas} needs at least {replicas + 1} nodes, and this job has {len(nodes.names)} "
            f"({', '.join(nodes.names)}): each copy must live on another node than its primary. Set the node of "
            "each rank (ZARRCKPT_NODE, or LocalTier(node=...)), or lower replicas"
        )
    return None


@dataclass(frozen=True)
class StepSeen:
    """What one node's tier directory holds of one local step (:func:`zarrckpt.tier.nodedir.scan`)."""

    step: int
    save_id: str
    world_size: int
    committed: bool  # the committed marker is there: every copy existed when the save ended
    held: tuple[int, ...]  # saving ranks whose objects this directory holds, each under a held marker
    started: float  # when the save began (rank 0's clock, alike on every node): orders saves of one step

    def to_json(self) -> list[Any]:
        return [self.step, self.save_id, self.world_size, self.committed, list(self.held), self.started]

    @classmethod
    def from_json(cls, doc: Sequence[Any]) -> StepSeen:
        step, sid, world, committed, held, started = doc
        return cls(int(step), str(sid), int(world), bool(committed), tuple(int(r) for r in held), float(started))


@dataclass(frozen=True)
class Choice:
    """The local step a restore assembles, and which restoring nodes hold it."""

    step: int
    save_id: str
    world_size: int
    holders: tuple[str, ...]  # restoring nodes whose directory holds some of it, in node order


def choose(seen: Mapping[str, Iterable[StepSeen]], newer_than: int | None = None) -> Choice | None:
    """The newest local step (the highest; of two saves of one step, the one started last) that every
    saving rank's objects survive of (on some node of ``seen``: node name -> what its directory
    holds), that some node saw committed and that is at least as new as ``newer_than`` (a remote
    step: of a step in both tiers, the local one is restored); None when there is none. Saves never
    mix (save ids). A node returning with a higher step of a run the job went back from (to an
    older remote step, after losing a node and its copies) wins over the later run's lower steps:
    the most progress, and a state that run had whole."""
    found: dict[tuple[int, str], list[tuple[str, StepSeen]]] = {}
    for node, steps in seen.items():
        for s in steps:
            found.setdefault((s.step, s.save_id), []).append((node, s))
    newest_first = sorted(found.items(), key=lambda kv: (kv[0][0], max(s.started for _, s in kv[1])), reverse=True)
    for (step, sid), where in newest_first:
        if newer_than is not None and step < newer_than:
            continue
        worlds = {s.world_size for _, s in where}
        if len(worlds) != 1 or not any(s.committed for _, s in where):
            continue
        world = worlds.pop()
        covered = {r for _, s in where for r in s.held}
        if covered.issuperset(range(world)):
            return Choice(step, sid, world, tuple(sorted({n for n, _ in where}, key=list(seen).index)))
    return None


def senders(missing: Sequence[str], held_by: Sequence[Sequence[int]], nodes: Nodes) -> tuple[dict[str, int], list[str]]:
    """Who sends each of ``missing`` (object paths): ``held_by[i]``: the node indices holding
    ``missing[i]``; the sender is one of their ranks, spread by the path's crc32. Returns the
    senders and the paths no node holds."""
    out: dict[str, int] = {}
    lost = []
    for path, holders in zip(missing, held_by, strict=True):
        if not holders:
            lost.append(path)
            continue
        h = zlib.crc32(path.encode())
        ranks = nodes.ranks[holders[h % len(holders)]]
        out[path] = ranks[(h // len(holders)) % len(ranks)]
    return out, lost
