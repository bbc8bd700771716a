"""Lightning's checkpoint dicts as zarrckpt states and back: each tensor an array named by its place
in the dict (``tensors.<path>``, each segment as a name a store takes, or ``unnamed.<n>``), the rest one value."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zarrckpt

ROOT_DOCUMENT = "zarr.json"  # a checkpoint's root document, written by its commit (docs/FORMAT.md)
_SEGMENT = re.compile(r"^(?!__)[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")  # dotted names ("layer.weight") too
Path = list[Any]  # dict keys and list indices from the checkpoint's root to a tensor


def save_dict(
    checkpoint: dict[str, Any],
    url: str,
    options: Any,
    allow_pickle: bool,
    group: dist.ProcessGroup | None,
    background: bool = False,
) -> zarrckpt.AsyncSave | None:
    """Save a Lightning checkpoint dict: its tensors as arrays named by their place, the rest one
    value (in the ``background``: the save in flight, its tensors already copied)."""
    tensors: dict[str, torch.Tensor] = {}
    places: list[tuple[Path, str]] = []
    skeleton = _split(checkpoint, [], tensors, places)
    _unclash(tensors, places)
    state: dict[str, Any] = {"lightning": (skeleton, places)}  # a tuple: one value, not flattened
    for key, tensor in tensors.items():  # "tensors.<its path>" or "unnamed.<n>"
        space, _, name = key.partition(".")
        state.setdefault(space, {})[name] = tensor
    how = {"storage_options": options, "overwrite": True, "allow_pickle": allow_pickle, "process_group": group}
    if background:
        return zarrckpt.async_save(state, url, **how)
    zarrckpt.save(state, url, **how)
    return None


def load_dict(
    url: str,
    options: Any,
    allow_pickle: bool,
    group: dist.ProcessGroup | None,
    into: dict[str, Any],
    map_location: Any | None = None,
) -> dict[str, Any]:
    """The Lightning checkpoint dict saved at ``url``. Tensors whose place is also a tensor's in
    ``into`` (a DTensor of the model's layout now) are loaded into that one; the others into new
    CPU tensors, moved as ``map_location`` says."""
    url = url.rstrip("/").removesuffix(f"/{ROOT_DOCUMENT}")  # a checkpoint named by its root document
    try:
        ckpt = zarrckpt.open(url, storage_options=options)
    except zarrckpt.CheckpointNotFoundError as e:
        raise FileNotFoundError(f"Checkpoint file not found: {url} ({e})") from e
    saved = ckpt.metadata.get("lightning")
    if not (isinstance(saved, tuple) and len(saved) == 2):
        raise zarrckpt.InvalidCheckpointError(
            f"{url} is a zarrckpt checkpoint but not one Lightning saved (it has no 'lightning' value)"
        )
    target: dict[str, Any] = {"lightning": None}
    given: set[str] = set()
    for path, key in saved[1]:
        space, _, name = key.partition(".")
        mine = _find(into, path)
        if mine is None:
            meta = ckpt[key]
            mine = torch.empty(meta.shape, dtype=meta.dtype)
        else:
            given.add(key)
        target.setdefault(space, {})[name] = mine
    zarrckpt.load(target, url, storage_options=options, allow_pickle=allow_pickle, process_group=group)
    skeleton, places = target.pop("lightning")
    move = _mover(map_location)
    placed = {
        f"{space}.{name}": t if f"{space}.{name}" in given else move(t)
        for space, named in target.items()
        for name, t in named.items()
    }
    rebuilt: dict[str, Any] = _join(skeleton, {tuple(p): key for p, key in places}, placed, [])
    return rebuilt


def _find(tree: Any, path: Path) -> torch.Tensor | None:
    """The tensor at ``path`` in a nested dict / list, or None."""
    for step in path:
        inside = step in tree if isinstance(tree, dict) else isinstance(tree, list) and 0 <= step < len(tree)
        if inside:
            tree = tree[step]
        else:
            return None
    return tree if isinstance(tree, torch.Tensor) else None


def _split(obj: Any, path: Path, tensors: dict[str, torch.Tensor], places: list[tuple[Path, str]]) -> Any:
    """``obj`` with its tensors taken out (None in their place, their key and path recorded)."""
    if isinstance(obj, torch.Tensor):
        key = "tensors." + ".".join(map(_name, path))
        if not path or key in tensors:
            key = f"unnamed.{len(places)}"  # numbered, apart from the named
        tensors[key] = obj.detach()
        places.append((list(path), key))
        return None
    if isinstance(obj, dict):  # (an AttributeDict of hyper-parameters comes back a dict, which Lightning takes)
        return {k: _split(v, [*path, k], tensors, places) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, [*path, i], tensors, places) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _name(segment: Any) -> str:
    """A path segment as a name a store takes: itself, or what is left of it in letters, digits, ``_``
    and ``-`` (``ModelCheckpoint{'monitor': 'loss', ...}``, the state key of a callback, becomes
    ``ModelCheckpoint_monitor_loss_...``; a file path, a key of ``best_k_models``, its file's name),
    at most 64 characters. The key is only a name: the load puts each tensor back by its path."""
    text = str(segment)
    if _SEGMENT.match(text):
        return text
    if "/" in text.rstrip("/"):
        text = text.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_\-]+", "_", text).strip("_")[:64].strip("_") or "unnamed"


def _unclash(tensors: dict[str, torch.Tensor], places: list[tuple[Path, str]]) -> None:
    """Renumber the tensors whose key is also the start of another's (``a.b`` and ``a.b.c``: one would
    be a group and an array at once)."""
    prefixes = {key.rsplit(".", n)[0] for key in tensors for n in range(1, key.count(".") + 1)}
    clashing = prefixes & tensors.keys()
    for n, (path, key) in enumerate(places):
        if key in clashing:
            tensors[f"unnamed.{n}"] = tensors.pop(key)
            places[n] = (path, f"unnamed.{n}")


def _join(obj: Any, where: dict[tuple[Any, ...], str], tensors: dict[str, torch.Tensor], path: Path) -> Any:
    """The skeleton with every tensor back in its place."""
    key = where.get(tuple(path))
    if key is not None:
        return tensors[key]
    if isinstance(obj, dict):
        return {k: _join(v, where, tensors, [*path, k]) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_join(v, where, tensors, [*path, i]) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _mover(map_location: Any | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What torch's loader does to a CPU tensor for a ``map_location``: a device, a string, a dict or None."""
    if map_location is None or callable(map_location):
        return lambda t: t  # Lightning's default maps storages to where they are: the CPU here
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        return lambda t: t.to(target)
    return lambda t: t.to(map_location)
