"""Stateful values (state_dict() / load_state_dict()): saved through state_dict(), restored by
building the target from state_dict(), loading into it, then calling load_state_dict()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

import zarrckpt


class Loader(Stateful):
    """A data loader's position (DCP's Stateful protocol)."""

    def __init__(self, position: int = 0) -> None:
        self.position, self.loaded = position, 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": (3, 1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.order = state["position"], state["order"]
        self.loaded += 1


class Wrapper:
    """torchtitan's ModelWrapper shape: a plain object, no base class."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


def _state(seed: int, position: int) -> tuple[dict[str, Any], Loader]:
    model, optim = _trained(seed)
    loader = Loader(position)
    return {"model": Wrapper(model), "optim": optim, "train": {"loader": loader, "step": position}}, loader


def _assert_restored(target: dict[str, Any], loader: Loader, want: dict[str, Any]) -> None:
    assert loader.loaded == 1 and loader.position == 40 and loader.order == (3, 1, 2)
    assert target["train"]["step"] == 40, "a plain value beside a Stateful is restored in the caller's dict"
    got_model = target["model"].model.state_dict()
    assert all(torch.equal(got_model[k], v) for k, v in want["model"].state_dict().items())
    got, ref = target["optim"].state_dict()["state"], want["optim"].state_dict()["state"]
    assert all(torch.equal(got[p]["exp_avg_sq"], ref[p]["exp_avg_sq"]) for p in ref)


def test_save_and_load_call_the_stateful_objects(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    saved, _ = _state(seed=0, position=40)
    zarrckpt.save(saved, url)
    ckpt = zarrckpt.open(url)
    assert {"model.weight", "optim.state.0.exp_avg", "train.loader.position"} <= {*ckpt.keys(), *ckpt.manifest.values}
    target, loader = _state(seed=1, position=0)  # other weights and moments: all must be replaced
    zarrckpt.load(target, url)
    _assert_restored(target, loader, saved)


def test_async_save_and_the_manager(tmp_path: Path) -> None:
    saved, _ = _state(seed=0, position=40)
    zarrckpt.async_save(saved, str(tmp_path / "async")).result(timeout=60)
    target, loader = _state(seed=1, position=0)
    zarrckpt.load(target, str(tmp_path / "async"))
    _assert_restored(target, loader, saved)
    manager = zarrckpt.CheckpointManager(str(tmp_path / "run"), interval=1, keep_last=2)
    manager.save(40, saved)
    manager.wait()
    target, loader = _state(seed=1, position=0)
    assert manager.load_latest(target) == 40
    _assert_restored(target, loader, saved)
    manager.close()
