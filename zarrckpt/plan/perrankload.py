"""A load's per-rank targets: which row of a per-rank array a rank reads, and into what (pure).

:mod:`zarrckpt.plan.targets` asks this module about every target leaf that is a
:class:`~zarrckpt.PerRank` and every saved array that is per-rank (:mod:`zarrckpt.plan.perrank`).
A ``PerRank`` target receives one row: its own on the save's world size, else as
``load(..., per_rank=...)`` says (``"modulo"``: row ``rank % saved_world``; ``"skip"``: none, the
target stays as it is; ``"error"``, the default: a mismatch naming both). A plain tensor target of the
whole ``[world, ...]`` shape receives the whole array, as any array; other plain targets of a per-rank
array are mismatches that say to wrap the target in ``PerRank``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import partial
from typing import Any

import numpy as np
import torch

from zarrckpt.format import dtypes
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.keys import Path, set_leaf
from zarrckpt.plan import perrank
from zarrckpt.plan.fetch import Request
from zarrckpt.plan.perrank import PerRank

Finish = list[Callable[[], Any]]


def compare(key: str, value: Any, meta: ArrayMeta | None, cast: bool, world: int, per_rank: str) -> list[str] | None:
    """How a ``PerRank`` target, or any target of a per-rank array, differs from what was saved
    (empty: loadable); None when neither is per-rank (the caller compares as usual)."""
    if not isinstance(value, PerRank):
        if meta is None or not meta.per_rank:
            return None
        if (
            meta.per_rank == perrank.TENSOR_ROWS
            and isinstance(value, torch.Tensor)
            and tuple(value.shape) == meta.shape
        ):
            return None  # the whole [world, ...] array, as any array
        return [
            f"{key}: saved per rank ({list(meta.shape)}: a row per rank), expected a {type(value).__name__}; "
            "load it into zarrckpt.PerRank(...) to receive this rank's row"
        ]
    if meta is None or not meta.per_rank:
        saved = "a plain value" if meta is None else f"a {meta.kind} {list(meta.shape)} that is not per-rank"
        return [f"{key}: saved {saved}, expected a PerRank value"]
    out = []
    inner = value.value
    if meta.per_rank == perrank.TENSOR_ROWS:
        if isinstance(inner, torch.Tensor):
            dtype = dtypes.zarr_name(inner.dtype)
        elif isinstance(inner, np.ndarray):
            dtype = dtypes.zarr_name(torch.from_numpy(np.empty(0, inner.dtype)).dtype)
        else:
            rows = f"{meta.dtype} rows {list(meta.shape[1:])}"
            return [f"{key}: saved per-rank {rows}, expected a PerRank of a {type(inner).__name__}"]
        if tuple(inner.shape) != meta.shape[1:]:
            out.append(f"{key}: per-rank rows of shape {list(meta.shape[1:])} saved vs {list(inner.shape)} expected")
        if dtype != meta.dtype and not (cast and isinstance(inner, torch.Tensor)):
            out.append(f"{key}: dtype {meta.dtype} saved vs {dtype} expected (load(..., cast=True) converts)")
    elif isinstance(inner, (torch.Tensor, np.ndarray)):
        out.append(f"{key}: saved per-rank values, expected a PerRank of a {type(inner).__name__}")
    if meta.shape[0] != world and per_rank == "error":
        out.append(perrank.world_problem(key, world, meta.shape[0]))
    return out


def requests(
    key: str,
    path: Path,
    value: PerRank,
    meta: ArrayMeta,
    row: int | None,
    state_dict: MutableMapping[str, Any],
    finish: Finish,
    tensor_request: Callable[[ArrayMeta, Any, torch.Tensor, Finish], Request],
    allow_pickle: bool,
) -> list[Request]:
    """The read of row ``row`` of ``meta`` into the ``PerRank`` target ``value`` (none for None),
    and what to run once it is in (``finish``: a value row decoded and set in the target)."""
    if row is None:
        return []
    box = perrank.row_box(row, meta.shape[1:])
    inner = value.value
    if meta.per_rank == perrank.JSON_ROWS:
        buf = np.empty((1, meta.shape[1]), dtype=np.uint8)
        finish.append(partial(_set_row, state_dict, path, buf, inner, key, allow_pickle))
        return [Request(meta, box, buf)]
    if isinstance(inner, np.ndarray):
        return [Request(meta, box, inner.reshape(1, *inner.shape).view(dtypes.storage_dtype(meta.dtype)))]
    return [tensor_request(meta, box, inner.unsqueeze(0), finish)]


def _set_row(
    state_dict: MutableMapping[str, Any], path: Path, buf: np.ndarray, like: Any, key: str, allow_pickle: bool
) -> None:
    set_leaf(state_dict, path, PerRank(perrank.decode_row(buf.tobytes(), like, key, allow_pickle)))
