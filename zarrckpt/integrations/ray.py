"""Ray Train: every worker of a ``TorchTrainer`` saves its shards of the state as one zarrckpt
checkpoint that Ray reports, lists, keeps or deletes, and a run with any other number of workers
restores it from ``ray.train.get_checkpoint()`` (``pip install zarrckpt[ray]``).

Where the checkpoint goes, and why. ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))``
copies each worker's local directory ``d`` into ``<storage_path>/<run name>/<checkpoint dir>``
(``pyarrow.fs.copy_files``, ``CheckpointUploadMode.SYNC``), and the controller keeps the first
checkpoint of the round, requiring every worker that reported one to name the same path. A
zarrckpt save needs none of that: every rank writes its own shards straight to their final URL, in
parallel, and the commit marker goes last. So :func:`save` writes the checkpoint *into Ray's own
checkpoint directory*, ``<experiment dir>/step_<10-digit step>`` on Ray's storage (local path,
``s3://``, ``gs://``), and :func:`report` hands Ray that directory with
``CheckpointUploadMode.NO_UPLOAD``: nothing is copied, nothing passes through one node, and the
checkpoint is a "managed" one (Ray checks it lies under the experiment directory), so
``CheckpointConfig(num_to_keep)`` deletes old ones, ``Result.checkpoint`` / ``best_checkpoints``
name them, and a run restarted with the same ``RunConfig(name, storage_path)`` gets the latest from
``ray.train.get_checkpoint()``. A tiny "pointer" directory holding a URL elsewhere was the other
choice; it would leave Ray deleting pointers while the data lives on, two retention policies to
keep in step. Retention is therefore Ray's (``CheckpointConfig(num_to_keep=...)``), not
:class:`zarrckpt.CheckpointManager`'s; the names follow the manager's ``step_<10 digits>`` so
``zarrckpt.latest_step`` / ``committed_steps`` / ``zarrckpt ls`` read Ray's experiment directory.

Every worker calls :func:`report` (Ray's ``report`` is a barrier all workers must reach; each
reports the same checkpoint), after the save has committed: a checkpoint Ray knows is always
whole. ``report(..., async_save=True)`` starts :func:`zarrckpt.async_save` and reports with
``CheckpointUploadMode.ASYNC`` and an upload function that only waits for the commit: training
goes on while the shards are written, and Ray registers the checkpoint once it is committed (a
failed save fails the run, as Ray does with a failed upload).

A job killed between a commit and its report leaves a committed checkpoint Ray never registered;
its restart resumes from an older step and saves that step again. So a save at a step after the
one ``ray.train.get_checkpoint()`` resumed from replaces what is there (``overwrite=True``, decided
the same way on every worker, without looking at the storage); any other existing checkpoint raises
:class:`zarrckpt.CheckpointExistsError`. When Ray has no checkpoint to resume from at all (the job
was killed between its first commit and its report), :func:`load` resumes from the newest committed
``step_`` checkpoint of the run directory instead of starting from scratch (logged at WARNING).
Before every save, rank 0 waits for a save that died at its URL (killed, maybe on another host: then
for its lease) to count as dead, and the save takes it over; a save that still runs is never touched.
Ray Train v2 only (the default of Ray 2.60): v1 has no ``NO_UPLOAD`` reports.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import PurePosixPath
from typing import Any

import pyarrow.fs
import ray.train

import zarrckpt
from zarrckpt.integrations.restarts import from_rank_0, make_way, rank

__all__ = ["checkpoint_url", "load", "report", "run_storage", "save"]

_STEP_DIR = re.compile(r"^step_(\d{10})$")  # zarrckpt.CheckpointManager's names, which zarrckpt.latest_step reads
_HOW = "save it with zarrckpt.integrations.ray.report (or save), or load it the way it was saved"
log = logging.getLogger("zarrckpt")
_saved_here: set[str] = set()  # URLs this worker process saved: saving one twice is refused, as in zarrckpt.save


def run_storage(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ray Train's storage at ``url`` (a local path, ``s3://``, ``gs://``) with the store's endpoint
    and credentials: ``RunConfig(name=..., **run_storage(url, storage_options=opts))``.

    Remote, it is ``storage_path`` plus a ``storage_filesystem`` over the fsspec filesystem zarrckpt
    uses (:func:`zarrckpt.fsspec_filesystem`), so that Ray's own files (its snapshot of the run's
    checkpoints, ...) go to the same endpoint with the same credentials as the checkpoints, and
    :func:`report` / :func:`load` take the options from it. Ray's own pyarrow S3 and GCS filesystems
    read the endpoint from the environment only, and pyarrow's S3 uploads fail on some S3 servers
    (``HTTP 411 MissingContentLength`` on Ceph RGW); on ``gs://`` Ray's default gcsfs class stalls
    asking for the bucket's type where nothing answers it. Local paths come back as they are.
    """
    path = str(url)
    if "://" not in path or path.startswith("file://"):
        return {"storage_path": path.removeprefix("file://")}
    fs, root = zarrckpt.fsspec_filesystem(path, storage_options)
    return {"storage_path": root, "storage_filesystem": pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))}


