"""The commit protocol: a checkpoint exists only once its manifest (the root zarr.json) exists.

save:   prepare (refuse, or un-commit and remove an old checkpoint; create the pending marker,
        create-only, so of two racing saves one goes on) -> every rank writes its shards and its
        share of zarr.json documents, create-only -> commit (the manifest, create-only, last, after
        checking that the pending marker is still this save's).
load:   read the manifest (one GET) -> read data, every chunk compared with the commit record (a
        chunk a later save replaced fails it) -> without that record (or with allow_modified),
        read the manifest again: a different save_id means the checkpoint was overwritten
        meanwhile, and the load fails instead of mixing.
delete: replace the manifest with a tombstone (readers refuse the checkpoint from this one PUT on,
        with no request of their own) -> write the deleting marker -> remove the manifest -> remove
        the rest -> remove the marker. A deletion that dies half-way leaves the marker, or the
        tombstone, either of which says what the leftover is.

Markers carry the save id, the start time and the writer (host, pid), so leftovers have an age.
While a save runs, its writer rewrites the pending marker every HEARTBEAT_SECONDS: a marker the
store has not seen rewritten for LEASE_SECONDS (its own clock: the object's modification time),
or whose writer was on this host and is no longer running, belongs to a save that died, and the
next save to that location takes it over (the deletion protocol, then its own marker). A writer
that was only slow finds its marker gone and cannot commit (``commit`` checks it).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from zarrckpt.engine.markers import (
    lease_seconds,
    marker,
    marker_doc,
    pending_id,
    start_heartbeat,
    stop_heartbeat,
    writer_gone,
)
from zarrckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    ZarrckptError,
)
from zarrckpt.format.jsondoc import Unsettled
from zarrckpt.format.manifest import (
    DELETING,
    HEAD_BYTES,
    MANIFEST,
    PENDING,
    Manifest,
    ManifestHead,
    tombstone,
    tombstone_marker,
)
from zarrckpt.storage.store import Storage

COMMITTED, INCOMPLETE, DELETING_STATE = "committed", "incomplete", "deleting"
log = logging.getLogger("zarrckpt")
GROUP_DOC_BYTES = 128  # a group's own zarr.json is smaller (a checkpoint's manifest is larger)


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
        raw = storage.read(MANIFEST, 0, end)  # an open range: s3fs skips its HEAD for the size
    except FileNotFoundError:
        raise _why_no_manifest(storage) from None
    gone = tombstone_marker(raw)
    if gone is not None:
        raise IncompleteCheckpointError(
            f"the checkpoint at {storage.url!r} is being deleted, or its deletion died half-way ({gone}); "
            "`zarrckpt gc` finishes interrupted deletions"
        )
    return raw


def _why_no_manifest(storage: Storage) -> ZarrckptError:
    """The error for a URL without a manifest, saying what is there instead (the error path only:
    one listing, and one more for each of the first 20 entries, to tell a root of checkpoints)."""
    entries = storage.entries()
    names, url = set(entries), storage.url
    if not names:
        return CheckpointNotFoundError(f"no checkpoint at {url!r}: nothing is stored there")
    if MANIFEST in names:  # not there a moment ago
        return IncompleteCheckpointError(f"the checkpoint at {url!r} was committed while it was opened: open it again")
    if DELETING in names:
        return IncompleteCheckpointError(
            f"the checkpoint at {url!r} is being deleted, or its deletion died half-way "
            f"({marker(storage, DELETING)}); `zarrckpt gc` finishes interrupted deletions"
        )
    if any(n.startswith(PENDING) for n in names):
        return IncompleteCheckpointError(
            f"{url!r} holds a checkpoint that was never committed (no {MANIFEST} manifest): its save failed "
            "or is still running. Load an earlier checkpoint, or save again with overwrite=True."
        )
    if ".metadata" in names:
        return InvalidCheckpointError(
            f"{url!r} is not a zarrckpt checkpoint: it looks like a DCP checkpoint (a .metadata file); "
            f"`zarrckpt import {url} NEW_URL` converts it, or read it with DCP's FileSystemReader"
        )
    inside: list[str] = []  # checkpoints under it
    nodes: list[str] = []  # parts of one: arrays, groups, a deletion's empty directories
    for name in sorted(n for n, size in entries.items() if size is None)[:20]:  # directories; a listing each
        found = storage.child(name).entries()
        if state(set(found)) not in (None, COMMITTED):  # a marker
            inside.append(name)
        elif MANIFEST in found:  # by the listing alone (no GET): an array has chunks ("c") or no directory
            subdirs = "c" not in found and any(size is None for size in found.values())
            (inside if subdirs and (found[MANIFEST] or 0) > GROUP_DOC_BYTES else nodes).append(name)
        elif "c" in found or not found:  # an array's chunks before its zarr.json; what a deletion leaves to prune
            nodes.append(name)
    if inside:
        shown = ", ".join(inside[:3]) + (", ..." if len(inside) > 3 else "")
        return InvalidCheckpointError(
            f"{url!r} is not a checkpoint but a root of checkpoints ({shown}): `zarrckpt ls {url}` lists them"
        )
    if nodes:  # parts of arrays without the manifest: a save that died, or a deletion not done yet
        return IncompleteCheckpointError(
            f"{url!r} holds a checkpoint that was never committed, or one being deleted ({', '.join(nodes[:3])} but "
            f"no {MANIFEST} manifest). Load an earlier checkpoint, or save again with overwrite=True."
        )
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    return InvalidCheckpointError(f"{url!r} is not a zarrckpt checkpoint (no {MANIFEST} manifest; it holds {shown})")


def prepare(storage: Storage, overwrite: bool) -> str:
    """Make the prefix ready for a new save and mark it pending; returns the new save id.

    The pending marker is created create-only: of two saves starting at one location, exactly
    one goes on and the other gets CheckpointExistsError before it has written anything.
    """
    names = storage.names()
    dying = marker(storage, DELETING) if DELETING in names else _tombstone(storage) if MANIFEST in names else None
    if dying is not None:  # a deletion (a marker, or only its tombstone: it died before the marker)
        if not overwrite:
            why = writer_gone(storage, names, DELETING if DELETING in names else MANIFEST, dying)
            if why is None:
                raise IncompleteCheckpointError(
                    f"the checkpoint at {storage.url!r} is being deleted ({dying}); pass overwrite=True to finish "
                    "that and save here, or wait: a deletion that died is finished by the next save once its "
                    f"marker has gone {lease_seconds():.0f} s without a heartbeat"
                )
            log.warning("finishing the deletion of %s before saving there: it died (%s)", storage.url, why)
        remove(storage)
    elif MANIFEST in names:
        if not is_zarrckpt_manifest(storage):
            raise ZarrckptError(f"refusing to write to {storage.url!r}: its zarr.json is not a zarrckpt checkpoint")
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: a committed checkpoint is at {storage.url!r} (overwrite=False); pass "
                "overwrite=True to replace it"
            )
        remove(storage)  # un-commit first: from here on readers see no checkpoint
    elif names:
        if PENDING not in names and not all(n.startswith(PENDING) for n in names):  # (a marker being created)
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ZarrckptError(
                f"refusing to write to {storage.url!r}: it is not empty ({shown}) and holds no zarrckpt checkpoint"
            )
        if not overwrite:
            why = writer_gone(storage, names)
            if why is None:
                raise IncompleteCheckpointError(
                    f"another save to {storage.url!r} is in progress or died ({marker(storage, PENDING)}); pass "
                    f"overwrite=True to replace it, or wait: a save that died is taken over once its marker has "
                    f"gone {lease_seconds():.0f} s without a heartbeat"
                )
            log.warning("taking over %s: the save that started it died (%s)", storage.url, why)
        remove(storage)  # leftovers of a save that never committed
    save_id = uuid.uuid4().hex
    doc = marker_doc(save_id)
    try:
        storage.create(PENDING, [json.dumps(doc).encode()])
    except FileExistsError:
        raise CheckpointExistsError(
            f"another save started writing to {storage.url!r} at the same time ({marker(storage, PENDING)}); "
            "this one wrote nothing"
        ) from None
    start_heartbeat(storage, doc)
    return save_id


def commit(storage: Storage, manifest: Manifest) -> None:
    """Create the manifest (the commit point), then drop the pending marker.

    Called once every rank has written its shards and ``zarr.json`` documents. Refuses
    (CheckpointExistsError) when the pending marker is no longer this save's, or another
    manifest is already there: another save took the location over meanwhile.
    """
    mine = manifest.save_id
    if pending_id(storage) != mine:
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
    stop_heartbeat(storage, mine)  # before the marker goes: no beat may bring it back
    if pending_id(storage) != mine:  # taken over between the check and the create: take the commit back
        if _manifest_id(storage) == mine:
            storage.delete(MANIFEST)
        raise CheckpointExistsError(
            f"not committing {storage.url!r}: another save took this location over while it committed"
        )
    storage.delete(PENDING)


def remove(storage: Storage) -> None:
    """Delete a checkpoint (committed or not) so that a deletion killed half-way stays visible.

    A committed manifest is first replaced by a tombstone, so no reader loads the checkpoint from the
    first step on; then the deleting marker goes first and last: a leftover always says what it is.
    """
    committed = _manifest_id(storage)  # None: no manifest, a tombstone already, or not a valid one
    doc = marker_doc(committed or "")
    if committed is not None:
        storage.write(MANIFEST, [tombstone(doc)])  # readers refuse from here on
    storage.write(DELETING, [json.dumps(doc).encode()])
    start_heartbeat(storage, doc, DELETING)  # a live deletion is never taken for a dead one
    try:
        storage.delete(MANIFEST)
        storage.delete_all(keep=[DELETING])
    finally:
        stop_heartbeat(storage, doc["save_id"], DELETING)  # before the marker goes: no beat may bring it back
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


def is_zarrckpt_manifest(storage: Storage) -> bool:
    """True when the root zarr.json is a zarrckpt manifest (even an invalid one): ours to replace or delete."""
    try:
        doc = json.loads(storage.read(MANIFEST, 0))
    except (FileNotFoundError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("node_type") != "group" or not isinstance(doc.get("attributes"), dict):
        return False  # (an array's zarr.json carries zarrckpt attributes too)
    return "zarrckpt" in doc["attributes"]


def is_tombstone(storage: Storage) -> bool:
    """True when the root zarr.json is a tombstone: a deletion started (and may have died) there."""
    return _tombstone(storage) is not None


def _tombstone(storage: Storage) -> dict[str, Any] | None:
    """The deleting marker in the root zarr.json when it is a tombstone; else None."""
    try:
        return tombstone_marker(storage.read(MANIFEST, 0))
    except FileNotFoundError:
        return None


def _manifest_id(storage: Storage) -> str | None:
    try:  # only the save id matters: skip building every array's metadata (0.4 s for 4,000 arrays)
        current = json.loads(storage.read(MANIFEST, 0))["attributes"]["zarrckpt"]["save_id"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return current if isinstance(current, str) else None


def check_unchanged(storage: Storage, save_id: str) -> None:
    """Fail if the checkpoint was overwritten or deleted since its manifest was read (a copy checked
    before its commit counts as unchanged while its own pending marker is there)."""
    if _manifest_id(storage) != save_id and pending_id(storage) != save_id:
        raise IncompleteCheckpointError(
            f"the checkpoint at {storage.url!r} was overwritten or deleted while it was being read; "
            "the data read may mix two saves and was discarded — load again"
        )
