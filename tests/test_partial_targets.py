"""What a load target may leave out, and what it may not: partial loads without hiding model
conversions, empty optimizer targets, and full state dicts held by rank 0 only."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.testing import spawn


def _full() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "layers": {"0": {"b": torch.ones(3)}}},
        "optim": {"state": {"w": {"exp_avg": torch.full((2, 3), 0.5)}}, "param_groups": [{"lr": 0.1}]},
        "trainer": {"step": 7},
        "seed": 3,
    }


def _model_target() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(2, 3), "layers": {"0": {"b": torch.zeros(3)}}}, "seed": 0}


def test_a_target_may_leave_out_whole_subtrees(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_full(), url)
    target = _model_target()
    with caplog.at_level(logging.INFO, logger="zarrckpt"):
        zarrckpt.load(target, url)  # strict, the default
    assert torch.equal(target["model"]["w"], _full()["model"]["w"]) and target["seed"] == 3
    said = [r.getMessage() for r in caplog.records]
    assert any("not loading 3 saved keys" in m and "optim, trainer" in m for m in said), said


def test_inside_a_subtree_keys_must_still_match(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_full(), url)
    fewer = {"model": {"w": torch.zeros(2, 3)}, "seed": 0}  # a model without its layer: a conversion
    with pytest.raises(zarrckpt.LayoutMismatchError, match=r"model\.layers\.0\.b: in the checkpoint, not expected"):
        zarrckpt.load(fewer, url)
    no_seed = {"model": _model_target()["model"]}  # top-level leaves must match too
    with pytest.raises(zarrckpt.LayoutMismatchError, match="seed: in the checkpoint, not expected"):
        zarrckpt.load(no_seed, url)


def test_keys_select_explicitly(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_full(), url)
    optim = {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}, "param_groups": [{"lr": 0.0}]}
    target = {**_model_target(), "optim": optim}
    zarrckpt.load(target, url, keys=["optim.*"])
    assert torch.equal(target["optim"]["state"]["w"]["exp_avg"], torch.full((2, 3), 0.5))
    assert target["optim"]["param_groups"][0]["lr"] == 0.1
    assert not target["model"]["w"].any() and target["seed"] == 0, "keys outside the patterns are untouched"
    with pytest.raises(zarrckpt.LayoutMismatchError, match=r"param_groups\.0\.lr: in the checkpoint, not expected"):
        zarrckpt.load({"optim": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}}}, url, keys=["optim.*"])


@pytest.mark.parametrize("strict", [True, False])
def test_an_empty_optimizer_target_is_an_error(tmp_path: Path, strict: bool) -> None:
    url = str(tmp_path / "ck")
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    zarrckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, url)
    fresh = torch.optim.AdamW(model.parameters())  # the FSDP2 recipe's mistake (docs/usage.md): no moments yet
    target = {"model": model.state_dict(), "optim": fresh.state_dict()}
    with pytest.raises(zarrckpt.LayoutMismatchError) as err:
        zarrckpt.load(target, url, strict=strict)
    text = str(err.value)
    assert "optim.state: the target is an empty dict, the checkpoint holds 6 tensors under it" in text
    assert "get_state_dict" in text and "optim.state.0.exp_avg: in the checkpoint" not in text, text


def _rank0_full_state(rank: int, world: int, url: str) -> None:
    full = _full()
    state = full if rank == 0 else {"model": {}, "optim": {}, "trainer": full["trainer"], "seed": 3}
    zarrckpt.save(state, url)  # ranks > 0 hold {} where rank 0 holds the full state
    dist.barrier()
    target = {"model": _model_target()["model"], "optim": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}}}
    target.update(trainer={"step": 0}, seed=0)
    target["optim"]["param_groups"] = [{"lr": 0.0}]
    zarrckpt.load(target, url)
    assert torch.equal(target["model"]["w"], full["model"]["w"]) and target["trainer"]["step"] == 7


@pytest.mark.slow
def test_empty_dicts_on_some_ranks_contribute_nothing(tmp_path: Path) -> None:
    spawn(2, _rank0_full_state, str(tmp_path / "ck"))
