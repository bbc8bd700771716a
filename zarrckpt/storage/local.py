"""The local-files backend: whole files published atomically, pooled and vectored reads (os calls).

A file is written aside, flushed to disk, then renamed into place (or, for a create, hard-linked from a
file without a name where the filesystem has them: "exists" when the name is taken; :class:`Storage` then
flushes its directory), so no reader ever sees it half-written. A save's shards and ``zarr.json``
documents instead go straight to their names, made durable by one barrier before the commit
(:mod:`zarrckpt.storage.durable`).
Listing, deleting and the rest go through :class:`~zarrckpt.storage.localfs.LocalFiles` (os calls).
Every read opens through :func:`~zarrckpt.storage.localfs.open_regular`: a FIFO, socket, device or
directory in place of an object is an error naming it, never a read that blocks or never ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from zarrckpt.storage.caps import LOCAL_FILES, NameLimits, ReadCaps
from zarrckpt.storage.durable import Unsynced, make_dirs, sync_path, write_parts
from zarrckpt.storage.localfs import open_regular

Buffer = bytes | memoryview


class LocalBackend:
    """Local files under :class:`~zarrckpt.storage.localfs.LocalFiles` ``fs``, with os-level fast paths."""

    caps: ReadCaps = LOCAL_FILES
    atomic_create = True  # a hard link fails when the name exists
    vectored = True  # read_into: preadv straight into the caller's buffers

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._made: set[str] = set()  # directories known to exist
        self._buffers: list[bytearray] = []  # reusable read buffers
        self._lock = threading.Lock()
        self.unsynced = Unsynced()  # files created without a flush, until :meth:`flush`

    def name_limits(self, root: str) -> NameLimits:
        """The filesystem's NAME_MAX and PATH_MAX where ``root`` is (or would be)."""
        probe = root
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)  # the nearest directory that exists decides
        try:
            name_max, path_max = os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
        except (OSError, ValueError):
            name_max, path_max = 255, 4096
        return NameLimits("local files", len(root.encode()), name_max, path_max, len(".0123456789ab.tmp"))

    def write(self, full: str, parts: Sequence[Buffer]) -> bool:
        """Write a file (flushed to disk before it is published); True: nothing crossed a network."""
        publish(full, parts, False, self._made)
        return True

    def create(self, full: str, parts: Sequence[Buffer], durable: bool = True) -> bool | None:
        """Write a new file: None (nothing written) when ``full`` already exists, else True.
        ``durable=False``: straight to its name, durable only after :meth:`flush` (a save's objects,
        inside its pending checkpoint)."""
        if durable:
            return True if publish(full, parts, True, self._made) else None
        return True if self.unsynced.create(full, parts, self._made) else None

    def writing_back(self) -> contextlib.AbstractContextManager[None]:
        """A batch of writes during which write-back starts early (:meth:`Unsynced.writing_back`)."""
        return self.unsynced.writing_back()

    def flush(self, root: str) -> None:
        """Make every file created with ``durable=False`` durable: one barrier."""
        self.unsynced.flush(root)

    def settle(self, full: str) -> None:
        """Flush the directory holding ``full`` (a new commit record or marker: its name survives a crash)."""
        sync_path(os.path.dirname(full), data_only=False)

    def get(self, full: str, start: int | None, end: int | None) -> Any:
        return self.fs.cat_file(full, start=start, end=end)

    def stored(self, full: str) -> bytes | None:
        """The file as stored, read back whole."""
        return bytes(self.fs.cat_file(full))

    def read_view(self, full: str, start: int | None, end: int | None) -> tuple[bytearray | None, memoryview]:
        """The bytes ``[start, end)`` of a file in a pooled buffer: (the buffer, to hand back with
        :meth:`release`; a view of the bytes read). No fresh allocation and page faults per read."""
        fd, size = open_regular(full)
        try:
            lo = start or 0
            nbytes = max(0, (size if end is None else min(end, size)) - lo)  # the file's bytes, not what was asked
            buf = self._take_buffer(nbytes)
            try:
                with memoryview(buf) as view:
                    n = _pread_into(fd, view[:nbytes], lo)
            except BaseException:
                self.release(buf)
                raise
        finally:
            os.close(fd)
        return buf, memoryview(buf)[:n]

    def release(self, buf: bytearray | None) -> None:
        """Hand back a buffer :meth:`read_view` returned."""
        if buf is not None:
            with self._lock:
                self._buffers.append(buf)

    def read_into(self, full: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order from ``offset`` (one vectored read per 512); bytes read."""
        fd, _ = open_regular(full)
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

    def is_empty(self, root: str) -> bool:
        """No file under ``root`` (which may itself be a file: a 0-d array's chunk ``c``)."""
        return not os.path.isfile(root) and not any(files for _, _, files in os.walk(root))

    def prune(self, root: str) -> None:
        """Remove the directories left empty under ``root``, and ``root`` if empty."""
        if not os.path.isdir(root):
            return
        for parent, dirs, _ in os.walk(root, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, d))
        with contextlib.suppress(OSError):
            os.rmdir(root)
        self._made.clear()

    def forget(self) -> None:
        """Drop what is known about the directory tree (after a deletion)."""
        self.fs.invalidate_cache()
        self._made.clear()
        self.unsynced.forget()

    def _take_buffer(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if len(buf) >= nbytes:
                    return self._buffers.pop(i)
            if self._buffers:
                self._buffers.pop(0)  # too small: let it go
        return bytearray(nbytes)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` of ``fd`` (a read returns at most ~2 GiB: as many as it takes);
    the bytes read, fewer at the end of the file."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def publish(full: str, parts: Sequence[Buffer], exclusive: bool, made: set[str]) -> bool:
    """Write ``parts`` aside and flush them to disk, then rename into place at ``full`` or,
    ``exclusive``, hard-link into place: False when the name already exists. ``made`` holds the
    directories known to exist (created here when missing). An exclusive write goes through a file
    with no name (``O_TMPFILE``) where the filesystem has them, so a process killed half-way leaves
    nothing; elsewhere through a temporary name, which such a kill leaves behind."""
    parent = os.path.dirname(full)
    make_dirs(parent, made)
    if exclusive:
        linked = _publish_unnamed(parent, full, parts)
        if linked is not None:
            return linked
    tmp = f"{full}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        (os.link if exclusive else os.replace)(tmp, full)
        return True
    except FileExistsError:
        if not exclusive:
            raise
        return False
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


_UNNAMED = {"works": hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")}
# what a system without unnamed files (or without /proc) answers; EISDIR: kernels before 3.11
_NO_UNNAMED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.EPERM, errno.EXDEV)


def _publish_unnamed(parent: str, full: str, parts: Sequence[Buffer]) -> bool | None:
    """Write ``parts`` to a file without a name in ``parent``, flush it, link it as ``full``: True,
    or False when the name exists; None when this filesystem (or this system) has no unnamed files
    (the caller writes under a temporary name, and from then on so does every call)."""
    if not _UNNAMED["works"]:
        return None
    try:
        fd = os.open(parent, os.O_TMPFILE | os.O_WRONLY, 0o666)
    except OSError as e:
        _without_unnamed(parent, e)
        return None
    try:
        write_parts(fd, parts)
        os.fsync(fd)
        into = os.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) of the /proc link needs no privilege (os.link makes it one with a dir fd)
            os.link(f"/proc/self/fd/{fd}", os.path.basename(full), dst_dir_fd=into)
        except FileExistsError:
            return False
        except OSError as e:
            _without_unnamed(parent, e)
            return None
        finally:
            os.close(into)
        return True
    finally:
        os.close(fd)


def _without_unnamed(parent: str, e: OSError) -> None:
    """An unnamed file failed with ``e``: raise it, unless this system has none (then no call tries again)."""
    if e.errno not in _NO_UNNAMED or not os.path.isdir(parent):
        raise e
    _UNNAMED["works"] = False
