"""The commit protocol: a checkpoint exists only once its manifest (the root zarr.json) exists.

save:   prepare (refuse, or delete an old checkpoint or a dead save's leftovers; create the pending
        marker, create-only, so of two racing saves one goes on) -> every rank writes its shards and
        its share of zarr.json documents, create-only, each rank stopping when it learns that the
        location is no longer its save's -> commit (the manifest, create-only, last, between two
        checks that the pending marker is still this save's).
load:   read the manifest (one GET) -> read data, every chunk compared with the commit record (a
        chunk a later save replaced fails it) -> without that record (or with allow_modified),
        read the manifest again: a different save_id means the checkpoint was overwritten
        meanwhile, and the load fails instead of mixing.
delete: :mod:`zarrckpt.engine.removal`: the deleting marker (create-only) -> a second look -> the
        manifest replaced by a tombstone, or a tombstone created where none is (a save there can no
        longer commit) -> the rest -> the tombstone -> the marker.

Markers carry the save id, the start time and the writer, so leftovers have an age; a running save
keeps a heartbeat object fresh (:mod:`zarrckpt.engine.markers`), and one whose heartbeat the store
has not seen for the lease, or whose writer provably stopped, is dead: the next save to that
location takes it over. A writer that was only slow finds its marker gone and cannot commit.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid

from zarrckpt.engine import crctable
from zarrckpt.engine.markers import (
    BEAT,
    check_lease,
    lease_seconds,
    marker,
    marker_doc,
    pending_id,
    start_heartbeat,
    stop_heartbeat,
)
from zarrckpt.engine.prefix import COMMITTED, DELETING_STATE, INCOMPLETE, look, manifest_id, state
from zarrckpt.engine.removal import LocationBusy, LocationChanged, remove
from zarrckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidCheckpointError,
    StorageError,
    ZarrckptError,
)
from zarrckpt.format import integrity
from zarrckpt.format.jsondoc import Unsettled
from zarrckpt.format.manifest import (
    DELETING,
    HEAD_BYTES,
    MANIFEST,
    PENDING,
    Manifest,
    ManifestHead,
    tombstone_marker,
)
from zarrckpt.storage.remote import CreatedCorrupt
from zarrckpt.storage.retry import missing_bucket
from zarrckpt.storage.store import Storage

__all__ = ["COMMITTED", "DELETING_STATE", "INCOMPLETE", "LocationBusy", "LocationChanged", "remove", "state"]
log = logging.getLogger("zarrckpt")
GROUP_DOC_BYTES = 128  # a group's own zarr.json is smaller (a checkpoint's manifest is larger)


def read_manifest(storage: Storage, *, table: bool = False) -> Manifest:
    """The committed manifest, or a clear error saying why there is none; ``table``: with every
    array's committed chunk checksums from the chunk checksum table (one more GET; without it, its
    arrays' chunks cannot be read until their segments are, :mod:`~zarrckpt.engine.crctable`).

    A manifest that fails its checks (not JSON, invalid, or its ``attributes_crc32c`` or an array's
    commit record does not match) is read again before that is believed, up to the storage's retry
    policy's attempts: bytes damaged on the way differ from one read to the next, while the same
    bytes twice are what is stored, reported (or returned, modified) as they are."""
    where, attempts = storage.where(MANIFEST), storage.retry.attempts
    raw = read_manifest_bytes(storage)
    for attempt in range(1, attempts + 1):
        try:
            manifest = Manifest.loads(raw, where)
        except InvalidCheckpointError:  # (bytes that are no text were read twice already: stored so)
            if attempt == attempts or not raw.isascii() or (again := read_manifest_bytes(storage)) == raw:
                raise
        else:
            if not manifest.modified or attempt == attempts or (again := read_manifest_bytes(storage)) == raw:
                if not table:
                    return manifest
                where = storage.where(integrity.TABLE)
                return crctable.with_table(manifest, lambda: crctable.read_table(storage), attempts, where)
        log.info("read %s again: what the last read returned fails its checks (damaged on the way?)", where)
        storage.traffic.add(retries=1)
        raw = again
    raise AssertionError("unreachable")


def read_manifest_head(storage: Storage) -> ManifestHead:
    """The committed manifest's checkpoint-wide fields (:class:`ManifestHead`): one ranged read of
    its first :data:`HEAD_BYTES`; the whole manifest only when they do not settle them. Errors as
    :func:`read_manifest`'s. A manifest read whole in that one read whose attributes_crc32c fails is
    read again (other bytes then: as :func:`read_manifest` reads it); one that is no JSON is reported
    at once (a listing of many checkpoints costs one GET each); a prefix cannot be checked."""
    where = storage.where(MANIFEST)
    raw = read_manifest_bytes(storage, HEAD_BYTES)
    try:
        if len(raw) >= HEAD_BYTES:
            return ManifestHead.parse(raw, where, whole=False)
    except Unsettled:
        return ManifestHead.of(read_manifest(storage))
    manifest = Manifest.loads(raw, where)  # the whole document, checked whole
    if manifest.modified and read_manifest_bytes(storage, HEAD_BYTES) != raw:  # damaged on the way?
        manifest = read_manifest(storage)
    return ManifestHead.of(manifest)


def read_manifest_bytes(storage: Storage, end: int | None = None) -> bytes:
    """The committed manifest's bytes (unparsed; those before ``end`` when given), or a clear error
    saying why there is none.

    Bytes that are no text (not UTF-8, as JSON is; zarrckpt writes ASCII) are read again, up to the
    storage's retry policy's attempts, until they are, or the same bytes come back (what is stored):
    a byte damaged on the way mostly shows so, at the cost of a scan (GB/s) instead of a parse."""

    def text(raw: bytes) -> bool:
        try:
            return raw.isascii() or bool(raw.decode())
        except UnicodeDecodeError as e:  # a prefix may end inside a character
            return end is not None and len(raw) == end and e.start >= end - 3 and e.reason == "unexpected end of data"

    raw = None
    for attempt in range(storage.retry.attempts):
        try:
            got = storage.read(MANIFEST, 0, end)  # an open range: s3fs skips its HEAD for the size
        except FileNotFoundError as e:
            raise _why_no_manifest(storage, e) from None
        except StorageError as e:  # a local file where the checkpoint's directory should be
            if isinstance(e.__cause__, NotADirectoryError):
                raise _why_no_manifest(storage, e.__cause__) from None
            raise
        if got == raw or text(got):
            break
        raw = got
        if attempt + 1 < storage.retry.attempts:
            log.info("read %s again: what was read is no text (damaged on the way?)", storage.where(MANIFEST))
            storage.traffic.add(retries=1)
    raw = got
    gone = tombstone_marker(raw)
    if gone is not None:
        raise IncompleteCheckpointError(
            f"the checkpoint at {storage.url!r} is being deleted, or its deletion died half-way ({gone}); "
            "`zarrckpt gc` finishes interrupted deletions"
        )
    return raw


def _why_no_manifest(storage: Storage, error: OSError) -> ZarrckptError:
    """The error for a URL without a manifest (``error``: the read's), saying what is there instead (the
    error path only: one listing, and one more for each of the first 20 entries, to tell a root of
    checkpoints)."""
    url = storage.url
    if missing_bucket(error):
        return CheckpointNotFoundError(f"no checkpoint at {url!r}: {storage.no_bucket()}")
    try:
        entries = storage.entries()
    except StorageError as e:  # a listing that found the bucket missing (gcsfs: its object read could not tell)
        if e.__cause__ is not None and missing_bucket(e.__cause__):
            return CheckpointNotFoundError(f"no checkpoint at {url!r}: {storage.no_bucket()}")
        raise
    names = set(entries)
    if not names:
        there = storage.no_bucket() if storage.bucket_missing() else "nothing is stored there"
        return CheckpointNotFoundError(f"no checkpoint at {url!r}: {there}")
    if storage.listed_itself(entries):
        return InvalidCheckpointError(
            f"{url!r} is a file, not a zarrckpt checkpoint (a checkpoint is a directory holding a {MANIFEST} "
            f"manifest): a torch.save or safetensors file converts with `zarrckpt import {url} NEW_URL`"
        )
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
        elif MANIFEST in found:  # by the listing alone (no GET): an array has no directory but "c/" (versions 1-3)
            subdirs = "c" not in found and any(size is None for size in found.values())
            (inside if subdirs and (found[MANIFEST] or 0) > GROUP_DOC_BYTES else nodes).append(name)
        elif not found or any(n == "c" or n.startswith("c.") for n in found):
            # an array's chunks ("c.0.1", or under "c/") before its zarr.json; what a deletion leaves to prune
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


def prepare(storage: Storage, overwrite: bool, world_size: int | None = None) -> str:
    """Make the prefix ready for a new save and mark it pending; returns the new save id.

    What is there is looked at once, fresh: a committed checkpoint is refused (``overwrite``: deleted);
    a save that died, or a deletion that died, is taken over (deleted); a save or deletion that may
    be running is refused, whatever ``overwrite`` (but a marker of a zarrckpt before heartbeats,
    which only its age could retire: ``overwrite`` deletes it). The
    pending marker is created create-only: of two saves starting at one location, exactly one goes on
    and the other gets CheckpointExistsError before it has written anything. ``world_size``: the
    ranks that will write (in the marker: a deletion of a one-rank save whose process stopped need
    not wait for other writers).
    """
    seen = look(storage)
    url = storage.url
    try:
        if seen.state == COMMITTED:
            if not seen.zarrckpt:
                raise ZarrckptError(f"refusing to write to {url!r}: its zarr.json is not a zarrckpt checkpoint")
            if not overwrite:
                raise CheckpointExistsError(
                    f"Checkpoint already exists: a committed checkpoint is at {url!r} (overwrite=False); pass "
                    "overwrite=True to replace it"
                )
            remove(storage, expect=COMMITTED, save_id=seen.save_id, linger=False)  # readers see none from here on
        elif seen.state == DELETING_STATE:
            if seen.dead is None:
                raise IncompleteCheckpointError(
                    f"the checkpoint at {url!r} is being deleted ({marker(storage, DELETING)}); wait for the "
                    f"deletion to end: one that died is finished by the next save once its marker has gone "
                    f"{lease_seconds():.0f} s without a heartbeat"
                )
            log.warning("finishing the deletion of %s before saving there: it died (%s)", url, seen.dead)
            remove(storage, expect=DELETING_STATE, linger=False)
        elif seen.state == INCOMPLETE:
            if seen.dead is None and (seen.lease or not overwrite):  # a running save is never replaced
                raise IncompleteCheckpointError(
                    f"another save to {url!r} is in progress, or died too recently to tell "
                    f"({marker(storage, PENDING)}); wait: a save that died is taken over once its heartbeat has "
                    f"gone {lease_seconds():.0f} s without reaching the store (`zarrckpt.lifecycle.await_dead_save` "
                    "waits for that; overwrite=True replaces committed checkpoints and dead saves, never a running one)"
                )
            if seen.dead is not None:
                log.warning("taking over %s: the save that started it died (%s)", url, seen.dead)
            remove(storage, expect=INCOMPLETE, save_id=seen.save_id, force=overwrite, linger=False)
        elif seen.names:
            shown = ", ".join(sorted(seen.names)[:5]) + (", ..." if len(seen.names) > 5 else "")
            raise ZarrckptError(
                f"refusing to write to {url!r}: it is not empty ({shown}) and holds no zarrckpt checkpoint"
            )
    except LocationBusy as e:
        raise IncompleteCheckpointError(f"{e}; this save wrote nothing") from e
    except LocationChanged as e:
        raise CheckpointExistsError(f"{e}; another save or deletion got there first: this save wrote nothing") from e
    save_id = uuid.uuid4().hex
    doc = marker_doc(save_id, world_size)
    try:
        storage.create(PENDING, [json.dumps(doc).encode()])
    except FileExistsError:
        raise CheckpointExistsError(
            f"another save started writing to {url!r} at the same time ({marker(storage, PENDING)}); "
            "this one wrote nothing"
        ) from None
    start_heartbeat(storage, doc)
    return save_id


def commit(storage: Storage, manifest: Manifest) -> None:
    """Create the manifest (the commit point), then drop the pending marker.

    Called once every rank has written its shards and ``zarr.json`` documents. Refuses
    (CheckpointExistsError) when the pending marker is no longer this save's before or right after
    the manifest is created (then taken back), or when the manifest's place is taken: another save
    committed there, or a deletion holds it (a tombstone). Once committed, a failure to remove the
    pending marker is logged, not raised: the checkpoint is committed, and the marker harmless.
    """
    mine, url = manifest.save_id, storage.url
    if pending_id(storage) != mine:
        raise CheckpointExistsError(
            f"not committing {url!r}: another save or a deletion took this location over while it was written "
            f"(pending marker: {marker(storage, PENDING) or 'missing'}); this save is abandoned"
        )
    check_lease(storage, mine)  # (the creates below rely on it)
    if manifest.table_ref is not None and manifest.integrity is not None:  # the record's chunk checksums first
        try:
            storage.create(integrity.TABLE, [manifest.table])
        except FileExistsError:
            raise CheckpointExistsError(
                f"not committing {url!r}: another writer's {integrity.TABLE} is there; this save is abandoned"
            ) from None
    try:
        storage.create(MANIFEST, [manifest.dumps()], repair=False)
    except CreatedCorrupt:  # (a store that cannot check a write on its way: read back, it is not what was sent)
        raise CheckpointExistsError(
            f"not committing {url!r}: its manifest, read back, is not what this save wrote (damaged on the way, or "
            "replaced by a deletion of it); this save is abandoned: save again"
        ) from None
    except FileExistsError:
        taken = is_tombstone(storage)
        by = "a deletion took it over (a tombstone holds its place)" if taken else "another save committed first"
        raise CheckpointExistsError(f"not committing {url!r}: {by}; this save is abandoned") from None
    stop_heartbeat(storage, mine)  # before the marker goes: no beat may land after it
    try:
        holder = pending_id(storage)
    except ZarrckptError as e:
        log.warning("committed %s, but could not read its pending marker back (%s): `zarrckpt verify` it", url, e)
        return
    if holder is None and manifest_id(storage)[0] == mine and _all_there(storage, manifest):
        log.info("committed %s; its pending marker was removed meanwhile (gc tidies committed checkpoints)", url)
        return
    if holder != mine:  # taken over before the create, after the first check: take the commit back
        if manifest_id(storage)[0] == mine:
            storage.delete(MANIFEST, guarded=False)
        raise CheckpointExistsError(f"not committing {url!r}: another save or a deletion took this location over")
    try:
        storage.delete(PENDING, guarded=False)
        storage.delete(BEAT, guarded=False)
    except ZarrckptError as e:
        log.warning(
            "committed %s, but removing its pending marker failed (%s): the checkpoint is committed and loads; "
            "`zarrckpt gc` removes the marker",
            url,
            e,
        )


def _all_there(storage: Storage, manifest: Manifest) -> bool:
    """Whether every object of ``manifest`` is stored (one listing): a commit whose marker is gone was
    either taken over before its manifest was created (a deletion swept its objects first) or
    committed, its marker then tidied away; only the objects tell."""
    stored = storage.sizes()
    if manifest.table_ref is not None and integrity.TABLE not in stored:
        return False
    for meta in manifest.arrays.values():
        if f"{meta.path}/zarr.json" not in stored:
            return False
        if meta.constant is None:
            grid = [range(-(-n // s)) for n, s in zip(meta.shape, meta.shard_shape, strict=True)]
            if any(meta.shard_path(idx) not in stored for idx in itertools.product(*grid)):
                return False
    return True


def is_zarrckpt_manifest(storage: Storage) -> bool:
    """True when the root zarr.json is a zarrckpt manifest (even an invalid one): ours to replace or delete."""
    return manifest_id(storage)[1]


def is_tombstone(storage: Storage) -> bool:
    """True when the root zarr.json is a tombstone: a deletion started (and may have died) there."""
    try:
        return tombstone_marker(storage.read(MANIFEST, 0, HEAD_BYTES)) is not None
    except FileNotFoundError:
        return False


def check_unchanged(storage: Storage, save_id: str) -> None:
    """Fail if the checkpoint was overwritten or deleted since its manifest was read (a copy checked
    before its commit counts as unchanged while its own pending marker is there)."""
    for _ in range(2):  # (looked at twice before it is believed: an answer damaged on the way says otherwise once)
        if manifest_id(storage)[0] == save_id or pending_id(storage) == save_id:
            return
    raise IncompleteCheckpointError(
        f"the checkpoint at {storage.url!r} was overwritten or deleted while it was being read; "
        "the data read may mix two saves and was discarded — load again"
    )
