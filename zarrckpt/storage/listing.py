"""What is stored under a checkpoint root, and bulk deletion: the half of
:class:`~zarrckpt.storage.store.Storage` that asks rather than reads or writes: one object's size,
age and existence, the entries directly under the root, every object below it with its size, and
deleting all of them but the ones kept (batched, checked by a last listing)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from zarrckpt.errors import StorageError
from zarrckpt.storage.retry import missing_bucket

if TYPE_CHECKING:
    from zarrckpt.storage.local import LocalBackend
    from zarrckpt.storage.remote import RemoteBackend

T = TypeVar("T")
R = TypeVar("R")


class Listing:
    """Mixed into :class:`~zarrckpt.storage.store.Storage`, whose requests (retried, counted, guarded)
    it makes."""

    root: str
    fs: Any
    client: str
    backend: LocalBackend | RemoteBackend

    if TYPE_CHECKING:  # Storage's

        def _request(self, what: str, path: str, fn: Callable[[], T], *, missing_ok: bool = True) -> T: ...
        def _abs(self, path: str) -> str: ...
        def _guard(self, *, fresh: bool = False) -> None: ...
        def where(self, path: str) -> str: ...
        def no_bucket(self) -> str: ...
        def delete(self, path: str, *, guarded: bool = True) -> None: ...
        def run_all(
            self,
            fn: Callable[[T], R],
            items: Iterable[T],
            *,
            writing: bool = False,
            inline: Callable[[T], bool] | None = None,
        ) -> list[R]: ...

    def modified(self, path: str) -> datetime | None:
        """When the store last saw the object at ``path`` written, in UTC (None if absent or unknown)."""
        full = self._abs(path)
        try:
            stamp: datetime = self._request("checking", path, lambda: self.fs.modified(full))
        except (FileNotFoundError, NotImplementedError, StorageError):
            return None
        return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp

    def age(self, path: str) -> float | None:
        """Seconds since the object at ``path`` was last modified (None if absent or unknown)."""
        stamp = self.modified(path)
        return None if stamp is None else (datetime.now(UTC) - stamp).total_seconds()

    def size(self, path: str) -> int:
        """The size in bytes of the object at ``path``; FileNotFoundError when absent."""
        full = self._abs(path)
        return int(self._request("checking", path, lambda: self.fs.info(full)["size"]))

    def listed_itself(self, entries: dict[str, int | None]) -> bool:
        """Whether ``entries``, this root's listing, is the root itself: an object (a file), which a
        listing names as its only entry (one request more, only for a listing of one object so named)."""
        name = self.root.rsplit("/", 1)[-1]
        if set(entries) != {name} or entries[name] is None:
            return False
        try:
            info = self._request("checking", "", lambda: self.fs.info(self.root))
        except FileNotFoundError:
            return False
        return bool(info.get("type") == "file")

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        return bool(self._request("checking", path, lambda: self.fs.exists(full)))

    def is_empty(self) -> bool:
        """True when nothing is stored under the root: the first entry found answers (object stores:
        one listing of the root's direct entries, however many objects lie below them)."""
        return self._listing(lambda: self.backend.is_empty(self.root)) in (None, True)

    def names(self) -> set[str]:
        """The entries directly under the root (one listing request)."""
        return set(self.children())

    def children(self) -> list[str]:
        """Names of the entries directly under the root (sorted; empty when the root is absent)."""
        return sorted(self.entries())

    def entries(self) -> dict[str, int | None]:
        """The entries directly under the root: name -> size of an object, None for a directory (one
        listing request; empty when the root is absent; StorageError when its bucket is)."""
        found = self._listing(lambda: self.fs.ls(self.root, detail=True, refresh=True))
        if found is None:
            return {}
        out: dict[str, int | None] = {}
        for e in found:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if name:
                out[name] = None if e.get("type") == "directory" else int(e.get("size") or 0)
        return out

    def _listing(self, fn: Callable[[], T]) -> T | None:
        """A listing of the root; None when nothing is there. A bucket that does not exist is no empty
        listing but a StorageError: whatever goes on to write there would fail, later."""
        try:
            return self._request("listing", "", fn)
        except FileNotFoundError as e:
            if missing_bucket(e):
                raise StorageError(f"listing {self.where('')} failed: {self.no_bucket()}") from e
            return None

    def delete_all(self, keep: Collection[str] = (), *, check: bool = True) -> list[str]:
        """Delete everything under the root but the objects ``keep`` names (the root may remain).

        With ``keep``, the rest is listed and deleted in batches; the kept objects stay, so a
        marker written first can say what the prefix is until the very end. A last listing tells
        what is left (a key a bulk delete refused inside a 200 answer, an object written meanwhile):
        a StorageError names it, or, without ``check``, the paths left are returned.
        """
        kept = {self._abs(k) for k in keep}
        if keep or self.client == "gcsfs":
            doomed = sorted(self._objects() - kept)
            if doomed and self.client == "gcsfs":  # gcsfs's batch delete retries with jitter from
                # Python's global random generator (a local `import random` in GCSFileSystem._rm_files),
                # which a run's data order may depend on: one DELETE per object, retried here instead
                self.run_all(lambda full: self.delete(full[len(self.root) :].lstrip("/")), doomed, writing=True)
            elif doomed:
                self._guard()
                with contextlib.suppress(FileNotFoundError):
                    self._request("deleting", "", lambda: self.fs.rm(doomed))
            self.prune()
        else:
            self._guard()
            with contextlib.suppress(FileNotFoundError):
                self._request("deleting", "", lambda: self.fs.rm(self.root, recursive=True))
        self.backend.forget()
        # One listing more: a bulk delete can answer 200 and refuse some keys, which s3fs ignores.
        left = sorted(self._objects() - kept) if keep else ([] if self.is_empty() else sorted(self._objects()))
        if not check:
            return [full[len(self.root) :].lstrip("/") for full in left]
        if left:
            raise StorageError(
                f"deleting {self.where('')} left {len(left)} object(s) the store did not delete, e.g. "
                f"{left[0]!r}: check the delete permission (s3:DeleteObject) and retry"
            )
        return []

    def _objects(self) -> set[str]:
        """Every object under the root (full paths on the filesystem)."""
        found = self._listing(lambda: self.fs.find(self.root, withdirs=False))
        return set() if found is None else set(map(str, found))

    def prune(self) -> None:
        """Remove the directories left empty under the root, and the root if empty (local files;
        object stores have none)."""
        self.backend.prune(self.root)

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) stored under the root."""
        sizes = self.sizes()
        return len(sizes), sum(sizes.values())

    def sizes(self) -> dict[str, int]:
        """Every object under the root (its path relative to the root: ``""`` for the root itself) and
        its size in bytes: one recursive listing (one request per page of objects on object stores)."""
        found = self._listing(lambda: self.fs.find(self.root, withdirs=False, detail=True))
        if found is None:
            return {}
        out = {}
        for name, info in found.items():
            rel = str(name).rstrip("/")[len(self.root) :].lstrip("/")
            out[rel] = int(info.get("size") or 0)
        return out
