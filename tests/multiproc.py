"""Run a function on N real processes joined by a gloo process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarrckpt.launch import free_port, spawn

__all__ = ["free_port", "run_ranks"]


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; raises if any of them fails."""
    spawn(world, fn, *args)