def checkpoint_url(checkpoint: ray.train.Checkpoint) -> str:
    """The zarrckpt URL of a Ray checkpoint's directory: a local path, ``s3://``, ``gs://``, or the
    URL of the fsspec filesystem behind ``RunConfig(storage_filesystem=PyFileSystem(FSSpecHandler(fs)))``.
    For ``zarrckpt.open``, ``zarrckpt.load``, ``export_safetensors`` and the command line, anywhere
    (a worker, the driver with ``result.checkpoint``, a notebook).

    Raises:
        ZarrckptError: the checkpoint lives on a filesystem zarrckpt has no URL for (HDFS, a mock).
    """
    return _url(checkpoint.filesystem, checkpoint.path)


def save(
    state_dict: Mapping[str, Any],
    step: int,
    *,
    checkpoint_dir_name: str | None = None,
    storage_options: dict[str, Any] | None = None,
    **save_options: Any,
) -> ray.train.Checkpoint:
    """Save ``state_dict`` into this run's checkpoint directory for ``step``; every worker calls it,
    each writing its own shards (DTensors, FSDP2 state, ``zarrckpt.LocalShard``s; see
    :func:`zarrckpt.save`). Returns the Ray checkpoint naming it, for
    ``ray.train.report(metrics, checkpoint=..., checkpoint_dir_name=checkpoint_dir_name,
    checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)``, which :func:`report` does.

    Args:
        step: names the directory ``step_<10-digit step>`` (unless ``checkpoint_dir_name``); the same
            on every worker.
        checkpoint_dir_name: another name for the directory, the same on every worker.
        storage_options: for fsspec (credentials, ``endpoint_url``); the default for a Ray storage
            given as an fsspec filesystem is that filesystem's own options. Ray's pyarrow filesystems
            carry no credentials zarrckpt can read: the environment's are used (``AWS_*``, ...).
        save_options: passed to :func:`zarrckpt.save` (``overwrite``, ``chunk_bytes``, ``progress``, ...).

    A checkpoint already committed at a step after the one this run resumed from (Ray's
    ``get_checkpoint()``) was never reported (its run died between the commit and the report) and
    is replaced; any other one already there raises :class:`zarrckpt.CheckpointExistsError`. A save
    that died there (a restart saves the step its predecessor was killed saving, maybe on another
    host) is taken over once it counts as dead: its writer gone from this host, or its marker the
    lease without a heartbeat (rank 0 waits for that).

    Raises:
        ZarrckptError: not called inside a Ray Train worker, or a bad ``step`` / ``checkpoint_dir_name``.
        CheckpointExistsError: a checkpoint is already there (see above).
        IncompleteCheckpointError: another save there still runs (it is never replaced).
    """
    url, checkpoint, options = _target(step, checkpoint_dir_name, storage_options, save_options)
    zarrckpt.save(state_dict, url, storage_options=options, **save_options)
    _saved_here.add(url)
    return checkpoint


def report(
    metrics: dict[str, Any],
    state_dict: Mapping[str, Any],
    step: int,
    *,
    checkpoint_dir_name: str | None = None,
    storage_options: dict[str, Any] | None = None,
    async_save: bool = False,
    **save_options: Any,
) -> ray.train.Checkpoint:
    """:func:`save`, then ``ray.train.report(metrics, checkpoint)`` without a copy; every worker
    calls it (Ray keeps rank 0's ``metrics``). Returns the reported checkpoint.

    With ``async_save=True`` the save is a :func:`zarrckpt.async_save` (``save_options`` may then
    hold its ``staging_budget_bytes``): the call returns once this worker's state is copied to host
    memory, and Ray registers the checkpoint when it is committed. Ray waits for the commit before
    the run ends; a failed save fails the run. ``staging="background"`` is refused: the loop would
    need the save's ``wait_staged()``, which Ray's report does not hand back.
    """
    if async_save and save_options.get("staging", "caller") != "caller":
        raise zarrckpt.ZarrckptError(
            "report(async_save=True) stages with staging='caller' (it returns once the state is copied); "
            "for staging='background' call zarrckpt.async_save and save()'s checkpoint yourself"
        )
    url, checkpoint, options = _target(step, checkpoint_dir_name, storage_options, save_options)
    name = PurePosixPath(checkpoint.path).name
    if not async_save:
        zarrckpt.save(state_dict, url, storage_options=options, **save_options)
        _saved_here.add(url)
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
        )
        return checkpoint
    pending = zarrckpt.async_save(state_dict, url, storage_options=options, **save_options)
    _saved_here.add(url)

    def committed(reported: ray.train.Checkpoint, _name: str) -> ray.train.Checkpoint:
        pending.result()  # Ray's upload thread: the checkpoint is registered once committed
        return reported

    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_dir_name=name,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=committed,
        delete_local_checkpoint_after_upload=False,  # ASYNC's default would delete the checkpoint itself
    )
    return checkpoint


