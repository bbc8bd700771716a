"""Restarts through the framework adapters (issue 38, "a save that returned OK stays saved").

Killed during a save: a real training job (tests/adapter_kill_worker.py) exits inside the save at the
dangerous moment (Lightning: re-saving ``last.ckpt`` in place, the old one already deleted; Ray: after
the commit, before Ray registered it; Accelerate and torchtitan: a save of the next step begun), and
the restarted job resumes from the newest committed checkpoint, never from step 0.

Restarted on another host: the killed writer's marker names another host, so only its lease (here
``ZARRCKPT_LEASE_SECONDS=1``) tells that it is dead; the restarted job's save to that place waits for
the lease and then saves, and a save that is still running there (its heartbeat fresh) is never
touched: the adapter's save fails, and the running one commits.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.engine import markers
from zarrckpt.format.manifest import PENDING
from zarrckpt.storage.store import Storage

pytestmark = pytest.mark.filterwarnings("ignore")  # the frameworks' notes on the CPU
WORKER = Path(__file__).with_name("adapter_kill_worker.py")
ROOT = WORKER.parents[1]
LEASE = 1.0


def kill_in(adapter: str, root: str, steps: int, where: str, options: dict[str, Any] | None, **extra: str) -> str:
    """Run the worker until it exits inside the save ``where`` (``NAME:K``); its output."""
    cmd = [sys.executable, str(WORKER), adapter, root, str(steps), "--kill-in", where]
    cmd += [*(["--options", json.dumps(options)] if options else []), *[f"--{k}={v}" for k, v in extra.items()]]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **env})
    assert done.returncode == 137 and "killed in" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def restart(adapter: str, root: str, steps: int, options: dict[str, Any] | None, capsys: Any, **extra: Any) -> int:
    """The worker's job again, in this process (its framework is imported once); the step it resumed from."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import adapter_kill_worker as worker
    finally:
        sys.path.remove(str(WORKER.parent))
    args = Namespace(**{"adapter": adapter, "root": root, "steps": steps, "kill_in": None, "step_seconds": 0.0} | extra)
    args.registry = getattr(args, "registry", None)
    capsys.readouterr()
    run = {"accelerate": worker.run_accelerate, "torchtitan": worker.run_torchtitan, "ray": worker.run_ray}
    run.get(adapter, worker.run_lightning)(args, options)
    out = capsys.readouterr().out
    resumed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("resumed ")]
    assert len(resumed) == 1, out
    return resumed[0]


