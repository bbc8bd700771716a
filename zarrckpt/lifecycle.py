"""Checkpoints under a root: list them, delete one, collect what died saves and deletions left.

Deletion follows the commit protocol (:mod:`zarrckpt.engine.commit`): a marker first, so a deletion
that dies half-way leaves a prefix that says what it is, and ``collect_garbage`` finishes it.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any

from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.errors import IncompleteCheckpointError, ZarrckptError
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING, TOMBSTONE_BYTES, ManifestHead
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL

log = logging.getLogger("zarrckpt")
DEFAULT_GRACE_SECONDS = 3600.0


def delete(url: URL, *, storage_options: dict[str, Any] | None = None, force: bool = False) -> None:
    """Delete the checkpoint at ``url``, committed or not; refuse anything that is not one.

    Raises ZarrckptError, touching nothing, unless ``url`` holds a zarrckpt manifest, pending
    marker or deleting marker (a directory of other files, or a root of several checkpoints, is
    never deleted). Writes a deleting marker first, then removes the manifest (readers see no
    checkpoint from then on), the rest, and last the marker: killed half-way, the leftover is
    listed as ``"deleting"`` and ``collect_garbage`` / ``zarrckpt gc`` finishes it.

    An incomplete checkpoint whose save may still be running (its marker has a heartbeat younger
    than the lease, and its writer is not known to be gone) is refused with
    IncompleteCheckpointError unless ``force``: deleting it would fail that save.
    """
    storage = Storage(url, storage_options)
    names = storage.names()
    if protocol.state(names) is None or (
        MANIFEST in names and not {PENDING, DELETING} & names and not protocol.is_zarrckpt_manifest(storage)
    ):
        inside = sorted(n for n, s in list_checkpoints(url, storage_options=storage_options).items() if s)
        hint = f"; it holds {len(inside)} checkpoints ({', '.join(inside[:3])}...): delete those" if inside else ""
        what = "nothing" if not names else "no zarrckpt checkpoint"
        raise ZarrckptError(f"refusing to delete {storage.url!r}: it holds {what}{hint}")
    if not force and protocol.state(names) == protocol.INCOMPLETE and markers.writer_gone(storage, names) is None:
        raise IncompleteCheckpointError(
            f"refusing to delete {storage.url!r}: a save may still be writing it ({markers.marker(storage, PENDING)}); "
            f"wait for it to commit, or to miss its heartbeat for {markers.lease_seconds():.0f} s, or pass "
            "force=True (`zarrckpt rm --force`) to delete it and fail that save"
        )
    protocol.remove(storage)


def list_checkpoints(root_url: URL, *, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """The checkpoints directly under ``root_url``: name -> ``"committed"``, ``"incomplete"``
    (a save is writing it, or died) or ``"deleting"`` (a deletion is removing it, or died)."""
    return {entry.name: entry.state for entry in scan(root_url, storage_options=storage_options)}


STEP_NAME = re.compile(r"^step_(\d{10})$")  # CheckpointManager's checkpoints: <root>/step_<10-digit step>


def committed_steps(root_url: URL, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The steps of the committed checkpoints a :class:`~zarrckpt.CheckpointManager` saved under
    ``root_url`` (``step_<10-digit step>``), ascending; one listing of the root and one of each
    checkpoint. A step being saved, whose save died, or being deleted is never among them."""
    return sorted(
        int(m.group(1))
        for name, state in list_checkpoints(root_url, storage_options=storage_options).items()
        if state == protocol.COMMITTED and (m := STEP_NAME.match(name))
    )


def latest_step(root_url: URL, *, storage_options: dict[str, Any] | None = None) -> int | None:
    """The newest committed step under ``root_url`` (None: none), as :func:`committed_steps` sees them."""
    steps = committed_steps(root_url, storage_options=storage_options)
    return steps[-1] if steps else None


@dataclass(frozen=True)
class Entry:
    """One checkpoint under a root, as :func:`collect_garbage` sees it."""

    name: str
    url: str
    state: str  # committed | incomplete | deleting
    age_seconds: float | None  # since its pending / deleting marker was written (None: committed or unknown)
    objects: int = 0
    nbytes: int = 0
    died: str | None = None  # incomplete: why its save counts as dead (no heartbeat for the lease, ...); None: may run


def scan(root_url: URL, *, storage_options: dict[str, Any] | None = None, depth: int = 1) -> list[Entry]:
    """Every checkpoint under ``root_url``, with its state and (leftovers) age; no sizes.

    ``depth`` 1: those directly under it; more: also those in directories that are no checkpoint,
    that many levels down (names are then paths relative to ``root_url``: ``run_a/step_0000000100``).
    One listing per directory visited; a checkpoint's own directories are never entered. Empty when
    ``root_url`` is itself a checkpoint, committed or not.
    """
    if depth < 1:
        raise ZarrckptError(f"depth must be >= 1, not {depth}")
    root = Storage(root_url, storage_options)
    return _entries(root, root.entries(), depth)


