"""ZarrWriter/ZarrReader against DCP's own FileSystemWriter/FileSystemReader as the oracle.

Each scenario saves the same state through both storages and loads it back the same way; the
loaded states must be bit-identical (tensors: dtype, shape and bytes; values: type and value),
or both runs must fail with the same exception type. The only difference allowed is the one
documented in docs/functions.md: an object of an arbitrary class is refused without ``allow_pickle``.
"""

from __future__ import annotations

import datetime as dt
import io
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, format_utils
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import zarrckpt
import zarrckpt.dcp
from zarrckpt.errors import causes
from zarrckpt.format.integrity import TABLE
from zarrckpt.testing import spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STORAGES = {
    "fs": (FileSystemWriter, FileSystemReader),
    "zarr": (zarrckpt.ZarrWriter, zarrckpt.ZarrReader),
}


def _clear_plan_cache() -> None:
    """DCP caches plans per planner class for the whole process: one storage's must not leak into the other's."""
    for name in dir(SavePlanner):
        if name.startswith("_cached_") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical: tensors by dtype, shape and bytes; everything else by type and value (NaN == NaN)."""
    if isinstance(a, DTensor):
        assert isinstance(b, DTensor) and a.placements == b.placements, where
        a, b = a.to_local(), b.to_local()
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a} vs {b}"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: {a} vs {b}"
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert sorted(a, key=repr) == sorted(b, key=repr), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, io.BytesIO):
        assert a.getvalue() == b.getvalue(), where
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def outcome(kind: str, scenario: Callable[[type, type, str], Any]) -> Any:
    """What ``scenario(writer_cls, reader_cls, dir)`` returns, or the type of the exception it raised."""
    _clear_plan_cache()
    writer, reader = STORAGES[kind]
    try:
        return scenario(writer, reader, tempfile.mkdtemp(prefix=f"dcp-{kind}-"))
    except BaseException as e:  # DCP wraps rank failures in CheckpointException (a BaseException)
        if isinstance(e, KeyboardInterrupt):
            raise
        return type(e)


def differential(scenario: Callable[[type, type, str], Any]) -> Any:
    want, got = outcome("fs", scenario), outcome("zarr", scenario)
    if isinstance(want, type):
        assert got is want, f"FileSystemWriter/Reader raised {want.__name__}, zarrckpt gave {got!r}"
    else:
        assert not isinstance(got, type), f"FileSystemWriter/Reader succeeded, zarrckpt raised {got.__name__}"
        same(want, got)
    return got


def roundtrip(state: Callable[[], dict[str, Any]], target: Callable[[], dict[str, Any]], **kw: Any) -> Any:
    def run(writer: type, reader: type, path: str) -> Any:
        save_planner, load_planner = kw.get("save_planner"), kw.get("load_planner")
        for _ in range(kw.get("saves", 1)):
            dcp.save(state(), storage_writer=writer(path), planner=save_planner() if save_planner else None)
        got = target()
        dcp.load(got, storage_reader=reader(path), planner=load_planner() if load_planner else None)
        return got

    return differential(run)


def _x() -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, 35).reshape(5, 7)


def _model() -> dict[str, Any]:
    return {"model": {"w": _x(), "layers": {"0": {"b": torch.arange(4.0)}}}, "step": 7, "lr": 3e-4}


def _empty_model(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    layers = {"0": {"b": torch.zeros(4, dtype=dtype)}}
    return {"model": {"w": torch.zeros(5, 7, dtype=dtype), "layers": layers}, "step": 0, "lr": 0.0}


# --------------------------------------------------------------------------- planners


class _ScalingSavePlanner(DefaultSavePlanner):
    """Custom resolve_data / transform_object: what is stored is not the state dict's value."""

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        return data * 2 if isinstance(data, torch.Tensor) else data

    def transform_object(self, write_item: Any, object: Any) -> Any:
        return super().transform_object(write_item, object * 10 if write_item.index.fqn == "step" else object)


class _CountingLoadPlanner(DefaultLoadPlanner):
    """Custom load_bytes / commit_tensor hooks must be called (and their effects kept)."""

    calls: ClassVar[dict[str, int]] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _CountingLoadPlanner.calls["load_bytes"] = _CountingLoadPlanner.calls.get("load_bytes", 0) + 1
        super().load_bytes(read_item, value)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        _CountingLoadPlanner.calls["commit_tensor"] = _CountingLoadPlanner.calls.get("commit_tensor", 0) + 1
        tensor.add_(1)
        super().commit_tensor(read_item, tensor)


