"""The commit protocol: a checkpoint exists only once its manifest (the root zarr.json) exists.

save:   prepare (refuse, or un-commit and remove an old checkpoint; create the pending marker,
        create-only, so of two racing saves one goes on) -> every rank writes its shards and its
        share of zarr.json documents, create-only -> commit (the manifest, create-only, last, after
        checking that the pending marker is still this save's).
load:   read the manifest (one GET) -> read data, every chunk compared with the commit record (a
        chunk a later save replaced fails it) -> without that record (or with allow_modified),
        read the manifest again: a different save_id means the checkpoint was overwritten
        meanwhile, and the load fails instead of mixing.
delete: write the deleting marker -> remove the manifest -> remove the rest -> remove the marker.
        A deletion that dies half-way leaves the marker, which says what the leftover is.

Markers carry the save id, the start time and the writer (host, pid), so leftovers have an age.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Any

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    ZarrckptError,
)
from .format import DELETING, HEAD_BYTES, MANIFEST, PENDING, Manifest, ManifestHead
from .jsondoc import Unsettled
from .storage import Storage

COMMITTED, INCOMPLETE, DELETING_STATE = "committed", "incomplete", "deleting"


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest, or a clear error saying why there is none."""
    return Manifest.loads(read_manifest_bytes(storage), storage.where(MANIFEST))


def read_manifest_head(storage: Storage) -> ManifestHead:
    """The committed manifest's checkpoint-wide fields (:class:`ManifestHead`): one ranged read of
    its first :data:`HEAD_BYTES`; the whole manifest only when they do not settle them. Errors as
    :func:`read_manifest`'s."""
    where = storage.where(MANIFEST)
    raw = read_manifest_bytes(storage, HEAD_BYTES)
    if len(raw) < HEAD_BYTES:  # the whole document
        return ManifestHead.parse(raw, where, whole=True)
    try:
        return ManifestHead.parse(raw, where, whole=False)
    except Unsettled:
        return ManifestHead.parse(read_manifest_bytes(storage), where, whole=True)


def read_manifest_bytes(storage: Storage, end: int | None = None) -> bytes:
    """The committed manifest's bytes (unparsed; those before ``end`` when given), or a clear error
    saying why there is none."""
    try:
        return storage.read(MANIFEST, 0, end)  # an open range: s3fs skips its HEAD for the size
    except FileNotFoundError:
        if storage.is_empty():
            raise CheckpointNotFoundError(f"no checkpoint at {storage.url!r}: nothing is stored there") from None
        if storage.exists(DELETING):
            raise IncompleteCheckpointError(
                f"the checkpoint at {storage.url!r} is being deleted, or its deletion died half-way "
                f"({marker(storage, DELETING)}); `zarrckpt gc` finishes interrupted deletions"
            ) from None
        raise IncompleteCheckpointError(
            f"{storage.url!r} holds a checkpoint that was never committed (no {MANIFEST} manifest): its save "
            "failed or is still running. Load an earlier checkpoint, or save again with overwrite=True."
        ) from None


def prepare(storage: Storage, overwrite: bool) -> str:
    """Make the prefix ready for a new save and mark it pending; returns the new save id.

    The pending marker is created create-only: of two saves starting at one location, exactly
    one goes on and the other gets CheckpointExistsError before it has written anything.
    """
    names = storage.names()
    if DELETING in names:
        if not overwrite:
            raise IncompleteCheckpointError(
                f"the checkpoint at {storage.url!r} is being deleted, or its deletion died half-way "
                f"({marker(storage, DELETING)}); pass overwrite=True to finish that and save here"
            )
        remove(storage)
    elif MANIFEST in names:
        if not is_zarrckpt_manifest(storage):
            raise ZarrckptError(f"refusing to write to {storage.url!r}: its zarr.json is not a zarrckpt checkpoint")
        if not overwrite:
            raise CheckpointExistsError(
                f"a committed checkpoint already exists at {storage.url!r}; pass overwrite=True to replace it"
            )
        remove(storage)  # un-commit first: from here on readers see no checkpoint
    elif names:
        if PENDING not in names and not all(n.startswith(PENDING) for n in names):  # (a marker being created)
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ZarrckptError(
                f"refusing to write to {storage.url!r}: it is not empty ({shown}) and holds no zarrckpt checkpoint"
            )
        if not overwrite:
            raise IncompleteCheckpointError(
                f"another save to {storage.url!r} is in progress or died before committing "
                f"({marker(storage, PENDING)}); pass overwrite=True to replace it once no other save is running"
            )
        remove(storage)  # leftovers of a save that never committed
    save_id = uuid.uuid4().hex
    try:
        storage.create(PENDING, [json.dumps(marker_doc(save_id)).encode()])
    except FileExistsError:
        raise CheckpointExistsError(
            f"another save started writing to {storage.url!r} at the same time ({marker(storage, PENDING)}); "
            "this one wrote nothing"
        ) from None
    return save_id


