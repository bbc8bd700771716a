"""Other Zarr v3 readers (zarr-python, TensorStore) read what zarrckpt writes, bit for bit.

Single process, local files, no torch.distributed.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt  # registers bfloat16 / float8 with zarr-python
from zarrckpt.engine import commit as protocol
from zarrckpt.engine.writer import committed_manifest, write_metadata, write_rank
from zarrckpt.format import fill, integrity
from zarrckpt.format.keys import nest
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.save import build_save_plan
from zarrckpt.storage.store import Storage

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")

CHUNK_BYTES = 4096


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals, ...) of ``dtype``; 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
]


def _tensors() -> dict[str, torch.Tensor]:
    """Flat key -> tensor (what was saved)."""
    flat: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        flat[f"model.by_dtype.{str(dtype).removeprefix('torch.')}"] = _random((5, 7), dtype, seed=i)
        flat[f"model.big.{str(dtype).removeprefix('torch.')}"] = _random((48, 3, 37), dtype, seed=100 + i)
    flat["model.layers.0.scale"] = torch.tensor(2.5, dtype=torch.float64)  # 0-d
    flat["optim.state.model.layers.0.w.step"] = torch.tensor(1234, dtype=torch.int64)  # 0-d
    flat["model.layers.0.empty"] = torch.zeros(0, 4)  # zero-size
    flat["model.layers.0.w"] = _random((64, 100), torch.float32, seed=7)  # 8 inner chunks of 8 rows
    flat["model.layers.0.t"] = _random((37, 20), torch.bfloat16, seed=8).t()  # non-contiguous source
    flat["optim.state.model.layers.0.w.exp_avg"] = torch.zeros(64, 100)  # zero-initialised moment
    flat["optim.state.model.layers.0.w.exp_avg_sq"] = torch.zeros(64, 100, dtype=torch.bfloat16)
    return flat


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """The raw element bytes, shape (*shape, itemsize), so NaN payloads compare too."""
    if isinstance(a, torch.Tensor):
        flat = a.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return flat.reshape((*a.shape, a.element_size()))
    shape = a.shape  # before ascontiguousarray, which makes a 0-d array 1-d
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape((*shape, a.dtype.itemsize))


def _assert_same_bits(got: np.ndarray | torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), what
    size = got.element_size() if isinstance(got, torch.Tensor) else got.dtype.itemsize
    assert size == want.element_size(), what
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    flat = _tensors()
    root = tmp_path_factory.mktemp("peer") / "ckpt"
    state = nest(flat)
    state["trainer"] = {"step": 10, "name": "run"}
    zarrckpt.save(state, root, chunk_bytes=CHUNK_BYTES)
    return root, flat


def _path(key: str) -> str:
    return key.replace(".", "/")


def test_layout_as_expected(saved) -> None:
    """Sanity: the test state really has multi-chunk shards, 0-d and zero-size arrays."""
    root, _ = saved
    meta = json.loads((root / "model/layers/0/w/zarr.json").read_text())
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    assert shard == [64, 100] and inner == [8, 100]
    for dtype in DTYPES:
        meta = json.loads((root / f"model/big/{_dtype_name(dtype)}/zarr.json").read_text())
        inner = meta["codecs"][0]["configuration"]["chunk_shape"]
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
        n_inner = math.prod(s // c for s, c in zip(shard, inner, strict=True))
        assert meta["data_type"] == _dtype_name(dtype)
        assert n_inner >= 2 or dtype.itemsize * 48 * 3 * 37 <= CHUNK_BYTES, (dtype, inner)
    assert json.loads((root / "model/layers/0/scale/zarr.json").read_text())["shape"] == []
    assert json.loads((root / "model/layers/0/empty/zarr.json").read_text())["shape"] == [0, 4]


@pytest.mark.parametrize("key", sorted(_tensors()))
def test_zarr_open_array(saved, key: str) -> None:
    root, flat = saved
    arr = zarr.open_array(str(root / _path(key)), mode="r", zarr_format=3)
    assert arr.shape == tuple(flat[key].shape)
    _assert_same_bits(arr[...], flat[key], f"zarr.open_array {key}")


def test_zarr_open_group_with_consolidated_metadata(saved) -> None:
    root, flat = saved
    group = zarr.open_group(str(root), mode="r", zarr_format=3)
    consolidated = group.metadata.consolidated_metadata
    assert consolidated is not None
    listed = consolidated.flattened_metadata
    arrays = {p for p, m in listed.items() if m.node_type == "array"}
    assert arrays == {_path(k) for k in flat}
    # the consolidated copy of each array's metadata is its own zarr.json
    for key in flat:
        own = json.loads((root / _path(key) / "zarr.json").read_text())
        assert listed[_path(key)].shape == tuple(own["shape"])
        assert listed[_path(key)].attributes == own["attributes"]
        _assert_same_bits(group[_path(key)][...], flat[key], f"zarr group {key}")
    assert group.attrs["zarrckpt"]["values"] == {"trainer.step": 10, "trainer.name": "run"}


def test_zarr_group_needs_only_the_consolidated_metadata(saved, tmp_path: Path) -> None:
    """Every array opens from the root zarr.json alone (one GET to open a checkpoint)."""
    root, flat = saved
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    for meta in copy.rglob("zarr.json"):
        if meta.parent != copy:
            meta.unlink()
    group = zarr.open_group(str(copy), mode="r", zarr_format=3, use_consolidated=True)
    for key in flat:
        _assert_same_bits(group[_path(key)][...], flat[key], f"consolidated-only {key}")


def _ts_open(path: Path):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True).result()


@pytest.mark.parametrize("key", sorted(_tensors()))
def test_tensorstore(saved, key: str) -> None:
    root, flat = saved
    arr = _ts_open(root / _path(key))
    assert tuple(arr.shape) == tuple(flat[key].shape)
    _assert_same_bits(arr.read().result(), flat[key], f"tensorstore {key}")


def test_tensorstore_opens_arrays_from_the_root(saved) -> None:
    root, flat = saved
    key = "model.big.bfloat16"
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root) + "/"}, "path": _path(key)}
    ).result()
    _assert_same_bits(arr.read().result(), flat[key], key)


SLICES = {
    "model.layers.0.w": (slice(5, 27), slice(13, 77)),  # crosses inner-chunk boundaries
    "model.layers.0.t": (slice(3, 17), slice(1, 30)),
    "model.big.bfloat16": (slice(7, 41), slice(1, 3), slice(0, 37)),
    "model.big.float8_e5m2": (slice(47, 48), slice(0, 3), slice(36, 37)),
    "model.big.bool": (slice(0, 48, 5), slice(None), slice(2, 30)),
    "model.by_dtype.int16": (slice(1, 4), slice(2, 6)),
}


@pytest.mark.parametrize("key", sorted(SLICES))
def test_partial_reads(saved, key: str) -> None:
    root, flat = saved
    sl = SLICES[key]
    want = flat[key][sl]
    got_ts = _ts_open(root / _path(key))[sl].read().result()
    _assert_same_bits(got_ts, want, f"tensorstore {key}{sl}")
    got_zarr = zarr.open_array(str(root / _path(key)), mode="r", zarr_format=3)[sl]
    _assert_same_bits(got_zarr, want, f"zarr {key}{sl}")


def _shard_files(root: Path, key: str) -> list[Path]:
    return sorted((root / _path(key)).glob("c.*"))


def _expected_shard_bytes(meta: dict[str, Any], n_stored: int) -> int:
    itemsize = {"float32": 4, "bfloat16": 2}[meta["data_type"]]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    n = math.prod(s // c for s, c in zip(shard, inner, strict=True))
    return 16 * n + 4 + n_stored * (math.prod(inner) * itemsize + 4)


@pytest.mark.parametrize("key", ["optim.state.model.layers.0.w.exp_avg", "optim.state.model.layers.0.w.exp_avg_sq"])
def test_small_all_zero_moment_is_a_constant_array(saved, key: str) -> None:
    """A zero-initialised moment of at most 64 KiB is stored as metadata only, and says so (the
    array and the commit record), so it is not taken for a lost write; peers read its zeros."""
    root, flat = saved
    meta = json.loads((root / _path(key) / "zarr.json").read_text())
    assert _shard_files(root, key) == [] and not (root / _path(key) / "c").exists()  # (nor a 0-d chunk)
    assert meta["attributes"]["zarrckpt"]["constant"] is True
    assert fill.from_json(meta["data_type"], meta["fill_value"]) == bytes(flat[key].element_size())  # 0.0, 0x0000
    record = json.loads((root / "zarr.json").read_text())["attributes"]["zarrckpt"]["integrity"]["arrays"]
    assert record[_path(key)]["constant"] is True and "chunk_crc32c" not in record[_path(key)]
    _assert_same_bits(_ts_open(root / _path(key)).read().result(), flat[key], key)
    _assert_same_bits(zarr.open_array(str(root / _path(key)), mode="r", zarr_format=3)[...], flat[key], key)


def test_all_zero_tensor_above_the_check_bound_is_written(tmp_path: Path) -> None:
    """zarr-python's write_empty_chunks=False pitfall: an all-zero tensor whose parts are too big to
    check for constancy (over 64 KiB) must still have every inner chunk stored."""
    key = "optim.state.w.exp_avg"
    zeros = torch.zeros(130, 128)  # 66,560 bytes
    root = tmp_path / "ck"
    zarrckpt.save({"optim": {"state": {"w": {"exp_avg": zeros}}}}, root, chunk_bytes=8 * 1024)
    meta = json.loads((root / _path(key) / "zarr.json").read_text())
    files = _shard_files(root, key)
    assert [p.relative_to(root / _path(key)).as_posix() for p in files] == ["c.0.0"]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    n = math.prod(s // c for s, c in zip(shard, inner, strict=True))
    assert shard == meta["shape"] and n >= 2 and "constant" not in meta["attributes"]["zarrckpt"]
    assert files[0].stat().st_size == _expected_shard_bytes(meta, n)  # every inner chunk is stored
    _assert_same_bits(_ts_open(root / _path(key)).read().result(), zeros, key)


# -- edge shards: several "ranks" saved from one process ------------------------------------------


def _save_as_ranks(states: list[dict[str, Any]], url: Path, chunk_bytes: int) -> None:
    """What ``zarrckpt.save`` does on each of ``len(states)`` ranks, run in one process."""
    local = [collect(s) for s in states]
    plan = build_save_plan([loc.describe() for loc in local], chunk_bytes)
    storage = Storage(url)
    save_id = protocol.prepare(storage, overwrite=False)
    written: integrity.Written = {}
    for rank, loc in enumerate(local):
        write_rank(storage, plan, loc, rank, written)
    for rank in range(len(local)):
        write_metadata(storage, plan.metadata_of(rank))
    views = [integrity.to_json(written)]  # the commit record, as rank 0 gathers it
    protocol.commit(storage, committed_manifest(save_id, plan.arrays, plan.values, plan.world_size, views))


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    sizes = [len(c) for c in torch.arange(n).chunk(parts)]
    offsets = [0, *np.cumsum(sizes)[:-1].tolist()]
    return list(zip(offsets, sizes, strict=True))


EDGE = {  # key -> (global tensor, row parts, column parts)
    "model.rows": (_random((10, 6), torch.float32, 1), 4, 1),  # rows 3,3,3,1
    "model.cols": (_random((5, 10), torch.bfloat16, 2), 1, 3),  # columns 4,4,2
    "model.grid": (_random((22, 13), torch.float8_e4m3fn, 3), 3, 2),  # rows 8,8,6 x columns 7,6
    "optim.state.model.rows.exp_avg": (torch.zeros(10, 6), 4, 1),  # every part zero: a constant array
    # zero but the last row: the parts disagree, so every shard is written, the all-zero ones too
    "optim.state.model.rows.exp_avg_sq": (torch.cat([torch.zeros(9, 6), torch.ones(1, 6)]), 4, 1),
}


@pytest.fixture(scope="module")
def saved_by_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cells = {
        k: [(r, c) for r in _split(t.shape[0], rp) for c in _split(t.shape[1], cp)] for k, (t, rp, cp) in EDGE.items()
    }
    world = max(len(v) for v in cells.values())
    states: list[dict[str, Any]] = [{} for _ in range(world)]
    for key, (full, _, _) in EDGE.items():
        for rank in range(world):
            (r0, nr), (c0, nc) = cells[key][rank % len(cells[key])]
            part = full[r0 : r0 + nr, c0 : c0 + nc].clone()
            states[rank][key] = zarrckpt.LocalShard(part, tuple(full.shape), (r0, c0))
    root = tmp_path_factory.mktemp("peer") / "ranks"
    _save_as_ranks(states, root, chunk_bytes=24)
    return root


def test_edge_shards_layout(saved_by_ranks: Path) -> None:
    root = saved_by_ranks
    meta = json.loads((root / "model/rows/zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [3, 6]
    assert meta["codecs"][0]["configuration"]["chunk_shape"] == [1, 6]
    assert [p.name for p in _shard_files(root, "model.rows")] == ["c.0.0", "c.1.0", "c.2.0", "c.3.0"]
    # the last shard holds one row: two of its three inner chunks are out of bounds, not stored
    last = root / "model/rows/c.3.0"
    assert last.stat().st_size == 16 * 3 + 4 + 1 * (6 * 4 + 4)
    index = np.frombuffer(last.read_bytes()[: 16 * 3], dtype="<u8").reshape(3, 2)
    assert (index[1:] == 2**64 - 1).all()
    grid = json.loads((root / "model/grid/zarr.json").read_text())
    assert grid["chunk_grid"]["configuration"]["chunk_shape"] == [8, 7]
    assert grid["codecs"][0]["configuration"]["chunk_shape"] == [2, 7]
    assert len(_shard_files(root, "model.grid")) == 6


@pytest.mark.parametrize("key", sorted(EDGE))
def test_edge_shards_read_by_peers(saved_by_ranks: Path, key: str) -> None:
    root = saved_by_ranks
    full = EDGE[key][0]
    _assert_same_bits(zarr.open_array(str(root / _path(key)), mode="r", zarr_format=3)[...], full, f"zarr {key}")
    group = zarr.open_group(str(root), mode="r", zarr_format=3)
    _assert_same_bits(group[_path(key)][...], full, f"zarr group {key}")
    arr = _ts_open(root / _path(key))
    _assert_same_bits(arr.read().result(), full, f"tensorstore {key}")
    sl = (slice(2, full.shape[0]), slice(1, full.shape[1] - 1))  # crosses shard and chunk edges
    _assert_same_bits(arr[sl].read().result(), full[sl], f"tensorstore {key}{sl}")
    target = torch.empty_like(full)
    zarrckpt.load({key: target}, root, strict=False)
    _assert_same_bits(target, full, f"load {key}")


def test_edge_all_zero_tensor_has_every_shard(saved_by_ranks: Path) -> None:
    """Ranks whose parts are all zero still write them when another rank's part is not (a
    constant array needs every holder to agree); when all agree, no rank writes any."""
    root = saved_by_ranks
    assert _shard_files(root, "optim.state.model.rows.exp_avg") == []
    key = "optim.state.model.rows.exp_avg_sq"
    meta = json.loads((root / _path(key) / "zarr.json").read_text())
    assert "constant" not in meta["attributes"]["zarrckpt"]
    files = {p.name: p.stat().st_size for p in _shard_files(root, key)}
    assert files == {
        "c.0.0": _expected_shard_bytes(meta, 3),
        "c.1.0": _expected_shard_bytes(meta, 3),
        "c.2.0": _expected_shard_bytes(meta, 3),
        "c.3.0": _expected_shard_bytes(meta, 1),
    }


@pytest.mark.slow
def test_zarr_opens_the_root_group_whatever_the_key_order(tmp_path: Path) -> None:
    """zarr-python groups the consolidated metadata's keys with itertools.groupby: unsorted keys (groups
    first, then arrays) made `a/w`, `a/g/w`, `b/g/w` or `model.pos_embed` beside `model.layers.*` and
    `optim.*` interleave, and open_group failed with GroupNotFoundError. Read in a process without zarrckpt."""
    url = str(tmp_path / "ck")
    state = {
        "a": {"w": torch.ones(2), "g": {"w": torch.full((2,), 2.0)}},
        "b": {"g": {"w": torch.full((3,), 3.0)}},
        "model": {"pos_embed": torch.arange(4.0), "layers": {"0": {"w": torch.ones(2, 2)}}},
        "optim": {"state": {"model.pos_embed": {"exp_avg": torch.full((4,), 0.5)}}},
    }
    zarrckpt.save(state, url)
    code = (
        "import json, sys, zarr\n"
        f"g = zarr.open_group({url!r}, mode='r', zarr_format=3)\n"
        "print(json.dumps({p: a[...].tolist() for p, a in sorted(g.members(max_depth=None)) if hasattr(a, 'dtype')}))\n"
        "assert 'zarrckpt' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got == {
        "a/g/w": [2.0, 2.0],
        "a/w": [1.0, 1.0],
        "b/g/w": [3.0, 3.0, 3.0],
        "model/layers/0/w": [[1.0, 1.0], [1.0, 1.0]],
        "model/pos_embed": [0.0, 1.0, 2.0, 3.0],
        "optim/state/model/pos_embed/exp_avg": [0.5] * 4,
    }


def test_unknown_fields_are_refused_unless_they_need_not_be_understood(tmp_path: Path) -> None:
    """Zarr v3 core spec: a reader must fail on an unknown top-level field unless it says must_understand: false."""
    url = tmp_path / "ck"
    zarrckpt.save({"w": torch.ones(3)}, str(url))
    manifest = url / "zarr.json"
    doc = json.loads(manifest.read_text())
    doc["an_extension"] = {"must_understand": False, "anything": 1}
    doc["consolidated_metadata"]["metadata"]["w"]["another"] = {"must_understand": False}
    manifest.write_text(json.dumps(doc))
    target = {"w": torch.zeros(3)}
    zarrckpt.load(target, str(url))
    assert torch.equal(target["w"], torch.ones(3))
    for where in ("root", "array"):
        bad = json.loads(json.dumps(doc))
        node = bad if where == "root" else bad["consolidated_metadata"]["metadata"]["w"]
        node["strange"] = {"must_understand": True}
        manifest.write_text(json.dumps(bad))
        with pytest.raises(zarrckpt.InvalidCheckpointError, match="unknown field 'strange'"):
            zarrckpt.open(str(url))


# -- without zarrckpt: zarr-python finds the bfloat16 / float8 types through entry points ----------

_PLAIN_ZARR = """
import json, sys
import numpy as np
import zarr

