"""Hugging Face Accelerate through ``zarrckpt.integrations.accelerate``, against the real package on gloo
processes, with Accelerate's own ``save_state`` / ``load_state`` as the oracle.

2 processes train (DDP, as Accelerate runs on the CPU, and FSDP2 and FSDP1 through Accelerate's own
``prepare``), save at step K through zarrckpt and through Accelerate, and train on to 2K. Then 2 and 3
processes, and one plain process without a process group, resume: the restored weights, AdamW moments and
steps, the scheduler, the registered object, the step, the data loader's epoch and the RNG states are
bit-exact; the losses after a resume on 2 equal the uninterrupted run's bit for bit, and on 3 and 1 those
of Accelerate resuming its own checkpoint on as many processes, bit for bit (where Accelerate can: not
FSDP1 on 3, whose moments it does not restore; not FSDP saves on one plain process, which it cannot read).

Accelerate turns FSDP on only for accelerators (``AcceleratorState``: ``DistributedType.FSDP`` is set for
``MULTI_GPU`` and its kin, never for ``MULTI_CPU``): on the CPU these tests set it by hand after
``Accelerator(fsdp_plugin=...)``, then Accelerate's own ``prepare`` (``fully_shard`` / ``FSDP``), and its
own ``save_state`` / ``load_state`` (DCP's ``FileSystemWriter``) run as they would on GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from docexamples import run_example

import zarrckpt
from zarrckpt.testing import spawn

pytest.importorskip("accelerate")  # `pip install zarrckpt[accelerate]` (make test installs it)

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from zarrckpt.integrations.accelerate import checkpoints_root, load_state, save_state

pytestmark = pytest.mark.filterwarnings("ignore")  # Accelerate's notes on the CPU, FSDP1's deprecation

K, STEPS_PER_EPOCH = 4, 4  # save at step K (an epoch's end), train to 2K
MODES = ("ddp", "fsdp2", "fsdp1")


class Progress:
    """A registered object (``register_for_checkpointing``): where the loop is."""

    def __init__(self) -> None:
        self.step, self.epoch, self.samples = 0, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.samples = state["step"], state["epoch"], state["samples"]


def _accelerator(mode: str, config: ProjectConfiguration | None = None) -> Accelerator:
    """A fresh Accelerator (its state is a process-wide singleton) in ``mode``, on the CPU."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = None
    if mode == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    elif mode == "fsdp1":  # (FSDP1 through Accelerate needs use_orig_params for an optimizer made before prepare)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1, state_dict_type="SHARDED_STATE_DICT", use_orig_params=True
        )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        project_config=config,
        # accelerator.step counts every step (by default it restarts with each pass over a data loader)
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True),
    )
    if plugin is not None:  # what Accelerate does on GPUs (state.py), by hand on the CPU
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        if mode == "fsdp1":  # FSDP1 wants "cpu", not the "cpu:0" Accelerate's MULTI_CPU gives
            PartialState().device = accelerator.state.device = torch.device("cpu")
    return accelerator


def _setup(mode: str, config: ProjectConfiguration | None = None, width: int = 32) -> tuple[Any, ...]:
    """Seeded model (with dropout: the RNG states matter), AdamW, a scheduler, shuffled data, a registered object."""
    accelerator = _accelerator(mode, config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(width, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x[:, :4] * 2 - x[:, 4:])
    loader = torch.utils.data.DataLoader(data, batch_size=12, shuffle=True)  # 4 steps an epoch, whatever the world
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    return accelerator, model, optimizer, scheduler, loader, progress


def _train(run: tuple[Any, ...], until: int) -> list[list[float]]:
    """Whole epochs up to step ``until``; each step's loss on every process."""
    accelerator, model, optimizer, scheduler, loader, progress = run
    losses = []
    while progress.step < until:
        loader.set_epoch(progress.epoch)  # what an Accelerate loop does (its save_state keeps no epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
            progress.step += 1
            progress.samples += len(x)
        progress.epoch += 1
    assert accelerator.step == progress.step
    return losses


def _snapshot(run: tuple[Any, ...]) -> dict[str, Any]:
    """Everything a resume must restore, gathered (weights and moments whole, on rank 0)."""
    accelerator, model, optimizer, scheduler, _, progress = run
    full = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizer.optimizer, options=full),
        "scheduler": scheduler.state_dict(),
        "step": accelerator.step,
        "progress": progress.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _env(rank: int, world: int) -> None:
    """What torchrun / accelerate launch set: Accelerate reads them (the gloo group is already up)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _save_and_go_on(rank: int, world: int, root: str) -> None:
    """Per mode: train to K, save through zarrckpt and Accelerate, train to 2K; then resume on the same
    processes from zarrckpt's checkpoint and train to 2K again."""
    _env(rank, world)
    for mode in MODES:
        out = Path(root) / mode
        run = _setup(mode)
        _train(run, K)
        url = save_state(run[0], out / "zarr")
        assert url == str(out / "zarr")
        run[0].save_state(str(out / "accelerate"))
        snap = _snapshot(run)
        torch.save(snap["rng"], out / f"rng{rank}.pt")
        if rank == 0:
            torch.save(snap, out / "at_k.pt")
        losses = _train(run, 2 * K)
        if rank == 0:
            torch.save(losses, out / "uninterrupted.pt")
        resumed = _setup(mode)
        load_state(resumed[0], out / "zarr")
        _check_restored(resumed, out, rank, world)
        again = _train(resumed, 2 * K)
        if rank == 0:
            torch.save(again, out / "resumed2.pt")


