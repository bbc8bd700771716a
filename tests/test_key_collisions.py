"""Two entries of a state dict that map to one key are refused before anything is written or read.

Storing them would keep one of the two and, on load, fill both from it. DCP's own flattening is
the oracle where it has an opinion: ``dcp.save`` refuses ``{"a.b": x, "a": {"b": y}}`` and
``{1: x, "1": y}`` ("duplicated flatten key").
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import zarrckpt
from zarrckpt.errors import causes
from zarrckpt.testing import s3_storage_options, unique_url

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

T1, T2 = torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3)
NFC, NFD = "caf\u00e9", "cafe\u0301"  # the same text, two Unicode spellings
COLLIDING: dict[str, tuple[dict[Any, Any], list[str]]] = {  # state dict, the paths the error must name
    "dotted key vs nested dict": ({"a.b": T1, "a": {"b": T2}}, ["['a.b']", "['a']['b']"]),
    "int vs str key": ({1: T1, "1": T2}, ["[1]", "['1']"]),
    "nested int vs str key": ({"m": {0: T1, "0": T2}}, ["['m'][0]", "['m']['0']"]),
    "plain values": ({"a.b": 1, "a": {"b": 2}}, ["['a.b']", "['a']['b']"]),
    "tensor vs value": ({"x": {"y": T1}, "x.y": 3}, ["['x']['y']", "['x.y']"]),
    "unicode spellings": ({NFC: T1, NFD: T2}, [repr(NFC), repr(NFD)]),
}


@pytest.mark.parametrize("name", COLLIDING)
def test_save_refuses_colliding_keys_before_writing(tmp_path: Path, name: str) -> None:
    state, paths = COLLIDING[name]
    with pytest.raises(zarrckpt.InvalidKeyError) as err:
        zarrckpt.save(state, tmp_path / "ck")
    for path in paths:
        assert path in str(err.value), (path, str(err.value))
    assert not (tmp_path / "ck").exists(), "nothing is written"


def test_save_refuses_colliding_keys_on_s3_before_any_request(s3_server: str) -> None:
    url, opts = unique_url("s3"), s3_storage_options(s3_server)
    with pytest.raises(zarrckpt.InvalidKeyError, match=r"\['a.b'\] and \['a'\]\['b'\]"):
        zarrckpt.save({"a.b": T1, "a": {"b": T2}}, url, storage_options=opts)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.open(url, storage_options=opts)


@pytest.mark.parametrize("name", ["dotted key vs nested dict", "int vs str key"])
def test_dcp_refuses_the_same(name: str) -> None:
    """The oracle: DCP's flattening refuses both (so zarrckpt refusing them is no stricter than DCP)."""
    state, _ = COLLIDING[name]
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(CheckpointException) as err:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
    assert _says(err.value, "duplicated flatten key")


def _says(error: BaseException, text: str) -> bool:
    """Whether ``error`` or what led to it (DCP wraps each rank's failure) says ``text``."""
    return any(text in str(e) for e in causes(error))


@pytest.mark.parametrize("name", COLLIDING)
def test_load_refuses_a_colliding_target_before_reading(tmp_path: Path, name: str) -> None:
    state, paths = COLLIDING[name]
    url = tmp_path / "ck"
    zarrckpt.save({"other": T1}, url)
    with pytest.raises(zarrckpt.InvalidKeyError) as err:
        zarrckpt.load(state, url, strict=False)
    assert all(p in str(err.value) for p in paths)
    assert torch.equal(T1, torch.arange(6.0).reshape(2, 3)) and torch.equal(T2, -torch.arange(6.0).reshape(2, 3))


def test_async_save_refuses_colliding_keys_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.InvalidKeyError, match=r"\[1\] and \['1'\]"):
        zarrckpt.async_save({1: T1, "1": T2}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_zarr_writer_refuses_colliding_keys_through_dcp(tmp_path: Path) -> None:
    """With DCP's default planner (flattening on), DCP refuses them itself, through ZarrWriter too."""
    with pytest.raises(CheckpointException) as err:
        dcp.save({"a.b": T1, "a": {"b": T2}}, storage_writer=zarrckpt.ZarrWriter(tmp_path / "ck"), no_dist=True)
    assert _says(err.value, "duplicated flatten key")
    assert not (tmp_path / "ck").exists()


def test_without_flattening_dcp_merges_1_and_str_1_for_both_writers(tmp_path: Path) -> None:
    """A difference DCP makes, not zarrckpt: with ``flatten_state_dict=False`` DCP's planner turns ``1``
    and ``"1"`` into one item before any writer sees the plan, and its own FileSystemWriter keeps one of
    the two as well. Asserted so that a change in DCP shows here."""
    planner = DefaultSavePlanner(flatten_state_dict=False)
    dcp.save({1: T1, "1": T2}, storage_writer=FileSystemWriter(tmp_path / "fs"), planner=planner, no_dist=True)
    assert list(FileSystemReader(tmp_path / "fs").read_metadata().state_dict_metadata) == ["1"]
    planner = DefaultSavePlanner(flatten_state_dict=False)
    dcp.save({1: T1, "1": T2}, storage_writer=zarrckpt.ZarrWriter(tmp_path / "z"), planner=planner, no_dist=True)
    assert zarrckpt.open(tmp_path / "z").keys() == ["1"]


def _item(fqn: str) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([3]))
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([3]))
    return WriteItem(index=MetadataIndex(fqn, torch.Size([0])), type=WriteItemType.TENSOR, tensor_data=data)


def test_zarr_writer_refuses_two_items_at_one_place_in_a_plan(tmp_path: Path) -> None:
    """Whatever planner made it: one rank's plan holding two items for one place is two entries
    mapped to one key; refused before the location is prepared."""
    writer = zarrckpt.ZarrWriter(tmp_path / "ck")
    with pytest.raises(zarrckpt.InvalidKeyError, match="rank 0: two entries of the state dict are both saved as '1'"):
        writer.prepare_global_plan([SavePlan([_item("1"), _item("1")])])
    with pytest.raises(zarrckpt.InvalidKeyError, match="same text"):
        writer.prepare_global_plan([SavePlan([_item(NFC)]), SavePlan([_item(NFD)])])
    assert not (tmp_path / "ck").exists()
    writer.prepare_global_plan([SavePlan([_item("1")]), SavePlan([_item("1")])])  # replicas on two ranks: fine
