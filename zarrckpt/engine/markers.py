"""The markers of the commit protocol (:mod:`zarrckpt.engine.commit`): their documents, their ages,
whether their writer still runs (who it is: :mod:`zarrckpt.engine.writerid`), and the heartbeats of
running saves and deletions.

A pending or deleting marker is a small JSON object: the save id, when it started, its writer (host,
pid, and where the system tells them, the boot and PID namespace that make the pid mean something),
and the time of its last heartbeat. A pending marker is created once and never rewritten: a running
save's heartbeat is a separate object, :data:`BEAT`, rewritten every HEARTBEAT_SECONDS (so a beat that
lands after a deletion can never bring the marker back, which the commit checks). A running
deletion rewrites its deleting marker. A marker whose freshest object the store has not seen
rewritten for the lease (their modification times: the store's clock) belongs to a save or deletion
that died (:func:`writer_gone`); the writer's pid settles it sooner only when it ran under this very
kernel and PID namespace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from datetime import UTC, datetime
from typing import Any, ClassVar

from zarrckpt.engine import clock, writerid
from zarrckpt.errors import CheckpointExistsError, ZarrckptError
from zarrckpt.format.manifest import PENDING
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")
HEARTBEAT_SECONDS = 10.0  # a running save rewrites its heartbeat object this often (at most; heartbeat_seconds())
BEAT = PENDING + ".beat"  # a running save's heartbeat object (its name starts with the marker's)


def lease_seconds() -> float:
    """How long a marker may go without a heartbeat before its save (or deletion) counts as dead:
    ``$ZARRCKPT_LEASE_SECONDS``, else three heartbeats."""
    env = os.environ.get("ZARRCKPT_LEASE_SECONDS", "").strip()
    try:
        return max(float(env), 0.0) if env else 3 * HEARTBEAT_SECONDS
    except ValueError:
        raise ZarrckptError(f"ZARRCKPT_LEASE_SECONDS must be a number of seconds, not {env!r}") from None


def heartbeat_seconds() -> float:
    """How often a running save or deletion renews its marker: every HEARTBEAT_SECONDS, or a third
    of a shorter lease."""
    return min(HEARTBEAT_SECONDS, lease_seconds() / 3)


def _lapse_seconds() -> float:
    """How long a marker's holder may go without a beat landing before it stops relying on its lease:
    a heartbeat short of the lease, so that what it sends next still lands before anyone may take over."""
    return lease_seconds() - heartbeat_seconds()


# -- markers and their ages ---------------------------------------------------------------------
def token(doc: dict[str, Any]) -> Any:
    """What names a marker's holder in this process's registries: a deletion's own id (several
    deletions may delete the same save), else the save id."""
    return doc.get("deletion") or doc.get("save_id")


def marker_doc(save_id: str, world_size: int | None = None) -> dict[str, Any]:
    """A marker's document; ``world_size``: a pending marker's, the ranks writing the save."""
    started = now()
    doc = {"save_id": save_id, "started": started, "heartbeat": started, "writer": writerid.writer_identity()}
    return doc if world_size is None else {**doc, "world_size": world_size}


def marker(storage: Storage, name: str) -> dict[str, Any]:
    """A marker's content ({} when absent or unreadable)."""
    try:
        doc = json.loads(storage.read(name))
    except (FileNotFoundError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def pending_id(storage: Storage) -> Any:
    """The save id in the pending marker (None when there is none)."""
    return marker(storage, PENDING).get("save_id")


def leftover_age(storage: Storage, names: set[str], name: str) -> float | None:
    """Seconds since the save or deletion marked by the marker ``name`` started: its ``started``
    time, else the marker's (or its temporary file's) modification time; None when unknown."""
    age = age_seconds(marker(storage, name))
    return _freshest(storage, names, name) if age is None else age


def _freshest(storage: Storage, names: set[str], name: str) -> float | None:
    """Seconds since the store last saw one of the objects ``name`` begins (the marker, its heartbeat
    object, their temporary files) written; None when none is there."""
    ages = []
    for n in sorted(names):
        if n.startswith(name):
            stamp = storage.modified(n)
            if stamp is not None:
                ages.append((clock.wall() - stamp).total_seconds())
    return min(ages, default=None)


def writer_gone(
    storage: Storage, names: set[str], name: str = PENDING, doc: dict[str, Any] | None = None
) -> str | None:
    """Why the save (or, ``name=DELETING``, the deletion) whose marker ``name`` is in ``names`` is
    dead, or None while it may be running: no object of its marker (the marker, its heartbeat
    object) has been written for ``lease_seconds()`` (the store's modification times; the marker's
    own times without them); or its writer provably ran here and is gone; or it failed in this
    process. ``doc``: the marker's content when it is held elsewhere (a tombstone)."""
    doc = marker(storage, name) if doc is None else doc
    writer: dict[str, Any] = doc["writer"] if isinstance(doc.get("writer"), dict) else {}
    gone = writerid.gone_here(writer)
    if gone is not None:
        return gone
    if (storage.url, name, token(doc), doc.get("started")) in _ABANDONED and writerid.is_me(writer):
        return "it failed in this process, which abandoned it"
    if doc and "heartbeat" not in doc:  # a writer of a zarrckpt without heartbeats: only the grace period tells
        return None
    age = _freshest(storage, names, name)
    if age is None:
        age = age_seconds({"started": doc.get("heartbeat") or doc.get("started")})
    if age is not None and age >= lease_seconds():
        return f"no heartbeat for {age:.0f} s"
    return None


def unplaced(storage: Storage, names: set[str], name: str) -> dict[str, Any]:
    """The marker ``name`` as a writer wrote it under a temporary name before it was killed, before
    placing it (local files without unnamed files, see :func:`~zarrckpt.storage.local.publish`):
    when there is exactly one such and it is whole; else {}. Its writer tells whether it may still
    place it."""
    temps = [n for n in names if re.fullmatch(re.escape(name) + r"\.[0-9a-f]{12}\.tmp", n)]
    return marker(storage, temps[0]) if len(temps) == 1 else {}


def writers_stopped(storage: Storage, doc: dict[str, Any], name: str = PENDING) -> bool:
    """Whether no writer of the save whose pending marker is ``doc`` can write any more: there is no
    marker (the save never got to write, or a deletion took it already), or the save ran on one rank
    whose process provably stopped (gone from this host, or abandoned the save in this process)."""
    if not doc:
        return True
    writer: dict[str, Any] = doc["writer"] if isinstance(doc.get("writer"), dict) else {}
    if doc.get("world_size") != 1:
        return False
    abandoned = (storage.url, name, token(doc), doc.get("started")) in _ABANDONED and writerid.is_me(writer)
    return abandoned or writerid.gone_here(writer) is not None


def has_lease(doc: dict[str, Any]) -> bool:
    """Whether a marker's writer keeps it alive with heartbeats (every zarrckpt since they exist):
    an empty document (a marker gone, or only its heartbeat object left) counts as one."""
    return not doc or "heartbeat" in doc


_ABANDONED: set[tuple[str, str, Any, Any]] = set()  # (url, marker, save id, started): what this process abandoned
_STARTED: dict[tuple[str, str, str], str] = {}  # (url, marker, save id) -> start time of a marker this process wrote
_LOST: dict[tuple[str, str], str] = {}  # (url, save id) -> why a save of this process lost its location


# -- heartbeats ---------------------------------------------------------------------------------
class _Heartbeat:
    """Keeps a running save alive (rewrites its heartbeat object :data:`BEAT`) or a running deletion
    (rewrites its deleting marker) every HEARTBEAT_SECONDS on a thread, until stopped, or until the
    marker is no longer this one's: the location was taken over, which the save's writers then learn
    (:class:`Ownership`)."""

    _running: ClassVar[dict[tuple[str, str, str], _Heartbeat]] = {}  # (url, marker, save id) -> its heartbeat
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, storage: Storage, doc: dict[str, Any], name: str) -> None:
        self.storage, self.doc, self.name = storage, doc, name
        self.last_ok = clock.monotonic()  # when the marker (or a beat) was last written for sure
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zarrckpt-heartbeat", daemon=True)

    def start(self) -> None:
        key = (self.storage.url, self.name, token(self.doc))
        with self._lock:
            self._running[key] = self
            _STARTED[key] = self.doc["started"]
        self.thread.start()

    def lapsed(self, lapse: float | None = None) -> bool:
        """Whether the lease may have run out for others: no beat landed for the lease less a heartbeat
        (``lapse``: that, when the caller has it)."""
        return clock.monotonic() - self.last_ok > (_lapse_seconds() if lapse is None else lapse)

    def beat(self) -> bool:
        """One heartbeat; False when the marker is no longer this one's, or its lease may have run out
        (nothing is written then: the save or deletion has lost its location)."""
        found = marker(self.storage, self.name)
        ours = all(found.get(k) == self.doc[k] for k in ("save_id", "started", "writer"))
        if not ours or self.lapsed():
            if self.name == PENDING:
                _LOST[(self.storage.url, self.doc["save_id"])] = (
                    f"its pending marker is gone or another save's ({found or 'missing'}): a deletion or "
                    "another save took the location over"
                    if not ours
                    else f"its heartbeat lapsed for over {_lapse_seconds():.0f} s"
                )
            return False
        started = clock.monotonic()
        if self.name == PENDING:
            doc = {"save_id": self.doc["save_id"], "heartbeat": now()}
            self.storage.write(BEAT, [json.dumps(doc).encode()], guarded=False)
        else:
            self.storage.write(self.name, [json.dumps({**self.doc, "heartbeat": now()}).encode()], guarded=False)
        self.last_ok = started  # (the lease runs from when the beat was sent)
        return True

    def _run(self) -> None:
        while not clock.wait(self.stopped, heartbeat_seconds()):
            try:
                if not self.beat():
                    return  # committed, abandoned or taken over: not ours to touch any more
            except Exception as e:  # the save itself will meet the storage's trouble
                log.debug("heartbeat of %s failed: %s", self.storage.url, e)

    @classmethod
    def stop(cls, url: str, save_id: str, name: str) -> None:
        """Stop the heartbeat of ``name`` for save ``save_id`` at ``url`` (waits for a beat in progress)."""
        with cls._lock:
            beat = cls._running.pop((url, name, save_id), None)
        if beat is not None:
            beat.stopped.set()
            beat.thread.join()


