"""Per-rank state (``zarrckpt.PerRank``): one array ``[world, ...]`` per key, rank r writing row r.

Saved by 2 gloo processes; loaded on 2 (each rank its row, bit-exact), on 3 and 1 (an error by
default, ``per_rank="modulo"`` and ``"skip"``); read by ``zarrckpt.open`` and the peer readers; a save
whose ranks disagree on a row's shape fails before anything is written; the layout-based planner
keeps one class for ranks that differ only in their rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.plan import compact
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, build_save_plan
from zarrckpt.testing import spawn


def _rng(rank: int) -> torch.Tensor:
    return torch.Generator().manual_seed(100 + rank).get_state()


def _position(rank: int) -> dict[str, Any]:
    return {"epoch": 1, "sample": 17 * rank, "name": "r" * (rank + 1)}  # rows of different lengths: padded


def _python(rank: int) -> Any:
    return random.Random(rank).getstate()


def _state(rank: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32)},
        "trainer": {
            "step": 5,
            "rng": {
                "torch": zarrckpt.PerRank(_rng(rank)),
                "python": zarrckpt.PerRank(_python(rank)),
                "numpy": zarrckpt.PerRank(np.random.default_rng(rank).bit_generator.state),
            },
            "loader": zarrckpt.PerRank(_position(rank)),
            "seen": zarrckpt.PerRank(np.array([rank, 2 * rank], dtype=np.int64)),
        },
    }


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(6)},
        "trainer": {
            "step": 0,
            "rng": {
                "torch": zarrckpt.PerRank(torch.zeros_like(_rng(0))),
                "python": zarrckpt.PerRank(random.getstate()),
                "numpy": zarrckpt.PerRank({}),
            },
            "loader": zarrckpt.PerRank(None),
            "seen": zarrckpt.PerRank(np.zeros(2, dtype=np.int64)),
        },
    }


def _save(rank: int, world: int, url: str) -> None:
    zarrckpt.save(_state(rank), url)


def _check_row(state: dict[str, Any], row: int) -> None:
    t = state["trainer"]
    assert torch.equal(t["rng"]["torch"].value, _rng(row))
    assert t["rng"]["python"].value == _python(row)
    assert t["rng"]["numpy"].value == np.random.default_rng(row).bit_generator.state
    assert t["loader"] == zarrckpt.PerRank(_position(row))
    assert t["seen"].value.tolist() == [row, 2 * row]
    assert t["step"] == 5 and torch.equal(state["model"]["w"], torch.arange(6, dtype=torch.float32))


def _load(rank: int, world: int, url: str, mode: str | None) -> None:
    state = _target()
    before = state["trainer"]["rng"]["torch"].value.clone()
    if mode is None:
        if world == 2:
            zarrckpt.load(state, url)
            _check_row(state, rank)
            return
        with pytest.raises(zarrckpt.LayoutMismatchError) as e:
            zarrckpt.load(state, url)
        message = str(e.value)
        assert "trainer.loader: saved per rank by 2 ranks, loading on" in message
        assert "per_rank='modulo'" in message and "per_rank='skip'" in message
        assert torch.equal(state["trainer"]["rng"]["torch"].value, before)  # nothing loaded
        return
    zarrckpt.load(state, url, per_rank=mode)
    if mode == "modulo":
        _check_row(state, rank % 2)
    else:  # skip: the per-rank targets stay as they were, the rest is loaded
        assert torch.equal(state["trainer"]["rng"]["torch"].value, before)
        assert state["trainer"]["loader"] == zarrckpt.PerRank(None) and state["trainer"]["step"] == 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("perrank") / "ckpt")
    spawn(2, _save, url)
    return url


def test_one_array_per_key_a_shard_per_row(saved: str) -> None:
    root = Path(saved)
    doc = json.loads((root / "trainer/rng/torch/zarr.json").read_text())
    n = _rng(0).numel()
    assert doc["shape"] == [2, n] and doc["chunk_grid"]["configuration"]["chunk_shape"] == [1, n]
    ours = doc["attributes"]["zarrckpt"]
    assert ours["per_rank"] == "tensor" and ours["format_version"] == 4 and ours["kind"] == "tensor"
    assert sorted(p.name for p in (root / "trainer/rng/torch").glob("c*")) == ["c.0.0", "c.1.0"]
    loader = json.loads((root / "trainer/loader/zarr.json").read_text())
    assert loader["data_type"] == "uint8" and loader["attributes"]["zarrckpt"]["per_rank"] == "json"
    manifest = json.loads((root / "zarr.json").read_text())["attributes"]["zarrckpt"]
    assert manifest["format_version"] == 4 and "trainer.loader" not in manifest["values"]


@pytest.mark.parametrize(
    ("world", "mode"), [(2, None), (3, None), (1, None), (3, "modulo"), (1, "modulo"), (3, "skip")]
)
def test_load(saved: str, world: int, mode: str | None) -> None:
    spawn(world, _load, saved, mode)


def test_open_shows_the_rank_axis(saved: str) -> None:
    ckpt = zarrckpt.open(saved)
    view = ckpt["trainer.rng.torch"]
    assert tuple(view.shape) == (2, _rng(0).numel())
    assert torch.equal(view[1], _rng(1))
    loader = ckpt["trainer.loader"][...]
    rows = [json.loads(bytes(loader[r].numpy()).decode()) for r in range(2)]
    assert rows == [_position(0), _position(1)]
    assert bytes(loader[0].numpy()).endswith(b" ")  # the shorter row, padded with spaces


def test_peer_readers_read_the_rows(saved: str) -> None:
    zarr = pytest.importorskip("zarr")
    ts = pytest.importorskip("tensorstore")
    group = zarr.open_group(saved, mode="r", zarr_format=3)
    want = torch.stack([_rng(0), _rng(1)]).numpy()
    np.testing.assert_array_equal(group["trainer/rng/torch"][...], want)
    text = group["trainer/loader"][...]
    assert [json.loads(bytes(text[r])) for r in range(2)] == [_position(0), _position(1)]
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{saved}/trainer/rng/torch"}}
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), want)
    spec["kvstore"]["path"] = f"{saved}/trainer/seen"
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), [[0, 0], [1, 2]])


def test_zarrs_and_xarray_read_the_rows(saved: str) -> None:
    zarr = pytest.importorskip("zarr")
    zarrs = pytest.importorskip("zarrs")
    xr = pytest.importorskip("xarray")
    want = torch.stack([_rng(0), _rng(1)]).numpy()
    strict = {"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "codec_pipeline.strict": True}
    with zarr.config.set(strict):  # zarrs' Rust codecs only
        arr = zarr.open_group(saved, mode="r", zarr_format=3)["trainer/rng/torch"]
        assert isinstance(arr._async_array.codec_pipeline, zarrs.ZarrsCodecPipeline)
        np.testing.assert_array_equal(arr[...], want)
        text = zarr.open_group(saved, mode="r", zarr_format=3)["trainer/loader"][...]
        assert json.loads(bytes(text[1])) == _position(1)
    ds = xr.open_zarr(saved, group="trainer/rng", consolidated=False)
    np.testing.assert_array_equal(ds["torch"].values, want)
    assert ds["torch"].dims == ("torch_dim_0", "torch_dim_1")


def _disagree(rank: int, world: int, url: str, which: str) -> None:
    state: dict[str, Any] = {"w": torch.ones(2)}
    if which == "shape":
        state["rng"] = zarrckpt.PerRank(torch.zeros(3 + rank))
    elif rank == 0:  # "count": a PerRank value on rank 0 only
        state["pos"] = zarrckpt.PerRank({"i": 1})
    with pytest.raises(zarrckpt.SaveLayoutError) as e:
        zarrckpt.save(state, url)
    if which == "shape":
        assert "rng: PerRank rows must have one shape and dtype on every rank" in str(e.value)
        assert "ranks 0: [3] float32" in str(e.value) and "ranks 1: [4] float32" in str(e.value)
    else:
        assert "every rank must hold each PerRank key" in str(e.value)


@pytest.mark.parametrize("which", ["shape", "count"])
def test_ranks_that_disagree_fail_before_writing(tmp_path: Path, which: str) -> None:
    spawn(2, _disagree, str(tmp_path / "c"), which)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*"))


def test_rows_do_not_split_the_planners_classes() -> None:
    """Ranks whose rows differ describe per-rank arrays alike (the row is the rank), so the
    layout-based planner keeps them in one class and sends nothing of theirs to the coordinator;
    its plan equals the gathering planner's (a row per shard: no small-shard joining)."""
    world = 4
    locals_ = []
    for rank in range(world):
        local = collect(
            {"rng": zarrckpt.PerRank(_rng(rank)), "pos": zarrckpt.PerRank({"i": 1})}, rank=rank, world=world
        )
        local.pad_rows(local.json_rows())
        locals_.append(local)
    splits = [compact.split(local) for local in locals_]
    assert len({s.digest() for s in splits}) == 1 and all(s.plain == [] for s in splits)
    descriptions = [RankDescription.from_json(json.loads(json.dumps(x.describe().to_json()))) for x in locals_]
    plan = build_save_plan(descriptions, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)
    assert plan.arrays["rng"].shard_shape == (1, _rng(0).numel()) and not plan.gathers
    assert plan.owners["rng"] == {(r, 0): r for r in range(world)}
    docs = compact.class_docs([list(range(world))], [splits[0].doc()], np.ones(0, dtype=np.int64))
    planned, _ = compact.coordinate(
        docs, [[] for _ in range(world)], world, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES
    )
    assert planned is not None and planned.plan == plan


