"""The only module that talks to storage: local paths, file://, memory://, s3://, gs://, through the
filesystem :mod:`zarrckpt.filesystems` picks (obstore for s3:// where it can, fsspec otherwise)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from typing import Any, TypeVar

from fsspec.implementations.local import LocalFileSystem

from .errors import StorageError, ZarrckptError
from .filesystems import open_filesystem
from .localfile import Buffer, publish
from .retry import RetryPolicy, current_policy, is_transient
from .storecaps import LOCAL_FILES, OBJECT_STORE, default_concurrency
from .types import URL

log = logging.getLogger("zarrckpt")

T = TypeVar("T")
R = TypeVar("R")
# Clients whose ``pipe_file(..., mode="create")`` is an atomic create-only write on the server:
# S3 ``If-None-Match: *`` (obstore, s3fs), GCS ``ifGenerationMatch=0`` (gcsfs). fsspec's memory store
# checks when a file is opened and stores it when closed: not atomic between threads.
_ATOMIC_CREATE_CLIENTS = ("obstore", "s3fs", "gcsfs")
_warned_no_create: set[str] = set()


class Storage:
    """A checkpoint root on some fsspec filesystem; paths are relative to the root.

    Every request is retried on transient failures (see :mod:`zarrckpt.retry`); ``retry``
    defaults to :func:`zarrckpt.retry.current_policy`.
    """

    def __init__(
        self,
        url: URL,
        storage_options: dict[str, Any] | None = None,
        *,
        concurrency: int = 0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = storage_options
        if not self.url:
            raise ZarrckptError("empty checkpoint URL")
        self.fs, root, self.client = open_filesystem(self.url, storage_options)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.caps = LOCAL_FILES if self.local else OBJECT_STORE
        self.atomic_create = self.local or self.client in _ATOMIC_CREATE_CLIENTS
        self._concurrency = concurrency
        self.concurrency = concurrency or default_concurrency(self.local, writing=False)
        self.write_concurrency = concurrency or default_concurrency(self.local, writing=True)
        self._made: set[str] = set()  # local directories known to exist
        self._buffers: list[bytearray] = []  # reusable read buffers (local files)
        self._lock = threading.Lock()
        self.retry = retry or current_policy()
        self._jitter = random.Random()  # private: never perturb the global RNG a trainer checkpoints

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as its URL and options (DCP's async PROCESS mode)
        return (_rebuild, (self.url, self.storage_options, self._concurrency, self.retry))

    def child(self, name: str) -> Storage:
        """The storage of the entry ``name`` directly under the root (same options)."""
        return Storage(f"{self.url.rstrip('/')}/{name}", self.storage_options, retry=self.retry)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def where(self, path: str) -> str:
        """A human-readable location for error messages."""
        return f"{self.url.rstrip('/')}/{path}"

    def _request(self, what: str, path: str, fn: Callable[[], T], *, missing_ok: bool = True) -> T:
        """Run one storage request, retrying transient failures with backoff; failures become
        StorageError, except FileNotFoundError, which passes (unretried) when ``missing_ok``."""
        policy = self.retry
        for attempt in range(1, policy.attempts + 1):
            try:
                return fn()
            except FileNotFoundError as e:
                if missing_ok:
                    raise
                raise StorageError(f"{what} {self.where(path)} failed: {e} (does the bucket/directory exist?)") from e
            except Exception as e:
                if not is_transient(e):
                    if isinstance(e, (OSError, RuntimeError, ValueError)):
                        raise StorageError(f"{what} {self.where(path)} failed: {type(e).__name__}: {e}") from e
                    raise
                if attempt == policy.attempts:
                    tries = f"{attempt} attempts" if attempt > 1 else "1 attempt (retries are off)"
                    raise StorageError(
                        f"{what} {self.where(path)} failed after {tries}: {type(e).__name__}: {e}"
                    ) from e
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
    def write(self, path: str, parts: Sequence[Buffer], *, create_only: bool = False) -> None:
        """Write one object from its parts; remote stores get exactly one PUT (per attempt).

        A retried write rewrites the whole object, so a write that failed after it landed is harmless.
        ``create_only``: fail with FileExistsError when the object already exists with other
        content, atomically on stores that can (local files, S3, GCS); elsewhere the check
        and the write are two requests (see :meth:`create`).
        """
        if create_only:
            self.create(path, parts)
            return
        full = self._abs(path)
        if self.local:
            self._request("writing", path, lambda: publish(full, parts, False, self._made), missing_ok=False)
        else:
            data = b"".join(parts)
            self._request("writing", path, lambda: self.fs.pipe_file(full, data), missing_ok=False)

    def create(self, path: str, parts: Sequence[Buffer]) -> None:
        """Write a new object, or raise FileExistsError when another writer's object is already there.

        Exactly one of several racing creators succeeds on stores with create-only writes (local
        files: a hard link; S3: ``If-None-Match: *``; GCS: ``ifGenerationMatch=0``). A create that
        finds the object already holding *these* bytes succeeds: it is a retry of a write that
        landed. Elsewhere a logged warning says the check is not atomic.
        """
        full = self._abs(path)
        if self.local:
            if self._request("creating", path, lambda: publish(full, parts, True, self._made), missing_ok=False):
                return
            data = b"".join(parts)
        elif self.atomic_create:
            data = b"".join(parts)
            if self._request("creating", path, lambda: self._create_remote(full, data), missing_ok=False):
                return
        else:
            data = b"".join(parts)
            name = type(self.fs).__name__
            if name not in _warned_no_create:
                _warned_no_create.add(name)
                log.warning(
                    "%s has no create-only writes: two saves racing to one location are told apart by a check "
                    "followed by a write, which is not atomic",
                    name,
                )
            if not self.exists(path):
                self._request("writing", path, lambda: self.fs.pipe_file(full, data), missing_ok=False)
                return
        if not self._holds(path, data):
            raise FileExistsError(errno.EEXIST, "another writer created it first", self.where(path))

    def _create_remote(self, full: str, data: bytes) -> bool:
        """One create-only PUT; False when the store refused it because the object exists."""
        try:
            self.fs.pipe_file(full, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:  # s3fs turns some servers' 412 (Ceph RGW) into OSError(EINVAL)
            if e.errno != errno.EINVAL:
                raise
            if self.fs.exists(full):
                return False
            # Measured on Ceph RGW: a create racing another can be refused before the other's
            # object is visible; try again (transient: retried with backoff) until one of them is.
            raise OSError(errno.EAGAIN, f"create refused ({e}), yet no object is there: a racing create?") from e
        return True

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
        if not self.local:
            yield memoryview(self._get(path, start, end))  # obstore's buffer as it came: no copy
            return

        def fill() -> tuple[bytearray, int]:
            with open(self._abs(path), "rb") as f:
                lo = start or 0
                nbytes = max(0, (os.fstat(f.fileno()).st_size if end is None else end) - lo)
                buf = self._take_buffer(nbytes)
                try:
                    f.seek(lo)
                    with memoryview(buf) as view:
                        return buf, f.readinto(view[:nbytes])
                except BaseException:
                    self._give_buffer(buf)
                    raise

        buf, n = self._request("reading", path, fill)
        try:
            view = memoryview(buf)
            yield view[:n]
            view.release()
        finally:
            self._give_buffer(buf)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Local files only: fill ``buffers`` in order from ``offset`` (one vectored read); bytes read."""

        def fill() -> int:
            fd = os.open(self._abs(path), os.O_RDONLY)
            try:
                total = 0
                for i in range(0, len(buffers), 512):  # stay under IOV_MAX
                    batch = buffers[i : i + 512]
                    n = os.preadv(fd, batch, offset + total)
                    total += n
                    if n < sum(len(b) for b in batch):
                        break
                return total
            finally:
                os.close(fd)

        return self._request("reading", path, fill)

    def _take_buffer(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if len(buf) >= nbytes:
                    return self._buffers.pop(i)
            if self._buffers:
                self._buffers.pop(0)  # too small: let it go
        return bytearray(nbytes)

    def _give_buffer(self, buf: bytearray) -> None:
        with self._lock:
            self._buffers.append(buf)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object or the byte range ``[start, end)``; FileNotFoundError when absent."""
        return bytes(self._get(path, start, end))

    def _get(self, path: str, start: int | None, end: int | None) -> Any:
        """What the filesystem read: bytes, or a buffer of its own (obstore's ``Bytes``)."""
        full = self._abs(path)
        return self._request("reading", path, lambda: self.fs.cat_file(full, start=start, end=end))

    def age(self, path: str) -> float | None:
        """Seconds since the object at ``path`` was last modified (None if absent or unknown)."""
        full = self._abs(path)
        try:
            stamp: datetime = self._request("checking", path, lambda: self.fs.modified(full))
        except (FileNotFoundError, NotImplementedError, StorageError):
            return None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=UTC)
        return (datetime.now(UTC) - stamp).total_seconds()

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        return bool(self._request("checking", path, lambda: self.fs.exists(full)))

    def delete(self, path: str) -> None:
        """Delete one object; a missing object is fine (so is a retry of a delete that landed)."""
        full = self._abs(path)
        with contextlib.suppress(FileNotFoundError):
            self._request("deleting", path, lambda: self.fs.rm_file(full))

    def is_empty(self) -> bool:
        """True when nothing is stored under the root: the first entry found answers (object stores:
        one listing of the root's direct entries, however many objects lie below them)."""
        if self.local:  # the root may itself be a file (a 0-d array's chunk "c")
            return not os.path.isfile(self.root) and not any(files for _, _, files in os.walk(self.root))
        try:
            return not self._request("listing", "", lambda: self.fs.ls(self.root, detail=False, refresh=True))
        except FileNotFoundError:
            return True

    def names(self) -> set[str]:
        """The entries directly under the root (one listing request)."""
        return set(self.children())

    def children(self) -> list[str]:
        """Names of the entries directly under the root (sorted; empty when the root is absent)."""
        try:
            entries = self._request("listing", "", lambda: self.fs.ls(self.root, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def delete_all(self, keep: Collection[str] = ()) -> None:
        """Delete everything under the root but the objects ``keep`` names (the root may remain).

        With ``keep``, the rest is listed and deleted in batches; the kept objects stay, so a
        marker written first can say what the prefix is until the very end.
        """
        kept = {self._abs(k) for k in keep}
        if keep:
            doomed = sorted(self._objects() - kept)
            if doomed:
                with contextlib.suppress(FileNotFoundError):
                    self._request("deleting", "", lambda: self.fs.rm(doomed))
            self.prune()
        else:
            with contextlib.suppress(FileNotFoundError):
                self._request("deleting", "", lambda: self.fs.rm(self.root, recursive=True))
        self.fs.invalidate_cache()
        self._made.clear()
        # One listing more: a bulk delete can answer 200 and refuse some keys, which s3fs ignores.
        left = sorted(self._objects() - kept) if keep else ([] if self.is_empty() else sorted(self._objects()))
        if left:
            raise StorageError(
                f"deleting {self.where('')} left {len(left)} object(s) the store did not delete, e.g. "
                f"{left[0]!r}: check the delete permission (s3:DeleteObject) and retry"
            )

    def _objects(self) -> set[str]:
        """Every object under the root (full paths on the filesystem)."""
        try:
            return set(map(str, self._request("listing", "", lambda: self.fs.find(self.root, withdirs=False))))
        except FileNotFoundError:
            return set()

    def prune(self) -> None:
        """Local files: remove the directories left empty under the root, and the root if empty."""
        if not self.local or not os.path.isdir(self.root):
            return
        for parent, dirs, _ in os.walk(self.root, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, d))
        with contextlib.suppress(OSError):
            os.rmdir(self.root)
        self._made.clear()

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) stored under the root."""
        try:
            found = self._request("listing", "", lambda: self.fs.find(self.root, withdirs=False, detail=True))
        except FileNotFoundError:
            return 0, 0
        return len(found), sum(int(info.get("size") or 0) for info in found.values())

    # -- concurrency ----------------------------------------------------------------------
    def run_all(self, fn: Callable[[T], R], items: Iterable[T], *, writing: bool = False) -> list[R]:
        """Run ``fn`` over ``items`` with bounded concurrency; results in order; re-raise the first failure."""
        items = list(items)
        limit = min(self.write_concurrency if writing else self.concurrency, len(items))
        if limit <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="zarrckpt") as pool:
            futures: list[Future[R]] = [pool.submit(fn, item) for item in items]
            wait(futures, return_when=FIRST_EXCEPTION)
            for fut in futures:  # after a failure, start nothing more
                fut.cancel()
        for fut in futures:
            error = None if fut.cancelled() else fut.exception()
            if error is not None:
                raise error
        return [f.result() for f in futures]


def _rebuild(url: str, options: dict[str, Any] | None, concurrency: int, retry: RetryPolicy) -> Storage:
    return Storage(url, options, concurrency=concurrency, retry=retry)