def _lapsed_error(storage: Storage, name: str) -> CheckpointExistsError:
    what = "save" if name == PENDING else "deletion"
    return CheckpointExistsError(
        f"stopped the {what} at {storage.url!r}: its heartbeat has not reached the store for over "
        f"{_lapse_seconds():.0f} s, so another process may have taken the location over"
    )


def check_lease(storage: Storage, save_id: str, name: str = PENDING, lease: float | None = None) -> None:
    """Before a request that relies on holding marker ``name`` of ``save_id`` (a deletion: its
    :func:`token`): raise
    CheckpointExistsError when its heartbeat, running in this process, has not landed for the lease
    less a heartbeat (others may take the location over from then on); nothing to check where no such
    heartbeat runs here. ``lease``: :func:`lease_seconds`, when the caller has it."""
    with _Heartbeat._lock:
        beat = _Heartbeat._running.get((storage.url, name, save_id))
    if beat is None:
        return
    lease = lease_seconds() if lease is None else lease
    if beat.lapsed(lease - min(HEARTBEAT_SECONDS, lease / 3)):
        raise _lapsed_error(storage, name)
    clock.relying_until(beat.last_ok + lease)


def stop_holding(storage: Storage, save_id: str, name: str = PENDING) -> None:
    """Stop the heartbeat of marker ``name`` (of ``save_id``, a deletion's :func:`token`), then check
    its lease as :func:`check_lease` does, for the request that follows (deleting the marker)."""
    with _Heartbeat._lock:
        beat = _Heartbeat._running.get((storage.url, name, save_id))
    _Heartbeat.stop(storage.url, save_id, name)
    if beat is None:
        return
    if beat.lapsed():
        raise _lapsed_error(storage, name)
    clock.relying_until(beat.last_ok + lease_seconds())


