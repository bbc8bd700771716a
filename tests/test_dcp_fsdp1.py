"""FSDP1 (``FullyShardedDataParallel``, ``SHARDED_STATE_DICT``: ShardedTensor state) model and
optimizer through ZarrWriter/ZarrReader, against FileSystemWriter/FileSystemReader as the oracle.

Ranks are real processes on gloo. One job of 2 ranks saves a trained model and its AdamW state
through both storages, once through ``get_state_dict`` and once through FSDP1's own API
(``model.state_dict()`` and ``FSDP.optim_state_dict`` under ``SHARDED_STATE_DICT``). Jobs of 1
and 3 ranks load each of them into a model and optimizer of other weights, through
``get_state_dict``/``set_state_dict`` and through the FSDP1 recipe (``dcp.load`` for the model,
``load_sharded_optimizer_state_dict`` for the optimizer, ``FSDP.optim_state_dict_to_load``). What
each storage loaded, and the model and optimizer state after, must be bit-identical on every
rank, or both loads must fail with the same exception type.

The "narrow" model's last layer has 2 rows, fewer than 3 ranks: one rank holds no shard of it.
DCP's own planner then fails the ``set_state_dict`` path on both storages (the rank's target lacks
keys the checkpoint has, and ``DefaultLoadPlanner`` takes it for a pre-2.4 checkpoint); the FSDP1
recipe loads it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_dcp_differential import STORAGES, _check_against_the_store, _clear_plan_cache, _indexes, same
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from zarrckpt.testing import spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SAVE_APIS = ("get_state_dict", "fsdp1")
LOAD_APIS = ("set_state_dict", "fsdp1")
MODELS = {"regular": 3, "narrow": 2}  # the last layer's rows


def _fsdp1(seed: int, rows: int) -> tuple[FSDP, torch.optim.Optimizer]:
    """A trained FSDP1 model and its AdamW, every Linear its own FSDP unit; the rows split unevenly
    (3 on 2 ranks: 2 + 1; 16 on 3 ranks: 6 + 6 + 4)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, rows))
    wrapped = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for _ in range(2):
        wrapped(torch.randn(4, 8)).square().sum().backward()  # every gradient depends on the weights
        optim.step()
    return wrapped, optim


def _state(api: str, model: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    if api == "get_state_dict":
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def plain(x: Any) -> Any:
    """A ShardedTensor as what this rank holds of it (global size, then each local shard's offsets
    and data), so :func:`same` compares it bit for bit; containers recursively."""
    if isinstance(x, ShardedTensor):
        shards = sorted((tuple(s.metadata.shard_offsets), s.tensor) for s in x.local_shards())
        return {"size": tuple(x.size()), "shards": [list(s) for s in shards]}
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    return x


def _local(x: Any) -> list[float]:
    """The numbers this rank holds of a tensor (a plain one, or a ShardedTensor through :func:`plain`)."""
    tensors = [t for _, t in x["shards"]] if isinstance(x, dict) else [x]
    return [v for t in tensors for v in t.reshape(-1).tolist()]


def _save(rank: int, world: int, root: str) -> None:
    warnings.simplefilter("ignore")  # FSDP1's and ShardedTensor's deprecation warnings, on every call
    for name, rows in MODELS.items():
        model, optim = _fsdp1(0, rows)
        for api in SAVE_APIS:
            state = _state(api, model, optim)
            for kind, (writer, _) in STORAGES.items():
                _clear_plan_cache()
                dcp.save(state, storage_writer=writer(f"{root}/{name}-{api}-{kind}"))


def _load_one(api: str, rows: int, path: str, reader: type) -> dict[str, Any]:
    """Load ``path`` into a model and optimizer of other weights: what was loaded, and their state after."""
    model, optim = _fsdp1(1, rows)
    if api == "set_state_dict":
        loaded = _state("get_state_dict", model, optim)
        dcp.load(loaded, storage_reader=reader(path))
        set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            loaded = {"model": model.state_dict()}
            dcp.load(loaded, storage_reader=reader(path))
            model.load_state_dict(loaded["model"])
            loaded |= load_sharded_optimizer_state_dict(loaded["model"], "optim", reader(path))
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, loaded["optim"]))
    return {"loaded": plain(loaded), "after": plain(_state("fsdp1", model, optim))}


