"""A fault-injecting fsspec filesystem for tests: ``faulty://`` wraps another filesystem (local files
by default) and fails a share of its requests with transient errors, the way a busy object store does.

Importing this module registers the protocol, so spawned child processes that import the test
module get it too. Options (``storage_options``; plain values, so they travel to children):

- ``rate``: share of requests that fail (0.05 = 5 %); ``1.0`` fails every request.
- ``seed``: which requests fail is a pure function of (seed, operation, path, how many times this
  process made that call), so runs repeat, whatever the thread interleaving.
- ``anchor``: a path prefix left out of that function (a test's tmp dir, so runs repeat across tmp dirs).
- ``fail_calls``: the first N calls of each (operation, path) fail, whatever ``rate`` says.
- ``fail_paths``: a glob; requests on matching paths always fail (``fail_with``: "transient",
  "permission" for a PermissionError or "nospace" for a full disk's ENOSPC; neither is retried).
- ``target_protocol`` / ``target_options``: the wrapped filesystem (default: local, auto_mkdir).

Faults happen before the request, or (for writes and deletes, half the time) after it has taken
effect, as when a response is lost: retries must be idempotent. Counters are per process:
:data:`FAULTS` (injected faults per operation) and :data:`CALLS` (requests per operation).
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

T = TypeVar("T")
FAULTS: Counter[str] = Counter()  # operation -> faults injected in this process
CALLS: Counter[str] = Counter()  # operation -> requests made in this process
_seen: Counter[tuple[str, str]] = Counter()  # (operation, path) -> calls so far
_lock = threading.Lock()
_MUTATING = {"pipe_file", "rm_file", "rm", "mkdir", "makedirs"}


class ServerBusy(Exception):
    """Like an HTTP client's response error for a 503 (aiohttp's ``ClientResponseError`` has ``.status``)."""

    status = 503


def reset() -> None:
    with _lock:
        FAULTS.clear()
        CALLS.clear()
        _seen.clear()


def calls_on(op: str, path_suffix: str) -> int:
    """How many ``op`` requests this process made on paths ending with ``path_suffix``."""
    with _lock:
        return sum(n for (o, p), n in _seen.items() if o == op and p.endswith(path_suffix))


def _transient(kind: int, op: str, path: str) -> Exception:
    where = f"{op} {path} (injected fault)"
    if kind == 0:
        return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer", where)
    if kind == 1:
        return TimeoutError(f"timed out: {where}")
    if kind == 2:  # what s3fs makes of S3's 503 SlowDown
        return OSError(errno.EBUSY, f"SlowDown: Please reduce your request rate: {where}")
    return ServerBusy(f"503 Service Unavailable: {where}")


class FaultyFileSystem(AbstractFileSystem):
    protocol = "faulty"
    cachable = False

    def __init__(
        self,
        rate: float = 0.05,
        seed: int = 0,
        anchor: str = "",
        fail_calls: int = 0,
        fail_paths: str | None = None,
        fail_with: str = "transient",
        target_protocol: str = "file",
        target_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.rate, self.seed, self.anchor = float(rate), int(seed), anchor
        self.fail_calls, self.fail_paths, self.fail_with = int(fail_calls), fail_paths, fail_with
        options = {"auto_mkdir": True} if target_protocol == "file" and target_options is None else target_options
        self.target = fsspec.filesystem(target_protocol, **(options or {}))

    def _draw(self, op: str, path: str) -> tuple[bool, int, bool]:
        """(fail?, error kind, fail after the request took effect?) for this call."""
        with _lock:
            n = _seen[(op, path)]
            _seen[(op, path)] += 1
            CALLS[op] += 1
        key = path[len(self.anchor) :] if self.anchor and path.startswith(self.anchor) else path
        h = hashlib.blake2b(f"{self.seed}|{op}|{key}|{n}".encode(), digest_size=8).digest()
        u = int.from_bytes(h[:6], "little") / 2.0**48
        return u < self.rate or n < self.fail_calls, h[6] % 4, op in _MUTATING and h[7] % 2 == 1

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        path = str(path)
        fail, kind, after = self._draw(op, path)
        if self.fail_paths and fnmatch.fnmatchcase(path, self.fail_paths):
            fail, after = True, False
            if self.fail_with == "permission":
                raise PermissionError(errno.EACCES, "Access Denied (injected)", path)
            if self.fail_with == "nospace":
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        if not fail:
            return fn()
        if after:
            fn()  # the request takes effect (or fails on its own: then no fault is injected)
        with _lock:
            FAULTS[op] += 1
        raise _transient(kind, op, path)

    # -- the requests zarrckpt.Storage makes (and what AbstractFileSystem builds on) ------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        return self._call("cat_file", path, lambda: self.target.cat_file(path, start=start, end=end, **kw))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        self._call("pipe_file", path, lambda: self.target.pipe_file(path, value, **kw))

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        return self._call(f"open_{mode}", path, lambda: self.target._open(path, mode=mode, **kw))

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        return self._call("info", path, lambda: self.target.info(path, **kw))

    def exists(self, path: str, **kw: Any) -> bool:
        return self._call("exists", path, lambda: self.target.exists(path, **kw))

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        return self._call("ls", path, lambda: self.target.ls(path, detail=detail, **kw))

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kw: Any) -> Any:
        return self._call("find", path, lambda: self.target.find(path, maxdepth=maxdepth, withdirs=withdirs, **kw))

    def rm_file(self, path: str) -> None:
        self._call("rm_file", path, lambda: self.target.rm_file(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._call("rm", str(path), lambda: self.target.rm(path, recursive=recursive, maxdepth=maxdepth))

    def mkdir(self, path: str, create_parents: bool = True, **kw: Any) -> None:
        self._call("mkdir", path, lambda: self.target.mkdir(path, create_parents=create_parents, **kw))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._call("makedirs", path, lambda: self.target.makedirs(path, exist_ok=exist_ok))

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


class RetryLog(logging.Handler):
    """Counts the retries zarrckpt logs (``"retrying ..."`` records on the ``zarrckpt`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("retrying "):
            with _lock:
                self.messages.append(message)

    @property
    def retries(self) -> int:
        return len(self.messages)


@contextmanager
def retry_log() -> Iterator[RetryLog]:
    """Count zarrckpt's retry log records while inside the block."""
    logger = logging.getLogger("zarrckpt")
    handler, level = RetryLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