root, out, consolidated = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
group = zarr.open_group(root, mode="r", zarr_format=3, use_consolidated=consolidated)
assert (group.metadata.consolidated_metadata is not None) == consolidated
tree = str(group.tree())
got = {}
for path, node in group.members(max_depth=None):
    if isinstance(node, zarr.Array):
        a = node[...]
        got[path] = [str(node.dtype), list(a.shape), a.tobytes().hex()]
alone = zarr.open_array(root + "/model/big/bfloat16", mode="r")
assert str(alone.dtype) == "bfloat16" and alone[...].shape == (48, 3, 37)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "zarrckpt", "zarrckpt_dtypes"))
json.dump({"tree": tree, "arrays": got, "modules": loaded}, open(out, "w"))
"""


@pytest.mark.parametrize("consolidated", [True, False])
def test_plain_zarr_reads_the_checkpoint_without_zarrckpt(saved, tmp_path: Path, consolidated: bool) -> None:
    """A fresh process that imports zarr only (no zarrckpt, no torch) opens the root group, walks
    the tree and reads every array, bf16 / fp8 included, bit for bit."""
    root, flat = saved
    out = tmp_path / "out.json"
    args = [sys.executable, "-c", _PLAIN_ZARR, str(root), str(out), "1" if consolidated else "0"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["modules"] == [
        "zarrckpt_dtypes",
        "zarrckpt_dtypes.zarr_types",
    ]  # the entry point's module; no torch, no zarrckpt
    assert set(report["arrays"]) == {_path(k) for k in flat}
    for key, want in flat.items():
        dtype, shape, hexbytes = report["arrays"][_path(key)]
        assert dtype == _dtype_name(want.dtype), key
        assert shape == list(want.shape), key
        got = np.frombuffer(bytes.fromhex(hexbytes), np.uint8).reshape((*want.shape, want.element_size()))
        np.testing.assert_array_equal(got, _bits(want), err_msg=key)
    assert "bfloat16" in report["tree"] and "float8_e4m3fn" in report["tree"]


def test_zarr_entry_points_are_declared_and_load_without_torch() -> None:
    code = """