def commit(storage: Storage, manifest: Manifest) -> None:
    """Create the manifest (the commit point), then drop the pending marker.

    Called once every rank has written its shards and ``zarr.json`` documents. Refuses
    (CheckpointExistsError) when the pending marker is no longer this save's, or another
    manifest is already there: another save took the location over meanwhile.
    """
    mine = manifest.save_id
    if _pending_id(storage) != mine:
        raise CheckpointExistsError(
            f"not committing {storage.url!r}: another save took this location over while it was written "
            f"(pending marker: {marker(storage, PENDING) or 'missing'}); this save is abandoned"
        )
    try:
        storage.create(MANIFEST, [manifest.dumps()])
    except FileExistsError:
        raise CheckpointExistsError(
            f"not committing {storage.url!r}: another save committed there first; this save is abandoned"
        ) from None
    if _pending_id(storage) != mine:  # taken over between the check and the create: take the commit back
        if _manifest_id(storage) == mine:
            storage.delete(MANIFEST)
        raise CheckpointExistsError(
            f"not committing {storage.url!r}: another save took this location over while it committed"
        )
    storage.delete(PENDING)


def remove(storage: Storage) -> None:
    """Delete a checkpoint (committed or not) so that a deletion killed half-way stays visible.

    The deleting marker goes first and last: a leftover always says what it is.
    """
    storage.write(DELETING, [json.dumps(marker_doc(_manifest_id(storage) or "")).encode()])
    storage.delete(MANIFEST)  # readers now see no checkpoint
    storage.delete_all(keep=[DELETING])
    storage.delete(DELETING)
    storage.prune()


def state(names: set[str]) -> str | None:
    """What a prefix holding the top-level entries ``names`` is: committed, incomplete, deleting, or None."""
    if DELETING in names:
        return DELETING_STATE
    if MANIFEST in names:
        return COMMITTED
    if any(n.startswith(PENDING) for n in names):  # the marker, or its temporary file (killed creating it)
        return INCOMPLETE
    return None


def leftover_age(storage: Storage, names: set[str], name: str) -> float | None:
    """Seconds since the save or deletion marked by the marker ``name`` started: its ``started``
    time, else the marker's (or its temporary file's) modification time; None when unknown."""
    age = age_seconds(marker(storage, name))
    if age is None:
        ages = [storage.age(n) for n in sorted(names) if n.startswith(name)]
        age = min((a for a in ages if a is not None), default=None)
    return age


def is_zarrckpt_manifest(storage: Storage) -> bool:
    """True when the root zarr.json is a zarrckpt manifest (even an invalid one): ours to replace or delete."""
    try:
        doc = json.loads(storage.read(MANIFEST, 0))
    except (FileNotFoundError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("attributes"), dict) and "zarrckpt" in doc["attributes"]


def marker_doc(save_id: str) -> dict[str, Any]:
    return {"save_id": save_id, "started": now(), "writer": {"host": socket.gethostname(), "pid": os.getpid()}}


def marker(storage: Storage, name: str) -> dict[str, Any]:
    """A marker's content ({} when absent or unreadable)."""
    try:
        doc = json.loads(storage.read(name))
    except (FileNotFoundError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _pending_id(storage: Storage) -> Any:
    return marker(storage, PENDING).get("save_id")


def _manifest_id(storage: Storage) -> str | None:
    try:  # only the save id matters: skip building every array's metadata (0.4 s for 4,000 arrays)
        current = json.loads(storage.read(MANIFEST, 0))["attributes"]["zarrckpt"]["save_id"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return current if isinstance(current, str) else None


def check_unchanged(storage: Storage, save_id: str) -> None:
    """Fail if the checkpoint was overwritten or deleted since its manifest was read."""
    if _manifest_id(storage) != save_id:
        raise IncompleteCheckpointError(
            f"the checkpoint at {storage.url!r} was overwritten or deleted while it was being read; "
            "the data read may mix two saves and was discarded — load again"
        )


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def age_seconds(doc: dict[str, Any]) -> float | None:
    """Seconds since a marker's ``started`` time (None when it has none)."""
    try:
        started = datetime.fromisoformat(doc["started"])
    except (KeyError, TypeError, ValueError):
        return None
    if started.tzinfo is None:
        started = started.replace(tzinfo=UTC)
    return (datetime.now(UTC) - started).total_seconds()
