"""The storage face: a checkpoint root on local paths, file://, memory://, s3://, gs://, through the
filesystem :mod:`zarrckpt.storage.clients` picks (obstore for s3:// where it can, fsspec otherwise).

:class:`Storage` retries every request, bounds concurrency and keeps create-only semantics; what
differs by kind of storage lives in its backend: :class:`~zarrckpt.storage.local.LocalBackend`
(local files) or :class:`~zarrckpt.storage.remote.RemoteBackend` (every other filesystem).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from zarrckpt.errors import StorageError, ZarrckptError
from zarrckpt.storage.caps import NameLimits, ReadCaps, default_concurrency
from zarrckpt.storage.clients import isolate_randomness, open_filesystem
from zarrckpt.storage.concurrency import SMALL_LOCAL_WRITE, Pace, in_runs, run_bounded
from zarrckpt.storage.listing import Listing
from zarrckpt.storage.local import Buffer, LocalBackend
from zarrckpt.storage.localfs import LocalFiles
from zarrckpt.storage.remote import CreatedCorrupt, RemoteBackend, UploadCorrupted
from zarrckpt.storage.retry import (
    RetryPolicy,
    bucket_of,
    current_policy,
    describe,
    from_client,
    is_transient,
    missing_bucket,
)
from zarrckpt.storage.traffic import Traffic
from zarrckpt.types import URL

log = logging.getLogger("zarrckpt")

Backend = LocalBackend | RemoteBackend  # what differs by kind of storage
T = TypeVar("T")
R = TypeVar("R")


class Storage(Listing):
    """A checkpoint root on some fsspec filesystem; paths are relative to the root.

    Every request is retried on transient failures (see :mod:`zarrckpt.storage.retry`); ``retry``
    defaults to :func:`zarrckpt.storage.retry.current_policy`.
    """

    def __init__(
        self,
        url: URL,
        storage_options: dict[str, Any] | None = None,
        *,
        concurrency: int = 0,
        retry: RetryPolicy | None = None,
        verify_writes: bool | None = None,
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = storage_options
        if not self.url:
            raise ZarrckptError("empty checkpoint URL")
        self.fs, root, self.client = open_filesystem(self.url, storage_options)
        self.root = root.rstrip("/")
        local = isinstance(self.fs, LocalFiles)
        self.backend: LocalBackend | RemoteBackend = (
            LocalBackend(self.fs) if local else RemoteBackend(self.fs, self.client)
        )
        self._concurrency = concurrency
        self.concurrency = concurrency or default_concurrency(local, writing=False)
        self.write_concurrency = concurrency or default_concurrency(local, writing=True)
        self.retry = retry or current_policy()
        # read every object written back (True), those no check covered on the way (None), or none
        self.verify_writes = verify_writes
        self._jitter = random.Random()  # private: never perturb the global RNG a trainer checkpoints
        self.traffic = Traffic()  # requests and bytes so far (Checkpoint.stats())
        # called before each request that changes the store (writes, creates, deletes; fresh=True before one
        # that would replace an object this writer created): the commit protocol's check that this process
        # still holds the location (markers.Ownership for a save, a deletion's lease); None: no check
        self.guard: Callable[..., None] | None = None

    @property
    def caps(self) -> ReadCaps:
        """What this storage does well, which decides how reads are planned."""
        return self.backend.caps

    @property
    def name_limits(self) -> NameLimits:
        """How long the names of objects under the root may be here (local files: the filesystem's
        NAME_MAX and PATH_MAX; S3 and GCS: keys of at most 1,024 bytes)."""
        return self.backend.name_limits(self.root)

    @property
    def atomic_create(self) -> bool:
        """Whether :meth:`create` is one atomic create-only request here."""
        return self.backend.atomic_create

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as its URL and options (DCP's async PROCESS mode)
        return (_rebuild, (self.url, self.storage_options, self._concurrency, self.retry, self.verify_writes))

    def child(self, name: str) -> Storage:
        """The storage of the entry ``name`` directly under the root (same options)."""
        url = f"{self.url.rstrip('/')}/{name}"
        return Storage(url, self.storage_options, retry=self.retry, verify_writes=self.verify_writes)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def no_bucket(self) -> str:
        """What to say when this storage's bucket does not exist."""
        return (
            f"the bucket {bucket_of(self.url)!r} does not exist: check its name and the endpoint "
            "(zarrckpt creates no buckets)"
        )

    def bucket_missing(self) -> bool:
        """Whether this storage's bucket is known not to exist, asked of GCS (one request, for error paths:
        gcsfs says only "not found" of an object in a missing bucket, where S3 clients say NoSuchBucket,
        and s3fs's own answer would take a bucket it may not look at for a missing one)."""
        if self.client != "gcsfs":
            return False
        bucket = self.root.strip("/").partition("/")[0]
        try:
            return not self.fs.exists(bucket)  # (404 only: a refusal raises)
        except Exception:  # (asked on an error's way: that error is what is said)
            return False

    def where(self, path: str) -> str:
        """A human-readable location for error messages."""
        return f"{self.url.rstrip('/')}/{path}"

    def _request(self, what: str, path: str, fn: Callable[[], T], *, missing_ok: bool = True) -> T:
        """Run one storage request, retrying transient failures with backoff; failures become
        StorageError, except FileNotFoundError, which passes (unretried) when ``missing_ok``."""
        policy = self.retry
        isolate_randomness()  # the clients' retry jitter: never Python's global generator
        for attempt in range(1, policy.attempts + 1):
            self.traffic.add(requests=1, retries=int(attempt > 1))
            try:
                return fn()
            except FileNotFoundError as e:
                if missing_ok:
                    raise
                if missing_bucket(e) or self.bucket_missing():  # never transient: fails at once, naming it
                    raise StorageError(f"{what} {self.where(path)} failed: {self.no_bucket()}") from e
                raise StorageError(f"{what} {self.where(path)} failed: {e} (does the bucket/directory exist?)") from e
            except Exception as e:
                if not is_transient(e):
                    if isinstance(e, (OSError, RuntimeError, ValueError)) or from_client(e):
                        raise StorageError(f"{what} {self.where(path)} failed: {describe(e)}") from e
                    raise
                if attempt == policy.attempts:
                    tries = f"{attempt} attempts" if attempt > 1 else "1 attempt (retries are off)"
                    raise StorageError(f"{what} {self.where(path)} failed after {tries}: {describe(e)}") from e
                pause = policy.delay(attempt, self._jitter.random())
                log.log(
                    logging.DEBUG if attempt < 3 else logging.INFO,
                    "retrying %s %s in %.2fs (attempt %d of %d failed: %s: %s)",
                    what,
                    self.where(path),
                    pause,
                    attempt,
                    policy.attempts,
                    type(e).__name__,
                    e,
                )
                time.sleep(pause)
        raise AssertionError("unreachable")

    # -- single objects -------------------------------------------------------------------
    def write(
        self,
        path: str,
        parts: Sequence[Buffer],
        *,
        create_only: bool = False,
        guarded: bool = True,
        durable: bool = True,
    ) -> None:
        """Write one object from its parts; remote stores get exactly one PUT (per attempt).

        A retried write rewrites the whole object, so a write that failed after it landed is harmless.
        ``create_only``: fail with FileExistsError when the object already exists with other
        content, atomically on stores that can (local files, S3, GCS); elsewhere the check
        and the write are two requests (see :meth:`create`). ``guarded=False``: without the
        :attr:`guard` (a heartbeat, which keeps the lease the guard checks). ``durable=False`` (with
        ``create_only``): see :meth:`create`.
        """
        if create_only:
            self.create(path, parts, durable=durable)
            return
        if guarded:
            self._guard()
        full = self._abs(path)

        def put() -> None:  # one attempt: the write, and its check
            self.traffic.add(bytes_written=sum(map(len, parts)))
            if self._read_back(self.backend.write(full, parts)):
                self._check_stored(full, parts)

        self._request("writing", path, put, missing_ok=False)

    def create(self, path: str, parts: Sequence[Buffer], *, repair: bool = True, durable: bool = True) -> None:
        """Write a new object, or raise FileExistsError when another writer's object is already there.

        Exactly one of several racing creators succeeds on stores with create-only writes (local
        files: a hard link; S3: ``If-None-Match: *``; GCS: ``ifGenerationMatch=0``). A create that
        finds the object already holding *these* bytes succeeds: it is a retry of a write that
        landed. Elsewhere a logged warning says the check is not atomic. Checked end to end as
        :meth:`write` is; an object this create made but that arrived damaged is overwritten (after the
        :attr:`guard`, fresh), or, without ``repair``, raises CreatedCorrupt. ``durable=False``: local
        files are written straight to their name and made durable only by :meth:`flush` (objects of a
        pending save, whose readers wait for its commit); elsewhere a create is durable when it returns.
        """
        self._guard()
        full = self._abs(path)

        def put() -> bool:  # one attempt; True: this create made the object
            self.traffic.add(bytes_written=sum(map(len, parts)))
            made = self.backend.create(full, parts, durable)
            if made is not None and self._read_back(made):
                try:
                    self._check_stored(full, parts)
                except UploadCorrupted as e:
                    raise CreatedCorrupt(str(e)) from e
            return made is not None

        try:
            if self._request("creating", path, put, missing_ok=False):
                local = self.backend
                if durable and isinstance(local, LocalBackend):  # the new name too survives a crash
                    self._request("flushing the directory of", path, lambda: local.settle(full))
                return
        except CreatedCorrupt:  # the object was this writer's, only damaged: write it again until it checks,
            if not repair:  # (or another writer replaced it since: the caller decides)
                raise
            self._guard(fresh=True)  # unless the location is another's now (then the object may be its too)
            self.write(path, parts)
            return
        if not self._holds(path, b"".join(parts)):
            raise FileExistsError(errno.EEXIST, "another writer created it first", self.where(path))

    def flush(self) -> None:
        """Make every object created with ``durable=False`` durable (local files: one barrier, see
        :mod:`zarrckpt.storage.durable`; other stores: nothing to do). A failed sync is never retried
        (after one, which bytes reached the disk is unknown): StorageError, and the save fails."""
        local = self.backend
        if isinstance(local, LocalBackend) and len(local.unsynced):
            self._request(
                "making durable the objects written under", "", lambda: local.flush(self.root), missing_ok=False
            )

    def _read_back(self, checked: bool) -> bool:
        """Whether to read a written object back: ``verify_writes`` True, or None (the default) and the
        write was not checked end to end on the way."""
        return self.verify_writes is True or (self.verify_writes is None and not checked)

    def _check_stored(self, full: str, parts: Sequence[Buffer]) -> None:
        """Raise UploadCorrupted (retried: the write happens again) unless the object holds ``parts``."""
        stored = self.backend.get(full, None, None)
        if bytes(stored) != b"".join(parts):
            raise UploadCorrupted(
                full, f"read back {len(stored)} bytes that differ from the {sum(map(len, parts))} sent"
            )

    def _holds(self, path: str, data: bytes) -> bool:
        """True when the object at ``path`` holds exactly ``data``."""
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def reading(self, path: str, start: int | None = None, end: int | None = None) -> Iterator[memoryview]:
        """Like :meth:`read`, as a view valid inside the ``with`` block.

        Local files are read into pooled buffers (no fresh allocation and page faults per read).
        """
        full = self._abs(path)
        held, view = self._request("reading", path, lambda: self.backend.read_view(full, start, end))
        self.traffic.add(bytes_read=len(view))
        try:
            yield view
        finally:
            view.release()
            self.backend.release(held)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order from ``offset`` (one vectored read); bytes read. Backends with
        ``vectored`` reads only (local files)."""
        full = self._abs(path)
        n = self._request("reading", path, lambda: self.backend.read_into(full, offset, buffers))
        self.traffic.add(bytes_read=n)
        return n

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object or the byte range ``[start, end)``; FileNotFoundError when absent."""
        return bytes(self._get(path, start, end))

    def _get(self, path: str, start: int | None, end: int | None) -> Any:
        """What the filesystem read: bytes, or a buffer of its own (obstore's ``Bytes``)."""
        full = self._abs(path)
        got = self._request("reading", path, lambda: self.backend.get(full, start, end))
        self.traffic.add(bytes_read=len(got))
        return got

    def _guard(self, *, fresh: bool = False) -> None:
        if self.guard is not None:
            self.guard(fresh=fresh)

    def delete(self, path: str, *, guarded: bool = True) -> None:
        """Delete one object; a missing object is fine (so is a retry of a delete that landed).
        ``guarded=False``: without the :attr:`guard` (a marker of this process's own, checked already)."""
        if guarded:
            self._guard()
        full = self._abs(path)
        with contextlib.suppress(FileNotFoundError):
            self._request("deleting", path, lambda: self.fs.rm_file(full))

    # -- concurrency ----------------------------------------------------------------------
    def run_all(
        self,
        fn: Callable[[T], R],
        items: Iterable[T],
        *,
        writing: bool = False,
        inline: Callable[[T], bool] | None = None,
    ) -> list[R]:
        """Run ``fn`` over ``items`` with bounded concurrency; results in order; re-raise the first failure.

        ``items`` is consumed as it goes (a generator planning each item is fine): at most four times
        the concurrency is taken ahead, and nothing more once an item failed, so a million items (a
        crafted manifest's shards, say) cost no more than the first failure. Items ``inline`` picks
        run on the calling thread, in their turn (small reads of local files: handing each to a
        thread costs more than the read, and the threads contend for the GIL).
        """
        return run_bounded(fn, items, self.write_concurrency if writing else self.concurrency, inline)

    def write_all(self, fn: Callable[[T], int], items: Iterable[T], size: Callable[[T], int]) -> int:
        """Run the writes ``fn`` over ``items`` (each returning the bytes it wrote) with bounded
        concurrency; their total. On local files, small writes go in runs
        (:func:`~zarrckpt.storage.concurrency.in_runs`), on the calling thread while the filesystem
        answers them fast, else to the threads (:class:`~zarrckpt.storage.concurrency.Pace`); large
        ones always to the threads; the disk starts writing them back early
        (:meth:`~zarrckpt.storage.durable.Unsynced.writing_back`)."""
        if not isinstance(self.backend, LocalBackend):
            return sum(self.run_all(fn, items, writing=True))
        pace = Pace(self.write_concurrency)
        with self.backend.writing_back():
            return sum(
                self.run_all(
                    lambda run: pace.timed(fn, run),
                    in_runs(items, size),
                    writing=True,
                    inline=lambda run: pace.inline(len(run) > 1 or size(run[0]) < SMALL_LOCAL_WRITE),
                )
            )


def _rebuild(
    url: str, options: dict[str, Any] | None, concurrency: int, retry: RetryPolicy, verify_writes: bool | None
) -> Storage:
    return Storage(url, options, concurrency=concurrency, retry=retry, verify_writes=verify_writes)
