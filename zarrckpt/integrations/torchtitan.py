"""torchtitan: a checkpoint manager, chosen in torchtitan's own config, that saves and loads through
zarrckpt (``pip install zarrckpt[torchtitan]``).

``Trainer.Config(checkpoint=ZarrCheckpointManager.Config(enable=True, folder=..., ...))``: the trainer
builds it with ``config.checkpoint.build(...)`` as it builds its own DCP ``CheckpointManager``, and
calls the same ``load`` / ``save`` / ``maybe_wait_for_staging`` / ``maybe_wait_for_saving`` /
``close``. A checkpoint holds the keys torchtitan's DCP checkpoint holds (the model's flattened at
the top, then ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``), each step in
``<folder>/step-N`` as a zarrckpt checkpoint: on local disk, ``s3://`` or ``gs://``, loadable on
any other world size and sharding. A restart resumes from the newest committed step (a save killed part
way is never one), and each save first takes over a save that died at its URL (on another host: once its
lease ran out); a save that still runs there is never touched.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

import zarrckpt
from zarrckpt.integrations.restarts import make_way

__all__ = ["ZarrCheckpointManager", "committed_steps", "latest_step"]

logger = logging.getLogger("zarrckpt.integrations.torchtitan")

_STEP = re.compile(r"^step-(\d+)$")
_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


def committed_steps(folder: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The steps of the committed ``step-N`` checkpoints in a manager's folder, in order (an
    incomplete save, a deletion under way and anything else in the folder do not count)."""
    try:
        found = zarrckpt.list_checkpoints(folder, storage_options=storage_options)
    except zarrckpt.CheckpointNotFoundError:
        return []
    steps = [int(m.group(1)) for name, state in found.items() if state == "committed" and (m := _STEP.match(name))]
    return sorted(steps)


