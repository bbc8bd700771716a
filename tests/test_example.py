"""The MoE training example: resume under other topologies, model conversion, coverage errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.example import launch, scenario
from zarrckpt.example.config import ModelConfig, Topology, TrainConfig
from zarrckpt.example.scenario import Layout
from zarrckpt.testing import spawn


def _check(report: scenario.Report, k: int, resumes: tuple[Layout, ...]) -> None:
    assert report.problems() == []
    assert len(report.run_a_losses) == 2 * k
    assert len(report.rows) == len(resumes)
    for row in report.rows:
        assert row.max_restore_diff == 0.0 and row.values_equal and row.same_samples
    same = report.rows[0]
    assert same.saved_by == same.loaded_by and same.max_loss_diff == 0.0  # bit for bit
    for row in report.rows[1:]:
        assert row.saved_by != row.loaded_by and row.max_loss_diff <= scenario.LOSS_TOLERANCE


def test_resume_under_three_topologies_on_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    """T1 = 8 ranks PP2 x EP2 x EP-DP2 (experts sharded over EP-DP) -> T1, 4 ranks EP4, 1 rank.

    K = 7 puts the end of the first epoch (12 steps) inside the resumed runs, so the numpy
    shuffle drawn after the resume must continue run A's.
    """
    url, options = s3_url
    report = scenario.run(url, options, k=7, progress=lambda _: None)
    _check(report, 7, scenario.DEFAULT_RESUMES)
    assert report.rows[0].tensors == 130


@pytest.mark.slow
def test_resume_with_experts_replicated_over_ep_dp(tmp_path: Path) -> None:
    t1 = Layout("T1", 4, pp=1, ep=2, expert_dp="replicated")
    resumes = (t1, Layout("T2", 2, pp=2, ep=1), Layout("T3", 2, pp=1, ep=2, expert_dp="replicated"))
    report = scenario.run(str(tmp_path), None, k=3, t1=t1, resumes=resumes, progress=lambda _: None)
    _check(report, 3, resumes)


@pytest.mark.slow
def test_resume_after_a_save_staged_in_the_background(tmp_path: Path) -> None:
    """Run A saves with async_save(staging="background") and trains on; the next step waits for the
    copy only before its update. Resuming on the same layout continues run A bit for bit."""
    t1 = Layout("T1", 2, pp=2, ep=1)
    resumes = (t1, Layout("T2", 1))
    report = scenario.run(
        str(tmp_path), None, k=3, t1=t1, resumes=resumes, progress=lambda _: None, background_staging=True
    )
    _check(report, 3, resumes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runA", "verify"]  # run A's checkpoint, named so
    assert zarrckpt.open(tmp_path / "runA" / "step_0000000003").saved_world_size == 2


def _save_one_rank(rank: int, world: int, url: str, steps: int) -> None:
    from zarrckpt.example.trainer import Trainer

    trainer = Trainer(ModelConfig(), TrainConfig(), Topology(world))
    for _ in range(steps):
        trainer.train_step()
    zarrckpt.save(trainer.state_dict(), url)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("example") / "ckpt")
    spawn(1, _save_one_rank, url, 2)
    return url


def _load_other_models(rank: int, world: int, url: str, direct: bool) -> None:
    from zarrckpt.example.trainer import Trainer

    for cfg, expected in CONVERSIONS.values():
        trainer = Trainer(cfg, TrainConfig(), Topology(world))
        with pytest.raises(zarrckpt.LayoutMismatchError) as err:
            if direct:  # the engine's own check, without the trainer's metadata pre-check
                zarrckpt.load(trainer.state_dict(), url)
            else:
                trainer.load(url)
        for line in expected:
            assert line in err.value.differences
            assert line in str(err.value)


CONVERSIONS = {
    "fewer experts": (
        ModelConfig(experts=4),
        [
            "model.layers.0.moe.experts.w1: shape [8, 64, 128] saved vs [4, 64, 128] expected",
            "model.layers.3.moe.experts.w2: shape [8, 128, 64] saved vs [4, 128, 64] expected",
            "optim.state.layers.1.moe.experts.w1.exp_avg_sq: shape [8, 64, 128] saved vs [4, 64, 128] expected",
            "model.layers.2.moe.router.weight: shape [8, 64] saved vs [4, 64] expected",
        ],
    ),
    "narrower experts": (
        ModelConfig(d_ff=96),
        ["model.layers.0.moe.experts.w1: shape [8, 64, 128] saved vs [8, 64, 96] expected"],
    ),
    "fewer layers": (
        ModelConfig(layers=2),
        [
            "model.layers.2.attn.wqkv.weight: in the checkpoint, not expected",
            "optim.state.layers.3.moe.experts.w2.exp_avg: in the checkpoint, not expected",
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["trainer", "zarrckpt.load"])
def test_model_conversion_is_refused_before_reading_data(saved: str, tmp_path: Path, direct: bool) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    for chunks in [*copy.rglob("c"), *copy.rglob("c.*")]:  # no tensor data left: reading any would fail differently
        chunks.unlink()
    spawn(1, _load_other_models, str(copy), direct)


@pytest.mark.slow
def test_loading_a_subset_of_experts_is_explicit(saved: str) -> None:
    ckpt = zarrckpt.open(saved)
    w1 = ckpt["model.layers.1.moe.experts.w1"]
    assert w1.shape == (8, 64, 128) and w1.role == "main_weight"
    assert torch.equal(w1[2:4], w1.read()[2:4])
    assert ckpt["optim.state.layers.1.moe.experts.w1.exp_avg_sq"].role == "second_moment"
    trainer = ckpt.metadata["trainer"]
    assert trainer["step"] == 2 and trainer["tokens"] == 2 * 8 * 32
    # the loader position and RNG states are per-rank arrays (zarrckpt.PerRank): a row per rank
    assert "loader" not in trainer and "rng" not in trainer
    assert {k for k in ckpt if k.startswith("trainer.rng.")} == {
        f"trainer.rng.{n}" for n in ("torch", "numpy", "python")
    }
    loader = ckpt["trainer.loader"]
    assert loader.meta.per_rank == "json" and loader.shape[0] == ckpt.saved_world_size
    assert json.loads(bytes(loader[0].numpy()))["position"] == 16  # typed JSON text, padded with spaces
    assert trainer["data"]["num_samples"] == 96


def _misdeclare(rank: int, world: int, url: str, offsets: tuple[int, ...], message: str) -> None:
    from zarrckpt.example.trainer import Trainer

    trainer = Trainer(ModelConfig(), TrainConfig(), Topology(world, ep=2))
    state = trainer.state_dict()
    key = "layers.0.moe.experts.w1"
    local = state["model"][key].to_local()  # this rank's 4 experts
    # a buggy expert-parallel wrapper: rank 1 declares its experts at the wrong offset
    state["model"][key] = zarrckpt.LocalShard(local, (8, 64, 128), (0, 0, 0) if rank == 0 else offsets)
    with pytest.raises(zarrckpt.SaveLayoutError) as err:
        zarrckpt.save(state, url)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ((0, 0, 0), "model.layers.0.moe.experts.w1: region [4:8, 0:64, 0:128] is held by no rank"),
        ((3, 0, 0), "model.layers.0.moe.experts.w1: region [3:4, 0:64, 0:128] is claimed twice"),
    ],
)
@pytest.mark.slow
def test_misdeclared_expert_layout_is_caught_at_save(tmp_path: Path, offsets: tuple[int, ...], message: str) -> None:
    url = tmp_path / "bad"
    spawn(2, _misdeclare, str(url), offsets, message)
    assert not url.exists()


@pytest.mark.slow
def test_train_command_resumes_on_another_world_size(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    cmd = [sys.executable, "-m", "zarrckpt.example.train", "--ckpt", root, "--save-every", "2", "--log-every", "2"]
    first = subprocess.run([*cmd, "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "starting from scratch" in first.stdout and "done: step 4 loss" in first.stdout
    assert sorted(zarrckpt.list_checkpoints(root)) == ["step_0000000002", "step_0000000004"]
    again = subprocess.run([*cmd, "--steps", "6", "--keep-last", "1"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed from step 4" in again.stdout and "done: step 6 loss" in again.stdout
    assert sorted(zarrckpt.list_checkpoints(root)) == ["step_0000000006"]
    bad = subprocess.run([*cmd, "--steps", "6", "--pp", "3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "pp=3 must divide" in bad.stderr


def test_layouts_that_do_not_fit_are_refused_before_any_collective() -> None:
    from zarrckpt.example.trainer import Trainer

    with pytest.raises(ValueError, match=r"the batch \(8\) must split evenly over the 3 DP ranks"):
        Trainer(ModelConfig(), TrainConfig(), Topology(3))
    with pytest.raises(ValueError, match=r"ep=3 must divide the experts \(8\)"):
        Topology(6, ep=3).resolved(ModelConfig())
    with pytest.raises(ValueError, match=r"pp=3 must divide the number of layers \(4\)"):
        Topology(6, pp=3).resolved(ModelConfig())


BLOCK_TESTING = """
import sys
sys.modules["zarrckpt.testing"] = None  # importing the test harness now raises ImportError
import zarrckpt.example.scenario, zarrckpt.example.train
from zarrckpt.example import train
sys.exit(train.main(["--ckpt", sys.argv[1], "--steps", "2", "--save-every", "2", "--log-every", "2"]))
"""


def test_the_example_runs_without_the_test_harness(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    proc = subprocess.run([sys.executable, "-c", BLOCK_TESTING, root], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "done: step 2 loss" in proc.stdout and zarrckpt.list_checkpoints(root) == {"step_0000000002": "committed"}


def _ranks_agree(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    Path(out, str(rank)).write_text(f"{world} {int(total.item())}")


def test_the_example_launcher_joins_local_processes(tmp_path: Path) -> None:
    launch.spawn(3, _ranks_agree, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["3 6"] * 3
