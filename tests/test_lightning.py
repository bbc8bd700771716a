"""PyTorch Lightning through ``zarrckpt.integrations.lightning.ZarrCheckpointIO``, against the real
package, with Lightning's own ``TorchCheckpointIO`` as the oracle: the same fit, saved, resumed from
``last.ckpt`` and trained on, ends with the same weights, and ``load_checkpoint`` gives back the dict
``torch.load`` does (int keys, lists, tuples, schedulers, callbacks' states with file paths as keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from docexamples import run_example

import zarrckpt

L = pytest.importorskip("lightning")  # `pip install zarrckpt[lightning]` (make test installs it)

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

from zarrckpt.integrations.lightning import ZarrCheckpointIO, ZarrModelCheckpoint, last_checkpoint  # noqa: E402
from zarrckpt.testing import free_port  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's tips and its CPU-only notes


class Regression(L.LightningModule):  # type: ignore[misc]
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.save_hyperparameters()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}


def _data() -> torch.utils.data.DataLoader[Any]:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _trainer(root: str, io: Any, steps: int) -> Any:
    return L.Trainer(
        max_steps=steps,
        default_root_dir=root,
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/ckpts", save_last=True, every_n_train_steps=2, monitor="loss")],
    )


def _fit_and_resume(root: str, io: Any) -> tuple[Any, dict[str, Any]]:
    """4 steps saving every 2 (top 1 by loss, and last), then a new trainer resumes from last.ckpt to 6."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.seed_everything(0, verbose=False)
        _trainer(root, io, 4).fit(Regression(), _data())
        resumed = Regression()
        _trainer(root, io, 6).fit(resumed, _data(), ckpt_path=f"{root}/ckpts/last.ckpt")
    return resumed, io.load_checkpoint(f"{root}/ckpts/last.ckpt")


def same(a: Any, b: Any, roots: tuple[str, str] = ("", ""), where: str = "") -> None:
    """Equal as saved: tensors bit-exact with their dtype, containers by kind and content, keys by
    type and value; strings (and keys) naming files under the runs' roots compared relative to them."""

    def norm(x: Any, root: str) -> Any:
        return x.replace(root, "ROOT") if root and isinstance(x, str) else x

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):  # (an OrderedDict or AttributeDict comes back a dict)
        assert isinstance(b, dict), where
        mine, theirs = {norm(k, roots[0]): v for k, v in a.items()}, {norm(k, roots[1]): v for k, v in b.items()}
        assert sorted(map(repr, mine)) == sorted(map(repr, theirs)), where
        for k, v in mine.items():
            same(v, theirs[k], roots, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, roots, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and norm(a, roots[0]) == norm(b, roots[1]), where


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_fit_save_resume_like_torch_checkpoint_io(tmp_path: Path, background: bool) -> None:
    """The same fit, save, resume through Lightning's ``TorchCheckpointIO`` and through zarrckpt (saving
    in the background too: its removals wait for its saves, so top-k keeps exactly what Lightning keeps)."""
    want, want_ckpt = _fit_and_resume(str(tmp_path / "torch"), TorchCheckpointIO())
    got, got_ckpt = _fit_and_resume(str(tmp_path / "zarr"), ZarrCheckpointIO(async_save=background))
    assert torch.equal(want.layer.weight, got.layer.weight) and torch.equal(want.layer.bias, got.layer.bias)
    same(want_ckpt, got_ckpt, (str(tmp_path / "torch"), str(tmp_path / "zarr")))
    assert got_ckpt["global_step"] == 6 and isinstance(got_ckpt["optimizer_states"], list)
    ckpts = tmp_path / "zarr" / "ckpts"
    # top-1 by loss: the others were removed through remove_checkpoint, as Lightning removed its files
    kept = sorted(p.name for p in (tmp_path / "torch" / "ckpts").iterdir())
    assert len(kept) == 2 and zarrckpt.list_checkpoints(ckpts) == dict.fromkeys(kept, "committed")
    view = zarrckpt.open(ckpts / "last.ckpt")
    assert "tensors.state_dict.layer.weight" in view  # browsable: `zarrckpt ls` names it so
    assert torch.equal(view["tensors.state_dict.layer.weight"][:], got.layer.weight.detach())
    assert last_checkpoint(str(ckpts)) == f"{ckpts}/last.ckpt"


def test_load_of_nothing_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        ZarrCheckpointIO().load_checkpoint(tmp_path / "nothing.ckpt")
    ZarrCheckpointIO().remove_checkpoint(tmp_path / "nothing.ckpt")  # nothing there: nothing to do
    assert last_checkpoint(str(tmp_path)) is None


def test_last_checkpoint_is_the_newest_committed_last(tmp_path: Path) -> None:
    io = ZarrCheckpointIO()
    io.save_checkpoint({"global_step": 5, "w": torch.ones(1)}, tmp_path / "last-v1.ckpt")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(1)}, tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 9, "w": torch.ones(1)}, tmp_path / "epoch=0-step=9.ckpt")  # not a last
    (tmp_path / "last-v2.ckpt").mkdir()
    (tmp_path / "last-v2.ckpt" / ".zarrckpt-pending.json").write_text("{}")  # a save of it under way
    assert last_checkpoint(str(tmp_path)) == f"{tmp_path}/last-v1.ckpt"


