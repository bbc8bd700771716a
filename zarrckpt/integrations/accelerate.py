"""Hugging Face Accelerate: ``save_state(accelerator, url)`` / ``load_state(accelerator, url)`` save and load
what ``Accelerator.save_state`` / ``load_state`` do, as one zarrckpt checkpoint that any number of
processes can load (``pip install zarrckpt[accelerate]``).

Accelerate's own helpers write files tied to the save's layout: under FSDP, DCP's ``FileSystemWriter``
(hard-coded in ``save_fsdp_model`` / ``save_fsdp_optimizer``); otherwise rank 0's ``model.safetensors``,
pickled ``optimizer.bin`` / ``scheduler.bin`` / ``custom_checkpoint_<i>.pkl`` and one
``random_states_<rank>.pkl`` per process. Here every rank calls zarrckpt with the same state dict:

- ``models.<i>``: each prepared model's ``get_model_state_dict`` (``torch.distributed.checkpoint.state_dict``):
  FSDP2's DTensor shards or FSDP1's ShardedTensors, each rank writing its own, or DDP's replicated
  tensors, written once; keyed by parameter name without wrapper prefixes (``module.``), so a checkpoint
  saved under FSDP loads under DDP or on one process, and the reverse;
- ``optimizers.<i>``: ``get_optimizer_state_dict`` of each optimizer with the model holding its
  parameters (moments keyed by parameter name, sharded like the parameters);
- ``schedulers.<i>``, ``custom.<i>`` (``register_for_checkpointing``), ``scaler`` (a ``GradScaler``),
  ``dataloaders.<i>`` (the epoch a prepared data loader is at and its seedable sampler's seed);
- ``accelerate``: ``step``, the save ``iteration`` and the saving mode (one value, equal on every rank);
- ``rng``: every process's Python, NumPy and torch (and CUDA) generator states, as Accelerate's
  ``random_states_<r>.pkl``: per-rank arrays (:class:`zarrckpt.PerRank`), row ``r`` process ``r``'s. A
  process ``r`` of a run with another number of processes takes the states of saved process ``r % N``
  (``load(..., per_rank="modulo")``). Checkpoints of zarrckpt before per-rank arrays hold them as
  ``rank<r>.rng``, one subtree per process; they still load.

Nothing is pickled unless ``allow_pickle`` (a custom object whose ``state_dict()`` holds other types).

Restarts: ``load_state()`` resumes from the newest committed checkpoint (a save killed part way is
never one); ``save_state`` first waits for a save that died at its URL (a restart saves the next
iteration, which its predecessor may have died writing, maybe on another host: then for its lease,
``$ZARRCKPT_LEASE_SECONDS``, 30 s by default) and takes it over. A save that still runs is never touched.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import zarrckpt
from zarrckpt.integrations.restarts import from_rank_0, make_way, rank

__all__ = ["checkpoints_root", "load_state", "save_state"]

FORMAT = 1  # of the "accelerate" entry
log = logging.getLogger("zarrckpt")


def save_state(
    accelerator: Accelerator,
    url: zarrckpt.URL | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool = False,
) -> str:
    """Save the state ``accelerator.save_state`` saves (models, optimizers, schedulers, scaler, data
    loaders, registered objects, step, RNG states) as one zarrckpt checkpoint; every process calls it.

    Without ``url``, and with ``ProjectConfiguration(automatic_checkpoint_naming=True)``, the checkpoint
    goes to ``<project_dir>/checkpoints/step_<iteration, 10 digits>`` (Accelerate's ``checkpoint_<iteration>``
    in ``zarrckpt.CheckpointManager``'s naming, so ``zarrckpt latest`` and :func:`zarrckpt.latest_step`
    find it), and once it is committed the oldest ones beyond ``total_limit`` are deleted. Like
    Accelerate, it then adds one to ``project_configuration.iteration``. A save that died at that URL
    (the job killed while saving it, on this host or another) is taken over once it counts as dead:
    its writer gone from this host, or its marker the lease without a heartbeat (it waits for that).

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved.
        url: where to save: a local path or any fsspec URL (``s3://bucket/run/step_100``).
        storage_options: passed to fsspec (credentials, endpoint, ...).
        overwrite: replace a checkpoint at ``url`` (as :func:`zarrckpt.save`; not with automatic naming,
            which refuses an existing one as Accelerate does).
        allow_pickle: store values of other types (in a custom object's ``state_dict()``) pickled.
        progress: a progress line on stderr, as for :func:`zarrckpt.save`.

    Returns:
        The checkpoint's URL.

    Raises:
        ZarrckptError: no ``url`` and automatic naming is off; an optimizer holds parameters of no
            prepared model, or of several; a data loader is a torchdata ``StatefulDataLoader``.
        CheckpointExistsError: a checkpoint is already at the URL (automatic naming: that iteration).
        IncompleteCheckpointError: another save to the URL still runs (it is never replaced).
        SaveLayoutError, UnsupportedValueError, StorageError: as for :func:`zarrckpt.save`.
    """
    config = accelerator.project_configuration
    iteration = int(config.iteration)
    state = _state(accelerator, None, saving=True, url=url)
    saved = str(url) if url is not None else f"{checkpoints_root(accelerator)}/step_{iteration:010d}"
    if rank() == 0:
        make_way(saved, storage_options)
    zarrckpt.save(
        state,
        saved,
        storage_options=storage_options,
        overwrite=overwrite and url is not None,
        allow_pickle=allow_pickle,
        progress=progress,
    )
    if url is None and config.total_limit is not None and rank() == 0:  # retention, once this one is committed
        root = checkpoints_root(accelerator)
        steps = zarrckpt.committed_steps(root, storage_options=storage_options)
        for step in steps[: max(len(steps) - int(config.total_limit), 0)]:
            log.info("deleting checkpoint %s/step_%010d (total_limit=%d)", root, step, config.total_limit)
            zarrckpt.delete(f"{root}/step_{step:010d}", storage_options=storage_options, committed_only=True)
    config.iteration = iteration + 1
    return saved


def load_state(
    accelerator: Accelerator,
    url: zarrckpt.URL | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    allow_pickle: bool = False,
) -> str:
    """Load a checkpoint :func:`save_state` wrote, on any number of processes and in any mode (FSDP2,
    FSDP1, DDP, one process), into the ``accelerator``'s prepared objects; every process calls it.

    Without ``url``, and with automatic checkpoint naming, the latest committed checkpoint under
    ``<project_dir>/checkpoints``. Restores ``accelerator.step`` and sets
    ``project_configuration.iteration`` to the one after the checkpoint's, so the next automatic save
    does not collide with it (Accelerate leaves it to you).

    Args:
        accelerator: the ``Accelerator`` with the same models, optimizers, schedulers, data loaders
            and registered objects prepared as when the checkpoint was saved.
        url: the checkpoint.
        storage_options: passed to fsspec.
        strict: as for :func:`zarrckpt.load`: ``False`` loads the keys both sides have and logs the rest
            (and lets the numbers of models, optimizers, ... differ from the saved ones).
        allow_pickle: load values saved with ``allow_pickle=True`` (runs code from the checkpoint).

    Returns:
        The checkpoint's URL.

    Raises:
        CheckpointNotFoundError: no ``url`` and no committed checkpoint under the project's root; or
            nothing at ``url``.
        InvalidCheckpointError: ``url`` is a zarrckpt checkpoint that :func:`save_state` did not write.
        LayoutMismatchError: the prepared objects differ from the saved ones (another model, another
            number of models or registered objects, another parameter's shape); nothing is loaded.
        ZarrckptError: no ``url`` and automatic naming is off; and as for :func:`zarrckpt.load`.
    """
    if url is None:
        root = checkpoints_root(accelerator)
        step = from_rank_0(zarrckpt.latest_step(root, storage_options=storage_options) if rank() == 0 else None)
        if step is None:
            raise zarrckpt.CheckpointNotFoundError(f"load_state: no committed checkpoint under {root}")
        url = f"{root}/step_{int(step):010d}"
    where = str(url)
    ckpt = zarrckpt.open(where, storage_options=storage_options)
    saved = ckpt.metadata.get("accelerate")
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise zarrckpt.InvalidCheckpointError(
            f"{where} is a zarrckpt checkpoint, but not one zarrckpt.integrations.accelerate.save_state wrote "
            f"(its entry 'accelerate' is {saved!r:.100}); load it with zarrckpt.load"
        )
    world = ckpt.saved_world_size
    if world != accelerator.num_processes and accelerator.is_main_process:
        log.info(
            "%s was saved by %d processes, loading on %d: process r takes the RNG states of saved process r %% %d",
            where,
            world,
            accelerator.num_processes,
            world,
        )
    legacy = "rng.torch" not in ckpt  # saved as rank<r>.rng (zarrckpt before per-rank arrays)
    state = _state(accelerator, accelerator.process_index % world if legacy else None, saving=False, url=where)
    differences = [
        f"{kind}: {saved_as!r} saved, {state['accelerate']['objects'].get(kind)!r} prepared"
        for kind, saved_as in saved.get("objects", {}).items()
        if saved_as != state["accelerate"]["objects"].get(kind)
    ]
    if differences and strict:  # (Accelerate: a RuntimeError for registered objects, nothing for the rest)
        raise zarrckpt.LayoutMismatchError(
            f"{where} holds other objects than the Accelerator has prepared (models with a save_state_pre_hook "
            "taking them out count as not saved); nothing was loaded:\n  " + "\n  ".join(differences),
            differences,
        )
    zarrckpt.load(
        state, where, storage_options=storage_options, strict=strict, allow_pickle=allow_pickle, per_rank="modulo"
    )
    loaded = state["accelerate"]
    accelerator.step = int(loaded["step"])
    accelerator.project_configuration.iteration = int(loaded["iteration"]) + 1
    return where


def checkpoints_root(accelerator: Accelerator) -> str:
    """Where automatic checkpoint naming puts the checkpoints: ``<project_dir>/checkpoints``.

    Raises:
        ZarrckptError: the ``ProjectConfiguration`` has ``automatic_checkpoint_naming`` off.
    """
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise zarrckpt.ZarrckptError(
            "no url given and automatic checkpoint naming is off: pass a url, or give the Accelerator "
            "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)"
        )
    return f"{str(config.project_dir).rstrip('/')}/checkpoints"


# -- the state dict ---------------------------------------------------------------------------------


def _state(accelerator: Accelerator, rng_of: int | None, *, saving: bool, url: Any) -> dict[str, Any]:
    """What every rank saves (or loads into): Stateful wrappers around the prepared objects (the RNG
    states as ``rank<rng_of>.rng`` where ``rng_of`` is given: a checkpoint of the old layout)."""
    models = list(accelerator._models)
    if saving:  # Accelerate's pre-hooks: hook(models, weights, output_dir) may take weights out of the list
        weights = [_Model(m).state_dict() for m in models]
        kept = list(weights)
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(models, kept, url)
        chosen = {i: _Model(m, weights[i]) for i, m in enumerate(accelerator._models) if _holds(kept, weights[i])}
    else:  # hook(models, input_dir) may take models out of the list
        for hook in accelerator._load_model_state_pre_hook.values():
            hook(models, url)
        chosen = {i: _Model(m) for i, m in enumerate(accelerator._models) if _holds(models, m)}
    scaler = accelerator.scaler
    state: dict[str, Any] = {
        "accelerate": {
            "format": FORMAT,
            "step": int(accelerator.step),
            "iteration": int(accelerator.project_configuration.iteration),
            "mode": str(accelerator.distributed_type).rsplit(".", 1)[-1],
            "objects": {
                "models": sorted(chosen),
                "optimizers": len(accelerator._optimizers),
                "schedulers": len(accelerator._schedulers),
                "dataloaders": len(accelerator._dataloaders),
                "custom": len(accelerator._custom_objects),
                "scaler": scaler is not None and scaler.is_enabled(),
            },
        },
        "models": {str(i): m for i, m in chosen.items()},
        "optimizers": {
            str(i): _Optimizer(_owner(accelerator, i, opt), opt) for i, opt in enumerate(accelerator._optimizers)
        },
        "schedulers": {str(i): s for i, s in enumerate(accelerator._schedulers)},
        "dataloaders": {str(i): _Loader(dl) for i, dl in enumerate(accelerator._dataloaders)},
        "custom": {str(i): obj for i, obj in enumerate(accelerator._custom_objects)},
    }
    if rng_of is None:
        state["rng"] = _RNG()
    else:
        state[f"rank{rng_of}"] = {"rng": _RNG(per_rank=False)}
    if state["accelerate"]["objects"]["scaler"]:
        state["scaler"] = scaler
    return {k: v for k, v in state.items() if not (isinstance(v, dict) and not v)}  # no empty subtrees


def _holds(items: list[Any], item: Any) -> bool:
    return any(x is item for x in items)


class _Model:
    """A prepared model (FSDP2, FSDP1, DDP or plain) as DCP's ``get/set_model_state_dict`` see it."""

    def __init__(self, model: torch.nn.Module, state: dict[str, Any] | None = None) -> None:
        self.model, self.state = model, state

    def state_dict(self) -> dict[str, Any]:
        return self.state if self.state is not None else get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class _Optimizer:
    """An optimizer with the model holding its parameters: moments keyed by parameter name."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer

    def state_dict(self) -> dict[str, Any]:
        # on a fresh optimizer this also creates its state entries (a step with lr 0), for the load to fill
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def _owner(accelerator: Accelerator, index: int, optimizer: Any) -> torch.nn.Module:
    """The prepared model holding every parameter of the optimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params = {id(p) for group in inner.param_groups for p in group["params"]}
    owners = [m for m in accelerator._models if params <= {id(p) for p in m.parameters()}]
    if not owners:
        raise zarrckpt.ZarrckptError(
            f"optimizer {index} holds parameters of no single prepared model: zarrckpt names its moments by "
            "parameter name within one model (prepare the model together with it, or one optimizer per model)"
        )
    return owners[0]  # type: ignore[no-any-return]


class _Loader:
    """A prepared data loader: the epoch it is at (``set_epoch``) and its seedable sampler's seed."""

    def __init__(self, loader: Any) -> None:
        if getattr(loader, "use_stateful_dataloader", False):
            raise zarrckpt.ZarrckptError(
                "a data loader prepared with use_stateful_dataloader=True (torchdata's StatefulDataLoader) holds "
                "a position per process that does not carry over to another number of processes: not supported"
            )
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        sampler = _sampler(self.loader)
        return {
            "epoch": int(getattr(self.loader, "iteration", 0)),
            "seed": int(sampler.initial_seed) if sampler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = _sampler(self.loader)
        if sampler is not None and state["seed"] is not None:
            sampler.initial_seed = int(state["seed"])
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(state["epoch"]))


def _sampler(loader: Any) -> SeedableRandomSampler | None:
    get = getattr(loader, "get_sampler", None)
    sampler = get() if callable(get) else None
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


class _RNG:
    """This process's generators, as Accelerate's ``random_states_<rank>.pkl`` holds them: each a
    :class:`zarrckpt.PerRank` (``per_rank=False``: plain, as ``rank<r>.rng`` of old checkpoints)."""

    def __init__(self, per_rank: bool = True) -> None:
        self.per_rank = per_rank

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            cuda = torch.cuda.get_rng_state_all()
            state["cuda"] = torch.stack(cuda) if self.per_rank else {str(i): s for i, s in enumerate(cuda)}
        return {k: zarrckpt.PerRank(v) for k, v in state.items()} if self.per_rank else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {k: v.value if isinstance(v, zarrckpt.PerRank) else v for k, v in state.items()}
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            cuda = state["cuda"]
            torch.cuda.set_rng_state_all(
                list(cuda) if isinstance(cuda, torch.Tensor) else [cuda[str(i)] for i in range(len(cuda))]
            )
