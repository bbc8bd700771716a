"""A value on its way: what a lazy read of a tensor does not have yet when its data read starts
(its committed chunk checksums, :mod:`zarrckpt.format.integrity`). No I/O of its own: it runs the
fetch it is given on a thread of its own, once started, and hands the result to whoever waits."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Deferred:
    """An array's committed chunk checksums on their way: a lazy read fetches its segment of the
    chunk checksum table beside its first data read (:meth:`start`, one round trip), and the first
    chunk check waits for it (:meth:`get`). A failed fetch is raised, and tried again next time."""

    def __init__(self, fetch: Callable[[], bytes]) -> None:
        self._fetch = fetch
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: bytes | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None and self._result is None:
                self._error = None
                self._thread = threading.Thread(target=self._run, name="zarrckpt-crc32c", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fetch()
        except BaseException as e:  # handed to get(), on the reading thread
            self._error = e

    def get(self) -> bytes:
        self.start()
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if self._result is not None:
                return self._result
            error, self._thread = self._error, None  # (fetched again next time)
        assert error is not None
        raise error

    def __bool__(self) -> bool:  # a record exists
        return True


__all__ = ["Deferred"]
