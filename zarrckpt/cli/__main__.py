"""``python -m zarrckpt.cli``: the ``zarrckpt`` command."""

from __future__ import annotations

import sys

from zarrckpt.cli import main

sys.exit(main())
