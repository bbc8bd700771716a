"""Ray Train through ``zarrckpt.integrations.ray``, against the real package (Ray 2.60, Train v2, CPU
and gloo). docs/integrations-ray.md's example runs as a script: a job trains with FSDP2 on 2 workers
until step 4, saving every 2 steps; restarted with the same ``RunConfig`` on 1 worker, it resumes from
Ray's latest checkpoint and trains to step 6, replacing a committed step 6 Ray never registered (a job
killed between its commit and its report). Its step 6 is compared bit for bit (weights, Adam moments
and step counters, step, loss curve) with 6 uninterrupted steps of the example's own ``build``,
``state_of`` and ``train_step``. The rules deciding where a save goes and whether it may replace what
is there run against Ray's API with the worker's context stood in for; bad input gets zarrckpt's errors."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from docexamples import example, run_example

import zarrckpt

pytest.importorskip("ray")  # `pip install zarrckpt[ray]` (make test installs it)

import pyarrow.fs
import ray
import ray.train

from zarrckpt.integrations.ray import checkpoint_url, load, report, save

ROOT = Path(__file__).resolve().parent.parent
FAST_RAY = {  # Ray Train's controller polls its workers every 2 s by default, and each report waits for a poll
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


def example_code() -> str:
    return example("integrations-ray.md", "ray-example")


def tensors_equal(a: zarrckpt.Checkpoint, b: zarrckpt.Checkpoint) -> None:
    """Same keys, and every tensor bit-identical with its dtype."""
    assert a.keys() == b.keys()
    for key in a.keys():  # noqa: SIM118 (a list)
        x, y = a[key][...], b[key][...]
        assert x.dtype == y.dtype and torch.equal(x, y), key


def uninterrupted(code: str, steps: int, url: Path) -> None:
    """The example's ``build``, ``state_of`` and ``train_step`` for ``steps`` steps in this process (a
    gloo group of 1, no Ray), saved at ``url`` as the example saves."""
    import torch.distributed as dist

    example: dict[str, Any] = {"__name__": "ray_example"}
    exec(compile(code, "example.py", "exec"), example)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optim = example["build"]()
        example["state_of"](model, optim, 0, [])  # as train_fn does (get_state_dict initializes Adam's state)
        losses = [example["train_step"](model, optim, step) for step in range(1, steps + 1)]
        zarrckpt.save(example["state_of"](model, optim, steps, losses), url)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_documented_example_runs_as_a_script(tmp_path: Path) -> None:
    run = tmp_path / "ray_results" / "demo"
    zarrckpt.save({"step": -1, "stale": torch.ones(3)}, run / "step_0000000006")  # committed, never reported
    done = run_example("integrations-ray.md", "ray-example", tmp_path, timeout=280, env=FAST_RAY)
    assert f"checkpoint: {run / 'step_0000000006'}" in done.stdout, done.stdout[-2000:]
    # Ray kept its last 2 (num_to_keep=2): step 2 deleted once step 6 was registered, across the restart
    assert zarrckpt.list_checkpoints(run) == dict.fromkeys(["step_0000000004", "step_0000000006"], "committed")
    resumed = zarrckpt.open(run / "step_0000000006")
    assert resumed.saved_world_size == 1 and "stale" not in resumed  # the leftover was replaced
    assert zarrckpt.open(run / "step_0000000004").saved_world_size == 2
    uninterrupted(example_code(), 6, tmp_path / "uninterrupted")
    reference = zarrckpt.open(tmp_path / "uninterrupted")
    tensors_equal(reference, resumed)
    for kind in ("weight", "bias"):  # weights, both Adam moments and the per-parameter step counters
        for key in (f"model.0.{kind}", *(f"optim.state.0.{kind}.{m}" for m in ("exp_avg", "exp_avg_sq", "step"))):
            assert key in resumed, key
    assert resumed.metadata["step"] == reference.metadata["step"] == 6
    losses = resumed.metadata["losses"]  # 1-4 from the job on 2 workers, 5-6 from the one on 1
    assert len(losses) == 6 and losses == reference.metadata["losses"] and len(set(losses)) == 6
    assert f"losses: {losses}" in done.stdout
    assert zarrckpt.latest_step(run) == 6  # Ray's run directory reads as a CheckpointManager's root


_JOB_ON_A_STORE = """
import json, sys
import ray, ray.train
from ray.train.torch import TorchTrainer
import zarrckpt
from zarrckpt.integrations.ray import checkpoint_url, run_storage

