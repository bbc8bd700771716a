"""What a checkpoint's location holds, as the commit protocol reads it: its state from a listing of
its top-level entries, and a fresh look at its markers and manifest, which every deletion and every
save's preparation decide on (docs/FORMAT.md §6, "Invariants")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zarrckpt.engine import markers
from zarrckpt.format import jsondoc
from zarrckpt.format.manifest import DELETING, HEAD_BYTES, MANIFEST, PENDING, TOMBSTONE_BYTES, tombstone_marker
from zarrckpt.storage.store import Storage

COMMITTED, INCOMPLETE, DELETING_STATE = "committed", "incomplete", "deleting"
_LARGE = frozenset({"values", "integrity", "consolidated_metadata"})  # a manifest's head ends before them


def state(names: set[str]) -> str | None:
    """What a prefix holding the top-level entries ``names`` is: committed, incomplete, deleting, or None."""
    if DELETING in names:
        return DELETING_STATE
    if MANIFEST in names:
        return COMMITTED
    if any(n.startswith(PENDING) for n in names):  # the marker, its heartbeat object, their temporary files
        return INCOMPLETE
    return None


@dataclass(frozen=True)
class Seen:
    """One look at a prefix (:func:`look`).

    ``state``: as :func:`state`, with a manifest that is a tombstone counted as deleting.
    ``save_id``: committed: its manifest's; incomplete: its pending marker's; deleting: its deleting
    marker's (the deleted checkpoint's); None where there is none to read.
    ``dead``: incomplete or deleting: why its save or deletion counts as dead (None: it may run).
    ``lease``: its marker carries heartbeats (False: a marker of a zarrckpt without them, which only a
    grace period retires).
    ``zarrckpt``: committed: the manifest is a zarrckpt manifest (False: another tool's ``zarr.json``).
    ``stopped``: incomplete: no writer of its save can write there any more (:func:`markers.writers_stopped`).
    """

    names: frozenset[str]
    state: str | None
    save_id: str | None = None
    dead: str | None = None
    lease: bool = True
    zarrckpt: bool = True
    stopped: bool = False

    def __str__(self) -> str:
        what = self.state or ("empty" if not self.names else "no zarrckpt checkpoint")
        return f"{what} (save {self.save_id})" if self.save_id else what


def look(storage: Storage, names: set[str] | None = None) -> Seen:
    """What ``storage`` holds now (``names``: its top-level entries, listed just before; else listed
    here): one listing, and the reads that tell its state and the liveness of its writer."""
    names = storage.names() if names is None else names
    found = state(names)
    frozen = frozenset(names)
    if found == DELETING_STATE:
        doc = markers.marker(storage, DELETING)
        return Seen(frozen, found, _id(doc), markers.writer_gone(storage, names, DELETING, doc), markers.has_lease(doc))
    if found == COMMITTED:
        head = _head(storage)
        if head is None:  # gone since the listing: look again
            return look(storage)
        dying = tombstone_marker(head)
        if dying is not None:  # a deletion that died before its marker (zarrckpt before 2026-12-05)
            dead = markers.writer_gone(storage, names, MANIFEST, dying)
            return Seen(frozen, DELETING_STATE, _id(dying), dead, markers.has_lease(dying))
        save_id, ours = manifest_id(storage, head)
        return Seen(frozen, found, save_id, zarrckpt=ours)
    if found == INCOMPLETE:
        doc = markers.marker(storage, PENDING) or markers.unplaced(storage, names, PENDING)
        dead = markers.writer_gone(storage, names, PENDING, doc)
        stopped = markers.writers_stopped(storage, doc)
        return Seen(frozen, found, _id(doc), dead, markers.has_lease(doc), stopped=stopped)
    return Seen(frozen, None)


def _id(doc: dict[str, Any]) -> str | None:
    found = doc.get("save_id")
    return found if isinstance(found, str) else None


def _head(storage: Storage) -> bytes | None:
    try:
        return storage.read(MANIFEST, 0, HEAD_BYTES)
    except FileNotFoundError:
        return None


def manifest_id(storage: Storage, head: bytes | None = None) -> tuple[str | None, bool]:
    """(the save id of the root ``zarr.json``, whether it is a zarrckpt manifest at all); (None, False)
    when absent, a tombstone or not JSON. ``head``: its first :data:`HEAD_BYTES`, read already. The
    save id comes from the head (zarrckpt writes it before the large fields); the whole document is
    read only when the head does not settle it (an edit by another tool)."""
    head = _head(storage) if head is None else head
    if head is None or tombstone_marker(head) is not None:
        return None, False
    try:
        doc = jsondoc.leading_members(head, ("attributes", "zarrckpt"), _LARGE)
        if "node_type" not in doc or "save_id" not in doc.get("attributes", {}).get("zarrckpt", {}):
            raise jsondoc.Unsettled  # laid out otherwise (another tool's edit): only the whole document tells
    except (jsondoc.Unsettled, AttributeError):
        try:
            doc = json.loads(storage.read(MANIFEST, 0))
        except (FileNotFoundError, ValueError):
            return None, False
    if not isinstance(doc, dict) or doc.get("node_type") != "group" or not isinstance(doc.get("attributes"), dict):
        return None, False  # (an array's zarr.json carries zarrckpt attributes too)
    attrs = doc["attributes"].get("zarrckpt")
    if not isinstance(attrs, dict):
        return None, False
    found = attrs.get("save_id")
    return (found if isinstance(found, str) else None), True


def may_be_tombstone(entries: dict[str, int | None]) -> bool:
    """Whether a listing's sizes allow its manifest to be a tombstone (only those are read)."""
    return entries.get(MANIFEST) == TOMBSTONE_BYTES
