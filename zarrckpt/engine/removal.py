"""Deleting what a checkpoint location holds: the one way its objects are removed, whoever asks
(``zarrckpt.delete`` / ``rm``, ``gc``, the manager's retention and cleanup, a save that overwrites or
takes over a dead save).

A deletion decides on the state it will change, never on an earlier listing (docs/FORMAT.md §6,
"Invariants"):

1. It creates the deleting marker, create-only: of two deletions of one location, one goes on and
   the other is told so (:class:`LocationBusy`); a deletion whose marker went the lease without a
   heartbeat is dead and is taken over.
2. It looks again, after its marker, and goes on only if the location still holds what it was asked
   to delete (that committed save, that dead save, that dead deletion); otherwise it removes its
   marker and raises :class:`LocationChanged`, having deleted nothing. From here on no other deletion
   and no save's preparation can start there.
3. A committed manifest is replaced by a tombstone: readers refuse the checkpoint from this request
   on. Where there is no manifest, a tombstone is *created* in its place, create-only: the save being
   deleted can no longer commit, and if it committed first, the deletion stops (LocationChanged).
4. Every other object is deleted, the pending marker among them (before the tombstone goes: a save
   that was only slow finds its marker gone when it checks after its commit, and takes it back),
   then the tombstone.
5. The marker is deleted; or, after deleting a save whose writers on other ranks may still be
   running (a save of several ranks, or of one whose process is not known to have stopped; not a
   save of a zarrckpt before heartbeats, whose writers would not notice anyway), left
   without a heartbeat (``linger``), so that whatever they write before they notice (they check at
   least every HEARTBEAT_SECONDS of writing) lies in a location that says what it is, until ``gc``
   (or the next save there) sweeps it again once the lease has passed.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from zarrckpt.engine import markers
from zarrckpt.engine.prefix import COMMITTED, DELETING_STATE, INCOMPLETE, Seen, look
from zarrckpt.errors import CheckpointExistsError, IncompleteCheckpointError, StorageError
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING, tombstone
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")
ANY = "any"  # remove(): whatever is there (pinned to what the first look finds)
_LOCK = re.compile(re.escape(DELETING) + r"\.\d+")  # the lock object of a takeover of a dead deletion


class LocationChanged(CheckpointExistsError):
    """The location no longer holds what a deletion was asked to delete (a save committed there, or
    another took it over); the deletion deleted nothing."""


class LocationBusy(IncompleteCheckpointError):
    """A running save or another running deletion holds the location; the deletion deleted nothing."""


def remove(
    storage: Storage, *, expect: str, save_id: str | None = None, force: bool = False, linger: bool = True
) -> bool:
    """Delete what ``storage`` holds, if it is what the caller means (see the module docstring).

    ``expect``: ``"committed"`` (the committed checkpoint ``save_id``, or any when None),
    ``"incomplete"`` (the save ``save_id`` that died; ``force``: also one that may be running),
    ``"deleting"`` (a deletion that died), or :data:`ANY` (what is there now, a running save only with
    ``force``). ``linger``: leave the marker after deleting a save's leftovers (step 5).

    Returns whether the marker was left to linger.

    Raises:
        LocationChanged, LocationBusy: as above; nothing was deleted.
        StorageError: a request failed; the marker stays and ``gc`` finishes the deletion.
    """
    seen = look(storage)
    if expect == ANY:
        expect, save_id = seen.state or "nothing", seen.save_id
    _require(storage, seen, expect, save_id, force)
    intent, target = expect, seen.save_id
    if expect == DELETING_STATE:  # finishing a deletion that died: what it was asked to delete
        held = markers.marker(storage, DELETING)
        intent, target = str(held.get("deletes", "")), held.get("save_id", seen.save_id)
    doc = {**markers.marker_doc(target or ""), "deletes": intent, "deletion": uuid.uuid4().hex}
    _acquire(storage, doc)
    markers.start_heartbeat(storage, doc, DELETING)
    token, guard = doc["deletion"], storage.guard
    storage.guard = lambda fresh=False: markers.check_lease(storage, token, DELETING)
    try:
        under = look(storage, {n for n in storage.names() if not n.startswith(DELETING)})  # beneath the marker
        if expect != DELETING_STATE:
            _require(storage, under, expect, save_id, force, after=True)
        elif under.state == COMMITTED and (intent != COMMITTED or under.save_id != target):
            raise LocationChanged(
                f"not deleting {storage.url!r}: a deletion of its {intent or 'leftovers'} died there, and it holds "
                f"{under} now, which that deletion was not asked to delete; it stays"
            )
        _unpublish(storage, under, doc)
        lingers = linger and _writers_may_run(storage, under)
        _sweep(storage, keep_what_is_left=lingers)
        if lingers:
            markers.stop_heartbeat(storage, token, DELETING)
        else:
            markers.stop_holding(storage, token, DELETING)  # no beat brings the marker back; it is still this one's
            storage.delete(DELETING, guarded=False)
            storage.prune()
    except (LocationChanged, LocationBusy):
        markers.stop_holding(storage, token, DELETING)
        _release(storage)
        raise
    except BaseException:  # failed here: the marker stays, and the next deletion from this process goes on at once
        markers.abandon(storage, token, DELETING)
        raise
    finally:
        storage.guard = guard
    if lingers:
        log.info(
            "deleted %s; its deleting marker stays for the lease, in case writers of that save still run", storage.url
        )
    return lingers


def _require(
    storage: Storage, seen: Seen, expect: str, save_id: str | None, force: bool, *, after: bool = False
) -> None:
    """Raise unless ``seen`` is what a deletion expecting ``expect`` (``save_id``) may delete."""
    url = storage.url
    if expect == COMMITTED:
        if seen.state == COMMITTED and seen.zarrckpt and save_id in (None, seen.save_id):
            return
    elif expect == INCOMPLETE:
        if seen.state == INCOMPLETE and save_id in (None, seen.save_id):
            if force or seen.dead is not None:
                return
            raise LocationBusy(
                f"not deleting {url!r}: a save may still be writing it ({markers.marker(storage, PENDING)}); wait "
                f"for it to commit, or to miss its heartbeat for {markers.lease_seconds():.0f} s"
            )
    elif expect == DELETING_STATE and seen.state == DELETING_STATE:
        if seen.dead is not None:
            return
        raise LocationBusy(f"not deleting {url!r}: another deletion is running there ({seen})")
    when = "after this deletion's marker was written" if after else "now"
    meant = f"{expect} checkpoint" + (f" (save {save_id})" if save_id else "")
    raise LocationChanged(
        f"not deleting {url!r}: it holds {seen} {when}, not the {meant} this deletion was asked to delete; "
        "nothing was deleted"
    )


def _writers_may_run(storage: Storage, under: Seen) -> bool:
    """Whether writers of a save may still write there after the sweep (step 5): its pending marker is
    still there (so they have not been told yet), of a zarrckpt with heartbeats (older writers would
    not notice anyway), and does not show that they stopped. (A deletion that died after deleting the
    marker had its own lease pass since: its writers noticed meanwhile.)"""
    if under.state == INCOMPLETE:
        return under.lease and not under.stopped
    doc = markers.marker(storage, PENDING) if PENDING in under.names else {}
    return bool(doc) and markers.has_lease(doc) and not markers.writers_stopped(storage, doc)


def _acquire(storage: Storage, doc: dict[str, Any]) -> None:
    """Create this deletion's marker, create-only. A dead deletion's marker is taken over, one taker
    at a time: each creates the lock object of the next generation, create-only, then rewrites the
    marker in place (so the location never goes without one)."""
    try:
        storage.create(DELETING, [json.dumps(doc).encode()])
        return
    except FileExistsError:
        pass
    names = storage.names()
    held = markers.marker(storage, DELETING)
    why = markers.writer_gone(storage, names, DELETING, held)  # (a taker's fresh lock object keeps it alive)
    if why is None:
        raise LocationBusy(f"not deleting {storage.url!r}: another deletion is running there ({held})")
    locks = [int(n.rsplit(".", 1)[1]) for n in names if _LOCK.fullmatch(n)]
    doc["generation"] = max([held.get("generation", 0) if isinstance(held.get("generation"), int) else 0, *locks]) + 1
    raw = json.dumps(doc).encode()
    try:
        storage.create(f"{DELETING}.{doc['generation']}", [raw])
    except FileExistsError:
        raise LocationBusy(f"not deleting {storage.url!r}: another process took over its dead deletion first") from None
    log.info("taking over the deletion of %s: it died (%s)", storage.url, why)
    storage.write(DELETING, [raw])


def _release(storage: Storage) -> None:
    """Remove this deletion's marker (and lock objects) after it deleted nothing."""
    for name in sorted(storage.names(), reverse=True):  # (the lock objects before the marker)
        if name.startswith(DELETING):
            storage.delete(name, guarded=False)