@pytest.mark.parametrize(
    "planners",
    [
        {},
        {"save_planner": lambda: DefaultSavePlanner(flatten_state_dict=False)},
        {
            "save_planner": lambda: DefaultSavePlanner(flatten_state_dict=False),
            "load_planner": lambda: DefaultLoadPlanner(flatten_state_dict=False),
        },
        {"save_planner": lambda: DefaultSavePlanner(enable_plan_caching=True), "saves": 3},
        {"save_planner": _ScalingSavePlanner},
    ],
    ids=["default", "flatten-off-save", "flatten-off", "plan-caching-x3", "custom-resolve"],
)
def test_planners(planners: dict[str, Any]) -> None:
    roundtrip(_model, _empty_model, **planners)


def test_custom_load_hooks_are_called() -> None:
    def run(writer: type, reader: type, path: str) -> Any:
        _CountingLoadPlanner.calls = {}
        dcp.save(_model(), storage_writer=writer(path))
        got = _empty_model()
        dcp.load(got, storage_reader=reader(path), planner=_CountingLoadPlanner())
        return {"state": got, "calls": dict(_CountingLoadPlanner.calls)}

    got = differential(run)
    assert got["calls"] == {"load_bytes": 2, "commit_tensor": 2} and torch.equal(got["state"]["model"]["w"], _x() + 1)


def test_plan_caching_saves_what_changed() -> None:
    """A cached plan is reused; the data of each save is its own."""

    def run(writer: type, reader: type, path: str) -> Any:
        loaded = []
        for n in range(1, 4):
            planner = DefaultSavePlanner(enable_plan_caching=True)
            dcp.save({"w": _x() * n, "step": n}, storage_writer=writer(path), planner=planner)
            got = {"w": torch.zeros(5, 7), "step": 0}
            dcp.load(got, storage_reader=reader(path))
            loaded.append(got)
        return loaded

    got = differential(run)
    assert [g["step"] for g in got] == [1, 2, 3] and torch.equal(got[2]["w"], _x() * 3)


def test_planner_data_and_loads_from_keys() -> None:
    def run(writer: type, reader: type, path: str) -> Any:
        dcp.save({**_model(), "extra": {"name": "x", "pair": (1, 2)}}, storage_writer=writer(path))
        return {
            "planner_data": reader(path).read_metadata().planner_data,
            "all": _load_state_dict_from_keys(storage_reader=reader(path)),  # _EmptyStateDictLoadPlanner
            "some": _load_state_dict_from_keys(keys={"model.w", "step"}, storage_reader=reader(path)),
        }

    got = differential(run)
    assert got["planner_data"]["model.layers.0.b"] == ("model", "layers", "0", "b")


# --------------------------------------------------------------------------- Metadata.storage_data


def _stored_state() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.linspace(-1.0, 1.0, 64 * 48).reshape(64, 48),  # several inner chunks at chunk_bytes=1024
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "bias": torch.nn.Parameter(torch.ones(3)),  # requires_grad: in TensorProperties
            "step": 7,
        },
        "blob": b"\x00\x01" * 50,
        "arr": np.arange(12, dtype=np.int32).reshape(3, 4),
        "name": "run",
    }


def _indexes(md: Metadata) -> set[MetadataIndex]:
    """The MetadataIndex of every saved item as ``state_dict_metadata`` lists it: each chunk of a
    tensor, and every other item."""
    out = set()
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out |= {MetadataIndex(key, chunk.offsets) for chunk in item.chunks}
        else:
            out.add(MetadataIndex(key))
    return out


def _items(md: Metadata) -> dict[str, Any]:
    """What ``state_dict_metadata`` says of each item: a tensor's size, properties (dtype,
    requires_grad, ...) and chunks (one of size 0 for a tensor without elements)."""
    out: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
            out[key] = (tuple(item.size), item.properties, chunks)
        else:
            out[key] = item
    return out


def _objects(path: str) -> set[str]:
    """The data objects of a zarrckpt checkpoint: every file but the zarr.json documents and the
    chunk checksum table (the commit record's, beside the manifest)."""
    root = Path(path)
    assert (root / TABLE).is_file()
    return {
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name not in ("zarr.json", TABLE)
    }


