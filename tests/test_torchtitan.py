"""torchtitan through ``zarrckpt.integrations.torchtitan.ZarrCheckpointManager``, against the real package
(0.3.0) on CPU / gloo.

torchtitan's ``Trainer`` does not import on a CPU-only torch (its MoE code imports ``triton``), so the
training loop here is the trainer's own, step for step (``load``; ``step += 1``; forward, backward;
``maybe_wait_for_staging()`` right before ``optimizers.step()``; ``lr_schedulers.step()``;
``save(step, last_step=...)``; ``close()``), around torchtitan's objects: the manager built from its
``Config`` by ``config.build(...)`` with the trainer's keyword arguments, torchtitan's
``OptimizersContainer`` (flat, FQN-keyed AdamW state), ``LRSchedulersContainer`` (warmup, decay),
``ParallelAwareDataloader`` (per-dp-rank state) and a ``train_state`` shaped like the trainer's, the
model sharded with FSDP2 over the ranks.

Every rank trains on the same global batch, so that the same training on 1, 2 or 3 ranks computes
the same numbers (the gradient mean over identical copies is exact) and a resume on another world
size can be compared bit for bit with the run it continues.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from docexamples import run_example

import zarrckpt

pytest.importorskip("torchtitan")  # `pip install zarrckpt[torchtitan]`

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from zarrckpt.integrations.torchtitan import ZarrCheckpointManager, committed_steps, latest_step
from zarrckpt.testing import spawn

STEPS = 6  # training.steps: checkpoints every 2 steps, the last one at 6


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 24)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(24, 24) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(24)
        self.out = torch.nn.Linear(24, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + torch.nn.functional.gelu(layer(h))
        return self.out(self.norm(h))


class Samples(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i of an endless stream, the same on every rank (each rank trains on the global batch)."""

    def __iter__(self) -> Any:
        i = 0
        while True:
            x = torch.randn(8, generator=torch.Generator().manual_seed(i))
            yield x, x.flip(0).sin()
            i += 1


class TrainState:
    """The trainer's own state (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def build(rank: int, world: int, fsdp: bool) -> tuple[Any, Any, Any, Any, TrainState]:
    """The model (FSDP2 over every rank when ``fsdp``), torchtitan's optimizers, schedulers, data loader."""
    torch.manual_seed(0)
    model = Net()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    loader = ParallelAwareDataloader(Samples(), dp_rank=rank, dp_world_size=world, batch_size=4)
    return model, optimizers, schedulers, loader, TrainState()


def manager(folder: str, model: Any, optimizers: Any, schedulers: Any, loader: Any, state: Any, **config: Any) -> Any:
    """Built as the trainer builds its checkpointer: ``config.checkpoint.build(...)``."""
    config.setdefault("interval", 2)
    kind = CheckpointManager if config.pop("torchtitan_dcp", False) else ZarrCheckpointManager  # (the oracle)
    checkpoint = kind.Config(enable=True, folder=folder, **config)
    return checkpoint.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder="",
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(model: Any, optimizers: Any, state: TrainState) -> dict[str, Any]:
    """Every global tensor of the training state, gathered: weights, AdamW moments and step counts."""
    moments = {k: full(v) for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}
    return {
        "weights": {k: full(v) for k, v in model.state_dict().items()},
        "moments": moments,
        "step": state.step,
        "lr": [g["lr"] for o in optimizers for g in o.param_groups],
    }


