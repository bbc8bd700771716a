"""``python -m zarrckpt``: the ``zarrckpt`` command (see :mod:`zarrckpt.cli`)."""

import sys

from zarrckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
