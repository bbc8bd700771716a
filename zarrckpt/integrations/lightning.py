"""PyTorch Lightning: ``Trainer(plugins=[ZarrCheckpointIO()])`` (single device, DDP) or
``Trainer(strategy=ZarrModelParallelStrategy(...))`` (FSDP2 / tensor parallel) saves and loads every
checkpoint as a zarrckpt checkpoint (``pip install zarrckpt[lightning]``).

``ZarrCheckpointIO`` serves the strategies that hand the whole checkpoint to their ``CheckpointIO`` on
rank 0; ``ZarrModelParallelStrategy`` is Lightning's ``ModelParallelStrategy`` whose every rank writes
its own shards of the model and optimizer states, and which loads on any number of ranks;
``ZarrModelCheckpoint`` makes ``fit(ckpt_path="last")`` find the newest committed one on object stores.

A Lightning checkpoint is a nested dict of tensors (the model's ``state_dict``, the optimizers'
states) and bookkeeping (loops, callbacks, schedulers, hyper-parameters), whose keys can be anything
(a callback's state key holds its arguments, a file path). The tensors become arrays named by their
path (``tensors.state_dict.layer.weight``, ``tensors.optimizer_states.0.state.1.exp_avg``: what
``zarrckpt ls`` shows and any Zarr reader opens; one whose path makes no name is ``unnamed.<n>``); the
rest is one value, ``lightning`` (the dict without its tensors, and each tensor's place), so
``load_checkpoint`` rebuilds the dict exactly (int keys, lists and tuples included) without a template.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import zarrckpt

__all__ = ["ZarrCheckpointIO", "ZarrModelCheckpoint", "ZarrModelParallelStrategy", "last_checkpoint"]
ROOT_DOCUMENT = "zarr.json"  # a checkpoint's root document, written by its commit (docs/FORMAT.md)

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
        async_save: return once the tensors are copied to host memory and write them in the
            background (:func:`zarrckpt.async_save`); the next save, a load, a removal and the end
            of the fit wait for it, and a failed save raises there. Use it rather than wrapping
            this plug-in in Lightning's ``AsyncCheckpointIO``, whose removals do not wait for its
            own saves (``ModelCheckpoint``'s top-k then keeps checkpoints it meant to delete).
    """

    def __init__(
        self, storage_options: dict[str, Any] | None = None, *, allow_pickle: bool = False, async_save: bool = False
    ) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.async_save = async_save
        self._pending: zarrckpt.AsyncSave | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path``, replacing a checkpoint already there (as Lightning does
        with ``last.ckpt``: the old one is deleted first, so a save that fails loses both).

        Lightning calls it on one rank (rank 0 under DDP): this process saves alone, never waiting
        for the other ranks of a process group."""
        options = storage_options if storage_options is not None else self.storage_options
        self._wait()
        self._pending = _save(checkpoint, str(path), options, self.allow_pickle, _this_process_alone(), self.async_save)

    def _wait(self) -> None:
        """Wait for the save in the background, if any (raising its failure)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        """The end of a fit: wait for the last save."""
        self._wait()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved at ``path``, as it was saved (tensors on the CPU, or as
        ``map_location`` says). ``weights_only`` is accepted for Lightning's sake: nothing is
        unpickled unless ``allow_pickle``.

        Raises:
            FileNotFoundError: nothing is stored at ``path`` (Lightning's contract).
        """
        self._wait()
        return _load(str(path), self.storage_options, self.allow_pickle, _this_process_alone(), {}, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (no checkpoint there: nothing to do, as Lightning expects)."""
        self._wait()
        parent, _, name = str(path).rstrip("/").rpartition("/")
        if name in zarrckpt.list_checkpoints(parent or ".", storage_options=self.storage_options):
            zarrckpt.delete(str(path), storage_options=self.storage_options)


class ZarrModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism over a device mesh; it runs
    on CPUs with gloo too) saving through zarrckpt: every rank writes its own shards of the model
    and optimizer states, straight to a local path or any fsspec URL, into one checkpoint that any
    number of ranks loads (``Trainer(devices=M)`` resuming a run saved on N). Lightning's own
    strategy bypasses the ``CheckpointIO``, so this is a strategy, not a plug-in.

    The bookkeeping (loops, callbacks, schedulers, hyper-parameters) is rank 0's, as Lightning's own
    sharded checkpoints keep it.

    Args:
        data_parallel_size, tensor_parallel_size, ...: as ``ModelParallelStrategy``
            (``save_distributed_checkpoint=False`` is refused: a zarrckpt checkpoint is always
            written in shards and read in any layout).
        storage_options: passed to fsspec (credentials, endpoint, ...).
        allow_pickle: store bookkeeping values of other types pickled (see ``ZarrCheckpointIO``).
    """

    def __init__(
        self,
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise zarrckpt.ZarrckptError(
                "ZarrModelParallelStrategy always saves the shards of every rank (any number of ranks loads "
                "them): leave save_distributed_checkpoint at True, or export a full copy with "
                "zarrckpt.export_safetensors"
            )
        super().__init__(*args, **kwargs)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank saves its shards of ``checkpoint`` at ``filepath`` (rank 0's path), replacing a
        checkpoint already there, as ``ZarrCheckpointIO`` does."""
        url = str(self.broadcast(str(filepath)))
        sharded: dict[str, Any] = {k: checkpoint.pop(k) for k in ("state_dict", "optimizer_states") if k in checkpoint}
        bookkeeping = self.broadcast(checkpoint)  # rank 0's on every rank: ranks' metrics may differ
        options = storage_options if storage_options is not None else self.storage_options
        _save({**bookkeeping, **sharded}, url, options, self.allow_pickle, None)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model's and optimizers' shards this rank holds now (whatever the ranks that saved
        them) into the model and optimizers; returns the rest of the checkpoint for Lightning."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = str(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        model = get_model_state_dict(self.model)  # DTensors of this layout, filled in place
        optimizers = [get_optimizer_state_dict(self.model, o) for o in self.optimizers]
        rest = _load(
            url, self.storage_options, self.allow_pickle, None, {"state_dict": model, "optimizer_states": optimizers}
        )
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, model, options=StateDictOptions(strict=strict))
        for optimizer, state, saved in zip(self.optimizers, optimizers, rest.pop("optimizer_states"), strict=True):
            state["param_groups"] = saved["param_groups"]  # as saved (a scheduler's learning rate)
            set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(strict=strict))
        rest.pop("state_dict")
        return rest

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete the checkpoint at ``filepath`` (rank 0; the others wait)."""
        if self.is_global_zero:
            ZarrCheckpointIO(self.storage_options).remove_checkpoint(filepath)
        self.barrier("zarrckpt remove_checkpoint")


class ZarrModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with which ``fit(..., ckpt_path="last")`` finds the newest committed
    ``last*.ckpt`` on any store. Lightning's own lookup lists the directory through fsspec and
    compares the entries' modification times, which an object store gives no prefix: on ``s3://`` /
    ``gs://`` it finds nothing, warns and trains from scratch. This one names each committed last
    checkpoint by its root document (``.../last.ckpt/zarr.json``, written when the save committed),
    which ``ZarrCheckpointIO`` and ``ZarrModelParallelStrategy`` load as the checkpoint.

    Args:
        storage_options: for listing the checkpoints (as given to ``ZarrCheckpointIO``); Lightning
            reads the modification times with the environment's credentials.
        *args, **kwargs: as ``ModelCheckpoint``.
    """

    def __init__(self, *args: Any, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_options = storage_options

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        if self.dirpath is None:
            return set()
        root = str(self.dirpath).rstrip("/")
        found = zarrckpt.list_checkpoints(root, storage_options=self.storage_options)
        last = [name for name, state in found.items() if state == "committed" and _LAST.match(name)]
        return {f"{root}/{name}/{ROOT_DOCUMENT}" for name in last}


_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")


def _save(
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


def _load(
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


_solo: list[Any] = [None, None]  # [the default group it was made in, the group of this process alone]


def _this_process_alone() -> dist.ProcessGroup | None:
    """A process group of this process alone where ``torch.distributed`` runs several (None: there is
    no group to leave out). Lightning calls ``CheckpointIO`` on rank 0 only; a save over the default
    group would wait for the other ranks forever. Made without the other ranks, once per default
    group (again after the default group is destroyed and made anew)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _solo[0] is not world:
        _solo[:] = [world, dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)]
    group: dist.ProcessGroup = _solo[1]
    return group


def last_checkpoint(dirpath: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The URL of the newest committed ``last*.ckpt`` checkpoint in a ``ModelCheckpoint`` directory,
    for ``trainer.fit(..., ckpt_path=last_checkpoint(dirpath))`` where Lightning's own
    ``ckpt_path="last"`` finds nothing (it looks for files, on local paths)."""
    root = dirpath.rstrip("/")
    found = [
        (name, state)
        for name, state in zarrckpt.list_checkpoints(root, storage_options=storage_options).items()
        if state == "committed" and _LAST.match(name)
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
