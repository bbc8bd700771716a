"""DCP adapters: dcp.save/dcp.load through ZarrWriter/ZarrReader, crossed with zarrckpt.save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from states import check_loaded, mixed_state

import zarrckpt
from zarrckpt.testing import spawn


def _save(rank: int, world: int, url: str, via: str) -> None:
    state = mixed_state(rank, world, fill=True, save_world=world)
    if via == "dcp":
        dcp.save(state, storage_writer=zarrckpt.ZarrWriter(url))
    else:
        zarrckpt.save(state, url)


def _load(rank: int, world: int, url: str, via: str, save_world: int) -> None:
    state = mixed_state(rank, world, fill=False, save_world=save_world)
    if via == "dcp":
        # DCP drops empty dicts from its plan: give the config a key to receive into
        state["config"] = {"name": "", "layers": [], "lr": 0.0, "flags": {"fused": False}}
        dcp.load(state, storage_reader=zarrckpt.ZarrReader(url))
    else:
        zarrckpt.load(state, url)
    check_loaded(state, rank, world, save_world)


@pytest.mark.slow
@pytest.mark.parametrize(("save_via", "load_via"), [("dcp", "zarrckpt"), ("zarrckpt", "dcp"), ("dcp", "dcp")])
def test_dcp_paths_cross(tmp_path: Path, save_via: str, load_via: str) -> None:
    url = str(tmp_path / "ck")
    spawn(4, _save, url, save_via)
    spawn(3, _load, url, load_via, 4)