def _check_restored(run: tuple[Any, ...], out: Path, rank: int, saved_world: int) -> None:
    snap, want = _snapshot(run), torch.load(out / "at_k.pt", weights_only=False)
    _same(snap["rng"], torch.load(out / f"rng{rank % saved_world}.pt"), "rng")
    _same(snap["step"], want["step"], "step")
    _same(snap["scheduler"], want["scheduler"], "scheduler")
    _same(snap["progress"], want["progress"], "progress")
    if rank == 0:  # (gathered there)
        _same(snap["model"], want["model"], "model")
        _same(snap["optim"], want["optim"], "optim")
    assert run[4].iteration == want["progress"]["epoch"]  # the loader's epoch, which Accelerate does not keep
    assert run[0].project_configuration.iteration == 1  # the saved iteration (0), plus one


def _resume(rank: int, world: int, out: Path, mode: str, saved_world: int) -> tuple[list[Any], list[Any] | None]:
    """Resume from zarrckpt's checkpoint and from Accelerate's own (where it can load it), each trained on to 2K."""
    ours = _setup(mode)
    load_state(ours[0], str(out / "zarr"))
    _check_restored(ours, out, rank, saved_world)
    ours_losses = _train(ours, 2 * K)
    if mode == "none" and out.name != "ddp":
        return ours_losses, None  # Accelerate's load_state reads FSDP's files only under FSDP
    if mode == "fsdp1" and world != saved_world:  # Accelerate's own loads no moments there (fresh, step 1):
        return ours_losses, None  # no oracle (the state zarrckpt restored is checked above)
    oracle = _setup(mode)
    oracle[0].load_state(str(out / "accelerate"))
    if rank >= saved_world:  # Accelerate finds no random_states_<rank>.pkl: its step stays 0, its RNG unset
        states = torch.load(out / "accelerate" / f"random_states_{rank % saved_world}.pkl", weights_only=False)
        oracle[0].step = states["step"]  # (give it what zarrckpt gives: saved process rank % N's)
        torch.set_rng_state(states["torch_manual_seed"])
    return ours_losses, _train(oracle, 2 * K)