url, opts = sys.argv[1], json.loads(sys.argv[2])
example = {"__name__": "ray_example"}
exec(open("example.py").read(), example)
ray.init(num_cpus=2, include_dashboard=False)
def fit(workers, steps, async_save):
    keep = ray.train.CheckpointConfig(num_to_keep=2)
    run_config = ray.train.RunConfig(name="demo", checkpoint_config=keep, **run_storage(url, storage_options=opts))
    config = {"steps": steps, "async_save": async_save}
    scaling = ray.train.ScalingConfig(num_workers=workers, use_gpu=False)
    trainer = TorchTrainer(example["train_fn"], train_loop_config=config, scaling_config=scaling, run_config=run_config)
    return trainer.fit()
fit(2, 4, True)
print("checkpoint:", checkpoint_url(fit(1, 6, False).checkpoint))
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_the_example_job_on_a_store_through_run_storage(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented job (2 workers, async saves, to step 4; restarted on 1 worker to step 6; Ray keeps 2)
    with ``RunConfig(**run_storage(url, storage_options=...))`` on S3 (moto) and GCS (the emulator), the
    environment naming a dead endpoint: Ray's own files and every checkpoint go to the store the options
    name, and `zarrckpt latest` reads the run directory there."""
    import json
    import subprocess
    import sys

    from zarrckpt.cli import main as cli

    url, options = request.getfixturevalue(f"{store}_url")
    (tmp_path / "example.py").write_text(example_code().replace('if __name__ == "__main__":', "if False:"))
    (tmp_path / "job.py").write_text(_JOB_ON_A_STORE)
    env = {**os.environ, **FAST_RAY}
    done = subprocess.run(
        [sys.executable, "job.py", f"{url}/ray_results", json.dumps(options)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"checkpoint: {url}/ray_results/demo/step_0000000006" in done.stdout, done.stdout[-2000:]
    run = f"{url}/ray_results/demo"
    assert zarrckpt.list_checkpoints(run, storage_options=options) == dict.fromkeys(
        ["step_0000000004", "step_0000000006"], "committed"
    )  # Ray's retention deleted step 2 through the same filesystem
    last = zarrckpt.open(f"{run}/step_0000000006", storage_options=options)
    assert last.saved_world_size == 1 and len(last.metadata["losses"]) == 6
    assert zarrckpt.open(f"{run}/step_0000000004", storage_options=options).saved_world_size == 2
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    capsys.readouterr()
    assert cli(["latest", run, *flags]) == 0 and capsys.readouterr().out == "6\n"
    assert cli(["latest", run, "--url", *flags]) == 0 and capsys.readouterr().out == f"{run}/step_0000000006\n"


class Worker:
    """A Ray Train worker's context, stood in for: its run directory, the checkpoint it resumed
    from, and the reports it made."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        run: Path | str,
        resumed: str | None,
        filesystem: pyarrow.fs.FileSystem | None = None,
    ) -> None:
        self.reports: list[tuple[Any, ...]] = []
        filesystem = filesystem or pyarrow.fs.LocalFileSystem()
        storage = SimpleNamespace(experiment_fs_path=str(run), storage_filesystem=filesystem)
        context = SimpleNamespace(get_storage=lambda: storage)
        resumed_from = ray.train.Checkpoint(f"{run}/{resumed}", filesystem) if resumed else None
        monkeypatch.setattr(ray.train, "get_context", lambda: context)
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: resumed_from)
        monkeypatch.setattr(ray.train, "report", lambda *a, **kw: self.reports.append((a, kw)))


