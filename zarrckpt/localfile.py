"""Publishing a file on local disk so no reader ever sees it half-written (os only, no fsspec)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence

Buffer = bytes | memoryview


def publish(full: str, parts: Sequence[Buffer], exclusive: bool, made: set[str]) -> bool:
    """Write ``parts`` aside and flush them to disk, then rename into place at ``full`` or,
    ``exclusive``, hard-link into place: False when the name already exists. ``made`` holds the
    directories known to exist (created here when missing)."""
    parent = os.path.dirname(full)
    if parent not in made:
        os.makedirs(parent, exist_ok=True)
        made.add(parent)
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