def train(
    rank: int, world: int, folder: str, out: str, stop_at: int, config: dict[str, Any], skip_data: bool = False
) -> None:
    """The trainer's loop (torchtitan/trainer.py ``train`` and ``train_step``), from whatever ``load``
    restores up to step ``stop_at`` (``STEPS``: the end of training; fewer: a job killed there)."""
    fsdp = torch.distributed.is_initialized()
    model, optimizers, schedulers, loader, state = build(rank, world, fsdp)
    checkpointer = manager(folder, model, optimizers, schedulers, loader, state, **config)
    loaded = checkpointer.load()
    data = iter(loader)
    if skip_data:  # the data loader's state was left out (another dp degree): skip what was trained on
        for _ in range(state.step):
            next(data)
    result: dict[str, Any] = {"loaded": loaded, "start": state.step, "losses": {}, "at": {}}
    if loaded:  # (not before: a fresh optimizer's state_dict() creates its state)
        result["at"][state.step] = snapshot(model, optimizers, state)
    while state.step < stop_at:
        state.step += 1
        x, y = next(data)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.ntokens_seen += x.numel()
        result["losses"][state.step] = loss.item()
        checkpointer.save(state.step, last_step=state.step == STEPS)
        if state.step == 4:
            result["at"][4] = snapshot(model, optimizers, state)
    checkpointer.close()
    result["end"] = snapshot(model, optimizers, state)
    if rank == 0:
        torch.save(result, out)


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert_same(a["weights"], b["weights"])
    assert_same(a["moments"], b["moments"])
    assert a["step"] == b["step"] and a["lr"] == b["lr"]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted run: 2 ranks, steps 1..6, a checkpoint every 2 steps, the 2 newest kept; the
    last one the model only, in bf16 (torchtitan's defaults for the last step, with export_dtype)."""
    root = tmp_path_factory.mktemp("titan")
    config = {"keep_latest_k": 2, "export_dtype": "bfloat16"}
    spawn(2, train, str(root / "a"), str(root / "a.pt"), STEPS, config, timeout_s=240)
    return root / "a", torch.load(root / "a.pt", weights_only=False)


@pytest.mark.slow
def test_retention_latest_and_the_model_only_last_step(run_a: tuple[Path, dict[str, Any]]) -> None:
    folder, a = run_a
    assert zarrckpt.list_checkpoints(folder) == {"step-4": "committed", "step-6": "committed"}  # step-2 purged
    assert committed_steps(str(folder)) == [4, 6] and latest_step(str(folder)) == 6
    last = zarrckpt.open(folder / "step-6")
    assert not last.metadata and all(not k.startswith(("optimizer.", "dataloader.")) for k in last.keys())  # noqa: SIM118 (a list)
    for name, weight in a["end"]["weights"].items():
        assert last[name].dtype == torch.bfloat16 and torch.equal(last[name][...], weight.to(torch.bfloat16))
    full_step = zarrckpt.open(folder / "step-4")
    assert full_step.metadata["train_state"] == {"step": 4, "ntokens_seen": 4 * 32}
    assert "optimizer.state.layers.0.weight.exp_avg_sq" in full_step and "dataloader.dp_rank_1" in full_step
    assert full_step.saved_world_size == 2


@pytest.mark.slow
def test_zarrckpt_latest_and_ls_name_the_steps(
    run_a: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """torchtitan's folder holds ``step-N`` checkpoints: `zarrckpt latest` and `ls` report N (issue 41)."""
    from zarrckpt.cli import main as cli

    folder, _ = run_a
    capsys.readouterr()
    assert cli(["latest", str(folder)]) == 0 and capsys.readouterr().out == "6\n"
    assert cli(["latest", str(folder), "--url"]) == 0 and capsys.readouterr().out == f"{folder}/step-6\n"
    assert cli(["ls", str(folder), "--json"]) == 0
    assert {r["name"]: r["step"] for r in json.loads(capsys.readouterr().out)} == {"step-4": 4, "step-6": 6}


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_killed_and_resumed_on_2_matches_the_uninterrupted_run(
    run_a: tuple[Path, dict[str, Any]], tmp_path: Path, async_mode: str
) -> None:
    """Run B saves at 2 and 4 (in ``async_mode``) and is killed after step 5; run C restarts with the
    same arguments, resumes the latest committed step (4, with its data loader position) and trains
    to 6: its losses and final weights and moments are run A's, bit for bit."""
    _, a = run_a
    config = {"keep_latest_k": 2, "export_dtype": "bfloat16", "async_mode": async_mode}
    folder = str(tmp_path / "b")
    spawn(2, train, folder, str(tmp_path / "b.pt"), 5, config, timeout_s=240)
    assert committed_steps(folder) == [2, 4]
    spawn(2, train, folder, str(tmp_path / "c.pt"), STEPS, config, timeout_s=240)
    b, c = torch.load(tmp_path / "b.pt", weights_only=False), torch.load(tmp_path / "c.pt", weights_only=False)
    assert_state(b["at"][4], a["at"][4])
    assert c["loaded"] and c["start"] == 4
    assert c["losses"] == {5: a["losses"][5], 6: a["losses"][6]}
    assert_state(c["end"], a["end"])
    assert committed_steps(folder) == [4, 6]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_resumed_on_another_world_size(run_a: tuple[Path, dict[str, Any]], tmp_path: Path, world: int) -> None:
    """Step 4 of run A (2 ranks) resumed on 1 rank and on 3 (FSDP2 shards of 24 rows over 3 ranks):
    weights, moments, step and learning rate are step 4's, bit for bit, and steps 5 and 6 give run A's
    losses. The data loader's state is per dp rank (torchtitan refuses another dp degree), so it is
    left out with ``exclude_from_loading`` and the loop skips the samples trained on."""
    folder, a = run_a
    config = {"exclude_from_loading": ["dataloader"], "initial_load_path": str(folder / "step-4")}
    config["initial_load_model_only"] = False  # a new folder starting from run A's step 4, all of it
    spawn(world, train, str(tmp_path / "d"), str(tmp_path / "d.pt"), STEPS, config, True, timeout_s=240)
    d = torch.load(tmp_path / "d.pt", weights_only=False)
    assert d["loaded"] and d["start"] == 4
    assert_state(d["at"][4], a["at"][4])  # as loaded: bit for bit
    if world == 1:
        assert d["losses"] == {5: a["losses"][5], 6: a["losses"][6]}
        assert_state(d["end"], a["end"])
    else:  # FSDP2 averages 3 identical gradients: (g + g + g) / 3 is g give or take a rounding
        close = {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(d["losses"], {5: a["losses"][5], 6: a["losses"][6]}, **close)
        torch.testing.assert_close(d["end"]["weights"], a["end"]["weights"], **close)
        torch.testing.assert_close(d["end"]["moments"], a["end"]["moments"], **close)
        assert d["end"]["step"] == a["end"]["step"] == STEPS


@pytest.mark.slow
def test_initial_load_from_torchtitans_own_dcp_checkpoint(run_a: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A run checkpointed by torchtitan's own DCP manager (2 ranks) continues in a new folder with this
    one (1 process), from ``initial_load_path``: the same state as run A's zarrckpt step 4, bit for bit."""
    _, a = run_a
    dcp_run = tmp_path / "dcp"
    spawn(2, train, str(dcp_run), str(tmp_path / "dcp.pt"), 5, {"torchtitan_dcp": True}, timeout_s=240)
    assert (dcp_run / "step-4" / ".metadata").is_file() and committed_steps(str(dcp_run)) == []
    assert_state(torch.load(tmp_path / "dcp.pt", weights_only=False)["at"][4], a["at"][4])  # the same training
    checkpointer, model, optimizers, state, _ = _one_process(
        tmp_path / "zarr",
        initial_load_path=str(dcp_run / "step-4"),
        initial_load_model_only=False,
        exclude_from_loading=["dataloader"],
    )
    assert checkpointer.load()
    assert_state(snapshot(model, optimizers, state), a["at"][4])
    checkpointer.close()


def _one_process(folder: Path | str, **config: Any) -> tuple[Any, Any, Any, TrainState, Any]:
    """torchtitan's objects in this process, without a process group, and their manager."""
    model, optimizers, schedulers, loader, state = build(0, 1, fsdp=False)
    return (
        manager(str(folder), model, optimizers, schedulers, loader, state, **config),
        model,
        optimizers,
        state,
        loader,
    )


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_2_rank_step_loads_in_one_process_from_an_object_store(
    run_a: tuple[Path, dict[str, Any]], store: str, request: pytest.FixtureRequest
) -> None:
    """Run A's step 4 (FSDP2 shards of 2 ranks), copied to S3 (moto) or GCS (the emulator): a manager of
    one process whose folder is there loads it (``load_step``), bit for bit."""
    folder, a = run_a
    url, options = request.getfixturevalue(f"{store}_url")
    zarrckpt.copy_checkpoint(folder / "step-4", f"{url}/checkpoint/step-4", dst_storage_options=options)
    checkpointer, model, optimizers, state, _ = _one_process(
        f"{url}/checkpoint", exclude_from_loading=["dataloader"], storage_options=options
    )
    assert checkpointer.load(step=4)
    assert_state(snapshot(model, optimizers, state), a["at"][4])
    checkpointer.close()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_2_ranks_save_on_an_object_store_and_1_resumes_there(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder on S3 (moto) or GCS (the emulator), given by ``storage_options`` only (the environment names
    a dead endpoint): 2 ranks (FSDP2) save every step to step 4 there, keeping the newest 2 (steps 1 and 2
    purged); `zarrckpt latest` and ``latest_step`` read step 4; a job of 1 rank restarted on that folder
    resumes step 4 with the 2 ranks' weights, moments, step and learning rate, bit for bit, trains to 6,
    and its steps 5 and 6 replace 3 and 4 there."""
    from zarrckpt.cli import main as cli

    url, options = request.getfixturevalue(f"{store}_url")
    folder = f"{url}/checkpoint"
    config = {"interval": 1, "keep_latest_k": 2, "storage_options": options}
    spawn(2, train, folder, str(tmp_path / "two.pt"), 4, config, timeout_s=240)
    assert zarrckpt.list_checkpoints(folder, storage_options=options) == dict.fromkeys(
        ["step-3", "step-4"], "committed"
    )
    assert latest_step(folder, storage_options=options) == 4
    assert zarrckpt.open(f"{folder}/step-4", storage_options=options).saved_world_size == 2
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    capsys.readouterr()
    assert cli(["latest", folder, *flags]) == 0 and capsys.readouterr().out == "4\n"
    assert cli(["latest", folder, "--url", *flags]) == 0 and capsys.readouterr().out == f"{folder}/step-4\n"
    config["exclude_from_loading"] = ["dataloader"]  # (per dp rank: another dp degree skips the samples)
    spawn(1, train, folder, str(tmp_path / "one.pt"), STEPS, config, True, timeout_s=240)
    two, one = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("two", "one"))
    assert one["loaded"] and one["start"] == 4 and list(one["losses"]) == [5, 6]
    assert_state(one["at"][4], two["at"][4])
    assert committed_steps(folder, storage_options=options) == [5, 6]
    assert zarrckpt.open(f"{folder}/step-5", storage_options=options).saved_world_size == 1


@pytest.mark.slow
def test_load_step_model_only_and_errors(run_a: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    folder, a = run_a
    # the latest step holds the model only: nothing to resume training from
    checkpointer, *_ = _one_process(folder)
    with pytest.raises(zarrckpt.LayoutMismatchError, match="holds the model only"):
        checkpointer.load()
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=r"load_step=2: .*committed steps in .*\[4, 6\]"):
        checkpointer.load(step=2)
    checkpointer.close()
    # load_step=4 in one process, no process group: a plain module from FSDP2 shards
    checkpointer, model, optimizers, state, _ = _one_process(folder, exclude_from_loading=["dataloader"])
    assert checkpointer.load(step=4)
    assert_state(snapshot(model, optimizers, state), a["at"][4])
    checkpointer.close()
    # the model-only last step, but only the model wanted: loads (cast from bf16)
    checkpointer, model, optimizers, state, _ = _one_process(
        folder, exclude_from_loading=["dataloader", "optimizer", "lr_scheduler", "train_state"]
    )
    assert checkpointer.load()
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, a["end"]["weights"][name].to(torch.bfloat16).float()), name
    assert state.step == 0
    checkpointer.close()
    # initial_load_path: a fresh folder starts from a step of another run, the model only by default
    checkpointer, model, optimizers, state, _ = _one_process(tmp_path / "new", initial_load_path=str(folder / "step-4"))
    assert checkpointer.load() and state.step == 0 and not optimizers.optimizers[0].state
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, a["at"][4]["weights"])
    checkpointer.close()


@pytest.mark.slow
def test_export_the_last_step_as_safetensors(run_a: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder, a = run_a
    checkpointer, *_ = _one_process(folder, export_dtype="bfloat16")
    summary = checkpointer.export_safetensors(str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert summary["tensors"] == len(a["end"]["weights"])
    assert_same(exported, {k: v.to(torch.bfloat16) for k, v in a["end"]["weights"].items()})
    checkpointer.export_safetensors(str(tmp_path / "fp32"), step=4, dtype="fp32")  # a full step: the model only
    assert_same(load_file(str(tmp_path / "fp32" / "model.safetensors")), a["at"][4]["weights"])
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match=r"no committed checkpoint .*step-3"):
        checkpointer.export_safetensors(str(tmp_path / "x"), step=3)
    checkpointer.close()


def test_config_errors() -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="async_mode 'sometimes' is not one of"):
        ZarrCheckpointManager.Config(enable=True, async_mode="sometimes")
    with pytest.raises(zarrckpt.ZarrckptError, match="export_safetensors"):
        ZarrCheckpointManager.Config(enable=True, last_save_in_hf=True)
    assert ZarrCheckpointManager.Config(async_mode="ASYNC").async_mode == "async"
    with pytest.raises(zarrckpt.KeyNotFoundError, match="exclude_from_loading: 'nothing' is not a state"):
        _one_process("unused", exclude_from_loading=["nothing"])
    disabled = ZarrCheckpointManager.Config().build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert disabled.load() is False and disabled.save(2) is False  # enable=False: nothing happens


def test_one_process_save_async_retention_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a process group (a single-device run): saves every 2 steps in each mode, keeps 2,
    an incomplete save left in the folder neither counts nor is purged, and a restart resumes.
    ``async_with_pinned_mem`` copies in the background, and the copy is waited for before the
    optimizer changes the weights (the race is too short to lose here: the order is checked)."""
    events: list[str] = []
    real_async_save = zarrckpt.async_save

    def async_save(*args: Any, **kwargs: Any) -> Any:
        pending = real_async_save(*args, **kwargs)
        events.append(f"save staging={kwargs['staging']}")
        real_wait = pending.wait_staged
        pending.wait_staged = lambda: (events.append("wait_staged"), real_wait())[1]
        return pending

    monkeypatch.setattr(zarrckpt, "async_save", async_save)
    folder = tmp_path / "run"
    (folder / "step-9").mkdir(parents=True)
    (folder / "step-9" / ".zarrckpt-pending.json").write_text("{}")  # a save of step 9 that died
    for mode, last in (("async", 4), ("async_with_pinned_mem", 8)):
        checkpointer, model, optimizers, state, loader = _one_process(folder, keep_latest_k=2, async_mode=mode)
        checkpointer.load()
        data = iter(loader)
        for _ in range(state.step):
            next(data)
        while state.step < last:
            state.step += 1
            x, y = next(data)
            ((model(x) - y) ** 2).mean().backward()
            checkpointer.maybe_wait_for_staging()
            events.append("optimizer.step")
            optimizers.step()
            optimizers.zero_grad()
            checkpointer.save(state.step)
        checkpointer.close()
        assert committed_steps(str(folder)) == [last - 2, last]
    step, caller, background = "optimizer.step", "save staging=caller", "save staging=background"
    saves_in_async = [step, step, caller] * 2  # steps 1-4: the copy done when save() returns
    saves_in_pinned = [step, step, background, "wait_staged", step, step, background]  # steps 5-8
    assert events == saves_in_async + saves_in_pinned
    assert zarrckpt.list_checkpoints(folder)["step-9"] == "incomplete"
    checkpointer, model, optimizers, state, _ = _one_process(folder)
    assert checkpointer.load() and state.step == 8
    assert torch.equal(model.out.weight, zarrckpt.open(folder / "step-8")["out.weight"][...])
    checkpointer.close()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_on_object_stores(store: str, request: pytest.FixtureRequest) -> None:
    url, options = request.getfixturevalue(f"{store}_url")
    for mode in ("disabled", "async"):
        checkpointer, model, _, state, _ = _one_process(
            f"{url}/{mode}", keep_latest_k=2, async_mode=mode, storage_options=options
        )
        for step in range(1, 7):
            state.step = step
            checkpointer.save(step)
        checkpointer.close()
        assert committed_steps(f"{url}/{mode}", storage_options=options) == [4, 6]
        resumed, model2, _, state2, _ = _one_process(f"{url}/{mode}", storage_options=options)
        assert resumed.load() and state2.step == 6
        assert torch.equal(model2.embed.weight, model.embed.weight)
        resumed.close()


@pytest.mark.slow
def test_the_documented_example_runs_as_a_script(tmp_path: Path) -> None:
    """docs/integrations-torchtitan.md's example, as a script."""
    done = run_example("integrations-torchtitan.md", "torchtitan-example", tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "resumed at step 4 on 1 rank, trained to 6", done.stdout[-2000:]
    assert json.dumps(zarrckpt.list_checkpoints(tmp_path / "outputs" / "checkpoint"), sort_keys=True) == json.dumps(
        {"step-4": "committed", "step-6": "committed"}
    )
