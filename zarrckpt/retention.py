"""Which checkpoints :class:`~zarrckpt.CheckpointManager`'s retention keeps (pure, but for reading
metrics back from manifests): the ``keep_last`` newest, every ``keep_every``-th step, and with
``keep_best`` the best ``keep_best`` by a metric saved with each checkpoint.

The metrics a ``save(step, sd, metrics={...})`` is given are saved in the checkpoint itself, as the
plain value ``zarrckpt_manager.metrics`` (a list of ``[name, number]`` pairs: metric names may hold
``/``, which a key may not; rank 0's metrics, as retention runs on rank 0), so a restarted job's
retention ranks the old checkpoints too: it reads each one's manifest head once
(:func:`zarrckpt.lifecycle.read_head`). A load into a state dict without a ``zarrckpt_manager``
entry ignores it, strict or not.

A checkpoint without the ranked metric (saved without ``metrics``, or with a NaN or infinite value)
is not ranked: it is kept while it is among the ``keep_last`` newest (or a ``keep_every`` step), and
deleted after that like any other, with a WARNING saying so. A checkpoint whose manifest cannot be
read is kept.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zarrckpt.errors import ZarrckptError
from zarrckpt.lifecycle import read_head

log = logging.getLogger("zarrckpt")

__all__ = ["METRICS_KEY", "BestMode", "Policy", "SavedMetrics", "metrics_of", "numbers", "with_metrics"]

BestMode = Literal["min", "max"]
METRICS_TOP, METRICS_SUB = "zarrckpt_manager", "metrics"
METRICS_KEY = f"{METRICS_TOP}.{METRICS_SUB}"  # the flat key of the saved metrics


def with_metrics(state_dict: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` plus ``metrics`` under ``zarrckpt_manager.metrics`` (numbers as floats; NaN and
    infinities as None: not ranked).

    Raises:
        ZarrckptError: ``state_dict`` has a ``zarrckpt_manager`` entry of its own, or a metric is no
            number (a 0-d tensor or numpy scalar counts as one).
    """
    if METRICS_TOP in state_dict:
        raise ZarrckptError(f"save(..., metrics=...): the state dict has a {METRICS_TOP!r} entry, where they go")
    return {**state_dict, METRICS_TOP: {METRICS_SUB: [[k, v] for k, v in numbers(metrics).items()]}}


def numbers(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """``metrics`` as floats (NaN and infinities: None); ZarrckptError for a value that is no number."""
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError) as e:  # (RuntimeError: a tensor of more than one element)
            raise ZarrckptError(f"save(..., metrics=...): {name!r} is not a number ({type(value).__name__})") from e
        out[str(name)] = number if math.isfinite(number) else None
    return out


def metrics_of(values: Mapping[str, Any]) -> dict[str, float | None]:
    """The metrics saved with a checkpoint, from its manifest's values (empty: none saved)."""
    pairs = values.get(METRICS_KEY)
    if not isinstance(pairs, list):
        return {}
    out: dict[str, float | None] = {}
    for pair in pairs:
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
            value = pair[1]
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            out[pair[0]] = float(value) if ok else None
    return out


@dataclass(frozen=True)
class Policy:
    """What to keep: see the module's docstring."""

    keep_last: int
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: BestMode = "min"

    def check(self, interval: int) -> None:
        """Raises ZarrckptError for values that make no policy (or no ``interval``)."""
        if interval < 1 or self.keep_last < 1 or (self.keep_every is not None and self.keep_every < 1):
            raise ZarrckptError("CheckpointManager: interval and keep_last must be >= 1 (keep_every too, if given)")
        if self.keep_best is not None and (self.keep_best < 1 or not self.best_metric):
            raise ZarrckptError("CheckpointManager: keep_best must be >= 1 and comes with best_metric, a metric's name")
        if self.best_mode not in ("min", "max"):
            raise ZarrckptError(f"CheckpointManager: best_mode must be 'min' or 'max', not {self.best_mode!r}")

    def keep(self, steps: Iterable[int], metrics: Mapping[int, float | None], doomed: Container[int] = ()) -> set[int]:
        """The steps kept; those deleted though they have no ``best_metric`` (not ranked) are logged at
        WARNING, once: not those in ``doomed`` (a deletion of them is already queued, and retention after
        the next save found them still listed). ``metrics``: each step's value of ``best_metric`` (None:
        none); a step not in it (its manifest could not be read) is kept. Unused without ``keep_best``."""
        ordered = sorted(steps)
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        if not self.keep_best:
            return keep
        keep |= {s for s in ordered if s not in metrics}
        scored = {s: v for s in ordered if (v := metrics.get(s)) is not None}
        sign = 1.0 if self.best_mode == "min" else -1.0
        best = sorted(scored, key=lambda s: (sign * scored[s], -s))[: self.keep_best]  # a tie: the newer
        keep |= set(best)
        for step in (s for s in ordered if s not in keep and s not in scored and s not in doomed):
            log.warning(
                "retention: step %d has no %r metric, so keep_best does not rank it; deleting it, as older than "
                "the keep_last=%d newest",
                *(step, self.best_metric, self.keep_last),
            )
        return keep


class SavedMetrics:
    """Each step's value of one metric, as saved with its checkpoint: noted at the save, else read
    from the manifest's head once (a restarted job's older checkpoints)."""

    def __init__(self, name: str, url: Callable[[int], str], storage_options: dict[str, Any] | None) -> None:
        self.name, self.url, self.storage_options = name, url, storage_options
        self.known: dict[int, float | None] = {}

    def note(self, step: int, state_dict: Any, metrics: Mapping[str, Any] | None, rank0: bool) -> Any:
        """``state_dict`` with the ``metrics`` ``step`` is being saved with (None: none), noted (a save
        of it again replaces them); ZarrckptError as :func:`with_metrics`. Only rank 0's are saved
        (ranks may differ: each its own loss), so other ranks only check theirs."""
        if metrics is None:
            self.known[step] = None
            return state_dict
        saved = with_metrics(state_dict, metrics)  # on every rank: a refusal raises on all of them alike
        self.known[step] = numbers(metrics).get(self.name)
        return saved if rank0 else state_dict

    def of(self, steps: Iterable[int]) -> dict[int, float | None]:
        """The metric of each of ``steps`` (None: none saved); those whose manifest cannot be read are left out."""
        steps = list(steps)
        for step in steps:
            if step not in self.known:
                try:
                    head = read_head(self.url(step), storage_options=self.storage_options)
                except ZarrckptError as e:  # deleted meanwhile, or unreadable: kept (see the module)
                    log.info("retention: cannot read the metrics of step %d, keeping it: %s", step, e)
                    continue
                self.known[step] = metrics_of(head.values).get(self.name)
        return {s: self.known[s] for s in steps if s in self.known}