def _unpublish(storage: Storage, under: Seen, doc: dict[str, Any]) -> None:
    """Step 3: no reader loads the checkpoint and no save commits one here from now on."""
    if under.state == COMMITTED:
        storage.write(MANIFEST, [tombstone(doc)])  # readers refuse from this request on
        return
    if MANIFEST in under.names:  # a tombstone already (a deletion that died after it)
        return
    try:
        storage.create(MANIFEST, [tombstone(doc)])  # the commit point taken: a save there cannot commit now
    except FileExistsError:
        now = look(storage, storage.names() - {DELETING})
        if now.state == COMMITTED:
            raise LocationChanged(
                f"not deleting {storage.url!r}: the save there committed just now ({now}); nothing was deleted"
            ) from None


def _sweep(storage: Storage, *, keep_what_is_left: bool) -> None:
    """Step 4: every object but the marker and the tombstone, then the tombstone. What a second pass
    still finds (a save's writer still running) stays when ``keep_what_is_left``, else is an error."""
    left = storage.delete_all(keep=[DELETING, MANIFEST], check=False)
    if left:  # a heartbeat or a writer in flight: once more
        left = storage.delete_all(keep=[DELETING, MANIFEST], check=False)
    if left and not keep_what_is_left:
        raise StorageError(
            f"deleting {storage.url!r} left {len(left)} object(s) the store did not delete, e.g. {left[0]!r}: check "
            "the delete permission (s3:DeleteObject) and retry (`zarrckpt gc` finishes the deletion)"
        )
    storage.delete(MANIFEST)
