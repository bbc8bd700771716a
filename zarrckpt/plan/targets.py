"""A load's targets matched against a checkpoint: which keys take part, what differs, what to read (pure).

:func:`match` looks at this rank's target alone; the ranks then share what each asks for and
found different (one all-gather of :meth:`Match.view`), and :func:`agree` decides for all of them
alike: the keys to load, or the :class:`~zarrckpt.errors.LayoutMismatchError` listing every
difference. :func:`decode_values` and :func:`plan_requests` turn the agreed keys into the values
to set and the reads to run. ``zarrckpt.load`` is that pipeline; nothing here does I/O or talks to
other ranks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, MutableMapping, Sequence, Set
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from zarrckpt.errors import LayoutMismatchError
from zarrckpt.format import dtypes, values
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.keys import Path, flat_leaves, nest, set_leaf
from zarrckpt.format.layout import Box
from zarrckpt.format.manifest import Manifest
from zarrckpt.plan import perrank, perrankload
from zarrckpt.plan.fetch import Request, allocate
from zarrckpt.plan.localstate import BYTES_TYPES, is_tensor_target, tensor_info, tensor_parts
from zarrckpt.plan.perrank import PerRank
from zarrckpt.types import ArrayKind

MAX_LISTED = 100  # differences a LayoutMismatchError message lists (``.differences`` has them all)

Leaves = dict[str, tuple[Path, Any]]  # flat key -> (path in the target, the target leaf)


@dataclass(frozen=True)
class Match:
    """This rank's target leaves next to the checkpoint's manifest.

    Attributes:
        leaves: the target's leaves taking part (those ``keys`` selects), by flat key.
        subtrees: target leaves that stand for a saved dict of plain values (``"config": {}`` or
            ``None``) -> the saved keys under them; each is replaced by the whole saved dict.
        mismatches: how leaves differ from what was saved (shape, dtype, kind).
        empty: target entries that are empty dicts where the checkpoint holds tensors -> why that is
            an error (they would load nothing: a fresh optimizer's ``state``).
        rows: :class:`~zarrckpt.PerRank` targets -> the row of the saved per-rank array this rank
            reads (None: none, the target stays as it is).
    """

    leaves: Leaves
    subtrees: dict[str, list[str]]
    mismatches: list[str]
    empty: dict[str, str]
    rows: dict[str, int | None] = field(default_factory=dict)

    def requested(self) -> set[str]:
        """The keys this rank asks for (a value subtree: the saved keys under it)."""
        return (self.leaves.keys() - self.subtrees.keys()) | {k for ks in self.subtrees.values() for k in ks}

    def view(self, saved: Set[str]) -> dict[str, list[str]]:
        """What the ranks share as JSON (usually the same on every rank): the keys this rank asks for
        that are not ``saved``, and its differences. Which saved keys it asks for goes as flags."""
        return {"missing": sorted(self.requested() - saved), "mismatches": self.mismatches + list(self.empty.values())}


@dataclass(frozen=True)
class Agreement:
    """What every rank decided alike from all ranks' views.

    Attributes:
        wanted: the keys some rank asks for.
        found: those of them in the checkpoint, sorted: what the load reads.
        missing: asked for, not in the checkpoint (left as they are with ``strict=False``).
        unexpected: in the checkpoint and in a subtree the targets hold, not asked for.
        skipped: saved keys no target asks for (whole top-level subtrees left out).
    """

    wanted: frozenset[str]
    found: list[str]
    missing: list[str]
    unexpected: list[str]
    skipped: frozenset[str]


@gc_paused()  # a load of 20,000 tensors: millions of small objects next to the state's, none in a cycle
def match(
    state_dict: Mapping[str, Any],
    manifest: Manifest,
    *,
    keys: Sequence[str] | None = None,
    cast: bool = False,
    rank: int = 0,
    world: int = 1,
    per_rank: str = "error",
) -> Match:
    """Match this rank's target ``state_dict`` (Stateful objects already resolved) against ``manifest``.

    Args:
        keys: fnmatch patterns: only the target leaves matching one take part.
        cast: a tensor target of another dtype is loadable (converted), not a mismatch.
        rank, world: this rank and the load's world size: the row a :class:`~zarrckpt.PerRank`
            target receives (:mod:`zarrckpt.plan.perrankload`).
        per_rank: on another world size than the save's, ``"modulo"`` (rank r reads row
            r % saved world), ``"skip"`` (no row), or ``"error"`` (a mismatch).
    """
    perrank.check_mode(per_rank)
    leaves = flat_leaves(state_dict)
    if keys is not None:
        leaves = {k: leaf for k, leaf in leaves.items() if _selected(k, keys)}
    saved = manifest.arrays.keys() | manifest.values.keys()
    mismatches = [
        d for key, (_, v) in leaves.items() if key in saved for d in _compare(key, v, manifest, cast, world, per_rank)
    ]
    rows = {
        key: perrank.row_of(rank, world, manifest.arrays[key].shape[0], per_rank)
        for key, (_, v) in leaves.items()
        if isinstance(v, PerRank) and key in manifest.arrays and manifest.arrays[key].per_rank
    }
    return Match(leaves, _value_subtrees(leaves, manifest), mismatches, _empty_targets(leaves, manifest), rows)


def saved_keys(manifest: Manifest) -> list[str]:
    """Every key the checkpoint holds (arrays and values), sorted: the same list on every rank."""
    return sorted(manifest.arrays.keys() | manifest.values.keys())


def agree(
    asked: Set[str],
    views: Sequence[Mapping[str, list[str]]],
    matched: Match,
    manifest: Manifest,
    *,
    keys: Sequence[str] | None,
    strict: bool,
    url: str,
) -> Agreement:
    """Decide what the load reads from the saved keys some rank asks for (``asked``) and every
    rank's :meth:`Match.view` (both the same on every rank).

    Raises:
        LayoutMismatchError: some rank's target differs from the checkpoint (shape, dtype, kind, an
            empty dict where tensors were saved), or, with ``strict``, keys are missing or
            unexpected; ``.differences`` lists them all, the message the first :data:`MAX_LISTED`.
    """
    mismatches = sorted({m for v in views for m in v["mismatches"]})
    wanted = set(asked) | {k for v in views for k in v["missing"]}
    saved = manifest.arrays.keys() | manifest.values.keys()
    considered = _considered(saved, wanted, keys)
    missing, unexpected = sorted(wanted - saved - matched.empty.keys()), sorted(considered - wanted)
    unexpected = [k for k in unexpected if not k.startswith(tuple(e + "." for e in matched.empty))]  # said once
    if mismatches or (strict and (missing or unexpected)):
        diffs = mismatches + [f"{k}: expected, not in the checkpoint" for k in missing]
        diffs += [f"{k}: in the checkpoint, not expected" for k in unexpected] if strict else []
        raise LayoutMismatchError(
            f"the state dict does not match the checkpoint at {url!r} (saved vs expected):\n  "
            + "\n  ".join(diffs[:MAX_LISTED])
            + ("" if len(diffs) <= MAX_LISTED else f"\n  ... and {len(diffs) - MAX_LISTED} more")
            + "\nA different model is a model conversion, not a topology change; "
            "strict=False loads only the keys both sides have.",
            diffs,
        )
    return Agreement(frozenset(wanted), sorted(wanted & saved), missing, unexpected, frozenset(saved - considered))


def decode_values(matched: Match, manifest: Manifest, *, allow_pickle: bool) -> dict[str, Any]:
    """The saved plain values the target receives, by flat key, each of its saved type (a value
    subtree: the whole saved dict, nested).

    Raises:
        UnsupportedValueError: a value was saved pickled and ``allow_pickle`` is False.
    """

    def dec(key: str, like: Any = None) -> Any:
        return values.decode(manifest.values[key], like, key=key, allow_pickle=allow_pickle)

    plain = {key: dec(key, matched.leaves[key][1]) for key in manifest.values if key in matched.leaves}
    nested = {key: nest({k[len(key) + 1 :]: dec(k) for k in under}) for key, under in matched.subtrees.items()}
    return plain | nested


def set_values(state_dict: MutableMapping[str, Any], matched: Match, decoded: Mapping[str, Any]) -> None:
    """Put the :func:`decode_values` result into the target."""
    for key, value in decoded.items():
        set_leaf(state_dict, matched.leaves[key][0], value)


@gc_paused()
def plan_requests(
    matched: Match, manifest: Manifest, state_dict: MutableMapping[str, Any], *, allow_pickle: bool = False
) -> tuple[list[Request], list[Callable[[], Any]]]:
    """Read requests for every array target, and what to run once the data is in (copies to GPU
    or to another dtype, bytes values and per-rank values set in the target)."""
    requests: list[Request] = []
    finish: list[Callable[[], Any]] = []
    for key, (path, value) in matched.leaves.items():
        meta = manifest.arrays.get(key)
        if meta is None:
            continue
        if isinstance(value, PerRank):
            row = matched.rows.get(key)
            requests += perrankload.requests(
                key, path, value, meta, row, state_dict, finish, _tensor_request, allow_pickle
            )
        elif meta.kind == ArrayKind.BYTES:
            buf = allocate(meta)
            requests.append(Request(meta, Box.full(meta.shape), buf))
            finish.append(partial(_set_bytes, state_dict, path, buf, type(value)))
        elif isinstance(value, np.ndarray):
            requests.append(Request(meta, Box.full(meta.shape), value.view(dtypes.storage_dtype(meta.dtype))))
        else:
            requests += [_tensor_request(meta, box, data, finish) for data, _, box, _ in tensor_parts(value)]
    return requests, finish


def target_boxes(meta: ArrayMeta, value: Any, rank: int = 0) -> list[Box]:
    """The regions of the saved array ``meta`` that a target leaf of ``rank`` receives: all of it for
    bytes and numpy arrays, the tensor's own parts (its shard, for a DTensor) otherwise, row ``rank %
    saved world`` of a per-rank array. The scale model plans loads with it."""
    if isinstance(value, PerRank):
        return [perrank.row_box(rank % meta.shape[0], meta.shape[1:])]
    if meta.kind == ArrayKind.BYTES or isinstance(value, np.ndarray):
        return [Box.full(meta.shape)]
    return [box for _, _, box, _ in tensor_parts(value)]


def _selected(key: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _considered(saved: Set[str], wanted: Set[str], patterns: Sequence[str] | None) -> set[str]:
    """The saved keys a load must account for: those matching ``patterns``; without patterns,
    all but the top-level subtrees (``model``, ``optim``, ...) the target has no key in."""
    if patterns is not None:
        return {k for k in saved if _selected(k, patterns)}
    tops = {k.split(".")[0] for k in wanted}
    return {k for k in saved if "." not in k or k.split(".")[0] in tops}


def _empty_targets(leaves: Leaves, manifest: Manifest) -> dict[str, str]:
    """Target entries that are empty dicts where the checkpoint holds tensors (they would load nothing): key -> why."""
    out = {}
    for key, (_, value) in leaves.items():
        if isinstance(value, Mapping) and not value and key not in manifest.arrays:
            under = sorted(k for k in manifest.arrays if k.startswith(key + "."))
            if under:
                out[key] = (
                    f"{key}: the target is an empty dict, the checkpoint holds {len(under)} tensors under it "
                    f"({', '.join(under[:2])}{', ...' if len(under) > 2 else ''}); build a target that holds them: "
                    "for an optimizer, torch.distributed.checkpoint.state_dict.get_state_dict(model, optim) "
                    "gives one with its state initialised (a fresh optimizer's state_dict() has none)"
                )
    return out


def _value_subtrees(leaves: Leaves, manifest: Manifest) -> dict[str, list[str]]:
    """Target leaves that stand for a saved dict of plain values (``"config": {}`` or ``None``).

    Such a leaf is replaced by the whole saved dict, so trainer state can be loaded without
    spelling out every key.
    """
    out: dict[str, list[str]] = {}
    for key, (_, value) in leaves.items():
        if key in manifest.values or key in manifest.arrays or not (value is None or isinstance(value, Mapping)):
            continue
        under = [k for k in manifest.values if k.startswith(key + ".")]
        if under and not any(k.startswith(key + ".") for k in manifest.arrays):
            out[key] = under
    return out


def _compare(
    key: str, value: Any, manifest: Manifest, cast: bool = False, world: int = 1, per_rank: str = "error"
) -> list[str]:
    """How a target leaf differs from what was saved under ``key`` (empty when it can be loaded)."""
    meta = manifest.arrays.get(key)
    found = perrankload.compare(key, value, meta, cast, world, per_rank)
    if found is not None:
        return found
    if meta is None:  # saved as a plain value
        if is_tensor_target(value) or isinstance(value, (np.ndarray, *BYTES_TYPES)):
            return [f"{key}: saved a plain value, expected a {type(value).__name__}"]
        return []
    if meta.kind == ArrayKind.BYTES:
        return [] if isinstance(value, BYTES_TYPES) else [f"{key}: saved bytes, expected {type(value).__name__}"]
    if meta.kind == ArrayKind.NDARRAY and isinstance(value, np.ndarray):
        shape, dtype = tuple(value.shape), dtypes.zarr_name(torch.from_numpy(np.empty(0, value.dtype)).dtype)
    elif is_tensor_target(value):
        shape, torch_dtype = tensor_info(value)
        dtype = dtypes.zarr_name(torch_dtype)
    else:
        return [f"{key}: saved a {meta.kind} {list(meta.shape)} {meta.dtype}, expected a {type(value).__name__}"]
    out = []
    if shape != meta.shape:
        out.append(f"{key}: shape {list(meta.shape)} saved vs {list(shape)} expected")
    if dtype != meta.dtype and not (cast and is_tensor_target(value)):
        out.append(f"{key}: dtype {meta.dtype} saved vs {dtype} expected (load(..., cast=True) converts)")
    return out


def _set_bytes(state_dict: MutableMapping[str, Any], path: Path, buf: np.ndarray, make: type) -> None:
    set_leaf(state_dict, path, make(buf.tobytes()))


def _tensor_request(meta: ArrayMeta, box: Box, target: torch.Tensor, finish: list[Callable[[], Any]]) -> Request:
    """Read straight into a CPU target of the stored dtype; else into a staging buffer of the
    stored dtype, copied (converted, moved to the GPU) once the data is in."""
    stored = dtypes.torch_dtype(meta.dtype)
    if target.device.type == "cpu" and target.dtype == stored:
        return Request(meta, box, dtypes.as_numpy(target.detach()))
    staging = torch.empty(
        target.shape, dtype=stored, pin_memory=target.device.type != "cpu" and torch.cuda.is_available()
    )
    finish.append(lambda: target.detach().copy_(staging, non_blocking=False))
    return Request(meta, box, dtypes.as_numpy(staging))
