"""The only module that talks to storage (fsspec): local paths, file://, memory://, s3://, gs://."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import StorageError, ZarrckptError

T = TypeVar("T")
R = TypeVar("R")
REMOTE_CONCURRENCY = 16  # object stores are latency-bound: many requests in flight
LOCAL_CONCURRENCY = 4  # local disks are CPU/memcpy-bound: more threads than cores only contend


def default_concurrency(local: bool) -> int:
    """Requests in flight per rank: ``$ZARRCKPT_CONCURRENCY``, else a default per storage kind."""
    env = os.environ.get("ZARRCKPT_CONCURRENCY", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return min(LOCAL_CONCURRENCY, os.cpu_count() or 1) if local else REMOTE_CONCURRENCY


Buffer = bytes | memoryview


class Storage:
    """A checkpoint root on some fsspec filesystem; paths are relative to the root."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        concurrency: int = 0,
    ) -> None:
        self.url = os.fspath(url)
        if not self.url:
            raise ZarrckptError("empty checkpoint URL")
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ValueError, ImportError, TypeError) as e:
            raise ZarrckptError(f"cannot open storage for {self.url!r}: {e}") from e
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.concurrency = concurrency or default_concurrency(self.local)
        self._made: set[str] = set()  # local directories known to exist
        self._buffers: list[bytearray] = []  # reusable read buffers (local files)
        self._lock = threading.Lock()

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def where(self, path: str) -> str:
        """A human-readable location for error messages."""
        return f"{self.url.rstrip('/')}/{path}"

    @contextlib.contextmanager
    def _failing(self, what: str, path: str, *, missing_ok: bool = True) -> Iterator[None]:
        """Turn storage failures into StorageError; FileNotFoundError passes when ``missing_ok``."""
        try:
            yield
        except FileNotFoundError as e:
            if missing_ok:
                raise
            raise StorageError(f"{what} {self.where(path)} failed: {e} (does the bucket/directory exist?)") from e
        except (OSError, RuntimeError, ValueError) as e:
            raise StorageError(f"{what} {self.where(path)} failed: {type(e).__name__}: {e}") from e

    # -- single objects -------------------------------------------------------------------
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Write one object from its parts; remote stores get exactly one PUT."""
        with self._failing("writing", path, missing_ok=False):
            self._write(self._abs(path), parts)

    def _write(self, full: str, parts: Sequence[Buffer]) -> None:
        if self.local:  # write aside, flush to disk, then rename: never a half-written file
            parent = os.path.dirname(full)
            if parent not in self._made:
                os.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            tmp = f"{full}.{uuid.uuid4().hex[:12]}.tmp"
            try:
                with open(tmp, "wb") as f:
                    for p in parts:
                        f.write(p)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, full)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        else:
            self.fs.pipe_file(full, b"".join(parts))

    @contextlib.contextmanager
    def reading(self, path: str, start: int | None = None, end: int | None = None) -> Iterator[memoryview]:
        """Like :meth:`read`, as a view valid inside the ``with`` block.

        Local files are read into pooled buffers (no fresh allocation and page faults per read).
        """
        if not self.local:
            yield memoryview(self.read(path, start, end))
            return
        with self._failing("reading", path):
            f = open(self._abs(path), "rb")  # noqa: SIM115 - closed below
        with f:
            lo = start or 0
            hi = os.fstat(f.fileno()).st_size if end is None else end
            buf = self._take_buffer(max(0, hi - lo))
            try:
                f.seek(lo)
                view = memoryview(buf)
                n = f.readinto(view[: max(0, hi - lo)])
                yield view[:n]
                view.release()
            finally:
                with self._lock:
                    self._buffers.append(buf)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Local files only: fill ``buffers`` in order from ``offset`` (one vectored read); bytes read."""
        with self._failing("reading", path):
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

    def _take_buffer(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if len(buf) >= nbytes:
                    return self._buffers.pop(i)
            if self._buffers:
                self._buffers.pop(0)  # too small: let it go
        return bytearray(nbytes)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object or the byte range ``[start, end)``; FileNotFoundError when absent."""
        with self._failing("reading", path):
            data = self.fs.cat_file(self._abs(path), start=start, end=end)
        return bytes(data)

    def exists(self, path: str) -> bool:
        with self._failing("checking", path):
            return bool(self.fs.exists(self._abs(path)))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._failing("deleting", path):
            self.fs.rm_file(self._abs(path))

    def is_empty(self) -> bool:
        """True when nothing is stored under the root."""
        try:
            with self._failing("listing", ""):
                return not self.fs.find(self.root, maxdepth=None, withdirs=False)
        except FileNotFoundError:
            return True

    def delete_all(self) -> None:
        """Delete everything under the root (the root itself may remain, empty)."""
        with contextlib.suppress(FileNotFoundError), self._failing("deleting", ""):
            self.fs.rm(self.root, recursive=True)
        self.fs.invalidate_cache()
        self._made.clear()

    # -- concurrency ----------------------------------------------------------------------
    def run_all(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """Run ``fn`` over ``items`` with bounded concurrency; results in order; re-raise the first failure."""
        items = list(items)
        if len(items) <= 1 or self.concurrency == 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items)), thread_name_prefix="zarrckpt") as pool:
            futures: list[Future[R]] = [pool.submit(fn, item) for item in items]
            wait(futures, return_when=FIRST_EXCEPTION)
            for fut in futures:  # after a failure, start nothing more
                fut.cancel()
        for fut in futures:
            error = None if fut.cancelled() else fut.exception()
            if error is not None:
                raise error
        return [f.result() for f in futures]
