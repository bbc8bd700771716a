"""Checkpoints under a root: list them, delete one, collect what died saves and deletions left.

Deletion follows the commit protocol (:mod:`zarrckpt.engine.commit`): a marker first, so a deletion
that dies half-way leaves a prefix that says what it is, and ``collect_garbage`` finishes it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any

from zarrckpt.engine import clock, markers
from zarrckpt.engine import commit as protocol
from zarrckpt.engine.prefix import look, manifest_id, may_be_tombstone
from zarrckpt.engine.removal import LocationBusy, LocationChanged, remove
from zarrckpt.errors import IncompleteCheckpointError, ZarrckptError
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING, ManifestHead
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL

log = logging.getLogger("zarrckpt")
DEFAULT_GRACE_SECONDS = 3600.0


def delete(
    url: URL, *, storage_options: dict[str, Any] | None = None, force: bool = False, committed_only: bool = False
) -> bool:
    """Delete the checkpoint at ``url``, committed or not; refuse anything that is not one.

    Raises ZarrckptError, touching nothing, unless ``url`` holds a zarrckpt manifest, pending
    marker or deleting marker (a directory of other files, or a root of several checkpoints, is
    never deleted). The deletion decides on what is there when it starts and again after its own
    marker (docs/FORMAT.md §6): if a save commits there meanwhile, or another deletion or save takes
    the location over, it deletes nothing and says so. Killed half-way, the leftover is listed as
    ``"deleting"`` and ``collect_garbage`` / ``zarrckpt gc`` finishes it.

    An incomplete checkpoint whose save may still be running (its heartbeat is younger than the lease,
    and its writer is not known to be gone) is refused with IncompleteCheckpointError unless ``force``:
    deleting it fails that save. After deleting an incomplete checkpoint, its deleting marker stays
    for the lease (writers of that save on other ranks may still write before they notice), and
    ``collect_garbage`` removes it then.

    ``committed_only`` (retention): delete only a committed checkpoint; anything else there (a save
    or a deletion running, nothing) is left as it is, and False returned.

    Returns:
        True when something was deleted; False only with ``committed_only``.
    """
    storage = Storage(url, storage_options)
    seen = look(storage)
    if committed_only and (seen.state != protocol.COMMITTED or not seen.zarrckpt):
        log.info("not deleting %s: it holds %s now, not a committed checkpoint", storage.url, seen)
        return False
    if seen.state is None or not seen.zarrckpt:
        inside = sorted(n for n, s in list_checkpoints(url, storage_options=storage_options).items() if s)
        hint = f"; it holds {len(inside)} checkpoints ({', '.join(inside[:3])}...): delete those" if inside else ""
        what = "nothing" if not seen.names else "no zarrckpt checkpoint"
        raise ZarrckptError(f"refusing to delete {storage.url!r}: it holds {what}{hint}")
    if not force and seen.state == protocol.INCOMPLETE and seen.dead is None:
        raise IncompleteCheckpointError(
            f"refusing to delete {storage.url!r}: a save may still be writing it ({markers.marker(storage, PENDING)}); "
            f"wait for it to commit, or to miss its heartbeat for {markers.lease_seconds():.0f} s, or pass "
            "force=True (`zarrckpt rm --force`) to delete it and fail that save"
        )
    try:
        if remove(storage, expect=seen.state, save_id=seen.save_id, force=force):
            log.warning(
                "deleted %s, but its deleting marker stays until the lease (%.0f s) has passed: writers of that "
                "save on other ranks may still be writing; `zarrckpt gc` removes the marker then",
                storage.url,
                markers.lease_seconds(),
            )
    except (LocationBusy, LocationChanged) as e:
        if committed_only:
            log.info("%s", e)
            return False
        raise
    return True


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
    died: str | None = None  # incomplete / deleting: why its save or deletion counts as dead; None: may run
    save_id: str | None = None  # incomplete: its pending marker's save id (None: unreadable, or committed)
    lease: bool = True  # its marker carries heartbeats (False: zarrckpt before them; only the grace retires it)
    marker_left: bool = False  # committed: its save's pending marker is still there (the commit's last step failed)


def scan(root_url: URL, *, storage_options: dict[str, Any] | None = None, depth: int = 1) -> list[Entry]:
    """Every checkpoint under ``root_url``, with its state and (leftovers) age; no sizes.

    ``depth`` 1: those directly under it; more: also those in directories that are no checkpoint,
    that many levels down (names are then paths relative to ``root_url``: ``run_a/step_0000000100``).
    One listing per directory visited; a checkpoint's own directories are never entered. Empty when
    ``root_url`` is itself a checkpoint, committed or not, or a file.
    """
    if depth < 1:
        raise ZarrckptError(f"depth must be >= 1, not {depth}")
    root = Storage(root_url, storage_options)
    entries = root.entries()
    return [] if root.listed_itself(entries) else _entries(root, entries, depth)


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
    """What :func:`collect_garbage` removes: a deletion that died, or an incomplete checkpoint whose save
    died (no heartbeat for the lease, or its writer provably gone). ``grace_seconds`` applies only to
    markers without heartbeats (zarrckpt before them): such a save counts as dead once it started
    that long ago. A running save or deletion is never a leftover, whatever the grace."""
    if entry.state == protocol.DELETING_STATE:
        return entry.died is not None
    if entry.state != protocol.INCOMPLETE:
        return False
    old = not entry.lease and entry.age_seconds is not None and entry.age_seconds >= grace_seconds
    return entry.died is not None or old


def remove_leftover(entry: Entry, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Delete the leftover ``entry`` (:func:`is_leftover`) if it still is what ``entry`` says: the
    deletion decides again on what it finds (a save that committed meanwhile, or was taken over and
    is running again, is left alone). Returns whether it deleted anything."""
    storage = Storage(entry.url, storage_options)
    try:
        if entry.state == protocol.DELETING_STATE:
            remove(storage, expect=protocol.DELETING_STATE)
        else:  # (a marker without heartbeats, past the grace period, counts as dead: force)
            remove(storage, expect=protocol.INCOMPLETE, save_id=entry.save_id, force=not entry.lease)
    except (LocationBusy, LocationChanged) as e:
        log.info("left %s as it is: %s", entry.url, e)
        return False
    return True