def test_save_replaces_only_what_ray_never_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed from step 4: a step after it was never reported and is replaced; step 4 itself, an
    earlier one, or a step this worker saved already is refused; a name of one's own is never replaced."""
    for step in (2, 4, 6):
        zarrckpt.save({"step": step}, tmp_path / f"step_{step:010d}")
    Worker(monkeypatch, tmp_path, "step_0000000004")
    for step in (2, 4):
        with pytest.raises(zarrckpt.CheckpointExistsError, match=f"step_{step:010d}"):
            save({"step": -1}, step)
        assert zarrckpt.open(tmp_path / f"step_{step:010d}").metadata["step"] == step
    checkpoint = save({"step": 60}, 6)
    assert checkpoint.path == str(tmp_path / "step_0000000006")
    assert zarrckpt.open(tmp_path / "step_0000000006").metadata["step"] == 60
    with pytest.raises(zarrckpt.CheckpointExistsError, match="this run saved it already"):
        save({"step": 61}, 6)
    zarrckpt.save({"step": 0}, tmp_path / "mine")
    with pytest.raises(zarrckpt.CheckpointExistsError):
        save({"step": 8}, 8, checkpoint_dir_name="mine")
    save({"step": 8}, 8, checkpoint_dir_name="mine", overwrite=True)
    assert zarrckpt.open(tmp_path / "mine").metadata["step"] == 8


def test_report_hands_ray_the_directory_without_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(monkeypatch, tmp_path, None)
    zarrckpt.save({"step": -1}, tmp_path / "step_0000000002")  # nothing resumed: a leftover, replaced
    returned = report({"loss": 0.5}, {"w": torch.ones(2), "step": 2}, 2)
    ((args, kwargs),) = worker.reports
    assert args == ({"loss": 0.5},) and kwargs["checkpoint"] is returned
    assert returned.path == str(tmp_path / "step_0000000002")
    assert kwargs["checkpoint_dir_name"] == "step_0000000002"
    assert kwargs["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.NO_UPLOAD
    assert zarrckpt.open(tmp_path / "step_0000000002").metadata["step"] == 2
    report({}, {"w": torch.ones(2), "step": 4}, 4, async_save=True)
    (_, kwargs) = worker.reports[1]
    assert kwargs["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
    assert kwargs["delete_local_checkpoint_after_upload"] is False  # ASYNC's default would delete it
    upload = kwargs["checkpoint_upload_fn"]
    assert upload(kwargs["checkpoint"], "step_0000000004") is kwargs["checkpoint"]  # waits for the commit
    assert zarrckpt.list_checkpoints(tmp_path)["step_0000000004"] == "committed"
    with pytest.raises(zarrckpt.ZarrckptError, match="staging='caller'"):
        report({}, {"step": 6}, 6, async_save=True, staging="background")
    assert "step_0000000006" not in zarrckpt.list_checkpoints(tmp_path)


@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_run_storage_needs_no_endpoint_in_the_environment(
    store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: Ray's own pyarrow S3 / GCS filesystems read the endpoint from the environment only (and
    pyarrow's S3 upload of Ray's snapshot failed on RGW with HTTP 411). ``RunConfig(**run_storage(url,
    storage_options=...))``: Ray's own files and the checkpoints go to the store the options name, though
    the environment points elsewhere, and report / load take the options from Ray's filesystem."""
    from zarrckpt.integrations.ray import run_storage

    url, options = request.getfixturevalue(f"{store}_url")
    storage = run_storage(url, storage_options=options)
    ray.train.RunConfig(name="demo", **storage)  # (Ray accepts it)
    fs, run = storage["storage_filesystem"], f"{storage['storage_path']}/demo"
    with fs.open_output_stream(f"{run}/checkpoint_manager_snapshot.json") as out:  # as Ray writes its own files
        out.write(b'{"checkpoints": []}')
    assert zarrckpt.fsspec_filesystem(url, options)[0].cat_file(f"{run}/checkpoint_manager_snapshot.json") == (
        b'{"checkpoints": []}'
    )
    Worker(monkeypatch, run, None, fs)
    report({"loss": 0.5}, {"w": torch.arange(4.0), "step": 2}, 2)  # no storage_options: Ray's filesystem's
    assert zarrckpt.list_checkpoints(f"{url}/demo", storage_options=options) == {"step_0000000002": "committed"}
    Worker(monkeypatch, run, "step_0000000002", fs)
    state: dict[str, Any] = {"w": torch.zeros(4), "step": 0}
    assert load(state) == f"{url}/demo/step_0000000002" and state["step"] == 2
    assert torch.equal(state["w"], torch.arange(4.0))
    assert run_storage("/tmp/ray_results") == {"storage_path": "/tmp/ray_results"}


def test_load_refuses_a_ray_checkpoint_that_is_no_zarrckpt_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "torch" / "model.pt")
    state = {"w": torch.zeros(2)}
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"Ray checkpoint .*model\.pt.*integrations\.ray"):
        load(state, ray.train.Checkpoint.from_directory(str(tmp_path / "torch")))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=r"holds no zarrckpt checkpoint \(nothing there\)"):
        load(state, ray.train.Checkpoint.from_directory(str(tmp_path / "nothing")))
    assert torch.equal(state["w"], torch.zeros(2))