def _outcome(*args: Any) -> Any:
    """What :func:`_load_one` returns, or the name of the exception type it raised."""
    try:
        return _load_one(*args)
    except BaseException as e:  # DCP wraps rank failures in CheckpointException (a BaseException)
        if isinstance(e, KeyboardInterrupt):
            raise
        return type(e).__name__


def _load(rank: int, world: int, root: str, models: list[str]) -> None:
    warnings.simplefilter("ignore")
    for name in models:
        rows = MODELS[name]
        fresh = plain(_state("fsdp1", *_fsdp1(1, rows)))
        for save_api in SAVE_APIS:
            for load_api in LOAD_APIS:
                where = f"{name} model on rank {rank} of {world}, saved by {save_api}, loaded by {load_api}"
                got = {
                    kind: _outcome(load_api, rows, f"{root}/{name}-{save_api}-{kind}", reader)
                    for kind, (_, reader) in STORAGES.items()
                }
                same(got["fs"], got["zarr"], where)
                if name == "narrow" and load_api == "set_state_dict" and world > rows:
                    assert got["fs"] == "CheckpointException", f"{where}: DCP's planner no longer fails: {got['fs']}"
                    continue
                assert not isinstance(got["fs"], str), f"{where}: {got['fs']}"
                after = got["zarr"]["after"]
                for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
                    for part in ("model", "exp_avg", "exp_avg_sq"):
                        loaded_, fresh_ = (
                            s["model"][key] if part == "model" else s["optim"]["state"][key][part]
                            for s in (after, fresh)
                        )
                        if _local(fresh_):  # this rank holds some of it
                            assert _local(loaded_) != _local(fresh_), f"{where}: {key} {part} not loaded"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp1")
    spawn(2, _save, str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("load_world", "models"), [(1, ["regular"]), (3, ["regular", "narrow"])], ids=["2to1", "2to3"])
def test_fsdp1_model_and_optimizer(saved: Path, load_world: int, models: list[str]) -> None:
    spawn(load_world, _load, str(saved), models)


@pytest.mark.slow
def test_fsdp1_checkpoints_without_a_job(saved: Path) -> None:
    """In one process without torch.distributed: DCP's ``_load_state_dict_from_keys`` (whole, and one
    parameter's optimizer state by its unflattened prefix) gives what it gives from DCP's storage; the
    metadata is DCP's (chunks, properties, planner_data), and ``storage_data`` names the shard objects
    the 2 ranks wrote."""
    for name in MODELS:
        for api in SAVE_APIS:
            path = {kind: str(saved / f"{name}-{api}-{kind}") for kind in STORAGES}
            for keys in (None, {"optim.state.2.weight"}):
                got = {
                    kind: _load_state_dict_from_keys(keys, storage_reader=STORAGES[kind][1](path[kind]))
                    for kind in STORAGES
                }
                same(got["fs"], got["zarr"], f"{name}, saved by {api}, keys {keys}")
            assert list(got["zarr"]["optim"]["state"]) == ["2.weight"]
            md = STORAGES["zarr"][1](path["zarr"]).read_metadata()
            want = STORAGES["fs"][1](path["fs"]).read_metadata()
            assert (md.state_dict_metadata, md.planner_data) == (want.state_dict_metadata, want.planner_data)
            assert set(md.storage_data) == _indexes(md)
            _check_against_the_store(path["zarr"], md)
            assert any(index.offset and index.offset[0] > 0 for index in md.storage_data), "a second rank's shard"