def latest_step(folder: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """The newest committed step in a manager's folder, or -1 (torchtitan's ``_find_load_step``,
    for zarrckpt checkpoints)."""
    steps = committed_steps(folder, storage_options=storage_options)
    return steps[-1] if steps else -1


class ZarrCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # (torchtitan has no type hints)
    """torchtitan's checkpoint manager contract (``BaseCheckpointManager``) on zarrckpt.

    Built by the trainer from ``ZarrCheckpointManager.Config`` (``config.checkpoint.build(...)``),
    with the same keyword arguments as torchtitan's DCP ``CheckpointManager``. Every rank calls
    every method, as the trainer does.

    - ``save(step, last_step)``: at ``interval`` steps, the first step (``enable_first_step_checkpoint``)
      and the last; ``async_mode="async"`` copies the state to host memory and writes in the
      background (``zarrckpt.async_save``), ``"async_with_pinned_mem"`` also copies in the
      background, overlapping the next forward and backward pass until ``maybe_wait_for_staging()``
      (which the trainer calls right before ``optimizers.step()``). The last step is saved
      synchronously, the model only in ``export_dtype`` unless ``last_save_model_only=False``.
      A save that died at that step's URL (a restarted job saves the step it was killed saving) is
      taken over once it counts as dead; one that still runs there fails this save.
    - ``load(step=-1)``: the newest committed step in the folder (``load_step`` for another); step 0
      (a seed checkpoint) and model-only checkpoints load the model only; with no checkpoint in the
      folder, ``initial_load_path`` (the model only unless ``initial_load_model_only=False``): a
      zarrckpt checkpoint, or a ``step-N`` folder of torchtitan's own DCP manager (read through DCP).
      ``exclude_from_loading`` leaves states out.
    - ``keep_latest_k``: after each commit, rank 0 deletes the older committed checkpoints in the
      background; the newest committed one survives any failed or running save.
    - ``export_safetensors(out_dir)``: the model of a step as safetensors files.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: save synchronously; ``async``: copy, then write in the background;
        ``async_with_pinned_mem``: copy and write in the background (pinned host memory for GPU
        tensors), the copy finished by ``maybe_wait_for_staging()``."""

        storage_options: dict[str, Any] | None = None
        """fsspec / s3fs / gcsfs options (credentials, ``endpoint_url``), never saved in a checkpoint."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in _ASYNC_MODES:
                raise zarrckpt.ZarrckptError(
                    f"ZarrCheckpointManager: async_mode {self.async_mode!r} is not one of {', '.join(_ASYNC_MODES)}"
                )
            self.async_mode = mode  # type: ignore[assignment]  # (checked above)
            if self.last_save_in_hf or self.initial_load_in_hf:
                raise zarrckpt.ZarrckptError(
                    "ZarrCheckpointManager: last_save_in_hf and initial_load_in_hf (Hugging Face names through a "
                    "state dict adapter) are torchtitan's DCP manager's; here the last step is a zarrckpt "
                    "checkpoint, exported with manager.export_safetensors(out_dir) under the model's own names"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any | None,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any | None = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: zarrckpt.AsyncSave | None = None
        if not self.enable:
            return
        self.folder: str = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.folder = self.folder.rstrip("/")
        self.interval = config.interval
        self.storage_options = config.storage_options
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise zarrckpt.KeyNotFoundError(
                    f"exclude_from_loading: {key!r} is not a state of this trainer (states: {', '.join(self.states)})"
                )
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype: torch.dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.sd_adapter = sd_adapter
        self.async_mode: str = config.async_mode
        self.staging_future: zarrckpt.AsyncSave | None = None
        # the background writes' collectives get a group of their own, apart from the training's
        self.pg: Any = None
        if self.async_mode != "disabled" and dist.is_available() and dist.is_initialized():
            self.pg = dist.new_group(backend="gloo")
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._purge_queue: queue.Queue[bool | None] = queue.Queue()
        self._purge_thread: threading.Thread | None = None
        if self.keep_latest_k > 0 and self._rank == 0:
            self._purge_thread = threading.Thread(target=self._purge_loop, name="zarrckpt-purge", daemon=True)
            self._purge_thread.start()
        logger.info("torchtitan checkpoints go to %s (zarrckpt)", self.folder)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # (nothing to raise to at garbage collection)
            logger.exception("closing the checkpoint manager")

    # -- where checkpoints are

    def checkpoint_url(self, step: int) -> str:
        """The URL of step ``step``'s checkpoint: ``<folder>/step-<step>``."""
        return f"{self.folder}/step-{step}"

    def committed_steps(self) -> list[int]:
        """The committed steps in the folder, in order."""
        return committed_steps(self.folder, storage_options=self.storage_options)

    # -- saving

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _flattened(self, states: dict[str, Any]) -> dict[str, Any]:
        """The state as torchtitan's DCP checkpoint has it: the model's keys at the top, then the other
        states (stateful objects, saved through their ``state_dict()``); states that are None left out."""
        flat = {k: v for k, v in states.items() if k != MODEL and v is not None}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # one save in flight; a failed one raises here
        begin = time.monotonic()
        url = self.checkpoint_url(curr_step)
        if self._rank == 0:
            make_way(url, self.storage_options)
        if last_step:
            if self.last_save_model_only:
                states = {
                    k: v.to(self.export_dtype)
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
                    else v
                    for k, v in self.states[MODEL].state_dict().items()
                }
            else:
                states = self._flattened(self.states)
            zarrckpt.save(states, url, storage_options=self.storage_options, overwrite=True)
            self._request_purge()
        elif self.async_mode == "disabled":
            zarrckpt.save(self._flattened(self.states), url, storage_options=self.storage_options, overwrite=True)
            self._request_purge()
        else:
            pending = zarrckpt.async_save(
                self._flattened(self.states),
                url,
                storage_options=self.storage_options,
                process_group=self.pg,
                overwrite=True,
                staging="background" if self.async_mode == "async_with_pinned_mem" else "caller",
            )
            self.save_future = pending
            if self.async_mode == "async_with_pinned_mem":
                self.staging_future = pending
            pending.add_done_callback(lambda f: None if f.exception() else self._request_purge())
        logger.info(
            "%s step %d to %s in %.2f s",
            "saved" if last_step or self.async_mode == "disabled" else "started saving",
            curr_step,
            url,
            time.monotonic() - begin,
        )
        return True

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            pending, self.staging_future = self.staging_future, None
            pending.wait_staged()

    def _wait_for_saving(self) -> None:
        pending, self.save_future = self.save_future, None
        self.staging_future = None
        assert pending is not None
        pending.result()

    # -- retention

    def _request_purge(self) -> None:
        if self._purge_thread is not None:
            self._purge_queue.put(True)

    def _purge_loop(self) -> None:
        while self._purge_queue.get() is not None:
            try:
                steps = self.committed_steps()
                for step in steps[: -self.keep_latest_k]:
                    logger.info("deleting %s (keep_latest_k=%d)", self.checkpoint_url(step), self.keep_latest_k)
                    zarrckpt.delete(
                        self.checkpoint_url(step), storage_options=self.storage_options, committed_only=True
                    )
            except Exception:  # a failed deletion is retried after the next save, like torchtitan's
                logger.exception("deleting old checkpoints in %s", self.folder)

    # -- loading

    def _model_only_checkpoint(self, url: str) -> bool:
        """Whether the checkpoint holds no state but the model's (a last step saved with
        ``last_save_model_only``, a seed checkpoint, an exported model), asked on rank 0 only."""
        answer = [False]
        if self._rank == 0:
            ckpt = zarrckpt.open(url, storage_options=self.storage_options)
            others = [k for k in self.states if k != MODEL]
            names = list(ckpt.keys())
            answer = [not any(k in ckpt.metadata or any(n.startswith(f"{k}.") for n in names) for k in others)]
        return bool(self._from_rank_0(answer[0]))

    def _from_rank_0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (one answer from storage per job, not one per rank)."""
        if dist.is_available() and dist.is_initialized():
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return value

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        steps: list[int] = self._from_rank_0(self.committed_steps() if self._rank == 0 else None)
        if step != -1 and step not in steps:
            raise zarrckpt.CheckpointNotFoundError(
                f"load_step={step}: no committed checkpoint {self.checkpoint_url(step)} "
                f"(committed steps in {self.folder}: {steps or 'none'})"
            )
        load_step = step if step != -1 else (steps[-1] if steps else -1)
        if load_step == -1:
            if not self.initial_load_path:
                logger.info("no checkpoint in %s: a fresh start", self.folder)
                return False
            url, model_only = self.initial_load_path, self.initial_load_model_only
        else:  # the folder's checkpoints take precedence over initial_load_path (restarts keep their arguments)
            url = self.checkpoint_url(load_step)
            model_only = load_step == 0 or self._model_only_checkpoint(url)
            if model_only and load_step != 0 and not self._only_model_wanted():
                raise zarrckpt.LayoutMismatchError(
                    f"{url} holds the model only (a last step saved with last_save_model_only=True): nothing to "
                    "resume training from; load an earlier step (load_step), or start a new folder from it "
                    "with initial_load_path"
                )
        begin = time.monotonic()
        kept = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        target = self.states[MODEL].state_dict() if model_only else self._flattened(kept)
        if load_step == -1 and self._is_dcp(url):  # a checkpoint of torchtitan's own (DCP) manager
            dcp_load(target, checkpoint_id=url)
        else:  # (model only: cast, as DCP does, for an export in another dtype)
            zarrckpt.load(target, url, storage_options=self.storage_options, cast=model_only)
        self.states[MODEL].load_state_dict(target)  # as torchtitan does: hook-produced tensors, the cache
        logger.info("loaded %s%s in %.2f s", url, " (model only)" if model_only else "", time.monotonic() - begin)
        return True

    def _is_dcp(self, url: str) -> bool:
        """Whether ``url`` holds no zarrckpt checkpoint but a DCP one (its ``.metadata``), asked on rank 0."""
        answer = [False]
        if self._rank == 0:
            try:
                zarrckpt.open(url, storage_options=self.storage_options)
            except (zarrckpt.CheckpointNotFoundError, zarrckpt.InvalidCheckpointError):
                fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
                answer = [bool(fs.isfile(f"{path.rstrip('/')}/.metadata"))]
            except zarrckpt.ZarrckptError:
                pass  # (an incomplete or damaged zarrckpt checkpoint: its load says what is wrong)
        return bool(self._from_rank_0(answer[0]))

    def _only_model_wanted(self) -> bool:
        return all(k == MODEL or k in self.exclude_from_loading or v is None for k, v in self.states.items())

    # -- export, close

    def export_safetensors(
        self, out_dir: str, *, step: int = -1, dtype: torch.dtype | str | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Write the model of step ``step`` (default: the newest committed) to ``out_dir`` as
        safetensors files, under the model's own names (``layers.0.attention.wq.weight``), cast to
        ``dtype`` (default: the config's ``export_dtype``). Call it on one process (rank 0); it reads
        the checkpoint, not the live model. ``kwargs`` go to :func:`zarrckpt.export_safetensors`.

        Raises:
            CheckpointNotFoundError: no committed checkpoint at that step.
        """
        steps = self.committed_steps()
        chosen = step if step != -1 else (steps[-1] if steps else -1)
        if chosen not in steps:
            raise zarrckpt.CheckpointNotFoundError(
                f"export_safetensors: no committed checkpoint {self.checkpoint_url(chosen)} "
                f"(committed steps in {self.folder}: {steps or 'none'})"
            )
        url = self.checkpoint_url(chosen)
        ckpt = zarrckpt.open(url, storage_options=self.storage_options)
        others = tuple(f"{k}." for k in self.states if k != MODEL)
        model_keys = [k for k in ckpt.keys() if not k.startswith(others)]  # noqa: SIM118 (a list)
        return zarrckpt.export_safetensors(
            ckpt,
            out_dir,
            include=[re.sub(r"([\[\]*?])", r"[\1]", k) for k in model_keys],  # fnmatch, escaped
            dtype=dtype if dtype is not None else self.export_dtype,
            **kwargs,
        )

    def _close(self) -> None:
        try:
            if getattr(self, "save_future", None) is not None:
                self._wait_for_saving()
        finally:
            thread = getattr(self, "_purge_thread", None)
            if thread is not None and thread.is_alive():
                self._request_purge()  # after the last commit (its callback may come later)
                self._purge_queue.put(None)
                thread.join()
            self._purge_thread = None