def load(
    state_dict: MutableMapping[str, Any],
    checkpoint: ray.train.Checkpoint | str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    **load_options: Any,
) -> str | None:
    """Load a zarrckpt checkpoint into ``state_dict`` in place, on any number of workers (every
    worker calls it, each reading only the chunks its shards need; see :func:`zarrckpt.load`).

    Args:
        checkpoint: a Ray checkpoint (default: ``ray.train.get_checkpoint()``, what a restarted run
            resumes from), or a zarrckpt URL (a checkpoint saved by ``zarrckpt.save`` anywhere).
        storage_options: as for :func:`save`.
        load_options: passed to :func:`zarrckpt.load` (``strict``, ``keys``, ``cast``, ...).

    Without ``checkpoint``, when Ray has none (its job was killed between its first commit and its
    report) or Ray's holds no committed checkpoint, the newest committed ``step_`` checkpoint of the
    run directory is loaded (logged at WARNING); one that does not fit ``state_dict`` is not (logged).

    Returns:
        The URL loaded, or None when there is nothing to resume from (``state_dict`` untouched).

    Raises:
        CheckpointNotFoundError: the Ray checkpoint holds no zarrckpt checkpoint (Ray's own
            ``Checkpoint.from_directory`` of other files), or nothing is at the URL.
        IncompleteCheckpointError: its save never committed.
        ZarrckptError: no ``checkpoint`` given outside a Ray Train worker.
    """
    resuming = checkpoint is None
    if checkpoint is None:
        checkpoint = _in_worker(ray.train.get_checkpoint, "load() without a checkpoint")
        if checkpoint is None:
            return _unreported(state_dict, "Ray has no checkpoint to resume from", storage_options, load_options)
    if isinstance(checkpoint, ray.train.Checkpoint):
        url = checkpoint_url(checkpoint)
        options = storage_options if storage_options is not None else _fsspec_options(checkpoint.filesystem)
        try:
            zarrckpt.load(state_dict, url, storage_options=options, **load_options)
        except (zarrckpt.CheckpointNotFoundError, zarrckpt.IncompleteCheckpointError) as e:
            fallback = (
                _unreported(state_dict, f"Ray's latest, {url}, is not committed ({e})", storage_options, load_options)
                if resuming
                else None
            )
            if fallback is not None:
                return fallback
            if isinstance(e, zarrckpt.IncompleteCheckpointError):
                raise
            raise zarrckpt.CheckpointNotFoundError(
                f"Ray checkpoint {url} holds no zarrckpt checkpoint{_listing(checkpoint)}: {_HOW}"
            ) from e
        except zarrckpt.InvalidCheckpointError as e:  # other files there ("not a zarrckpt checkpoint"), or damage
            raise zarrckpt.InvalidCheckpointError(f"Ray checkpoint {url}: {e}; {_HOW}") from e
        return url
    url = os.fspath(checkpoint)
    zarrckpt.load(state_dict, url, storage_options=storage_options, **load_options)
    return url


def _unreported(
    state_dict: MutableMapping[str, Any], why: str, storage_options: dict[str, Any] | None, load_options: dict[str, Any]
) -> str | None:
    """Load the newest committed ``step_`` checkpoint of the run directory, which Ray does not know:
    a job killed between a commit and its report leaves one. None: there is none, or it does not fit."""
    storage = _in_worker(ray.train.get_context, "load() without a checkpoint").get_storage()
    root = _url(storage.storage_filesystem, storage.experiment_fs_path)
    options = storage_options if storage_options is not None else _fsspec_options(storage.storage_filesystem)
    steps = from_rank_0(zarrckpt.committed_steps(root, storage_options=options) if rank() == 0 else None)
    if not steps:
        return None
    url = f"{root}/step_{steps[-1]:010d}"
    try:
        zarrckpt.load(state_dict, url, storage_options=options, **load_options)
    except zarrckpt.LayoutMismatchError as e:  # (nothing loaded) another job's leftover: not ours to resume
        log.warning(
            "%s; %s, the newest committed checkpoint there, does not fit the state: starting afresh (%s)", why, url, e
        )
        return None
    log.warning("%s: resuming from %s, the newest committed checkpoint of the run (never reported to Ray)", why, url)
    return url