def _save_planned(rank: int, world: int, url: str, force: bool) -> None:
    """``zarrckpt.save`` of :func:`_state` with a DTensor beside, planned by gathering every
    description where ``force`` (the planner before issue 28), else from layouts."""
    import inspect

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zarrckpt.api import _save as save_with

    state = _state(rank)
    mesh = init_device_mesh("cpu", (world,))
    state["model"]["d"] = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    options = inspect.signature(zarrckpt.save).parameters
    defaults = {k: p.default for k, p in options.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    save_with(state, url, **defaults, force_gather=force)


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.relative_to(root).as_posix() == "zarr.json":
                doc = json.loads(data)
                for per_save in ("save_id", "created", "attributes_crc32c"):
                    doc["attributes"]["zarrckpt"][per_save] = None
                data = json.dumps(doc).encode()
            out[p.relative_to(root).as_posix()] = data
    return out


def test_both_planners_write_the_same_checkpoint(tmp_path: Path) -> None:
    spawn(2, _save_planned, str(tmp_path / "gathered"), True)
    spawn(2, _save_planned, str(tmp_path / "compact"), False)
    before, after = _files(tmp_path / "gathered"), _files(tmp_path / "compact")
    assert "trainer/loader/c.1.0" in before and before.keys() == after.keys()
    assert [k for k in before if before[k] != after[k]] == []


def test_async_save_and_a_plain_target_of_the_whole_array(tmp_path: Path) -> None:
    zarrckpt.async_save(_state(0), tmp_path / "c").result(timeout=120)
    whole = {"trainer": {"rng": {"torch": torch.zeros(1, _rng(0).numel(), dtype=torch.uint8)}}}
    zarrckpt.load(whole, tmp_path / "c", strict=False)  # a plain [world, ...] tensor: the whole array
    assert torch.equal(whole["trainer"]["rng"]["torch"][0], _rng(0))
    row = {"trainer": {"rng": {"torch": torch.zeros_like(_rng(0))}, "loader": {}}}
    with pytest.raises(zarrckpt.LayoutMismatchError) as e:
        zarrckpt.load(row, tmp_path / "c", strict=False)
    assert "trainer.rng.torch: saved per rank" in str(e.value) and "zarrckpt.PerRank" in str(e.value)
    plain = {"trainer": {"step": zarrckpt.PerRank(0)}}
    with pytest.raises(zarrckpt.LayoutMismatchError, match=r"trainer\.step: saved a plain value, expected a PerRank"):
        zarrckpt.load(plain, tmp_path / "c", strict=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"per_rank": "rows"}, "per_rank 'rows' is not one of"),
        ({"per_rank": 1}, "per_rank"),
        ({"per_rank": "json"}, "must be stored as a 2-D uint8 array of kind bytes"),
    ],
)
def test_readers_refuse_a_malformed_per_rank_array(change: dict[str, Any], message: str) -> None:
    from zarrckpt.format.array import ArrayMeta

    meta = ArrayMeta("rng", (2, 4), "float32", (1, 4), (1, 4), per_rank="tensor", separator="/")
    doc = meta.to_json()
    assert doc["attributes"]["zarrckpt"]["format_version"] == 3 and ArrayMeta.from_json("rng", doc) == meta
    doc["attributes"]["zarrckpt"].update(change)
    with pytest.raises(zarrckpt.InvalidCheckpointError, match=message):
        ArrayMeta.from_json("rng", doc)


@pytest.mark.parametrize("row", [(3,), (0,), (), (2, 0, 5)])
def test_the_planners_shortcut_for_rows_gives_the_general_grid(row: tuple[int, ...]) -> None:
    """Rows held one per rank in rank order skip the box-by-box check and grid (``exact_rows``);
    what they give equals the general path's for the same boxes as plain parts."""
    import dataclasses

    world = 5
    locals_ = [collect({"x": zarrckpt.PerRank(torch.zeros(row))}, rank=r, world=world) for r in range(world)]
    descriptions = [x.describe() for x in locals_]
    plain = [
        RankDescription(tuple(dataclasses.replace(s, per_rank="") for s in d.specs), d.tensors, d.values)
        for d in descriptions
    ]
    rows, general = build_save_plan(descriptions), build_save_plan(plain)
    assert rows.owners == general.owners
    assert rows.owners["x"] == ({} if 0 in row else {(r, *(0 for _ in row)): r for r in range(world)})
    assert dataclasses.replace(rows.arrays["x"], per_rank="") == general.arrays["x"]