def start_heartbeat(storage: Storage, doc: dict[str, Any], name: str = PENDING) -> None:
    """Rank 0 of a save whose pending marker ``doc`` was just created (or a deletion, ``name=DELETING``):
    keep it alive until the save commits or the deletion ends (:func:`stop_heartbeat`), or it is abandoned."""
    _Heartbeat(storage, doc, name).start()


def stop_heartbeat(storage: Storage, save_id: str, name: str = PENDING) -> None:
    """Stop the heartbeat of save ``save_id``'s marker ``name`` (waits for a beat in progress)."""
    _Heartbeat.stop(storage.url, save_id, name)


def abandon(storage: Storage, save_id: str, name: str = PENDING) -> None:
    """A save (or, ``name=DELETING``, a deletion) that will not go on: stop its heartbeat, so that the
    next save may take it over (at once from this process, elsewhere once its lease runs out; its
    objects stay until then)."""
    started = _STARTED.get((storage.url, name, save_id))
    if started is not None:
        _ABANDONED.add((storage.url, name, save_id, started))
    _Heartbeat.stop(storage.url, save_id, name)


class Ownership:
    """A save's check, before each object it writes, that the location is still its own: a save whose
    location was taken over (by a deletion, ``gc`` after its lease ran out, or another save) stops
    writing there and fails, instead of leaving objects that no marker accounts for. Free on the rank
    whose heartbeat learns it; elsewhere one read of the pending marker at most every
    HEARTBEAT_SECONDS of writing (none for a shorter save)."""

    def __init__(self, storage: Storage, save_id: str) -> None:
        self.storage, self.save_id = storage, save_id
        self._lease = lease_seconds()  # (read once: this check runs before every object a save writes)
        self._every = min(HEARTBEAT_SECONDS, self._lease / 3)  # heartbeat_seconds()
        self._checked = clock.monotonic()
        self._lock = threading.Lock()

    def check(self, *, fresh: bool = False) -> None:
        """Raise CheckpointExistsError when the location is known to be another's now, or this rank's
        heartbeat lapsed; ``fresh``: read the pending marker now, whenever it was read last."""
        if not self.save_id:
            return
        key = (self.storage.url, self.save_id)
        every = self._every
        if key not in _LOST and (fresh or clock.monotonic() - self._checked >= every):
            with self._lock:
                if fresh or clock.monotonic() - self._checked >= every:
                    found = pending_id(self.storage)
                    self._checked = clock.monotonic()
                    if found != self.save_id:
                        _LOST[key] = "its pending marker is another save's" if found else "its pending marker is gone"
        why = _LOST.get(key)
        if why is None:
            check_lease(self.storage, self.save_id, lease=self._lease)
            return
        raise CheckpointExistsError(
            f"stopped writing to {self.storage.url!r}: {why}; a deletion (`zarrckpt rm --force`, `gc` after "
            "its lease ran out) or another save took the location over. This save is abandoned uncommitted."
        )


def now() -> str:
    return clock.wall().isoformat(timespec="seconds")


def age_seconds(doc: dict[str, Any]) -> float | None:
    """Seconds since a marker's ``started`` time (None when it has none)."""
    try:
        started = datetime.fromisoformat(doc["started"])
    except (KeyError, TypeError, ValueError):
        return None
    if started.tzinfo is None:
        started = started.replace(tzinfo=UTC)
    return (clock.wall() - started).total_seconds()
