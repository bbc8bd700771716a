"""PyTorch Lightning: ``Trainer(plugins=[ZarrCheckpointIO()])`` saves and loads every checkpoint as a
zarrckpt checkpoint (``pip install zarrckpt[lightning]``).

For the strategies that hand the whole checkpoint to their ``CheckpointIO`` on rank 0 (single
device, DDP). A Lightning checkpoint is a nested dict of tensors (the model's ``state_dict``, the
optimizers' states) and bookkeeping (loops, callbacks, schedulers, hyper-parameters), whose keys can
be anything (a callback's state key holds its arguments, a file path). The tensors become arrays
named by their path (``tensors.state_dict.layer.weight``, ``tensors.optimizer_states.0.state.1.exp_avg``:
what ``zarrckpt ls`` shows and any Zarr reader opens; one whose path makes no name is
``unnamed.<n>``); the rest is one value, ``lightning`` (the dict without its tensors, and each
tensor's place), so ``load_checkpoint`` rebuilds the dict exactly (int keys, lists and tuples
included) without a template.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

import zarrckpt

__all__ = ["ZarrCheckpointIO", "last_checkpoint"]

_SEGMENT = re.compile(r"^(?!__)[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")  # dotted names ("layer.weight") too
Path = list[Any]  # dict keys and list indices from the checkpoint's root to a tensor


class ZarrCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through zarrckpt: to a local path or any fsspec URL (``s3://``,
    ``gs://``), the ``.ckpt`` name becoming a checkpoint prefix.

    Args:
        storage_options: passed to fsspec (credentials, endpoint, ...); ``Trainer.save_checkpoint(...,
            storage_options=...)`` overrides them for one save.
        allow_pickle: store bookkeeping values of other types (your own classes in
            ``hyper_parameters``) pickled; loading them then runs code from the checkpoint.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path``, replacing a checkpoint already there (as Lightning does
        with ``last.ckpt``: the old one is deleted first, so a save that fails loses both)."""
        tensors: dict[str, torch.Tensor] = {}
        places: list[tuple[Path, str]] = []
        skeleton = _split(checkpoint, [], tensors, places)
        _unclash(tensors, places)
        state: dict[str, Any] = {"lightning": (skeleton, places)}  # a tuple: one value, not flattened
        for key, tensor in tensors.items():  # "tensors.<its path>" or "unnamed.<n>"
            space, _, name = key.partition(".")
            state.setdefault(space, {})[name] = tensor
        zarrckpt.save(
            state,
            str(path),
            storage_options=storage_options if storage_options is not None else self.storage_options,
            overwrite=True,
            allow_pickle=self.allow_pickle,
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved at ``path``, as it was saved (tensors on the CPU, or as
        ``map_location`` says). ``weights_only`` is accepted for Lightning's sake: nothing is
        unpickled unless ``allow_pickle``.

        Raises:
            FileNotFoundError: nothing is stored at ``path`` (Lightning's contract).
        """
        url = str(path)
        try:
            ckpt = zarrckpt.open(url, storage_options=self.storage_options)
        except zarrckpt.CheckpointNotFoundError as e:
            raise FileNotFoundError(f"Checkpoint file not found: {url} ({e})") from e
        target: dict[str, Any] = {"lightning": None}
        for key in ckpt.keys():  # noqa: SIM118 (a list)
            space, _, name = key.partition(".")
            target.setdefault(space, {})[name] = torch.empty(ckpt[key].shape, dtype=ckpt[key].dtype)
        zarrckpt.load(target, url, storage_options=self.storage_options, allow_pickle=self.allow_pickle)
        skeleton, places = target.pop("lightning")
        move = _mover(map_location)
        placed = {f"{space}.{name}": move(t) for space, named in target.items() for name, t in named.items()}
        rebuilt: dict[str, Any] = _join(skeleton, {tuple(p): key for p, key in places}, placed, [])
        return rebuilt

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (no checkpoint there: nothing to do, as Lightning expects)."""
        parent, _, name = str(path).rstrip("/").rpartition("/")
        if name in zarrckpt.list_checkpoints(parent or ".", storage_options=self.storage_options):
            zarrckpt.delete(str(path), storage_options=self.storage_options)


def last_checkpoint(dirpath: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The URL of the newest committed ``last*.ckpt`` checkpoint in a ``ModelCheckpoint`` directory,
    for ``trainer.fit(..., ckpt_path=last_checkpoint(dirpath))`` where Lightning's own
    ``ckpt_path="last"`` finds nothing (it looks for files, on local paths)."""
    root = dirpath.rstrip("/")
    found = [
        (name, state)
        for name, state in zarrckpt.list_checkpoints(root, storage_options=storage_options).items()
        if state == "committed" and re.match(r"^last(-v?\d+)?\.ckpt$", name)
    ]
    if not found:
        return None

    def step(name: str) -> int:
        saved = zarrckpt.open(f"{root}/{name}", storage_options=storage_options).metadata.get("lightning")
        skeleton = saved[0] if isinstance(saved, tuple) and saved and isinstance(saved[0], dict) else {}
        found_step = skeleton.get("global_step", -1)
        return found_step if isinstance(found_step, int) else -1

    return f"{root}/{max((name for name, _ in found), key=lambda n: (step(n), n))}"


def _split(obj: Any, path: Path, tensors: dict[str, torch.Tensor], places: list[tuple[Path, str]]) -> Any:
    """``obj`` with its tensors taken out (None in their place, their key and path recorded)."""
    if isinstance(obj, torch.Tensor):
        key = "tensors." + ".".join(map(str, path))
        if not path or not all(_SEGMENT.match(str(p)) for p in path) or key in tensors:
            key = f"unnamed.{len(places)}"  # a path no store takes as a name: numbered, apart from the named
        tensors[key] = obj.detach()
        places.append((list(path), key))
        return None
    if isinstance(obj, dict):  # (an AttributeDict of hyper-parameters comes back a dict, which Lightning takes)
        return {k: _split(v, [*path, k], tensors, places) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, [*path, i], tensors, places) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


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
