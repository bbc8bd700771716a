"""DCP's ``TensorProperties`` beyond the dtype, kept by ``ZarrWriter`` in the manifest's
``dcp.properties`` and given back by ``ZarrReader.read_metadata()``; a crafted entry is refused.
(The differential suite compares them with FileSystemReader's: tests/test_dcp_differential.py.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zarrckpt


def _save(path: Path) -> None:
    state = {"bias": torch.nn.Parameter(torch.ones(3)), "w": torch.zeros(2, 2), "empty": torch.zeros(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, storage_writer=zarrckpt.ZarrWriter(path))


def _edit(path: Path, properties: object) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["zarrckpt"]["dcp"]["properties"] = properties
    (path / "zarr.json").write_text(json.dumps(doc))


def test_only_what_differs_from_the_defaults_is_stored(tmp_path: Path) -> None:
    _save(tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "zarr.json").read_text())
    assert doc["attributes"]["zarrckpt"]["dcp"]["properties"] == {"bias": {"requires_grad": True}}
    md = zarrckpt.ZarrReader(tmp_path / "ck").read_metadata().state_dict_metadata
    assert md["bias"].properties.requires_grad and not md["w"].properties.requires_grad  # type: ignore[union-attr]


def test_every_stored_property_comes_back(tmp_path: Path) -> None:
    _save(tmp_path / "ck")
    _edit(tmp_path / "ck", {"w": {"memory_format": "channels_last", "pin_memory": True}})
    props = zarrckpt.ZarrReader(tmp_path / "ck", allow_modified=True).read_metadata().state_dict_metadata["w"]
    assert props.properties.memory_format == torch.channels_last and props.properties.pin_memory  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "crafted",
    [
        {"w": {"requires_grad": "yes"}},
        {"w": {"memory_format": "__class__"}},
        {"w": {"layout": "sparse"}},
        {"w": ["requires_grad"]},
        ["w"],
    ],
)
def test_a_crafted_entry_is_refused(tmp_path: Path, crafted: object) -> None:
    _save(tmp_path / "ck")
    _edit(tmp_path / "ck", crafted)
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=r"dcp\.properties"):
        zarrckpt.ZarrReader(tmp_path / "ck", allow_modified=True).read_metadata()


def _save_small_shards(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    norm = distribute_tensor(torch.arange(64.0), mesh, [Shard(0)])  # 128 bytes a rank: a "small" part
    dcp.save({"norm": norm}, storage_writer=zarrckpt.ZarrWriter(f"{root}/dcp"))
    zarrckpt.save({"norm": norm}, f"{root}/save")


@pytest.mark.slow
def test_zarr_writer_writes_each_ranks_small_parts_as_objects_of_their_own(tmp_path: Path) -> None:
    """The difference that stays (docs/functions.md): DCP runs write_data on each rank without a
    collective, so ZarrWriter cannot send a rank's small parts to another rank to join them into one
    object as zarrckpt.save does. Both load the same values."""
    from zarrckpt.testing.procs import spawn

    spawn(2, _save_small_shards, str(tmp_path))
    objects = {kind: sorted(p.name for p in (tmp_path / kind / "norm").glob("c*")) for kind in ("dcp", "save")}
    assert objects == {"dcp": ["c.0", "c.1"], "save": ["c.0"]}
    for kind in ("dcp", "save"):
        assert torch.equal(zarrckpt.open(tmp_path / kind)["norm"][:], torch.arange(64.0))