def _check_against_the_store(path: str, md: Metadata) -> None:
    """Every object ``storage_data`` names is there, as long as it says; every object there is named
    once; shard shapes, inner chunks and object names agree with zarr-python's view of each array."""
    infos = [part for info in md.storage_data.values() for part in (info, *info.parts)]
    assert all(not part.parts for info in md.storage_data.values() for part in info.parts)
    named = [info.relative_path for info in infos if info.relative_path != "zarr.json"]
    assert sorted(set(named)) == sorted(_objects(path)) and len(named) == len(set(named))
    for info in infos:
        assert info.offset == 0 and info.length == Path(path, info.relative_path).stat().st_size, info
    group = zarr.open_group(path, mode="r", zarr_format=3)
    for index, info in md.storage_data.items():
        if index.offset is None or info.relative_path == "zarr.json":  # a value, or a chunk without objects
            continue
        arr = group[index.fqn.replace(".", "/")]
        assert isinstance(arr, zarr.Array) and info.chunk_shape == arr.chunks, (index, info, arr.chunks)
        block = tuple(o // s for o, s in zip(index.offset, arr.shards or (), strict=True))
        assert all(o % s == 0 for o, s in zip(index.offset, arr.shards or (), strict=True)), (index, arr.shards)
        assert info.relative_path == f"{arr.path}/{arr.metadata.encode_chunk_key(block)}", (index, info)
    as_is = zarrckpt.ZarrReader(path, allow_modified=True).read_metadata().storage_data
    assert {index: info.length for index, info in as_is.items() if info.relative_path != "zarr.json"} == {
        index: None for index, info in md.storage_data.items() if info.relative_path != "zarr.json"
    }, "allow_modified=True: another tool may have rewritten the objects"


@pytest.mark.parametrize("flatten", [True, False], ids=["flatten", "flatten-off"])
def test_storage_data_names_every_item_where_it_lies(flatten: bool) -> None:
    def run(writer: type, reader: type, path: str) -> Any:
        w = writer(path, chunk_bytes=1024) if writer is zarrckpt.ZarrWriter else writer(path)
        dcp.save(_stored_state(), storage_writer=w, planner=DefaultSavePlanner(flatten_state_dict=flatten))
        md = reader(path).read_metadata()
        assert set(md.storage_data) == _indexes(md)
        for info in md.storage_data.values():  # what FileSystemReader's _StorageInfo says too
            assert info.offset + (info.length or 0) <= Path(path, info.relative_path).stat().st_size
        if writer is zarrckpt.ZarrWriter:
            _check_against_the_store(path, md)
        loaded = _load_state_dict_from_keys(storage_reader=reader(path))  # _EmptyStateDictLoadPlanner
        return {"metadata": _items(md), "planner_data": md.planner_data, "loaded": loaded}

    got = differential(run)
    assert torch.equal(got["loaded"]["model"]["w"], _stored_state()["model"]["w"])
    if flatten:  # (else "model" is one object)
        assert got["metadata"]["model.bias"][1].requires_grad and not got["metadata"]["model.w"][1].requires_grad
        assert got["metadata"]["model.empty"][2] == [((0, 0), (0, 3))]


def _save_uneven_parts(rank: int, world: int, root: str) -> None:
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    full = torch.arange(30.0).reshape(10, 3)
    rows = [(0, 2), (2, 6), (6, 7), (7, 10)][2 * rank : 2 * rank + 2]  # two parts a rank, on no regular grid
    parts = [STShard(full[a:b].clone(), ShardMetadata([a, 0], [b - a, 3], f"rank:{rank}/cpu")) for a, b in rows]
    state = {"st": init_from_local_shards(parts, [10, 3]), "step": 3}
    for kind, (writer, _) in STORAGES.items():
        dcp.save(state, storage_writer=writer(f"{root}/{kind}"))


@pytest.mark.slow
def test_storage_data_of_several_parts_per_rank(tmp_path: Path) -> None:
    """Parts that no regular grid fits are stored on a finer one (docs/functions.md): the metadata lists its
    shards as the chunks, storage_data names each shard object, and every load gives DCP's result."""
    spawn(2, _save_uneven_parts, str(tmp_path))
    want, md = FileSystemReader(tmp_path / "fs").read_metadata(), zarrckpt.ZarrReader(tmp_path / "zarr").read_metadata()
    assert [c[1][0] for c in _items(want)["st"][2]] == [2, 4, 1, 3]
    assert [c[1][0] for c in _items(md)["st"][2]] == [1] * 10
    assert set(md.storage_data) == _indexes(md)
    _check_against_the_store(str(tmp_path / "zarr"), md)
    loads = [
        _load_state_dict_from_keys(storage_reader=reader(tmp_path / kind)) for kind, (_, reader) in STORAGES.items()
    ]
    same(*loads)
    assert torch.equal(loads[1]["st"], torch.arange(30.0).reshape(10, 3))


def test_dcp_to_torch_save(tmp_path: Path) -> None:
    """torch's dcp_to_torch_save reads through FileSystemReader alone: on a zarrckpt checkpoint it
    finds no .metadata. zarrckpt.dcp.dcp_to_torch_save writes what torch's writes from DCP's own."""
    dcp.save(_stored_state(), storage_writer=FileSystemWriter(tmp_path / "fs"))
    dcp.save(_stored_state(), storage_writer=zarrckpt.ZarrWriter(tmp_path / "zarr", chunk_bytes=1024))
    format_utils.dcp_to_torch_save(tmp_path / "fs", tmp_path / "fs.pt")
    zarrckpt.dcp.dcp_to_torch_save(tmp_path / "zarr", tmp_path / "zarr.pt")
    want, got = (torch.load(tmp_path / f"{kind}.pt", weights_only=False) for kind in ("fs", "zarr"))
    same(want, got)
    with pytest.raises(BaseException, match=r"\.metadata") as err:
        format_utils.dcp_to_torch_save(tmp_path / "zarr", tmp_path / "torch.pt")
    assert type(err.value).__name__ == "CheckpointException" and not (tmp_path / "torch.pt").exists()


# --------------------------------------------------------------------------- casting loads


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-chunk", "partial-chunks"])
def test_casting_loads(saved: torch.dtype, loaded: torch.dtype, chunked: bool) -> None:
    big = torch.linspace(-3.0, 3.0, 64 * 48).reshape(64, 48)

    def state() -> dict[str, Any]:
        return {"w": _x().to(saved), "big": big.to(saved)}

    def target() -> dict[str, Any]:
        return {"w": torch.zeros(5, 7, dtype=loaded), "big": torch.zeros(64, 48, dtype=loaded)}

    if not chunked:
        got = roundtrip(state, target)
    else:  # small inner chunks, and a target of a slice: partial chunk reads convert too

        def run(writer: type, reader: type, path: str) -> Any:
            w = writer(path, chunk_bytes=1024) if writer is zarrckpt.ZarrWriter else writer(path)
            dcp.save(state(), storage_writer=w)
            out = _load_state_dict_from_keys(keys={"big"}, storage_reader=reader(path))
            part = target()
            dcp.load(part, storage_reader=reader(path))
            return {"sliced": out["big"][5:40, 3:30].to(loaded), **part}

        got = differential(run)
    assert torch.equal(got["w"], _x().to(saved).to(loaded))


def test_zarrckpt_load_casts_only_when_asked(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save({"w": _x()}, url, chunk_bytes=64)
    target = {"w": torch.zeros(5, 7, dtype=torch.bfloat16)}
    with pytest.raises(zarrckpt.LayoutMismatchError, match="dtype float32 saved vs bfloat16 expected"):
        zarrckpt.load(target, url)
    assert not target["w"].any(), "nothing loaded"
    zarrckpt.load(target, url, cast=True)
    assert torch.equal(target["w"], _x().to(torch.bfloat16))


# --------------------------------------------------------------------------- values without pickle


class _Custom:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Custom) and other.n == self.n


VALUES: dict[str, Callable[[], Any]] = {
    "tuple": lambda: (1, "a", (2.5, None)),
    "set": lambda: {1, 2, 3},
    "frozenset": lambda: frozenset({"a", "b"}),
    "bytes": lambda: b"\x00\x01binary",
    "bytearray": lambda: bytearray(b"xyz"),
    "BytesIO": lambda: io.BytesIO(b"DCP's TestTrainState keeps one"),
    "non-finite": lambda: [math.inf, -math.inf, math.nan, 1.5],
    "big int": lambda: 2**80 + 1,
    "numpy rng": lambda: np.random.RandomState(3).get_state(),
    "numpy scalar": lambda: np.float32(2.5),
    "numpy array": lambda: np.arange(6, dtype=np.int16).reshape(2, 3),
    "torch.dtype": lambda: torch.bfloat16,
    "torch.Size": lambda: torch.Size([3, 4]),
    "datetime": lambda: dt.datetime(2026, 12, 1, 8, 30, tzinfo=dt.UTC),
    "plateau": lambda: torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ).state_dict(),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_values(name: str) -> None:
    like = VALUES[name]()
    empty = type(like)() if isinstance(like, (io.BytesIO, bytes, bytearray)) else None
    roundtrip(lambda: {"v": VALUES[name](), "w": _x()}, lambda: {"v": empty, "w": torch.zeros(5, 7)})


def test_values_through_zarrckpt_save_and_load(tmp_path: Path) -> None:
    state = {name: make() for name, make in VALUES.items()}
    zarrckpt.save(state, str(tmp_path / "ck"))
    empty = {"BytesIO": io.BytesIO(), "bytes": b"", "bytearray": bytearray(), "numpy array": np.zeros((2, 3), np.int16)}
    target = {name: empty.get(name) for name in state}
    zarrckpt.load(target, str(tmp_path / "ck"))
    same(target, state)


def test_arbitrary_objects_need_allow_pickle(tmp_path: Path) -> None:
    """The one documented difference: FileSystemWriter pickles anything; zarrckpt refuses, or stores it
    pickled (marked) with allow_pickle=True, and then loading needs allow_pickle=True too."""
    assert isinstance(outcome("fs", _custom_roundtrip), dict)
    with pytest.raises(BaseException, match=r"'v': a .*_Custom cannot be stored without pickle.*allow_pickle=True"):
        dcp.save({"v": _Custom(3)}, storage_writer=zarrckpt.ZarrWriter(str(tmp_path / "refused")))
    assert not (tmp_path / "refused" / "zarr.json").exists(), "nothing committed"
    url = str(tmp_path / "pickled")
    dcp.save({"v": _Custom(3)}, storage_writer=zarrckpt.ZarrWriter(url, allow_pickle=True))
    with pytest.raises(BaseException, match="saved pickled"):
        dcp.load({"v": None}, storage_reader=zarrckpt.ZarrReader(url))
    got: dict[str, Any] = {"v": None}
    dcp.load(got, storage_reader=zarrckpt.ZarrReader(url, allow_pickle=True))
    assert got["v"] == _Custom(3)
    zarrckpt.save({"v": _Custom(4)}, str(tmp_path / "z"), allow_pickle=True)
    with pytest.raises(zarrckpt.UnsupportedValueError, match="saved pickled"):
        zarrckpt.load({"v": None}, str(tmp_path / "z"))
    assert zarrckpt.open(str(tmp_path / "z")).metadata["v"].startswith("<pickled"), "open() never unpickles"
    target: dict[str, Any] = {"v": None}
    zarrckpt.load(target, str(tmp_path / "z"), allow_pickle=True)
    assert target["v"] == _Custom(4)


def _custom_roundtrip(writer: type, reader: type, path: str) -> Any:
    dcp.save({"v": _Custom(3)}, storage_writer=writer(path))
    got: dict[str, Any] = {"v": None}
    dcp.load(got, storage_reader=reader(path))
    return got


# --------------------------------------------------------------------------- DCP contracts


def test_writer_defaults_and_contracts(tmp_path: Path) -> None:
    import pickle

    url = str(tmp_path / "ck")
    for _ in range(2):  # overwrites, like FileSystemWriter
        dcp.save({"w": _x()}, storage_writer=zarrckpt.ZarrWriter(url))
    assert zarrckpt.ZarrWriter.validate_checkpoint_id(url)
    assert not zarrckpt.ZarrWriter.validate_checkpoint_id("abc://bucket/x"), "no fsspec filesystem for abc://"
    assert zarrckpt.ZarrReader.validate_checkpoint_id(url)
    assert not zarrckpt.ZarrReader.validate_checkpoint_id(str(tmp_path)), "no checkpoint there"
    for obj in (zarrckpt.ZarrWriter(url), zarrckpt.ZarrReader(url)):
        assert pickle.loads(pickle.dumps(obj)).storage.url == url
    dcp.save({"w": _x()}, storage_writer=FileSystemWriter(tmp_path / "fs"))  # the oracle: DCP's own wording
    with pytest.raises(BaseException, match=r".*Checkpoint already exists.*") as oracle:
        dcp.save({"w": _x()}, storage_writer=FileSystemWriter(tmp_path / "fs", overwrite=False))
    with pytest.raises(BaseException, match=r".*Checkpoint already exists.*") as ours:
        dcp.save({"w": _x()}, storage_writer=zarrckpt.ZarrWriter(url, overwrite=False))
    assert type(oracle.value) is type(ours.value)  # both wrapped in DCP's CheckpointException
    assert any(isinstance(e, zarrckpt.CheckpointExistsError) for e in causes(ours.value)), "our type, inside"
    inner = [[type(e) for e in causes(raised.value) if "already exists" in str(e)][-1] for raised in (oracle, ours)]
    assert all(issubclass(t, RuntimeError) for t in inner), inner  # code catching DCP's RuntimeError catches ours


@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_async_save_modes(tmp_path: Path, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def run(writer: type, reader: type, path: str) -> Any:
        kind = getattr(AsyncCheckpointerType, mode)
        dcp.async_save(_model(), storage_writer=writer(path), async_checkpointer_type=kind).result(timeout=120)
        got = _empty_model()
        dcp.load(got, storage_reader=reader(path))
        return got

    differential(run)


# --------------------------------------------------------------------------- several ranks


def _mesh_state(mesh: Any, fill: bool, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10) / 7
    source = full if fill else torch.zeros(12, 10)
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    return {
        "w": distribute_tensor(source.to(dtype), mesh, placements),
        "r": distribute_tensor((full if fill else torch.zeros(12, 10))[:3].to(dtype), mesh, [Replicate()] * mesh.ndim),
        "step": 5 if fill else 0,
    }


def _mesh(world: int, two_d: bool) -> Any:
    return init_device_mesh("cpu", (2, world // 2) if two_d and world >= 4 else (world,))


def _ranks_save(rank: int, world: int, root: str, two_d: bool) -> None:
    mesh = _mesh(world, two_d)
    for kind, (writer, _) in STORAGES.items():
        _clear_plan_cache()
        dcp.save(_mesh_state(mesh, True), storage_writer=writer(f"{root}/{kind}"))
    dist.barrier()


def _ranks_load(rank: int, world: int, root: str, two_d: bool, dtype: torch.dtype) -> None:
    mesh = _mesh(world, two_d)
    loaded = {}
    for kind, (_, reader) in STORAGES.items():
        target = _mesh_state(mesh, False, dtype)
        dcp.load(target, storage_reader=reader(f"{root}/{kind}"))
        loaded[kind] = target
    same(loaded["fs"], loaded["zarr"], f"rank {rank}")
    assert loaded["zarr"]["w"].to_local().abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save_world", "load_world", "two_d", "dtype"),
    [(2, 3, False, torch.float32), (4, 1, True, torch.float32), (2, 3, False, torch.bfloat16)],
    ids=["1d-2to3", "2d-4to1", "1d-2to3-cast-bf16"],
)
@pytest.mark.slow
def test_dtensor_resharding(tmp_path: Path, save_world: int, load_world: int, two_d: bool, dtype: Any) -> None:
    spawn(save_world, _ranks_save, str(tmp_path), two_d)
    spawn(load_world, _ranks_load, str(tmp_path), two_d, dtype)


# A ShardedTensor with several local shards per rank: tests/test_multipart.py.


def _fsdp2(world: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()  # moments exist, on both sides
    return model, optim


def _fsdp2_save(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp2(world, seed=0)
    msd, osd = get_state_dict(model, optim)
    for kind, (writer, _) in STORAGES.items():
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer(f"{root}/{kind}"))
    with pytest.raises(BaseException, match="use_collectives=True"):
        dcp.save({"model": msd}, storage_writer=zarrckpt.ZarrWriter(f"{root}/nc"), use_collectives=False)
    dist.barrier()


def _fsdp2_load(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    loaded = {}
    for kind, (_, reader) in STORAGES.items():
        model, optim = _fsdp2(world, seed=1)  # other weights and moments: the load must replace them all
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=reader(f"{root}/{kind}"))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded[kind] = dict(zip(("model", "optim"), get_state_dict(model, optim), strict=True))
    same(loaded["fs"], loaded["zarr"], f"rank {rank}")
    fresh, _ = get_state_dict(*_fsdp2(world, seed=1))
    assert not torch.equal(loaded["zarr"]["model"]["0.weight"].full_tensor(), fresh["0.weight"].full_tensor())


@pytest.mark.slow
def test_fsdp2_model_and_optimizer_2_to_1(tmp_path: Path) -> None:
    spawn(2, _fsdp2_save, str(tmp_path))
    spawn(1, _fsdp2_load, str(tmp_path))
