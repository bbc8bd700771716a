"""Checkpoints under a root: list them, delete one, collect what died saves and deletions left.

Deletion follows the commit protocol (:mod:`zarrckpt.commit`): a marker first, so a deletion
that dies half-way leaves a prefix that says what it is, and ``collect_garbage`` finishes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import commit as protocol
from .errors import ZarrckptError
from .format import DELETING, MANIFEST, PENDING
from .storage import Storage
from .types import URL

log = logging.getLogger("zarrckpt")
DEFAULT_GRACE_SECONDS = 3600.0


def delete(url: URL, *, storage_options: dict[str, Any] | None = None) -> None:
    """Delete the checkpoint at ``url``, committed or not; refuse anything that is not one.

    Raises ZarrckptError, touching nothing, unless ``url`` holds a zarrckpt manifest, pending
    marker or deleting marker (a directory of other files, or a root of several checkpoints, is
    never deleted). Writes a deleting marker first, then removes the manifest (readers see no
    checkpoint from then on), the rest, and last the marker: killed half-way, the leftover is
    listed as ``"deleting"`` and ``collect_garbage`` / ``zarrckpt gc`` finishes it.
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
    protocol.remove(storage)


def list_checkpoints(root_url: URL, *, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """The checkpoints directly under ``root_url``: name -> ``"committed"``, ``"incomplete"``
    (a save is writing it, or died) or ``"deleting"`` (a deletion is removing it, or died)."""
    return {entry.name: entry.state for entry in scan(root_url, storage_options=storage_options)}


@dataclass(frozen=True)
class Entry:
    """One checkpoint under a root, as :func:`collect_garbage` sees it."""

    name: str
    url: str
    state: str  # committed | incomplete | deleting
    age_seconds: float | None  # since its pending / deleting marker was written (None: committed or unknown)
    objects: int = 0
    nbytes: int = 0


def scan(root_url: URL, *, storage_options: dict[str, Any] | None = None) -> list[Entry]:
    """Every checkpoint directly under ``root_url``, with its state and (leftovers) age; no sizes."""
    return _entries(Storage(root_url, storage_options))


def is_leftover(entry: Entry, grace_seconds: float) -> bool:
    """What :func:`collect_garbage` removes: an interrupted deletion, or an incomplete checkpoint
    whose save started at least ``grace_seconds`` ago."""
    old = entry.age_seconds is not None and entry.age_seconds >= grace_seconds
    return entry.state == protocol.DELETING_STATE or (entry.state == protocol.INCOMPLETE and old)


def _entries(root: Storage) -> list[Entry]:
    out = []
    for name in root.children():
        child = root.child(name)
        names = child.names()
        state = protocol.state(names)
        if state is None:
            continue
        marker = {protocol.INCOMPLETE: PENDING, protocol.DELETING_STATE: DELETING}.get(state)
        age = protocol.leftover_age(child, names, marker) if marker else None
        out.append(Entry(name, child.url, state, age))
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
    started more than ``grace_seconds`` ago (default one hour): a younger one may still be being
    written. The age comes from the marker's start time, else its modification time. Committed
    checkpoints and anything that is not a zarrckpt checkpoint are never touched.
    """
    if grace_seconds < 0:
        raise ZarrckptError(f"grace_seconds must be >= 0, not {grace_seconds}")
    root = Storage(root_url, storage_options)
    doomed = []
    for entry in _entries(root):
        if is_leftover(entry, grace_seconds):
            child = root.child(entry.name)
            objects, nbytes = child.usage()
            doomed.append(Entry(entry.name, entry.url, entry.state, entry.age_seconds, objects, nbytes))
            if not dry_run:
                log.info("removing %s checkpoint %s (%d objects, %d bytes)", entry.state, entry.url, objects, nbytes)
                protocol.remove(child)
    return doomed
