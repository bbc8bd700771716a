"""Preemption as a save: signal handlers that note a scheduler's warning (SIGTERM from Kubernetes or
torchrun, Slurm's ``--signal=USR1@120``) for :class:`~zarrckpt.CheckpointManager`, which saves at
the next step boundary. The handler only records the signal; everything else runs in the loop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from zarrckpt.errors import ZarrckptError

__all__ = ["SignalWatch"]


class SignalWatch:
    """Handlers for ``signals`` that record the first one received (``signalled``); ``close()``
    puts the previous handlers back. Installed from the main thread (Python runs handlers there)."""

    def __init__(self, signals: Iterable[int | signal.Signals]) -> None:
        wanted = sorted({signal.Signals(s) for s in signals})
        if threading.current_thread() is not threading.main_thread():
            raise ZarrckptError(
                "save_on=: signal handlers can only be installed from the main thread; create the "
                "CheckpointManager there (or leave save_on empty and call save(step, sd, force=True) yourself)"
            )
        self.signalled: signal.Signals | None = None
        self.previous: dict[signal.Signals, Any] = {}
        try:
            for sig in wanted:
                self.previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.close()
            raise

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is None:  # a second signal changes nothing: the save it asked for is under way
            self.signalled = signal.Signals(signum)

    def close(self) -> None:
        """Put the previous handlers back (those still ours; idempotent)."""
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
        self.previous = {}
