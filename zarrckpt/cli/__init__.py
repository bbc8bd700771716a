"""The ``zarrckpt`` command (rule: the public face only; ``--help`` imports neither torch nor fsspec).

``commands`` holds the subcommands, ``args`` what they parse, ``tensors`` the ones that read values.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the ``zarrckpt`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    from zarrckpt.cli.commands import main as run

    return run(argv)
