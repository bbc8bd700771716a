"""The clocks of the commit protocol: wall time for marker times and ages, a monotonic clock for
deadlines, and the waits of heartbeats and of a restarted job.

Real clocks; the protocol model in the tests (``tests/protocol_model.py``) swaps in virtual ones so
that it can explore leases running out between any two requests.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime


def wall() -> datetime:
    """Now, in UTC (marker times; compared with the store's modification times)."""
    return datetime.now(UTC)


def monotonic() -> float:
    """Seconds on a clock that never goes back (deadlines and check periods)."""
    return time.monotonic()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def wait(event: threading.Event, seconds: float) -> bool:
    """Wait until ``event`` is set (True) or ``seconds`` have passed (False)."""
    return event.wait(seconds)


def relying_until(deadline: float) -> None:
    """The calling thread's next request relies on a check that holds until ``deadline`` (on
    :func:`monotonic`): it must reach the store before then. Nothing to do with real clocks (the
    protocol's assumption: no process pauses for HEARTBEAT_SECONDS between a check and the request
    relying on it); the protocol model lets no virtual time pass beyond it meanwhile."""
