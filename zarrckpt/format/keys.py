"""State-dict keys: flattening nested state dicts, key validation, key -> array path, roles.

Flattening follows ``torch.distributed.checkpoint`` exactly (mappings are always walked, lists
only when they hold tensors or mappings, tuples are leaves, path parts joined with '.'), so the
keys zarrckpt stores are the keys DCP plans with. One addition: an empty mapping is a leaf (a
plain ``{}`` value) instead of vanishing, so ``{"config": {}}`` can receive a saved config.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from zarrckpt.errors import InvalidKeyError
from zarrckpt.types import Role

Path = tuple[str | int, ...]  # from the top to a leaf: dict keys as strings, list indices as ints (as DCP has them)

ROLES: tuple[str, ...] = tuple(role.value for role in Role)  # the stored role names, in Role's order
_OPTIM_TOPS = {"optim", "optimizer", "optimizers", "optim_state", "optimizer_state"}
_OTHER_TOPS = {"rng", "rng_state", "trainer", "dataloader", "data", "extra", "scheduler", "lr_scheduler", "meta"}
_BUFFER_NAMES = {"running_mean", "running_var", "num_batches_tracked", "inv_freq", "position_ids", "mask"}


def _is_terminal(value: Any) -> bool:
    import torch  # here, not at the top: reading a checkpoint's keys (`zarrckpt ls`) needs no torch

    if isinstance(value, Mapping):
        return not value
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def iter_leaves(state_dict: Mapping[Any, Any]) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every leaf of a nested state dict, exactly as DCP walks it (dict keys
    as strings, list indices as ints)."""
    for path, _, value in _walk(state_dict):
        yield path, value


def _walk(state_dict: Mapping[Any, Any]) -> Iterator[tuple[Path, str, Any]]:
    """``(path, where, leaf)``: the DCP path and, for messages, the path as written with the dict keys
    as they are (``["m"][0]`` vs ``["m"]["0"]``)."""

    def walk(path: Path, where: str, value: Any) -> Iterator[tuple[Path, str, Any]]:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                yield from walk((*path, str(k)), f"{where}[{k!r}]", v)
        elif _is_terminal(value):
            yield path, where, value
        else:
            for i, v in enumerate(value):
                yield from walk((*path, i), f"{where}[{i}]", v)

    for key, value in state_dict.items():
        yield from walk((str(key),), f"[{key!r}]", value)


def flat_leaves(state_dict: Mapping[Any, Any]) -> dict[str, tuple[Path, Any]]:
    """Every leaf of a nested state dict by its flat key: ``key -> (path, leaf)``.

    Raises:
        InvalidKeyError: two leaves flatten to one key (``{"a.b": x, "a": {"b": y}}``, ``{1: x, "1": y}``)
            or to keys that are the same text in two Unicode spellings (:func:`check_distinct`).
    """
    leaves = [(flat_key(path), path, where, value) for path, where, value in _walk(state_dict)]
    check_distinct((key, where) for key, _, where, _ in leaves)
    return {key: (path, value) for key, path, _, value in leaves}


def check_distinct(named: Iterable[tuple[str, str]]) -> None:
    """``(key, where)`` pairs, one per entry of a state dict: raise when two entries share a key.

    Storing them would keep one of the two and fill both from it when loading. Keys that are the
    same text in two Unicode spellings (NFC and NFD ``é``) count as one: some filesystems store them
    as one name, and nobody can tell them apart in a listing.

    Raises:
        InvalidKeyError: naming both entries.
    """
    seen: dict[str, tuple[str, str]] = {}  # NFC form of a key -> (key, where)
    for key, where in named:
        first = seen.setdefault(unicodedata.normalize("NFC", key), (key, where))
        if first[1] != where:
            same = f"one key {key!r}" if first[0] == key else f"keys {first[0]!r} and {key!r}, the same text"
            raise InvalidKeyError(
                f"two entries of the state dict map to {same}: {first[1]} and {where}; nested dicts are flattened "
                "with '.' (as DCP does) and keys turned into strings, so rename one"
            )


def flat_key(path: Path) -> str:
    return ".".join(str(p) for p in path)


def set_leaf(state_dict: MutableMapping[Any, Any], path: Path, value: Any) -> None:
    """Replace the leaf at ``path`` (as produced by :func:`iter_leaves`)."""
    container: Any = state_dict
    for part in path[:-1]:
        container = container[part if isinstance(part, int) else _orig_key(container, part)]
    last = path[-1]
    container[last if isinstance(last, int) else _orig_key(container, last)] = value


def _orig_key(container: Mapping[Any, Any], key: str) -> Any:
    if key in container:
        return key
    for k in container:  # non-str keys were stringified while walking
        if str(k) == key:
            return k
    raise KeyError(key)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "a.c": 2}`` -> ``{"a": {"b": 1, "c": 2}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


_BAD_KEY = re.compile(r"(?:^|\.)(?:\.|$|__)|[/\\\x00]")  # an empty segment, one starting "__", or / \ NUL


def validate_keys(keys: Sequence[str]) -> None:
    """Reject keys that cannot be stored as Zarr array paths, or that clash with each other."""
    problems = []
    for key in keys:
        if not _BAD_KEY.search(key):
            continue
        segs = key.split(".")
        bad = [s for s in segs if not s or s in (".", "..") or s.startswith("__")]
        bad += [s for s in segs if any(ch in s for ch in "/\\\0")]
        if bad or not key:
            problems.append(f"{key!r}: invalid segment {bad[0]!r}" if bad else "empty key")
    ordered = sorted(set(keys))  # the keys under k, if any, follow k + "." at once in this order
    for k in ordered:
        at = bisect.bisect_left(ordered, k + ".")
        if at < len(ordered) and ordered[at].startswith(k + "."):
            problems.append(f"{k!r} is both a leaf and the prefix of another key")
    if problems:
        raise InvalidKeyError(
            "state-dict keys that cannot be stored: "
            + "; ".join(problems[:10])
            + ". Segments must be non-empty, not '.'/'..', not start with '__', and contain no '/'."
        )


def key_to_path(key: str) -> str:
    return key.replace(".", "/")


def infer_role(key: str, is_floating: bool) -> Role:
    """Guess a tensor's role from the standard ``state_dict()`` / ``get_state_dict()`` structure."""
    segs = key.split(".")
    last = segs[-1]
    if "callbacks" in segs[:2]:  # a training framework's callbacks' state (Lightning's, under tensors.): scores
        return Role.OTHER
    if segs[0] in _OPTIM_TOPS or (len(segs) >= 3 and "state" in segs[:-1]):
        return {
            "exp_avg": Role.FIRST_MOMENT,
            "momentum_buffer": Role.FIRST_MOMENT,
            "exp_avg_sq": Role.SECOND_MOMENT,
            "max_exp_avg_sq": Role.SECOND_MOMENT,
            "step": Role.OPTIMIZER_STEP,
        }.get(last, Role.OTHER)
    if segs[0] in _OTHER_TOPS:
        return Role.OTHER
    if last in _BUFFER_NAMES or not is_floating:
        return Role.BUFFER
    return Role.MAIN_WEIGHT