def _resume_on(rank: int, world: int, root: str, saved_world: int) -> None:
    _env(rank, world)
    for mode in MODES:
        out = Path(root) / mode
        losses = _resume(rank, world, out, mode, saved_world)
        if rank == 0:
            torch.save(losses, out / f"resumed{world}.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("accelerate")
    for mode in MODES:
        (root / mode).mkdir()
    spawn(2, _save_and_go_on, str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_resume_on_2_continues_the_uninterrupted_run(saved: Path, mode: str) -> None:
    uninterrupted = torch.load(saved / mode / "uninterrupted.pt")
    resumed = torch.load(saved / mode / "resumed2.pt")
    assert len(uninterrupted) == K and resumed == uninterrupted  # every process's loss, bit for bit
    ckpt = zarrckpt.open(saved / mode / "zarr")
    assert ckpt.saved_world_size == 2
    assert ckpt.metadata["accelerate"]["mode"] == ("MULTI_CPU" if mode == "ddp" else "FSDP")
    assert {"models.0.0.weight", "optimizers.0.state.0.weight.exp_avg", "rng.torch"} <= set(ckpt.keys())
    assert ckpt["rng.torch"].shape[0] == 2 and ckpt["rng.torch"].meta.per_rank == "tensor"  # a row per process


@pytest.mark.slow
def test_resume_on_3_like_accelerate(saved: Path) -> None:
    """Resharded onto 3 processes (32 rows over 3: uneven), in each mode: the state bit-exact, and the same run
    as Accelerate resuming its own checkpoint. (Not the uninterrupted run's losses: each process draws its
    own dropout masks, so another number of processes draws others.) Under FSDP1 Accelerate's own
    ``load_state`` on 3 processes of a 2-process save restores no AdamW moments (zeros, step 1), silently:
    no oracle there."""
    spawn(3, _resume_on, str(saved), 2)
    for mode in MODES:
        ours, oracle = torch.load(saved / mode / "resumed3.pt")
        assert len(ours) == K and len(ours[0]) == 3, mode
        assert ours == oracle if mode != "fsdp1" else oracle is None, mode  # every process's loss, bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_resume_on_1_process_without_a_process_group(saved: Path, mode: str, alone: Any) -> None:
    """Saved by 2 processes under DDP, FSDP2 or FSDP1; loaded by one plain process (``DistributedType.NO``):
    bit-exact, and (from DDP, the one Accelerate itself can load there) the run Accelerate's own resume makes."""
    ours, oracle = _resume(0, 1, saved / mode, "none", 2)
    assert len(ours) == K
    assert oracle is None if mode != "ddp" else ours == oracle
    if mode == "fsdp2":  # the weights as a Hugging Face safetensors file, from the sharded save
        from safetensors.torch import load_file

        zarrckpt.export_safetensors(
            saved / mode / "zarr", saved / "exported", include="models.*", strip_prefix="models.0."
        )
        want = torch.load(saved / mode / "at_k.pt", weights_only=False)["model"]
        _same(load_file(saved / "exported" / "model.safetensors"), want)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_2_process_save_resumes_on_1_from_an_object_store(
    saved: Path, store: str, request: pytest.FixtureRequest, alone: Any
) -> None:
    """The FSDP2 checkpoint of 2 processes, copied to S3 (moto) or GCS (the emulator), loaded by one
    plain process through ``load_state(url, storage_options=...)``: every part bit-exact."""
    url, options = request.getfixturevalue(f"{store}_url")
    zarrckpt.copy_checkpoint(saved / "fsdp2" / "zarr", f"{url}/ck", dst_storage_options=options)
    run = _setup("none")
    assert load_state(run[0], f"{url}/ck", storage_options=options) == f"{url}/ck"
    _check_restored(run, saved / "fsdp2", 0, 2)


def _save_on_a_store(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    """FSDP2 with automatic naming and ``total_limit=2`` in a project on the store: a save every epoch, 3
    of them; rank 0 keeps what a resume must restore."""
    _env(rank, world)
    run = _setup("fsdp2", ProjectConfiguration(url, automatic_checkpoint_naming=True, total_limit=2))
    root = checkpoints_root(run[0])
    for epoch in range(3):
        _train(run, (epoch + 1) * STEPS_PER_EPOCH)
        assert save_state(run[0], storage_options=options) == f"{root}/step_{epoch:010d}"
    snap = _snapshot(run)
    if rank == 0:
        torch.save(snap, out)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gcs"])
@pytest.mark.usefixtures("store_elsewhere_in_env")
def test_2_processes_save_on_an_object_store_and_1_resumes_the_latest(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, alone: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A project on S3 (moto) or GCS (the emulator), the store given by ``storage_options`` only (the
    environment names a dead endpoint): 2 FSDP2 processes save 3 times with automatic naming, keeping
    ``total_limit=2`` (iteration 0 deleted); `zarrckpt latest` reads the training step, 12; one plain
    process resumes the latest, ``load_state(accelerator)`` with no URL, every part bit-exact, and its next
    automatic save there (iteration 3) deletes iteration 1."""
    from zarrckpt.cli import main as cli

    url, options = request.getfixturevalue(f"{store}_url")
    spawn(2, _save_on_a_store, url, options, str(tmp_path / "saved.pt"))
    root = f"{url}/checkpoints"
    assert zarrckpt.committed_steps(root, storage_options=options) == [1, 2]
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    capsys.readouterr()
    assert cli(["latest", root, *flags]) == 0 and capsys.readouterr().out == f"{3 * STEPS_PER_EPOCH}\n"
    assert cli(["latest", root, "--url", *flags]) == 0 and capsys.readouterr().out == f"{root}/step_0000000002\n"
    config = ProjectConfiguration(url, automatic_checkpoint_naming=True, total_limit=2)
    run = _setup("none", config)
    assert load_state(run[0], storage_options=options) == f"{root}/step_0000000002"
    _same(_snapshot(run), torch.load(tmp_path / "saved.pt", weights_only=False))
    assert zarrckpt.open(f"{root}/step_0000000002", storage_options=options).saved_world_size == 2
    assert save_state(run[0], storage_options=options) == f"{root}/step_0000000003"
    assert zarrckpt.committed_steps(root, storage_options=options) == [2, 3]


# -- one process, no process group (DistributedType.NO) ---------------------------------------------


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_automatic_naming_keeps_total_limit_and_resumes_the_latest(tmp_path: Path, alone: Any) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    run = _setup("none", config)
    assert run[0].distributed_type == DistributedType.NO
    root = checkpoints_root(run[0])
    for epoch in range(3):
        _train(run, (epoch + 1) * STEPS_PER_EPOCH)
        assert save_state(run[0]) == f"{root}/step_{epoch:010d}"
    assert zarrckpt.committed_steps(root) == [1, 2] and run[0].project_configuration.iteration == 3
    want = _snapshot(run)
    resumed = _setup("none", ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    assert load_state(resumed[0]) == f"{root}/step_{2:010d}"
    _same(_snapshot(resumed), want)
    assert resumed[0].step == 3 * STEPS_PER_EPOCH and resumed[0].project_configuration.iteration == 3
    with pytest.raises(zarrckpt.CheckpointExistsError):  # as Accelerate refuses an existing checkpoint_<n>
        resumed[0].project_configuration.iteration = 2
        save_state(resumed[0])


def test_no_url_without_automatic_naming(tmp_path: Path, alone: Any) -> None:
    run = _setup("none")
    with pytest.raises(zarrckpt.ZarrckptError, match="automatic checkpoint naming is off"):
        save_state(run[0])
    with pytest.raises(zarrckpt.ZarrckptError, match="automatic checkpoint naming is off"):
        load_state(run[0])
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    empty = _setup("none", config)
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="no committed checkpoint under"):
        load_state(empty[0])


def test_not_a_checkpoint_of_save_state(tmp_path: Path, alone: Any) -> None:
    run = _setup("none")
    run[0].save_state(str(tmp_path / "accelerate"))  # Accelerate's own files
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="is not a zarrckpt checkpoint") as err:
        load_state(run[0], tmp_path / "accelerate")
    assert str(tmp_path / "accelerate") in str(err.value) and "model.safetensors" in str(err.value)
    zarrckpt.save({"w": torch.ones(2), "step": 3}, tmp_path / "plain")  # zarrckpt's, not save_state's
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"not one zarrckpt\.integrations\.accelerate"):
        load_state(run[0], tmp_path / "plain")
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        load_state(run[0], tmp_path / "nothing")


def test_a_changed_model_is_refused_and_nothing_loaded(tmp_path: Path, alone: Any) -> None:
    run = _setup("none")
    _train(run, STEPS_PER_EPOCH)
    save_state(run[0], tmp_path / "ck")
    wider = _setup("none", width=48)
    before = {k: v.clone() for k, v in wider[1].state_dict().items()}
    with pytest.raises(zarrckpt.LayoutMismatchError, match=r"models\.0\.0\.weight"):
        load_state(wider[0], tmp_path / "ck")
    assert all(torch.equal(wider[1].state_dict()[k], v) for k, v in before.items())
    assert wider[0].step == 0
    fewer = _setup("none")
    fewer[0]._custom_objects.clear()  # saved with one registered object, loaded with none
    with pytest.raises(zarrckpt.LayoutMismatchError, match="custom: 1 saved, 0 prepared"):
        load_state(fewer[0], tmp_path / "ck")
    more = _setup("none")
    more[0].register_for_checkpointing(Progress())
    with pytest.raises(zarrckpt.LayoutMismatchError, match="custom: 1 saved, 2 prepared"):
        load_state(more[0], tmp_path / "ck")


def test_pre_hooks_choose_the_models(tmp_path: Path, alone: Any) -> None:
    """Accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``: a hook that takes a
    model's weights (or the model) out of the list saves (loads) it its own way."""
    run = _setup("none")
    other = run[0].prepare(torch.nn.Linear(3, 3))
    seen: list[Any] = []
    run[0].register_save_state_pre_hook(lambda models, weights, where: (seen.append(where), weights.pop()))
    save_state(run[0], tmp_path / "ck")
    assert seen == [tmp_path / "ck"]
    keys = set(zarrckpt.open(tmp_path / "ck").keys())
    assert "models.0.0.weight" in keys and not any(k.startswith("models.1") for k in keys)
    resumed = _setup("none")
    torch.manual_seed(5)
    other2 = resumed[0].prepare(torch.nn.Linear(3, 3))  # other weights than the saved run's
    before = other2.weight.detach().clone()
    resumed[0].register_load_state_pre_hook(lambda models, where: models.pop())
    load_state(resumed[0], tmp_path / "ck")
    assert torch.equal(other2.weight, before) and not torch.equal(other2.weight, other.weight)
    assert torch.equal(resumed[1][0].weight, run[1][0].weight)


def test_what_cannot_be_saved_is_refused_before_writing(tmp_path: Path, alone: Any) -> None:
    run = _setup("none")
    run[4].use_stateful_dataloader = True
    with pytest.raises(zarrckpt.ZarrckptError, match="use_stateful_dataloader"):
        save_state(run[0], tmp_path / "ck")
    run[4].use_stateful_dataloader = False
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a, b, _ = run[0].prepare(a, b, torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    with pytest.raises(zarrckpt.ZarrckptError, match="optimizer 1 holds parameters of no single prepared model"):
        save_state(run[0], tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_grad_scaler_and_sampler_seed_come_back(tmp_path: Path, alone: Any) -> None:
    """Accelerate makes a ``GradScaler`` (fp16) on accelerators only: here one is set on the Accelerator by hand."""
    run = _setup("none")
    run[0].scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    run[4].get_sampler().initial_seed = 1234  # the SeedableRandomSampler's seed (set_seed's, or data_seed)
    save_state(run[0], tmp_path / "ck")
    resumed = _setup("none")
    resumed[0].scaler = torch.amp.GradScaler("cpu")
    load_state(resumed[0], tmp_path / "ck")
    assert resumed[0].scaler.state_dict() == run[0].scaler.state_dict()
    assert resumed[0].scaler.get_scale() == 512.0 and resumed[4].get_sampler().initial_seed == 1234
    without = _setup("none")
    with pytest.raises(zarrckpt.LayoutMismatchError, match="scaler: True saved, False prepared"):
        load_state(without[0], tmp_path / "ck")


def test_rng_states_of_the_old_layout_still_load(tmp_path: Path, alone: Any) -> None:
    """zarrckpt before per-rank arrays saved the RNG states as ``rank<r>.rng``: they load as before."""
    import random

    from zarrckpt.integrations.accelerate import _state

    run = _setup("none")
    torch.manual_seed(7)
    random.seed(8)
    zarrckpt.save(_state(run[0], 0, saving=True, url=None), tmp_path / "old")  # the old layout
    want = torch.get_rng_state(), random.getstate()
    assert "rank0.rng.torch" in zarrckpt.open(tmp_path / "old")
    torch.manual_seed(1)
    random.seed(2)
    load_state(_setup("none")[0], tmp_path / "old")
    assert torch.equal(torch.get_rng_state(), want[0]) and random.getstate() == want[1]


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_on_object_stores(store: str, request: pytest.FixtureRequest, alone: Any) -> None:
    url, options = request.getfixturevalue(f"{store}_url")
    run = _setup("none")
    _train(run, STEPS_PER_EPOCH)
    assert save_state(run[0], f"{url}/ck", storage_options=options) == f"{url}/ck"
    want = _snapshot(run)
    resumed = _setup("none")
    load_state(resumed[0], f"{url}/ck", storage_options=options)
    _same(_snapshot(resumed), want)


@pytest.mark.slow
def test_the_documented_example_runs_as_a_script(tmp_path: Path) -> None:
    """docs/integrations-accelerate.md's example, as a script: 2 processes save, 1 resumes."""
    done = run_example("integrations-accelerate.md", "accelerate-example", tmp_path)
    assert "resumed at step 6: saved by 2 processes, loaded by 1, trained to 12" in done.stdout, done.stdout[-2000:]
    assert zarrckpt.committed_steps(tmp_path / "runs" / "checkpoints") == [4, 5]  # iterations 0..5, total_limit 2


def test_latest_and_ls_report_the_training_step_not_the_save_iteration(
    tmp_path: Path, alone: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Automatic naming counts saves (``step_<iteration>``); `zarrckpt latest` and `ls` report the
    training step each one saved, ``accelerator.step`` (issue 41)."""
    from zarrckpt.cli import main as cli

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    run = _setup("none", config)
    root = checkpoints_root(run[0])
    for epoch in range(3):
        _train(run, (epoch + 1) * STEPS_PER_EPOCH)
        save_state(run[0])
    assert zarrckpt.committed_steps(root) == [1, 2]  # iterations
    capsys.readouterr()
    assert cli(["latest", root]) == 0 and capsys.readouterr().out == f"{3 * STEPS_PER_EPOCH}\n"
    assert cli(["latest", root, "--url"]) == 0 and capsys.readouterr().out == f"{root}/step_0000000002\n"
    assert cli(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["step"] for r in rows} == {
        "step_0000000001": 2 * STEPS_PER_EPOCH,
        "step_0000000002": 3 * STEPS_PER_EPOCH,
    }