def _target(
    step: int, name: str | None, storage_options: dict[str, Any] | None, save_options: dict[str, Any]
) -> tuple[str, ray.train.Checkpoint, dict[str, Any] | None]:
    """The URL to save ``step`` at, the Ray checkpoint naming it and the storage options; decides
    ``overwrite`` (in ``save_options``) the same way on every worker."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise zarrckpt.ZarrckptError(f"step must be an int >= 0, not {step!r}")
    if name is not None and (not name or "/" in name or name in (".", "..")):
        raise zarrckpt.ZarrckptError(f"checkpoint_dir_name must be one directory name, not {name!r}")
    if not hasattr(ray.train, "CheckpointUploadMode"):
        raise zarrckpt.ZarrckptError(
            "zarrckpt.integrations.ray needs Ray Train v2 (RAY_TRAIN_V2_ENABLED=1, the default)"
        )
    context = _in_worker(ray.train.get_context, "save() and report()")
    storage = context.get_storage()
    path = PurePosixPath(storage.experiment_fs_path, name or f"step_{step:010d}").as_posix()
    checkpoint = ray.train.Checkpoint(path, filesystem=storage.storage_filesystem)
    url = checkpoint_url(checkpoint)
    if url in _saved_here:
        raise zarrckpt.CheckpointExistsError(f"Checkpoint already exists: {url} (this run saved it already)")
    if "overwrite" not in save_options and name is None:
        resumed = _step_of(ray.train.get_checkpoint())
        save_options["overwrite"] = resumed is None or step > resumed  # an unreported leftover: replace it
    options = storage_options if storage_options is not None else _fsspec_options(storage.storage_filesystem)
    if rank() == 0:
        make_way(url, options)
    return url, checkpoint, options


def _step_of(checkpoint: ray.train.Checkpoint | None) -> int | None:
    """The step of a checkpoint :func:`save` named (None: no checkpoint, or another name)."""
    match = _STEP_DIR.match(PurePosixPath(checkpoint.path).name) if checkpoint is not None else None
    return int(match.group(1)) if match else None


def _url(filesystem: pyarrow.fs.FileSystem | None, path: str) -> str:
    kind = filesystem.type_name if filesystem is not None else "local"
    if kind == "local":
        return path
    if kind == "s3":
        return f"s3://{path}"
    if kind == "gcs":
        return f"gs://{path}"
    handler = getattr(filesystem, "handler", None)
    if isinstance(filesystem, pyarrow.fs.PyFileSystem) and isinstance(handler, pyarrow.fs.FSSpecHandler):
        url: str = handler.fs.unstrip_protocol(path)
        return url
    raise zarrckpt.ZarrckptError(
        f"Ray's storage filesystem {kind!r} has no URL zarrckpt can write to: use a local path, s3://, "
        "gs://, or RunConfig(storage_filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))"
    )


def _fsspec_options(filesystem: pyarrow.fs.FileSystem) -> dict[str, Any] | None:
    """The options of the fsspec filesystem behind a ``PyFileSystem(FSSpecHandler(fs))``, else None."""
    handler = getattr(filesystem, "handler", None)
    if isinstance(handler, pyarrow.fs.FSSpecHandler):
        return dict(handler.fs.storage_options) or None
    return None


def _listing(checkpoint: ray.train.Checkpoint) -> str:
    """`` (it holds: a, b)``, the first names in the checkpoint's directory, or ``` (nothing there)```."""
    filesystem = checkpoint.filesystem or pyarrow.fs.LocalFileSystem()
    try:
        infos = filesystem.get_file_info(pyarrow.fs.FileSelector(checkpoint.path))
    except (FileNotFoundError, OSError):
        return " (nothing there)"
    names = sorted(PurePosixPath(info.path).name for info in infos)
    return f" (it holds: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else " (it is empty)"


def _in_worker(call: Any, what: str) -> Any:
    """``call()``, a Ray Train call that needs a worker's context; outside one, a clear error."""
    try:
        return call()
    except RuntimeError as e:
        raise zarrckpt.ZarrckptError(
            f"zarrckpt.integrations.ray: {what} run inside a Ray Train worker (the train_loop_per_worker "
            f"of a TorchTrainer): {e}"
        ) from e