@pytest.fixture(params=["local", "rgw"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """A fresh root on local disk, or on a Ceph RADOS Gateway."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    url, options = request.getfixturevalue("rgw_url")
    return url, options


@pytest.fixture
def lease(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """A lease of 1 s (2 s on the gateway, whose modification times have whole seconds: a marker
    written just now can look up to a second old), and heartbeats every 0.2 s (a running save's here)."""
    seconds = (
        2 * LEASE
        if getattr(request.node, "callspec", None) and request.node.callspec.params.get("where") == "rgw"
        else LEASE
    )
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", str(seconds))
    monkeypatch.setattr(markers, "HEARTBEAT_SECONDS", 0.2)
    return seconds


def died_elsewhere(url: str, options: dict[str, Any] | None) -> None:
    """What a save killed half-way on another host leaves at ``url``: its pending marker, written just
    now (its last heartbeat), naming a writer on another host, and part of a shard."""
    storage = Storage(url, options)
    doc = markers.marker_doc("died-elsewhere")
    doc["writer"] = {"host": "another-host", "pid": 1}
    storage.write(PENDING, [json.dumps(doc).encode()])
    storage.write("model/w/c.0.0", [b"half of a shard"])


@contextmanager
def running_save(url: str, options: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A save to ``url`` that is running (its heartbeat fresh) until the block ends, then commits; it
    must commit its own data, untouched."""
    go = threading.Event()
    real = Storage.write

    def held(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        if self.url.rstrip("/") == url.rstrip("/") and "/c." in path:
            go.wait(60)
        real(self, path, parts, **kwargs)

    monkeypatch.setattr(Storage, "write", held)
    data = torch.arange(16.0).reshape(4, 4)  # (not constant: a constant array has no chunks to write)
    saving = zarrckpt.async_save({"live": {"w": data}}, url, storage_options=options)
    for _ in range(200):
        if PENDING in Storage(url, options).names():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the save to {url} did not start")
    try:
        yield
    finally:
        go.set()
        saving.result(timeout=60)
        monkeypatch.setattr(Storage, "write", real)
    back = {"live": {"w": torch.zeros(4, 4)}}
    zarrckpt.load(back, url, storage_options=options)
    assert torch.equal(back["live"]["w"], data), "the running save committed its own data"


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    began = time.monotonic()
    return fn(*args, **kwargs), time.monotonic() - began


# -- PyTorch Lightning ----------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_killed_in_its_last_resave_resumes_from_the_newest_committed(
    where: tuple[str, dict[str, Any] | None], capsys: Any, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed re-saving ``last.ckpt`` at step 3 (the old one deleted, the new one begun): no last
    checkpoint is committed, ``epoch=0-step=3.ckpt`` is. ``last_checkpoint`` and ``ZarrModelCheckpoint``
    (``ckpt_path="last"``) resume from it, saying so; the restart's ``last.ckpt`` takes the dead save over."""
    pytest.importorskip("lightning")
    from zarrckpt.integrations.lightning import last_checkpoint

    root, options = where
    if options:
        monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
        _fresh_s3fs(monkeypatch)
    kill_in("lightning-last", root, 6, "last.ckpt:3", options)
    ckpts = f"{root}/ckpts"
    assert zarrckpt.list_checkpoints(ckpts, storage_options=options) == {
        "epoch=0-step=3.ckpt": "committed",
        "last.ckpt": "incomplete",
    }
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert last_checkpoint(ckpts, storage_options=options) == f"{ckpts}/epoch=0-step=3.ckpt"
    assert (
        "resuming from epoch=0-step=3.ckpt (global step 3)" in caplog.text and "last.ckpt is incomplete" in caplog.text
    )
    assert restart("lightning-last", root, 5, options, capsys) == 3  # ZarrModelCheckpoint, ckpt_path="last"
    assert last_checkpoint(ckpts, storage_options=options) == f"{ckpts}/last.ckpt"
    assert zarrckpt.open(f"{ckpts}/last.ckpt", storage_options=options).metadata["lightning"][0]["global_step"] == 5


def test_lightning_restart_on_another_host_waits_for_the_lease(
    where: tuple[str, dict[str, Any] | None], lease: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``last.ckpt`` holds a save killed on another host a moment ago: the save waits for its lease,
    then takes it over. A save still running elsewhere is never replaced: this one fails instead."""
    pytest.importorskip("lightning")
    from zarrckpt.integrations.lightning import ZarrCheckpointIO

    root, options = where
    io = ZarrCheckpointIO(options)
    died_elsewhere(f"{root}/last.ckpt", options)
    _, took = timed(io.save_checkpoint, {"global_step": 7, "w": torch.ones(3)}, f"{root}/last.ckpt")
    assert took >= 0.8 * LEASE, f"saved after {took:.2f} s: the dead save was taken over before its lease ran out"
    assert io.load_checkpoint(f"{root}/last.ckpt")["global_step"] == 7
    with (
        running_save(f"{root}/epoch=0-step=8.ckpt", options, monkeypatch),
        pytest.raises(zarrckpt.IncompleteCheckpointError, match="is in progress"),
    ):
        io.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, f"{root}/epoch=0-step=8.ckpt")


def test_lightning_save_replaces_what_a_save_killed_early_left(tmp_path: Path, lease: float) -> None:
    """Leftovers without a heartbeat to wait for (found by benchmarks/adapter_kill_trials.py): a job
    killed between the first two requests of ``last.ckpt``'s re-save (its manifest replaced by a
    tombstone, no deleting marker yet), or while creating its pending marker (only the marker's
    temporary file there, which counts as dead once the lease has passed it). The restart's save
    replaces them, as a save with ``overwrite`` does: no running save is there, and refusing would end
    the restarted job."""
    pytest.importorskip("lightning")
    from zarrckpt.format.manifest import MANIFEST, tombstone
    from zarrckpt.integrations.lightning import ZarrCheckpointIO

    io, url = ZarrCheckpointIO(), str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, url)
    doc = markers.marker_doc("")
    doc["writer"] = {**doc["writer"], "pid": _dead_pid()}  # its writer on this host, gone
    Storage(url).write(MANIFEST, [tombstone(doc)])
    assert zarrckpt.list_checkpoints(tmp_path) == {"last.ckpt": "deleting"}
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, url)
    assert io.load_checkpoint(url)["global_step"] == 2
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / f"{PENDING}.0123456789ab.tmp").write_text('{"save_id": "0')  # killed creating it
    assert zarrckpt.list_checkpoints(tmp_path)["step-4"] == "incomplete"
    io.save_checkpoint({"global_step": 4, "w": torch.ones(3)}, tmp_path / "step-4")
    assert io.load_checkpoint(tmp_path / "step-4")["global_step"] == 4


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- Accelerate -----------------------------------------------------------------------------------


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One process without a process group, Accelerate's state reset before and after."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.slow
def test_accelerate_killed_while_saving_resumes_from_the_newest_committed(
    tmp_path: Path, alone: None, capsys: Any
) -> None:
    root = str(tmp_path / "run")
    kill_in("accelerate", root, 5, "step_0000000002:1", None)  # saving its 3rd step
    assert zarrckpt.committed_steps(f"{root}/checkpoints") == [0, 1]
    assert restart("accelerate", root, 4, None, capsys) == 2
    assert zarrckpt.committed_steps(f"{root}/checkpoints") == [2, 3]  # (total_limit=2)


def test_accelerate_restart_on_another_host_waits_for_the_lease(
    where: tuple[str, dict[str, Any] | None], lease: float, alone: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restarted job saves the iteration its predecessor was killed saving, on another host:
    it waits for the lease, then saves (it raised "wait 30 s" before, and the job died)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from zarrckpt.integrations.accelerate import checkpoints_root, load_state, save_state

    root, options = where
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(root, automatic_checkpoint_naming=True))
    accelerator.prepare(torch.nn.Linear(4, 4))
    save_state(accelerator, storage_options=options)  # step_0000000000
    died_elsewhere(f"{checkpoints_root(accelerator)}/step_0000000001", options)
    assert load_state(accelerator, storage_options=options).endswith("step_0000000000")
    url, took = timed(save_state, accelerator, storage_options=options)
    assert url.endswith("step_0000000001") and took >= 0.8 * LEASE, took
    assert zarrckpt.committed_steps(checkpoints_root(accelerator), storage_options=options) == [0, 1]
    if options is None:  # (the same code on every store: on the gateway, Lightning's test runs it)
        with (
            running_save(f"{root}/mine", options, monkeypatch),
            pytest.raises(zarrckpt.IncompleteCheckpointError, match="is in progress"),
        ):  # replacing one's own checkpoint: never a running save
            save_state(accelerator, f"{root}/mine", storage_options=options, overwrite=True)


# -- torchtitan -----------------------------------------------------------------------------------


def _titan(folder: str, options: dict[str, Any] | None) -> tuple[Any, Any]:
    """torchtitan's objects in this process and their ZarrCheckpointManager (saving every step)."""
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from zarrckpt.integrations.torchtitan import ZarrCheckpointManager

    model = torch.nn.Linear(4, 4)
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=9)
    config = ZarrCheckpointManager.Config(enable=True, folder=folder, interval=1, storage_options=options)
    manager = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
    )
    return manager, model


@pytest.mark.slow
def test_torchtitan_killed_while_saving_resumes_from_the_newest_committed(tmp_path: Path, capsys: Any) -> None:
    root = str(tmp_path / "run")
    kill_in("torchtitan", root, 5, "step-3:1", None)
    assert zarrckpt.list_checkpoints(root) == {"step-1": "committed", "step-2": "committed", "step-3": "incomplete"}
    assert restart("torchtitan", root, 4, None, capsys) == 2
    assert zarrckpt.list_checkpoints(root) == {"step-3": "committed", "step-4": "committed"}  # (keep_latest_k=2)


def test_torchtitan_restart_on_another_host_waits_for_the_lease(
    where: tuple[str, dict[str, Any] | None], lease: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restarted job saves the step its predecessor was killed saving on another host: it waits
    for the lease, then saves (it replaced the save at once before, running or not); a running save
    is never replaced."""
    root, options = where
    manager, model = _titan(root, options)
    died_elsewhere(f"{root}/step-2", options)
    saved, took = timed(manager.save, 2)
    assert saved and took >= 0.8 * LEASE, (
        f"saved after {took:.2f} s: the dead save was taken over before its lease ran out"
    )
    if options is None:  # (the same code on every store: on the gateway, Lightning's test runs it)
        with (
            running_save(f"{root}/step-3", options, monkeypatch),
            pytest.raises(zarrckpt.IncompleteCheckpointError, match="is in progress"),
        ):
            manager.save(3)
    manager.close()
    weight = zarrckpt.open(f"{root}/step-2", storage_options=options)["weight"][...]
    assert torch.equal(weight, model.weight.detach())


# -- Ray Train ------------------------------------------------------------------------------------


@pytest.fixture
def ray_worker() -> Iterator[Any]:
    """The worker's stand-in for a Ray Train worker's context patches ``ray.train``: put it back."""
    ray_train = pytest.importorskip("ray.train")
    real = {name: getattr(ray_train, name) for name in ("get_context", "get_checkpoint", "report")}
    yield ray_train
    for name, value in real.items():
        setattr(ray_train, name, value)


@pytest.mark.slow
def test_ray_killed_between_commit_and_report_resumes_from_the_commit(
    where: tuple[str, dict[str, Any] | None], ray_worker: Any, tmp_path: Path, capsys: Any, caplog: Any
) -> None:
    """Killed inside its first ``report``: step 1 is committed, Ray knows no checkpoint. The restart
    resumes from step 1 (it started from scratch before), saying so."""
    root, options = where
    registry = str(tmp_path / "ray-registry.json")
    kill_in("ray", root, 3, "report:1", options, registry=registry)
    assert zarrckpt.committed_steps(root, storage_options=options) == [1]
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert restart("ray", root, 3, options, capsys, registry=registry) == 1
    assert "Ray has no checkpoint to resume from: resuming from" in caplog.text
    assert json.loads(Path(registry).read_text())[0].endswith("step_0000000002")


def test_ray_restart_on_another_host_waits_for_the_lease(
    where: tuple[str, dict[str, Any] | None], lease: float, ray_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for torchtitan, in a Ray Train worker (its context stood in for): the step after the one Ray
    resumed from (none here) replaces what is there, but only once the save there is dead."""
    import pyarrow.fs

    from zarrckpt.integrations.ray import save

    root, options = where
    if options:
        import s3fs

        filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(s3fs.S3FileSystem(**options)))
    else:
        filesystem = pyarrow.fs.LocalFileSystem()
    storage = SimpleNamespace(experiment_fs_path=root.removeprefix("s3://"), storage_filesystem=filesystem)
    monkeypatch.setattr(ray_worker, "get_context", lambda: SimpleNamespace(get_storage=lambda: storage))
    monkeypatch.setattr(ray_worker, "get_checkpoint", lambda: None)
    died_elsewhere(f"{root}/step_0000000002", options)
    _, took = timed(save, {"step": 2, "w": torch.ones(2)}, 2)
    assert took >= 0.8 * LEASE, f"saved after {took:.2f} s: the dead save was taken over before its lease ran out"
    assert zarrckpt.committed_steps(root, storage_options=options) == [2]
    if options is None:  # (the same code on every store: on the gateway, Lightning's test runs it)
        with (
            running_save(f"{root}/step_0000000003", options, monkeypatch),
            pytest.raises(zarrckpt.IncompleteCheckpointError, match="is in progress"),
        ):
            save({"step": 3, "w": torch.ones(2)}, 3)


def _fresh_s3fs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning opens s3:// through fsspec with the environment's endpoint: an s3fs instance cached by
    an earlier test (another server) must not be reused, here or in the tests after this one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setattr(s3fs.S3FileSystem, "cachable", False)
