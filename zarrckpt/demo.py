"""``python -m zarrckpt.demo``: runs the demo, :mod:`zarrckpt.example.demo`."""

from __future__ import annotations

import sys

from .example.demo import main

if __name__ == "__main__":
    sys.exit(main())
