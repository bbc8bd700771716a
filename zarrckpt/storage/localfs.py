"""Local files without fsspec: the part of fsspec's ``LocalFileSystem`` that :class:`Storage` calls,
on os calls, so that a local checkpoint (``zarrckpt ls ./ckpt``) never imports fsspec (0.1 s of CPU).

Each method answers as fsspec's ``LocalFileSystem`` does for the same path (``tests/test_localfs.py``
compares them): paths absolute and posix, a symbolic link listed as an entry and never descended
into, FileNotFoundError for what is not there. Reads differ in one way: only regular files are
read (:func:`open_regular`); a FIFO, socket, device or directory where an object should be is a
:class:`NotAFileError` naming it, at once (fsspec would block on a FIFO, or read a device forever).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from datetime import UTC, datetime
from typing import Any

_PREFIXES = ("file://", "local://", "file:", "local:")
# O_NONBLOCK: opening a FIFO returns at once (a plain open waits for a writer, forever); no tty becomes
# this process's terminal. Reads of a regular file ignore the flag.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotAFileError(OSError):
    """A path where a checkpoint holds an object is no regular file (a FIFO, socket, device or
    directory): never read, never retried."""

    def __init__(self, path: str, mode: int | None) -> None:
        kind = next((name for test, name in _KINDS if mode is not None and test(mode)), "not a regular file")
        self.kind = kind
        super().__init__(
            errno.EINVAL,
            f"{path} is {kind}, not a regular file: a checkpoint holds only regular files, so something "
            "replaced this object; remove it, then restore the object from a copy or save the checkpoint again",
            path,
        )

    def __str__(self) -> str:
        return str(self.strerror)


def open_regular(path: str) -> tuple[int, int]:
    """A read-only file descriptor of the regular file at ``path`` (a link: what it points to), and its
    size; never blocks (O_NONBLOCK: a FIFO opens at once, and fstat then refuses it).

    Raises:
        NotAFileError: ``path`` is a FIFO, socket, device or directory.
        FileNotFoundError, PermissionError: as ``os.open``.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:  # a socket cannot be opened at all (ENXIO); say what it is
        if e.errno not in (errno.ENXIO, errno.EOPNOTSUPP):
            raise
        raise NotAFileError(path, _mode(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFileError(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _mode(path: str) -> int | None:
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


def local_path(url: str) -> str | None:
    """The absolute path a local URL names (``ckpt``, ``./ckpt``, ``~/ckpt``, ``file:///ckpt``), as
    fsspec spells it; None for every other URL (``s3://...``, ``memory://...``, chained ``a::b``)."""
    protocol, sep, _ = url.partition("://")
    if "::" in url or url.startswith("data:") or (sep and len(protocol) > 1 and protocol not in ("file", "local")):
        return None
    path = next((url.removeprefix(p) for p in _PREFIXES if url.startswith(p)), url)
    if path.startswith("~"):
        path = os.path.expanduser(path)
    elif not path.startswith("/"):
        path = f"{os.getcwd()}/{'' if path == '.' else path.removeprefix('./')}"
    return path.rstrip("/") or "/"


class LocalFiles:
    """fsspec's ``LocalFileSystem`` calls that :class:`~zarrckpt.storage.store.Storage` makes."""

    protocol = ("file", "local")

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        fd, size = open_regular(path)
        with open(fd, "rb") as f:
            if start is not None:
                f.seek(start if start >= 0 else max(0, size + start))
            if end is None:
                return f.read()
            return f.read(max(0, (end if end >= 0 else size + end) - f.tell()))

    def info(self, path: str) -> dict[str, Any]:
        st = os.stat(path)  # a link: what it points to (FileNotFoundError when that is gone)
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
        return {"name": path, "size": st.st_size, "type": kind, "mtime": st.st_mtime}

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(os.stat(path).st_mtime, tz=UTC)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)  # a dangling link: False

    def rm_file(self, path: str) -> None:
        os.remove(path)

    def ls(self, path: str, detail: bool = True, refresh: bool = True) -> list[dict[str, Any]]:
        """The entries of a directory (a file: itself), each ``{"name", "size", "type"}``.

        One call decides (no separate "is it a directory?" first): a directory another writer
        creates meanwhile is listed, never reported as an entry of itself."""
        out = []
        try:
            with os.scandir(path) as entries:
                for e in entries:
                    try:
                        out.append(_entry(e))
                    except FileNotFoundError:  # deleted while listed
                        continue
        except NotADirectoryError:
            return [self.info(path)]
        return out

    def find(self, path: str, withdirs: bool = False, detail: bool = False) -> Any:
        """Every file under ``path`` (sorted; with ``detail`` a dict of their entries), not following
        links; a file: itself; nothing there: empty."""
        found: dict[str, dict[str, Any]] = {}
        todo = [path] if os.path.isdir(path) else []
        while todo:
            try:
                listed = self.ls(todo.pop())
            except FileNotFoundError:  # deleted while listed
                continue
            for e in listed:
                if e["type"] == "directory":
                    todo.append(e["name"])
                else:
                    found[e["name"]] = e
        if not found and os.path.isfile(path):
            found[path] = self.info(path)
        return {name: found[name] for name in sorted(found)} if detail else sorted(found)

    def rm(self, path: str | list[str], recursive: bool = False) -> None:
        for p in [path] if isinstance(path, str) else path:
            if os.path.isdir(p) and not os.path.islink(p):
                if not recursive:
                    raise IsADirectoryError(f"{p} is a directory")
                shutil.rmtree(p)
            else:
                os.remove(p)

    def invalidate_cache(self, path: str | None = None) -> None:
        """(Nothing is cached.)"""


def _entry(e: os.DirEntry[str]) -> dict[str, Any]:
    """A directory entry as fsspec describes it: a link is typed by itself (never "directory"),
    sized by what it points to."""
    kind = "directory" if e.is_dir(follow_symlinks=False) else "file" if e.is_file(follow_symlinks=False) else "other"
    if not e.is_symlink():
        size = e.stat(follow_symlinks=False).st_size
    else:
        try:
            size = e.stat().st_size
        except OSError:
            size = 0  # a dangling link
    return {"name": e.path, "size": size, "type": kind}
