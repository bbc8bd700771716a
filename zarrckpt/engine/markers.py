"""The markers of the commit protocol (:mod:`zarrckpt.engine.commit`): their documents, their ages,
and the heartbeat a running save gives its pending marker.

A pending or deleting marker is a small JSON object: the save id, when it started, its writer
(host, pid), and the time of its last heartbeat. While a save or a deletion runs, its writer
rewrites its marker every HEARTBEAT_SECONDS. A marker the store has not seen rewritten for the
lease (its modification time: the store's clock), or whose writer ran on this host and is gone,
belongs to a save or deletion that died (:func:`writer_gone`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from datetime import UTC, datetime
from typing import Any, ClassVar

from zarrckpt.errors import ZarrckptError
from zarrckpt.format.manifest import PENDING
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")
HEARTBEAT_SECONDS = 10.0  # a running save rewrites its pending marker this often


def lease_seconds() -> float:
    """How long a marker may go without a heartbeat before its save (or deletion) counts as dead:
    ``$ZARRCKPT_LEASE_SECONDS``, else three heartbeats."""
    env = os.environ.get("ZARRCKPT_LEASE_SECONDS", "").strip()
    try:
        return max(float(env), 0.0) if env else 3 * HEARTBEAT_SECONDS
    except ValueError:
        raise ZarrckptError(f"ZARRCKPT_LEASE_SECONDS must be a number of seconds, not {env!r}") from None


def marker_doc(save_id: str) -> dict[str, Any]:
    started = now()
    writer = {"host": socket.gethostname(), "pid": os.getpid()}
    return {"save_id": save_id, "started": started, "heartbeat": started, "writer": writer}


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
    if age is None:
        ages = [storage.age(n) for n in sorted(names) if n.startswith(name)]
        age = min((a for a in ages if a is not None), default=None)
    return age


def writer_gone(
    storage: Storage, names: set[str], name: str = PENDING, doc: dict[str, Any] | None = None
) -> str | None:
    """Why the save (or, ``name=DELETING``, the deletion) whose marker ``name`` is in ``names`` is
    dead, or None while it may be running: its writer ran on this host and is gone, or the marker
    has gone ``lease_seconds()`` without a heartbeat (the store's modification time; the marker's
    own times without one). ``doc``: the marker's content when it is held elsewhere (a tombstone)."""
    doc = marker(storage, name) if doc is None else doc
    writer: dict[str, Any] = doc["writer"] if isinstance(doc.get("writer"), dict) else {}
    pid = writer.get("pid")
    if writer.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        return f"its writer, process {pid} on this host, is gone"
    if name == PENDING and (storage.url, doc.get("save_id")) in _ABANDONED and pid == os.getpid():
        return "it failed in this process, which abandoned it"
    if doc and "heartbeat" not in doc:  # a writer of a zarrckpt without heartbeats: only the grace period tells
        return None
    age = storage.age(name) if name in names else None
    if age is None:
        age = age_seconds({"started": doc.get("heartbeat") or doc.get("started")})
    if age is None:
        ages = [storage.age(n) for n in sorted(names) if n.startswith(name)]  # a marker killed mid-create
        age = min((a for a in ages if a is not None), default=None)
    if age is not None and age >= lease_seconds():
        return f"no heartbeat for {age:.0f} s"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's, or unknowable: running for all we know
    return True


_ABANDONED: set[tuple[str, str]] = set()  # (url, save id) of the saves this process abandoned


class _Heartbeat:
    """Rewrites a running save's pending marker (or a running deletion's deleting marker) every
    HEARTBEAT_SECONDS on a thread, until it is stopped or the marker is no longer this one's (the
    save was taken over)."""

    _running: ClassVar[dict[tuple[str, str, str], _Heartbeat]] = {}  # (url, marker, save id) -> its heartbeat
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, storage: Storage, doc: dict[str, Any], name: str) -> None:
        self.storage, self.doc, self.name = storage, doc, name
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zarrckpt-heartbeat", daemon=True)

    def start(self) -> None:
        with self._lock:
            self._running[(self.storage.url, self.name, self.doc["save_id"])] = self
        self.thread.start()

    def _ours(self) -> bool:
        found = marker(self.storage, self.name)
        return all(found.get(k) == self.doc[k] for k in ("save_id", "started", "writer"))

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_SECONDS):
            try:
                if not self._ours():
                    return  # committed, abandoned or taken over: not ours to touch any more
                beat = {**self.doc, "heartbeat": now()}
                self.storage.write(self.name, [json.dumps(beat).encode()])
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


def start_heartbeat(storage: Storage, doc: dict[str, Any], name: str = PENDING) -> None:
    """Rank 0 of a save whose pending marker ``doc`` was just created (or a deletion, ``name=DELETING``):
    keep it fresh until the save commits or the deletion ends (:func:`stop_heartbeat`), or it is abandoned."""
    _Heartbeat(storage, doc, name).start()


def stop_heartbeat(storage: Storage, save_id: str, name: str = PENDING) -> None:
    """Stop the heartbeat of save ``save_id``'s marker ``name`` (waits for a beat in progress)."""
    _Heartbeat.stop(storage.url, save_id, name)


def abandon(storage: Storage, save_id: str) -> None:
    """A save that will not commit: stop its heartbeat, so that the next save may take it over (at
    once from this process, elsewhere once its lease runs out; its objects stay until then)."""
    _ABANDONED.add((storage.url, save_id))
    _Heartbeat.stop(storage.url, save_id, PENDING)


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
