"""PyTorch Lightning: ``Trainer(plugins=[ZarrCheckpointIO()])`` (single device, DDP) or
``Trainer(strategy=ZarrModelParallelStrategy(...))`` (FSDP2 / tensor parallel) saves and loads every
checkpoint as a zarrckpt checkpoint (``pip install zarrckpt[lightning]``).

``ZarrCheckpointIO`` serves the strategies that hand the whole checkpoint to their ``CheckpointIO`` on
rank 0; ``ZarrModelParallelStrategy`` is Lightning's ``ModelParallelStrategy`` whose every rank writes
its own shards of the model and optimizer states, and which loads on any number of ranks;
``ZarrModelCheckpoint`` makes ``fit(ckpt_path="last")`` find the newest committed one on object stores.

Restarts: :func:`last_checkpoint` (and ``ZarrModelCheckpoint``) resume from the newest committed
``last*.ckpt``, or, when none is (a re-save in place killed), the newest committed checkpoint; a save
first waits for a save that died at its URL to count as dead (on another host: its lease), takes it
over, and never replaces a save that still runs.

A Lightning checkpoint is a nested dict of tensors (the model's ``state_dict``, the optimizers'
states) and bookkeeping (loops, callbacks, schedulers, hyper-parameters), whose keys can be anything
(a callback's state key holds its arguments, a file path). The tensors become arrays named by their
path (``tensors.state_dict.layer.weight``, ``tensors.optimizer_states.0.state.1.exp_avg``: what
``zarrckpt ls`` shows and any Zarr reader opens; a key that is no name is cut to one: a callback's
``best_model_score`` is ``tensors.callbacks.ModelCheckpoint_monitor_loss_<...>.best_model_score``, a
``best_k_models`` entry is named by its file, and a path that still clashes is ``unnamed.<n>``); the
rest is one value, ``lightning`` (the dict without its tensors, and each tensor's place), so
``load_checkpoint`` rebuilds the dict exactly (int keys, lists and tuples included) without a template.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import zarrckpt
from zarrckpt.integrations.lightning_state import ROOT_DOCUMENT, load_dict, save_dict
from zarrckpt.integrations.restarts import make_way
from zarrckpt.lifecycle import read_head

__all__ = ["ZarrCheckpointIO", "ZarrModelCheckpoint", "ZarrModelParallelStrategy", "last_checkpoint"]
log = logging.getLogger("zarrckpt")


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
        with ``last.ckpt``: the old one is deleted first, so a save that fails loses both; a restart
        resumes from the newest committed checkpoint then, see :func:`last_checkpoint`). A save that
        died at ``path`` is taken over once it counts as dead (on another host: its lease).

        Lightning calls it on one rank (rank 0 under DDP): this process saves alone, never waiting
        for the other ranks of a process group.

        Raises:
            IncompleteCheckpointError: another save to ``path`` still runs (it is never replaced).
        """
        options = storage_options if storage_options is not None else self.storage_options
        self._wait()
        make_way(str(path), options)  # (this process saves alone)
        self._pending = save_dict(
            checkpoint, str(path), options, self.allow_pickle, _this_process_alone(), self.async_save
        )

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
        return load_dict(str(path), self.storage_options, self.allow_pickle, _this_process_alone(), {}, map_location)

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
        checkpoint already there, as ``ZarrCheckpointIO`` does (a save that died there taken over, a
        running one refused)."""
        url = str(self.broadcast(str(filepath)))
        sharded: dict[str, Any] = {k: checkpoint.pop(k) for k in ("state_dict", "optimizer_states") if k in checkpoint}
        bookkeeping = self.broadcast(checkpoint)  # rank 0's on every rank: ranks' metrics may differ
        options = storage_options if storage_options is not None else self.storage_options
        if self.is_global_zero:
            make_way(url, options)
        save_dict({**bookkeeping, **sharded}, url, options, self.allow_pickle, None)

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
        rest = load_dict(
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
    """``ModelCheckpoint`` with which ``fit(..., ckpt_path="last")`` finds :func:`last_checkpoint`'s
    choice on any store (the newest committed ``last*.ckpt``, else the newest committed checkpoint).
    Lightning's own lookup compares the modification times fsspec reports, which an object store gives
    no prefix (on ``s3://`` / ``gs://`` it finds nothing and trains from scratch), and takes a killed
    ``last.ckpt`` for one. This one names the checkpoint by its root document
    (``.../last.ckpt/zarr.json``, written when the save committed), which ``ZarrCheckpointIO`` and
    ``ZarrModelParallelStrategy`` load as the checkpoint.

    Args:
        storage_options: the store's endpoint and credentials (as given to ``ZarrCheckpointIO``), for
            listing the checkpoints and for Lightning's own file operations in ``dirpath`` (it looks
            for existing files there, and writes ``best_k_models.yaml``): with them, no
            ``AWS_ENDPOINT_URL`` / ``STORAGE_EMULATOR_HOST`` / credentials in the environment are
            needed. Without them, Lightning uses the environment's, as ``ModelCheckpoint`` does.
        *args, **kwargs: as ``ModelCheckpoint``.
    """

    def __init__(self, *args: Any, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.storage_options = storage_options  # (before Lightning makes its filesystem: see _fs)
        super().__init__(*args, **kwargs)

    @property
    def _fs(self) -> Any:
        return self._filesystem

    @_fs.setter
    def _fs(self, fs: Any) -> None:
        """Lightning makes the filesystem of ``dirpath`` from the path alone (the environment's endpoint
        and credentials); a remote one is made with ``storage_options`` instead, as zarrckpt's is."""
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if self.storage_options and protocol not in ("file", "local"):
            fs = zarrckpt.fsspec_filesystem(f"{protocol}://", self.storage_options)[0]
        self._filesystem = fs

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        if self.dirpath is None:
            return set()
        chosen = _newest(str(self.dirpath), self.storage_options, warn=trainer.is_global_zero)
        return {f"{chosen}/{ROOT_DOCUMENT}"} if chosen else set()