def test_last_checkpoint_falls_back_to_the_newest_committed_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``last*.ckpt`` committed (the job was killed re-saving ``last.ckpt`` in place, after the old
    one was deleted): the newest committed checkpoint Lightning saved, by global step, and a WARNING
    saying which and why; before, None, and the fit started from step 0."""
    import logging

    io = ZarrCheckpointIO()
    io.save_checkpoint({"global_step": 6, "w": torch.ones(1)}, tmp_path / "epoch=0-step=6.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.ones(1)}, tmp_path / "epoch=1-step=4.ckpt")  # later, older
    zarrckpt.save({"global_step": 9, "w": torch.ones(1)}, tmp_path / "other.ckpt")  # not Lightning's
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / ".zarrckpt-pending.json").write_text("{}")  # its re-save, killed
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert last_checkpoint(str(tmp_path)) == f"{tmp_path}/epoch=0-step=6.ckpt"
    assert (
        "last.ckpt is incomplete" in caplog.text and "resuming from epoch=0-step=6.ckpt (global step 6)" in caplog.text
    )


def test_keys_no_store_takes_and_map_location(tmp_path: Path) -> None:
    checkpoint = {
        "state_dict": {"a.b": torch.ones(2)},  # a dot inside a key: its tensor keeps a path of its own
        "odd": {"x/y": torch.zeros(3), 7: [torch.arange(3), (torch.ones(1), "s")]},
        # keys that would be a group and an array at once: numbered apart
        "clash": {"a": torch.ones(1), "a.b": torch.zeros(1), "a.b-c": torch.ones(2), "a.b.c": torch.zeros(2)},
        "epoch": 3,
        "unnamed": {"0": torch.full((2,), 5.0)},  # where numbered tensors go, too: kept apart
    }
    io = ZarrCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    back = io.load_checkpoint(tmp_path / "c.ckpt", map_location="cpu")
    same(checkpoint, back)
    io.save_checkpoint({"epoch": 4}, tmp_path / "c.ckpt")  # Lightning re-saves last.ckpt in place
    assert io.load_checkpoint(tmp_path / "c.ckpt") == {"epoch": 4}


def test_on_s3(s3_url: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``default_root_dir`` on S3: Lightning's own listing (``ModelCheckpoint``) goes through fsspec with
    the environment's credentials; the checkpoints through zarrckpt with ``storage_options``."""
    url, options = s3_url
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    got, ckpt = _fit_and_resume(url, ZarrCheckpointIO(options))
    assert ckpt["global_step"] == 6 and torch.equal(ckpt["state_dict"]["layer.weight"], got.layer.weight.detach())
    assert last_checkpoint(f"{url}/ckpts", storage_options=options) == f"{url}/ckpts/last.ckpt"