import sys
from importlib.metadata import entry_points
OURS = "zarrckpt_dtypes.zarr_types:"
types = {e.name: e.load() for e in entry_points(group="zarr.data_type") if e.value.startswith(OURS)}
assert sorted(types) == ["bfloat16", "float8_e4m3fn", "float8_e5m2"], types
assert all(cls._zarr_v3_name == name for name, cls in types.items())
(buffer,) = [e for e in entry_points(group="zarr.buffer") if e.value.startswith(OURS)]
from zarr.core.buffer.cpu import Buffer
assert buffer.load() is Buffer  # registers nothing new as a buffer
from zarr.dtype import data_type_registry
assert all(data_type_registry.get(name) is cls for name, cls in types.items())
assert not any(m.split(".")[0] in ("torch", "zarrckpt") for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- dimension_names, xarray --------------------------------------------------------------------


def test_every_array_has_unique_dimension_names(saved) -> None:
    root, flat = saved
    manifest = json.loads((root / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    by_group: dict[str, list[str]] = {}
    for key, t in flat.items():
        path = _path(key)
        leaf = path.rsplit("/", 1)[-1]
        own = json.loads((root / path / "zarr.json").read_text())
        assert own["dimension_names"] == [f"{leaf}_dim_{i}" for i in range(t.dim())], key
        assert manifest[path]["dimension_names"] == own["dimension_names"]
        assert zarr.open_array(str(root / path), mode="r").metadata.dimension_names == tuple(own["dimension_names"])
        by_group.setdefault(path.rsplit("/", 1)[0], []).extend(own["dimension_names"])
    for group, names in by_group.items():
        assert len(names) == len(set(names)), group


def test_xarray_opens_every_group_bit_exact(saved) -> None:
    xr = pytest.importorskip("xarray")
    root, flat = saved
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        group, _, name = _path(key).rpartition("/")
        groups.setdefault(group, {})[name] = t
    assert len(groups) >= 4 and any(len({t.shape for t in g.values()}) > 1 for g in groups.values())
    for group, arrays in groups.items():
        ds = xr.open_zarr(str(root), group=group, consolidated=False)
        assert set(ds.data_vars) == set(arrays), group
        for name, want in arrays.items():
            got = ds[name].values
            assert str(got.dtype) == _dtype_name(want.dtype), (group, name)
            _assert_same_bits(got, want, f"xarray {group}/{name}")


def test_a_checkpoint_without_dimension_names_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before dimension_names was added: no such field in any array document."""
    url = tmp_path / "old"
    state = {"w": _random((6, 5), torch.bfloat16, 1), "c": _random((3,), torch.complex128, 2), "s": torch.tensor(7)}
    zarrckpt.save(state, str(url))
    for meta in url.rglob("zarr.json"):
        doc = json.loads(meta.read_text())
        doc.pop("dimension_names", None)
        for node in doc.get("consolidated_metadata", {}).get("metadata", {}).values():
            node.pop("dimension_names", None)
        meta.write_text(json.dumps(doc))
    assert b"dimension_names" not in b"".join(p.read_bytes() for p in url.rglob("zarr.json"))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    zarrckpt.load(target, str(url))
    for key, want in state.items():
        _assert_same_bits(target[key], want, f"load {key}")
    ckpt = zarrckpt.open(str(url))
    ckpt.verify()
    _assert_same_bits(ckpt["w"].read(), state["w"], "open")
    _assert_same_bits(zarr.open_group(str(url), mode="r")["c"][...], state["c"], "zarr")


# -- complex and unsigned types through zarrckpt itself ---------------------------------------------


def test_zarrckpt_load_and_open_every_dtype(saved) -> None:
    root, flat = saved
    target = {k: torch.empty_like(v) for k, v in flat.items()}
    zarrckpt.load(target, str(root), strict=False)
    ckpt = zarrckpt.open(str(root))
    for key, want in flat.items():
        assert target[key].dtype == want.dtype, key
        _assert_same_bits(target[key], want, f"load {key}")
        view = ckpt[key]
        assert view.dtype == want.dtype, key
        _assert_same_bits(view.read(), want, f"open {key}")
        values = view.numpy()
        assert str(values.dtype) == _dtype_name(want.dtype), key  # ml_dtypes' types for bf16 / fp8
        _assert_same_bits(values, want, f"numpy {key}")


def test_numpy_arrays_of_complex_and_unsigned_types_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    state = {
        "c64": (rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))).astype(np.complex64),
        "c128": np.array([complex("nan+infj"), -0.0 + 5e-324j], dtype=np.complex128),
        "u64": np.array([0, 2**64 - 1, 2**63], dtype=np.uint64),
        "u32": rng.integers(0, 2**32, size=(2, 2, 2), dtype=np.uint32),
        "u16": np.array(65535, dtype=np.uint16),
    }
    zarrckpt.save(state, str(tmp_path / "ck"))
    target = {k: np.zeros_like(v) for k, v in state.items()}
    zarrckpt.load(target, str(tmp_path / "ck"))
    for key, want in state.items():
        assert target[key].dtype == want.dtype, key
        np.testing.assert_array_equal(_bits(target[key]), _bits(want), err_msg=key)
        doc = json.loads((tmp_path / "ck" / key / "zarr.json").read_text())
        assert doc["data_type"] == str(want.dtype), key
        if key == "u16":  # 0-d: one element, so a constant array whose fill_value is the value
            assert doc["attributes"]["zarrckpt"]["constant"] is True and doc["fill_value"] == 65535
            continue
        assert doc["fill_value"] == ([0.0, 0.0] if want.dtype.kind == "c" else 0), key