def read_head(url: URL, *, storage_options: dict[str, Any] | None = None, whole: bool = False) -> ManifestHead:
    """The checkpoint-wide fields of the committed checkpoint at ``url`` (step, time, world size, values):
    one ranged GET of its manifest's first bytes; with ``whole`` (or when those hold it all) the
    whole manifest, which gives tensor count and size too.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, InvalidCheckpointError, StorageError:
            as :func:`zarrckpt.open`.
    """
    storage = Storage(url, storage_options)
    return ManifestHead.of(protocol.read_manifest(storage)) if whole else protocol.read_manifest_head(storage)


def is_leftover(entry: Entry, grace_seconds: float) -> bool:
    """What :func:`collect_garbage` removes: an interrupted deletion, or an incomplete checkpoint whose
    save died (no heartbeat for the lease, or its writer on this host is gone) or started at least
    ``grace_seconds`` ago."""
    old = entry.age_seconds is not None and entry.age_seconds >= grace_seconds
    dead = old or entry.died is not None
    return entry.state == protocol.DELETING_STATE or (entry.state == protocol.INCOMPLETE and dead)


def await_dead_save(
    url: URL, *, storage_options: dict[str, Any] | None = None, timeout: float | None = None
) -> str | None:
    """When ``url`` holds a save that never committed (or a deletion not finished), wait (polling each
    second, at most ``timeout`` seconds; default: the lease) until it counts as dead, commits, or goes
    away. Returns why it counts as dead (the next save there takes it over, or finishes the deletion),
    or None (nothing to wait for; a marker without heartbeats, which no wait settles; or it still
    runs: a save or deletion elsewhere, never touched).
    A restarted job calls it before saving where its predecessor may have died mid-save;
    :class:`~zarrckpt.CheckpointManager` does."""
    storage = Storage(url, storage_options)
    deadline = time.monotonic() + (markers.lease_seconds() + markers.HEARTBEAT_SECONDS if timeout is None else timeout)
    while True:
        names = storage.names()
        found = protocol.state(names)
        if found not in (protocol.INCOMPLETE, protocol.DELETING_STATE):
            return None
        name = PENDING if found == protocol.INCOMPLETE else DELETING
        why = markers.writer_gone(storage, names, name)
        if why is not None or time.monotonic() >= deadline:
            return why
        if "heartbeat" not in markers.marker(storage, name):  # (older zarrckpt) no lease to run out
            return None
        time.sleep(1.0)


def _entries(root: Storage, under: dict[str, int | None], depth: int = 1) -> list[Entry]:
    """The checkpoints under ``root`` (whose listing is ``under``), ``depth`` levels down (none when
    ``root`` is itself one, committed or not)."""
    if protocol.state(set(under)) is not None:
        return []
    out = []
    for name in sorted(under):
        child = root.child(name)
        entries = child.entries()
        names = set(entries)
        state = protocol.state(names)
        if state is None:
            if depth > 1 and under[name] is None and entries:  # a directory of something else: look inside
                out += [replace(e, name=f"{name}/{e.name}") for e in _entries(child, entries, depth - 1)]
            continue
        sized = entries.get(MANIFEST) == TOMBSTONE_BYTES  # (only a manifest of exactly this size may be one)
        if state == protocol.COMMITTED and sized and protocol.is_tombstone(child):
            state = protocol.DELETING_STATE  # a deletion that died before its marker
        marker = {protocol.INCOMPLETE: PENDING, protocol.DELETING_STATE: DELETING}.get(state)
        age = markers.leftover_age(child, names, marker) if marker else None
        died = markers.writer_gone(child, names) if state == protocol.INCOMPLETE else None
        out.append(Entry(name, child.url, state, age, died=died))
    return out


def collect_garbage(
    root_url: URL,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> list[Entry]:
    """Remove what died saves and deletions left directly under ``root_url``; returns what was (or,
    with ``dry_run``, would be) removed, with sizes.

    Interrupted deletions are always finished. An incomplete checkpoint is removed once its save
    died: its pending marker has gone the lease (``$ZARRCKPT_LEASE_SECONDS``, default 30 s) without
    the heartbeat a running save gives it every 10 s, or its writer ran on this host and is gone;
    or (markers without heartbeats, of older zarrckpt versions) once its save started more than
    ``grace_seconds`` ago (default one hour). A save still running is never touched. Committed
    checkpoints and anything that is not a zarrckpt checkpoint are never touched.
    """
    if grace_seconds < 0:
        raise ZarrckptError(f"grace_seconds must be >= 0, not {grace_seconds}")
    root = Storage(root_url, storage_options)
    doomed = []
    for entry in _entries(root, root.entries()):
        if is_leftover(entry, grace_seconds):
            child = root.child(entry.name)
            objects, nbytes = child.usage()
            doomed.append(Entry(entry.name, entry.url, entry.state, entry.age_seconds, objects, nbytes, entry.died))
            if not dry_run:
                log.info("removing %s checkpoint %s (%d objects, %d bytes)", entry.state, entry.url, objects, nbytes)
                protocol.remove(child)
    return doomed