def test_load_outside_a_job_from_a_checkpoint_or_url(tmp_path: Path) -> None:
    """In a driver or a notebook: a Ray checkpoint's URL (local, or through an fsspec filesystem and
    its options), or a zarrckpt URL; without a checkpoint, outside a worker: a clear error."""
    zarrckpt.save({"w": torch.arange(4.0), "step": 3}, tmp_path / "ckpt")
    state: dict[str, Any] = {"w": torch.zeros(4), "step": 0}
    assert load(state, ray.train.Checkpoint.from_directory(str(tmp_path / "ckpt"))) == str(tmp_path / "ckpt")
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(4.0))
    memory = pytest.importorskip("fsspec").filesystem("memory")
    zarrckpt.save({"w": torch.ones(4), "step": 5}, "memory://zarrckpt-ray-test/ckpt")
    via_fsspec = ray.train.Checkpoint(
        "zarrckpt-ray-test/ckpt", pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(memory))
    )
    assert load(state, via_fsspec) == "memory://zarrckpt-ray-test/ckpt" and state["step"] == 5
    assert load(state, tmp_path / "ckpt") == str(tmp_path / "ckpt") and state["step"] == 3
    with pytest.raises(zarrckpt.ZarrckptError, match="inside a Ray Train worker"):
        load(state)


def test_save_and_report_refuse_bad_input() -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="inside a Ray Train worker"):
        save({"step": 1}, 1)
    with pytest.raises(zarrckpt.ZarrckptError, match="inside a Ray Train worker"):
        report({}, {"step": 1}, 1)
    for step in (-1, 1.0, True, "3"):
        with pytest.raises(zarrckpt.ZarrckptError, match="step must be an int >= 0"):
            save({}, step)  # type: ignore[arg-type]
    for name in ("", "a/b", ".."):
        with pytest.raises(zarrckpt.ZarrckptError, match="checkpoint_dir_name must be one directory name"):
            report({}, {}, 1, checkpoint_dir_name=name)