_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")


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
    """The URL of the checkpoint to resume from in a ``ModelCheckpoint`` directory, for
    ``trainer.fit(..., ckpt_path=last_checkpoint(dirpath))`` where Lightning's own ``ckpt_path="last"``
    finds nothing (it looks for files, on local paths): the newest committed ``last*.ckpt`` (by the
    global step it saved, then its commit time). When none is committed (``last.ckpt`` is re-saved in
    place: a save killed after the old one was deleted leaves none), the newest committed checkpoint
    there (a top-k one), logged at WARNING. None: no checkpoint Lightning saved is committed there."""
    return _newest(dirpath, storage_options)


def _newest(dirpath: str, options: dict[str, Any] | None, warn: bool = True) -> str | None:
    root = dirpath.rstrip("/")
    found = zarrckpt.list_checkpoints(root, storage_options=options)
    committed = [name for name, state in found.items() if state == "committed"]
    lasts = _ranked(root, [name for name in committed if _LAST.match(name)], options)
    ranked = lasts or _ranked(root, committed, options)
    if not ranked:
        return None
    chosen = max(ranked, key=lambda name: (*ranked[name], name))
    if warn and not lasts:
        torn = ", ".join(f"{name} is {state}" for name, state in sorted(found.items()) if _LAST.match(name))
        why = f"{torn}: its save, or its re-save in place, was killed or still runs" if torn else "none saved"
        log.warning(
            "no last*.ckpt in %s is committed (%s): resuming from %s (global step %d), the newest committed "
            "checkpoint there",
            root,
            why,
            chosen,
            ranked[chosen][0],
        )
    return f"{root}/{chosen}"


def _ranked(root: str, names: list[str], options: dict[str, Any] | None) -> dict[str, tuple[int, str]]:
    """The global step and commit time of each of ``names`` that Lightning saved (one ranged GET each)."""
    with ThreadPoolExecutor(min(16, max(1, len(names)))) as pool:
        found = dict(zip(names, pool.map(lambda name: _saved_at(f"{root}/{name}", options), names), strict=True))
    return {name: at for name, at in found.items() if at is not None}


def _saved_at(url: str, options: dict[str, Any] | None) -> tuple[int, str] | None:
    """(global step, commit time) from the manifest's first bytes: the ``lightning`` value is a tuple
    in typed JSON (docs/FORMAT.md section 6). None: not Lightning's, or gone meanwhile."""
    try:
        head = read_head(url, storage_options=options)
    except zarrckpt.ZarrckptError as e:
        log.debug("not a checkpoint to resume from: %s (%s)", url, e)
        return None
    typed = head.values.get("lightning")
    saved = typed.get("__zarrckpt__") if isinstance(typed, dict) else None
    skeleton = saved[1][0] if isinstance(saved, list) and saved[0] == "tuple" and saved[1] else None
    step = skeleton.get("global_step") if isinstance(skeleton, dict) else None
    return (step, head.created) if type(step) is int else None
