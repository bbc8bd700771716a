"""One training job through a framework adapter, resuming from whatever the adapter finds, for the
kill-and-restart tests (tests/test_adapter_restarts.py) and trials (benchmarks/adapter_kill_trials.py):

    python tests/adapter_kill_worker.py ADAPTER ROOT STEPS [--options JSON] [--kill-in NAME:K] [--step-seconds S]

ADAPTER: ``lightning`` (``ZarrCheckpointIO`` with ``ModelCheckpoint(save_last=True, save_top_k=1)``,
resumed with ``last_checkpoint``), ``lightning-last`` (``ZarrModelCheckpoint``, ``ckpt_path="last"``),
``accelerate`` (automatic naming, ``total_limit=2``), ``torchtitan`` (``ZarrCheckpointManager``,
``keep_latest_k=2``), ``ray`` (``report`` / ``load`` in a Ray Train worker whose context is stood in
for: Ray's registry of reported checkpoints is a JSON file in ROOT, written when ``ray.train.report``
returns). Each saves after every step until STEPS, on local disk or (``--options``) an ``s3://`` ROOT.

Prints ``resumed N`` (the step training goes on from: 0 for a fresh start) and ``saved N`` after each
save returns (``trained N`` for Lightning, whose saves follow). ``--kill-in NAME:K`` exits (``os._exit``:
nothing flushed or cleaned up) inside the K-th save whose checkpoint is named NAME (fnmatch), right
after it prepared the location: the old checkpoint there deleted, its own pending marker created;
NAME ``report`` for ``ray``: inside the K-th ``ray.train.report``, after the commit, before Ray
registers it. ``--step-seconds``: sleep per step.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import zarrckpt
from zarrckpt.engine import commit

KILLED = 137


def kill_hook(spec: str | None) -> None:
    """``--kill-in NAME:K``: exit inside the K-th save of a checkpoint named NAME, once prepared."""
    if not spec or spec.startswith("report:"):
        return
    name, _, nth = spec.rpartition(":")
    seen = [0]
    real = commit.prepare

    def prepare(storage: Any, *args: Any, **kwargs: Any) -> str:
        save_id = real(storage, *args, **kwargs)
        if fnmatch.fnmatchcase(storage.url.rstrip("/").rsplit("/", 1)[-1], name):
            seen[0] += 1
            if seen[0] == int(nth):
                print(f"killed in {storage.url}", flush=True)
                os._exit(KILLED)
        return save_id

    commit.prepare = prepare


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step))


def run_lightning(args: argparse.Namespace, options: dict[str, Any] | None) -> None:
    import lightning as L

    from zarrckpt.integrations.lightning import ZarrCheckpointIO, ZarrModelCheckpoint, last_checkpoint

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, x: torch.Tensor, index: int) -> torch.Tensor:
            time.sleep(args.step_seconds)
            return ((self.net(x) - x.flip(1)) ** 2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Report(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            print(f"resumed {trainer.global_step}", flush=True)

        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            print(f"trained {trainer.global_step}", flush=True)  # (ModelCheckpoint saves after: it runs last)

    dirpath = f"{args.root}/ckpts"
    zmc = args.adapter == "lightning-last"
    kind = ZarrModelCheckpoint if zmc else L.pytorch.callbacks.ModelCheckpoint
    extra = {"storage_options": options} if zmc else {}
    checkpoints = kind(dirpath=dirpath, save_last=True, every_n_train_steps=1, save_top_k=1, **extra)
    if options:  # Lightning's own file operations (ModelCheckpoint's) take the environment's credentials
        os.environ.update(
            AWS_ENDPOINT_URL=options["endpoint_url"],
            AWS_ACCESS_KEY_ID=options["key"],
            AWS_SECRET_ACCESS_KEY=options["secret"],
        )
    data = torch.utils.data.DataLoader([batch(i)[0] for i in range(16 * args.steps)], batch_size=16)
    trainer = L.Trainer(
        max_steps=args.steps,
        default_root_dir=args.root,
        plugins=[ZarrCheckpointIO(options)],
        callbacks=[checkpoints, Report()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt_path = "last" if zmc else last_checkpoint(dirpath, storage_options=options)
    trainer.fit(Module(), data, ckpt_path=ckpt_path)


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def run_accelerate(args: argparse.Namespace, options: dict[str, Any] | None) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from zarrckpt.integrations.accelerate import load_state, save_state

    config = ProjectConfiguration(project_dir=args.root, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    with contextlib.suppress(zarrckpt.CheckpointNotFoundError):  # nothing committed yet: a fresh start
        load_state(accelerator, storage_options=options)
    print(f"resumed {progress.step}", flush=True)
    while progress.step < args.steps:
        progress.step += 1
        time.sleep(args.step_seconds)
        loss = ((model(batch(progress.step)) - batch(progress.step).flip(1)) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        save_state(accelerator, storage_options=options)
        print(f"saved {progress.step}", flush=True)


def run_torchtitan(args: argparse.Namespace, options: dict[str, Any] | None) -> None:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from zarrckpt.integrations.torchtitan import ZarrCheckpointManager

    model = net()
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=args.steps)
    progress = Progress()
    config = ZarrCheckpointManager.Config(enable=True, folder=args.root, interval=1, keep_latest_k=2)
    config.storage_options = options
    checkpointer = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": progress},
        sd_adapter=None,
        base_folder="",
    )
    checkpointer.load()
    print(f"resumed {progress.step}", flush=True)
    while progress.step < args.steps:
        progress.step += 1
        time.sleep(args.step_seconds)
        ((model(batch(progress.step)) - batch(progress.step).flip(1)) ** 2).mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        checkpointer.save(progress.step)  # (never last_step: the last step of torchtitan holds the model only)
        print(f"saved {progress.step}", flush=True)
    checkpointer.close()


def run_ray(args: argparse.Namespace, options: dict[str, Any] | None) -> None:
    from types import SimpleNamespace

    import pyarrow.fs
    import ray.train

    from zarrckpt.integrations.ray import load, report

    if options:
        import s3fs

        filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(s3fs.S3FileSystem(**options)))
        run = args.root.removeprefix("s3://")
    else:
        filesystem, run = pyarrow.fs.LocalFileSystem(), args.root
    registry = Path(args.registry) if args.registry else Path(args.root) / "ray-registry.json"
    storage = SimpleNamespace(experiment_fs_path=run, storage_filesystem=filesystem)
    reports = [0]

    def get_checkpoint() -> Any:
        latest = json.loads(registry.read_text())[-1] if registry.exists() else None
        return ray.train.Checkpoint(latest, filesystem=filesystem) if latest else None

    def register(metrics: dict[str, Any], checkpoint: Any = None, **kwargs: Any) -> None:
        reports[0] += 1
        if args.kill_in == f"report:{reports[0]}":  # committed, not yet registered by Ray
            print("killed in report", flush=True)
            os._exit(KILLED)
        known = json.loads(registry.read_text()) if registry.exists() else []
        fresh = registry.with_suffix(
            ".tmp"
        )  # (replaced whole, as Ray persists its state: a kill leaves one or the other)
        fresh.write_text(json.dumps([*known, checkpoint.path]))
        fresh.replace(registry)

    ray.train.get_context = lambda: SimpleNamespace(get_storage=lambda: storage)
    ray.train.get_checkpoint = get_checkpoint
    ray.train.report = register
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}

    ((model(batch(0)) * 0).sum()).backward()
    optimizer.step()  # (Adam's state exists: a load fills it)
    optimizer.zero_grad()
    resumed = state(0)
    load(resumed, storage_options=options)
    model.load_state_dict(resumed["model"])
    optimizer.load_state_dict(resumed["optim"])
    print(f"resumed {resumed['step']}", flush=True)
    for step in range(resumed["step"] + 1, args.steps + 1):
        time.sleep(args.step_seconds)
        ((model(batch(step)) - batch(step).flip(1)) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        report({"step": step}, state(step), step, storage_options=options)
        print(f"saved {step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("adapter", choices=["lightning", "lightning-last", "accelerate", "torchtitan", "ray"])
    parser.add_argument("root")
    parser.add_argument("steps", type=int)
    parser.add_argument("--options", help="storage options, JSON (an s3:// ROOT)")
    parser.add_argument("--kill-in", help="NAME:K: exit inside the K-th save of a checkpoint named NAME")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--registry", help="ray: the file of Ray's registered checkpoints (default: ROOT/...)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    options = json.loads(args.options) if args.options else None
    if options and args.adapter.startswith("lightning"):  # Lightning's own file operations take the environment's
        os.environ.update(AWS_ENDPOINT_URL=options["endpoint_url"], AWS_ACCESS_KEY_ID=options["key"])
        os.environ["AWS_SECRET_ACCESS_KEY"] = options["secret"]
    kill_hook(args.kill_in)
    runs = {"lightning": run_lightning, "lightning-last": run_lightning}
    runs |= {"accelerate": run_accelerate, "torchtitan": run_torchtitan, "ray": run_ray}
    runs[args.adapter](args, options)


if __name__ == "__main__":
    main()