class Counting(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.trained = 0

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.trained += 1
        return super().training_step(batch, index)


def test_ckpt_path_last_on_s3_with_zarr_model_checkpoint(
    s3_url: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fit(ckpt_path="last")`` on an ``s3://`` root: Lightning's own ``ModelCheckpoint`` finds no last
    checkpoint there (an object store gives a prefix no modification time) and trains from scratch;
    ``ZarrModelCheckpoint`` finds the newest committed ``last.ckpt`` and the fit resumes from it."""
    url, options = s3_url
    for name, value in (("ENDPOINT_URL", "endpoint_url"), ("ACCESS_KEY_ID", "key"), ("SECRET_ACCESS_KEY", "secret")):
        monkeypatch.setenv(f"AWS_{name}", options[value])
    import s3fs  # (Lightning opens s3:// with the environment's endpoint: no instance an earlier test cached)

    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setattr(s3fs.S3FileSystem, "cachable", False)

    def fit(steps: int, callback: type[ModelCheckpoint], **extra: Any) -> tuple[Any, Counting]:
        trainer = L.Trainer(
            max_steps=steps,
            default_root_dir=url,
            plugins=[ZarrCheckpointIO(options)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback(dirpath=f"{url}/ckpts", save_last=True, every_n_train_steps=2, **extra)],
        )
        model = Counting()
        trainer.fit(model, _data(), ckpt_path="last")
        return trainer, model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, model = fit(4, ZarrModelCheckpoint, storage_options=options)  # nothing to resume yet
        assert model.trained == 4 and first.ckpt_path is None
        plain, model = fit(6, ModelCheckpoint)
        assert plain.ckpt_path is None and model.trained == 6, "Lightning's own lookup found it after all"
        resumed, model = fit(8, ZarrModelCheckpoint, storage_options=options)
    # the plain run, seeing last.ckpt as taken, saved last-v1.ckpt (step 6): the newest, so the one resumed
    assert resumed.ckpt_path == f"{url}/ckpts/last-v1.ckpt/zarr.json" and model.trained == 2
    newest = last_checkpoint(f"{url}/ckpts", storage_options=options)
    assert resumed.global_step == 8 and ZarrCheckpointIO(options).load_checkpoint(newest)["global_step"] == 8


@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_zarr_model_checkpoint_needs_no_endpoint_in_the_environment(store: str, request: pytest.FixtureRequest) -> None:
    """Issue 41: Lightning's own file operations in ``dirpath`` went to the environment's endpoint
    (``ckpt.s3.amazonaws.com`` without ``AWS_ENDPOINT_URL``). With ``storage_options`` given to
    ``ZarrModelCheckpoint`` they go where the checkpoints do, though the environment points elsewhere:
    docs/integrations.md's ``lightning-remote`` example saves every 2 steps keeping the best 1 by loss
    and last, resumes from ``last_checkpoint(dirpath)`` (``ckpt_path="last"`` has the trainer itself
    look the file up, from the path alone), and top-k retention deletes through ``ZarrCheckpointIO``."""
    from docexamples import example

    url, options = request.getfixturevalue(f"{store}_url")
    documented: dict[str, Any] = {}
    exec(example("integrations.md", "lightning-remote"), documented)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = documented["fit"](model := Counting(), _data(), url, options, 4)
        assert first.ckpt_path is None and model.trained == 4
        resumed = documented["fit"](model := Counting(), _data(), url, options, 6)
    assert resumed.ckpt_path == f"{url}/ckpts/last.ckpt" and model.trained == 2
    found = zarrckpt.list_checkpoints(f"{url}/ckpts", storage_options=options)
    assert set(found.values()) == {"committed"} and "last.ckpt" in found and len(found) == 2, found  # top 1 + last
    assert last_checkpoint(f"{url}/ckpts", storage_options=options) == f"{url}/ckpts/last.ckpt"
    assert ZarrCheckpointIO(options).load_checkpoint(f"{url}/ckpts/last.ckpt")["global_step"] == 6


@pytest.mark.slow
def test_the_documented_example_runs_as_a_script(tmp_path: Path) -> None:
    """docs/integrations.md's example, as a script: fit 4 steps, resume from last.ckpt, train to 6."""
    done = run_example("integrations.md", "lightning-example", tmp_path)
    assert done.stdout.strip().endswith("resumed at step 4, trained to 6"), done.stdout[-2000:]
    assert zarrckpt.list_checkpoints(tmp_path / "runs" / "ckpts")["last.ckpt"] == "committed"


WORKER = Path(__file__).with_name("lightning_worker.py")


def _torchrun(
    ranks: int, *args: Any, report_to: Path | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """tests/lightning_worker.py on ``ranks`` gloo processes; rank 0's report (losses, full state), written
    into ``report_to`` (by default the run's root, ``args[1]``), ``env`` added to the workers' environment."""
    out = Path(str(report_to or args[1])) / f"report-{ranks}.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd += ["--master-port", str(free_port()), str(WORKER), *map(str, args[:3]), str(out), *map(str, args[3:])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1]), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report: dict[str, Any] = torch.load(out, weights_only=False)
    return report


def _equal_states(a: dict[str, Any], b: dict[str, Any]) -> None:
    same(a["model"], b["model"])
    same(a["optim"]["state"], b["optim"]["state"])
    assert [g["lr"] for g in a["optim"]["param_groups"]] == [g["lr"] for g in b["optim"]["param_groups"]]


@pytest.mark.slow
def test_model_parallel_strategy_resumes_on_the_same_and_another_number_of_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FSDP2 through ``ZarrModelParallelStrategy`` on 2 gloo ranks, 6 steps, saving every 2 (`zarrckpt
    latest` reads step 6). Resumed from step 4 on 2 ranks it trains the same losses into the same
    weights and Adam moments, bit for bit; resumed on 1 rank it holds exactly the global tensors the 2
    ranks saved (and the learning rate the scheduler had halved at every step, and the step)."""
    from zarrckpt.cli import main as cli

    whole = _torchrun(2, "model_parallel", tmp_path / "whole", 6)
    step4 = tmp_path / "whole" / "ckpts" / "epoch=0-step=4.ckpt"
    assert len(whole["losses"]) == 6 and zarrckpt.open(step4).metadata["lightning"][0]["global_step"] == 4
    capsys.readouterr()
    assert cli(["latest", str(tmp_path / "whole" / "ckpts")]) == 0 and capsys.readouterr().out == "6\n"
    resumed = _torchrun(2, "model_parallel", tmp_path / "resumed", 6, step4)
    assert resumed["losses"] == whole["losses"][4:] and resumed["global_step"] == 6
    _equal_states(resumed["state"], whole["state"])

    one = _torchrun(1, "model_parallel", tmp_path / "one", 4, step4)
    assert one["losses"] == [] and one["global_step"] == 4
    ckpt = zarrckpt.open(step4)
    for name, tensor in one["state"]["model"].items():
        assert torch.equal(tensor, ckpt[f"tensors.state_dict.{name}"][...]), name
    for name, moments in one["state"]["optim"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[moment], ckpt[f"tensors.optimizer_states.0.state.{name}.{moment}"][...])
    saved_groups = ckpt.metadata["lightning"][0]["optimizer_states"][0]["param_groups"]
    assert [g["lr"] for g in one["state"]["optim"]["param_groups"]] == [g["lr"] for g in saved_groups] == [0.01 / 2**4]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model_parallel", "ddp"])
@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_2_ranks_save_on_object_stores_and_1_resumes(
    store: str, strategy: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ZarrModelParallelStrategy`` (FSDP2), and DDP with ``ZarrCheckpointIO``, on S3 (moto) and GCS (the
    emulator), the store's options given to them and to ``ZarrModelCheckpoint``, the environment naming a
    dead endpoint: 2 ranks train to step 4, saving every 2 and keeping the newest 1 and ``last.ckpt``
    (step 2 deleted through ``remove_checkpoint``); `zarrckpt latest` reads step 4 there and
    ``last_checkpoint`` names ``last.ckpt``; 1 rank resumes from it holding the 2 ranks' weights, Adam
    moments and learning rate, bit for bit."""
    from zarrckpt.cli import main as cli

    url, options = request.getfixturevalue(f"{store}_url")
    env = {"WORKER_STORAGE_OPTIONS": json.dumps(options), "WORKER_TOP_K": "1"}
    saved = _torchrun(2, strategy, url, 4, report_to=tmp_path, env=env)
    assert len(saved["losses"]) == 4 and saved["global_step"] == 4
    ckpts = f"{url}/ckpts"
    found = zarrckpt.list_checkpoints(ckpts, storage_options=options)
    assert set(found.values()) == {"committed"} and len(found) == 2, found  # step 2 removed
    assert "last.ckpt" in found and any(name.endswith("-step=4.ckpt") for name in found), found
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    capsys.readouterr()
    assert cli(["latest", ckpts, *flags]) == 0 and capsys.readouterr().out == "4\n"
    last = last_checkpoint(ckpts, storage_options=options)
    assert last == f"{ckpts}/last.ckpt"
    ranks = zarrckpt.open(last, storage_options=options).saved_world_size
    assert ranks == (2 if strategy == "model_parallel" else 1)  # (under DDP rank 0 saves alone)
    one = _torchrun(1, strategy, f"{url}/one", 4, last, report_to=tmp_path, env=env)
    assert one["losses"] == [] and one["global_step"] == 4
    _equal_states(one["state"], saved["state"])


@pytest.mark.slow
def test_the_documented_strategy_example_on_2_ranks_then_1(tmp_path: Path) -> None:
    """docs/integrations.md's ``lightning-strategy`` example: FSDP2 through ``ZarrModelParallelStrategy``
    under torchrun on 2 ranks (fit to 4, resume to 6), then run as one process, which resumes from the
    2-rank checkpoint (resharded) and has nothing left to train."""
    done = run_example("integrations.md", "lightning-strategy", tmp_path, ranks=2, env={"OMP_NUM_THREADS": "1"})
    assert "resumed, trained to step 6: ['epoch=2-step=6.ckpt', 'last.ckpt']" in done.stdout, done.stdout[-2000:]
    last = zarrckpt.open(tmp_path / "runs" / "ckpts" / "last.ckpt")
    assert last.saved_world_size == 2 and last.metadata["lightning"][0]["global_step"] == 6
    assert "tensors.optimizer_states.0.state.a.weight.exp_avg" in last
    again = run_example("integrations.md", "lightning-strategy", tmp_path)
    assert "Restored all states from the checkpoint at runs/ckpts/last.ckpt" in again.stdout + again.stderr
    assert "resumed, trained to step 6" in again.stdout


@pytest.mark.slow
def test_ddp_saves_from_rank_0_alone(tmp_path: Path) -> None:
    """Under DDP Lightning hands the checkpoint to ``ZarrCheckpointIO`` on rank 0 only: the save must
    not wait for rank 1 (it did, until the process group timed out), and the checkpoint holds the
    trained state, which 1 rank resumes bit for bit."""
    report = _torchrun(2, "ddp", tmp_path, 4)
    ckpt = zarrckpt.open(tmp_path / "ckpts" / "last.ckpt")
    assert report["global_step"] == 4 and ckpt.metadata["lightning"][0]["global_step"] == 4
    for name, tensor in report["state"]["model"].items():
        assert torch.equal(tensor, ckpt[f"tensors.state_dict.{name}"][...]), name
    one = _torchrun(1, "ddp", tmp_path / "one", 4, tmp_path / "ckpts" / "last.ckpt")  # resumed on 1 rank
    assert one["losses"] == [] and one["global_step"] == 4
    _equal_states(one["state"], report["state"])


def test_a_background_save_is_committed_or_raises_when_fit_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``async_save=True``: the end of the fit (Lightning's teardown of the plug-in) waits for the last
    save, so the checkpoint is committed when ``fit`` returns; a background save that fails makes
    the fit raise instead of ending as if it had saved."""
    from zarrckpt.storage.store import Storage

    io = ZarrCheckpointIO(async_save=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(str(tmp_path / "ok"), io, 2).fit(Regression(), _data())
    assert io._pending is None
    assert zarrckpt.list_checkpoints(tmp_path / "ok" / "ckpts")["last.ckpt"] == "committed"

    real = Storage.write

    def refuse(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        if "/c." in path:
            raise zarrckpt.StorageError(f"writing {path} refused (injected)")
        real(self, path, parts, **kwargs)

    monkeypatch.setattr(Storage, "write", refuse)
    with warnings.catch_warnings(), pytest.raises(zarrckpt.ZarrckptError, match="injected"):
        warnings.simplefilter("ignore")
        _trainer(str(tmp_path / "failing"), ZarrCheckpointIO(async_save=True), 2).fit(Regression(), _data())


def test_ls_and_latest_report_lightnings_global_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning names its checkpoints freely (``epoch=0-step=2.ckpt``, ``last.ckpt``); `zarrckpt ls`
    and `latest` read the global step each one saved (issue 41)."""
    from zarrckpt.cli import main as cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.seed_everything(0, verbose=False)
        _trainer(str(tmp_path), ZarrCheckpointIO(), 4).fit(Regression(), _data())
    ckpts = str(tmp_path / "ckpts")
    capsys.readouterr()
    assert cli(["ls", ckpts, "--json"]) == 0
    steps = {r["name"]: r["step"] for r in json.loads(capsys.readouterr().out)}
    assert "last.ckpt" in steps and len(steps) == 2, steps
    for name, step in steps.items():
        assert step == (4 if name == "last.ckpt" else int(name.split("step=")[1].split(".")[0])), steps
    assert cli(["latest", ckpts]) == 0 and capsys.readouterr().out == "4\n"
    assert cli(["latest", ckpts, "--url"]) == 0 and capsys.readouterr().out == f"{ckpts}/last.ckpt\n"


def test_diff_of_two_runs_shows_what_differs_briefly_and_callback_scores_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`zarrckpt diff` of two Lightning checkpoints: the differing parts of the one ``lightning`` value,
    each line short; ModelCheckpoint's scores are named by its state key, with role ``other`` (issue 41)."""
    from zarrckpt.cli import main as cli

    for name, steps in (("a", 4), ("b", 6)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            L.seed_everything(0, verbose=False)
            _trainer(str(tmp_path / name), ZarrCheckpointIO(), steps).fit(Regression(), _data())
    last = tmp_path / "a" / "ckpts" / "last.ckpt"
    rows = zarrckpt.open(last).tensors()
    scores = [r for r in rows if ".callbacks." in r["key"]]
    assert not [r for r in rows if r["key"].startswith("unnamed.")], rows
    assert any(r["key"].endswith(".best_model_score") for r in scores), rows
    assert all(r["key"].startswith("tensors.callbacks.ModelCheckpoint_monitor_loss_") for r in scores), scores
    assert {r["role"] for r in scores} == {"other"}
    assert {r["role"] for r in rows if r["key"].startswith("tensors.state_dict.")} == {"main_weight"}
    back = ZarrCheckpointIO().load_checkpoint(last)  # the names are names only: each tensor goes back to its path
    callback = next(iter(back["callbacks"].values()))
    assert isinstance(callback["best_model_score"], torch.Tensor) and back["global_step"] == 4
    capsys.readouterr()
    assert cli(["diff", str(last), str(tmp_path / "b" / "ckpts" / "last.ckpt")]) == 1
    out = capsys.readouterr().out
    assert "metadata:  lightning[0].global_step: A 4 vs B 6\n" in out, out
    assert max(len(line) for line in out.splitlines()) < 700, out