def test_checkpoint_url_per_filesystem() -> None:
    local = ray.train.Checkpoint("/data/run/step_0000000002", pyarrow.fs.LocalFileSystem())
    assert checkpoint_url(local) == "/data/run/step_0000000002"
    s3 = pyarrow.fs.S3FileSystem(anonymous=True, endpoint_override="127.0.0.1:1", scheme="http")
    assert checkpoint_url(ray.train.Checkpoint("bucket/run/step_0000000002", s3)) == "s3://bucket/run/step_0000000002"
    gcs = pyarrow.fs.GcsFileSystem(anonymous=True)
    assert checkpoint_url(ray.train.Checkpoint("bucket/run/x", gcs)) == "gs://bucket/run/x"
    with pytest.raises(zarrckpt.ZarrckptError, match="has no URL zarrckpt can write to"):
        checkpoint_url(ray.train.Checkpoint("run/x", pyarrow.fs._MockFileSystem()))


def test_load_from_ray_checkpoints_on_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    """Ray's own pyarrow S3 filesystem (credentials given to zarrckpt apart), and an fsspec one
    (``RunConfig(storage_filesystem=PyFileSystem(FSSpecHandler(s3fs)))``), whose options zarrckpt takes."""
    import s3fs

    url, options = s3_url
    zarrckpt.save({"w": torch.arange(6.0), "step": 7}, f"{url}/step_0000000007", storage_options=options)
    path = f"{url.removeprefix('s3://')}/step_0000000007"
    endpoint = options["endpoint_url"].removeprefix("http://")
    arrow = pyarrow.fs.S3FileSystem(
        access_key=options["key"], secret_key=options["secret"], endpoint_override=endpoint, scheme="http"
    )
    state: dict[str, Any] = {"w": torch.zeros(6), "step": 0}
    assert load(state, ray.train.Checkpoint(path, arrow), storage_options=options) == f"{url}/step_0000000007"
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(6.0))
    fsspec_s3 = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(s3fs.S3FileSystem(**options)))
    state = {"w": torch.zeros(6), "step": 0}
    assert load(state, ray.train.Checkpoint(path, fsspec_s3)) == f"{url}/step_0000000007"
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(6.0))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="nothing there"):
        load(state, ray.train.Checkpoint(f"{path}-missing", fsspec_s3))


def test_load_without_a_committed_ray_checkpoint_resumes_from_the_newest_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray registered nothing (the job was killed between its first commit and its report), or Ray's
    latest holds no committed checkpoint: ``load(state)`` resumes from the run directory's newest
    committed checkpoint, saying so, instead of from scratch; one that does not fit the state is not
    loaded (another job's leftover), and a torn Ray checkpoint with nothing to fall back on still raises."""
    import logging

    def fresh() -> dict[str, Any]:
        return {"w": torch.zeros(2), "step": 0}

    Worker(monkeypatch, tmp_path, None)
    assert load(state := fresh()) is None and state["step"] == 0  # nothing anywhere: a fresh start
    zarrckpt.save({"w": torch.ones(2), "step": 2}, tmp_path / "step_0000000002")  # committed, never reported
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert load(state := fresh()) == str(tmp_path / "step_0000000002") and state["step"] == 2
    assert "Ray has no checkpoint to resume from: resuming from" in caplog.text
    (tmp_path / "step_0000000006").mkdir()
    (tmp_path / "step_0000000006" / ".zarrckpt-pending.json").write_text("{}")  # Ray's latest, torn
    Worker(monkeypatch, tmp_path, "step_0000000006")
    assert load(state := fresh()) == str(tmp_path / "step_0000000002") and state["step"] == 2
    zarrckpt.save({"other": torch.ones(3)}, tmp_path / "step_0000000004")  # committed, another layout
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), pytest.raises(zarrckpt.IncompleteCheckpointError):
        load(state := fresh())
    assert "does not fit the state" in caplog.text and state["step"] == 0
    Worker(monkeypatch, tmp_path, None)
    assert load(state := fresh()) is None and state["step"] == 0 and torch.equal(state["w"], torch.zeros(2))