def await_dead_save(
    url: URL, *, storage_options: dict[str, Any] | None = None, timeout: float | None = None
) -> str | None:
    """When ``url`` holds a save that never committed (or a deletion not finished), wait (polling each
    second, at most ``timeout`` seconds; default: the lease) until it counts as dead, commits, or goes
    away. Returns why it counts as dead (the next save there takes it over, or finishes the deletion),
    or None (nothing to wait for; a marker without heartbeats, which no wait settles; or it still
    runs: a save or deletion elsewhere, never touched).
    A restarted job calls it before saving where its predecessor may have died mid-save;
    :class:`~zarrckpt.CheckpointManager` and the framework adapters do."""
    storage = Storage(url, storage_options)
    limit = markers.lease_seconds() + markers.heartbeat_seconds() if timeout is None else timeout
    deadline = clock.monotonic() + limit
    while True:
        seen = look(storage)
        if seen.state not in (protocol.INCOMPLETE, protocol.DELETING_STATE):
            return None
        if seen.dead is not None or clock.monotonic() >= deadline or not seen.lease:
            return seen.dead  # (a marker without heartbeats: no lease to run out)
        clock.sleep(1.0)


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
        left = any(n.startswith(PENDING) for n in names)
        if state == protocol.COMMITTED and not may_be_tombstone(entries):  # (only a manifest of one size may be)
            out.append(Entry(name, child.url, state, None, marker_left=left))
            continue
        seen = look(child, names)
        if seen.state == protocol.COMMITTED:
            out.append(Entry(name, child.url, seen.state, None, marker_left=left))
            continue
        marker = PENDING if seen.state == protocol.INCOMPLETE else DELETING if DELETING in names else MANIFEST
        age = markers.leftover_age(child, names, marker)
        save_id = seen.save_id if seen.state == protocol.INCOMPLETE else None
        out.append(Entry(name, child.url, str(seen.state), age, died=seen.dead, save_id=save_id, lease=seen.lease))
    return out


def _tidy(storage: Storage) -> None:
    """A committed checkpoint whose save could not delete its pending marker (the commit's last request
    failed): the marker, its save's, is stale; delete it and its heartbeat object."""
    names = storage.names()
    doc = markers.marker(storage, PENDING)
    mine = doc.get("save_id") is not None and doc.get("save_id") == manifest_id(storage)[0]
    if mine and markers.writer_gone(storage, names, PENDING, doc) is not None:  # (its save may still be ending)
        log.info("removing the pending marker left in committed checkpoint %s", storage.url)
        storage.delete(PENDING)
        storage.delete(markers.BEAT)


def collect_garbage(
    root_url: URL,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> list[Entry]:
    """Remove what died saves and deletions left directly under ``root_url``; returns what was (or,
    with ``dry_run``, would be) removed, with sizes.

    A deletion that died is finished. An incomplete checkpoint is removed once its save died: its
    heartbeat has gone the lease (``$ZARRCKPT_LEASE_SECONDS``, default 30 s) without being renewed,
    as a running save renews it every 10 s, or its writer provably ran on this host and is gone; or
    (markers without heartbeats, of older zarrckpt versions) once its save started more than
    ``grace_seconds`` ago (default one hour). A save or deletion still running is never touched,
    whatever ``grace_seconds``; committed checkpoints and anything that is not a zarrckpt
    checkpoint are never touched (but for the pending marker a save left in one when the last
    request of its commit failed). Each removal decides again on what it finds when it starts (a
    save that committed since the listing is left alone, and not returned).
    """
    if grace_seconds < 0:
        raise ZarrckptError(f"grace_seconds must be >= 0, not {grace_seconds}")
    root = Storage(root_url, storage_options)
    doomed = []
    for entry in _entries(root, root.entries()):
        if entry.marker_left and not dry_run:
            _tidy(root.child(entry.name))
        if not is_leftover(entry, grace_seconds):
            continue
        objects, nbytes = root.child(entry.name).usage()
        if not dry_run:
            log.info("removing %s checkpoint %s (%d objects, %d bytes)", entry.state, entry.url, objects, nbytes)
            if not remove_leftover(entry, storage_options=storage_options):
                continue
        doomed.append(replace(entry, objects=objects, nbytes=nbytes))
    return doomed
