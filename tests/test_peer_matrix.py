"""The peer-reader matrix: four other Zarr v3 readers on checkpoints saved by 2 gloo ranks.

Checkpoints (both written by one 2-rank run, ~10 s):

- ``example``: the example MoE job's ``Trainer`` (``zarrckpt.example``) after 2 steps on 2 ranks, its
  ``state_dict()`` saved by ``zarrckpt.save`` (DTensor weights on a 2-D mesh, Adam moments, 0-d
  ``step`` counters, its per-rank RNG states and data-loader position (``PerRank``): 130 arrays); the
  truth is each DTensor's ``full_tensor()``, each per-rank array every rank's row.
- ``dtensor``: DTensors of every dtype zarrckpt writes, ``Shard`` split unevenly over the 2 ranks
  (5 rows -> 3 + 2, 5 columns -> 3 + 2, 1 row -> 1 + 0), 0-d tensors, empty tensors, small chunks.

Readers: zarr-python (in this process, and in a fresh one that never imports zarrckpt or torch:
``open_group`` + ``tree()``, consolidated and not), TensorStore ``zarr3``, zarrs-python's codec
pipeline with ``strict=True`` (no fallback to zarr-python's codecs), xarray ``open_zarr`` per group.
Every array is compared bit for bit with the tensors the ranks saved; where a reader cannot read an
array, the exact failure is asserted (``CANNOT``), so docs/other-readers.md's table changes only with a test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.testing import spawn

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")

pytestmark = pytest.mark.slow

WORLD = 2
CHUNK_BYTES = 16  # several inner chunks per shard, so readers cross inner-chunk edges too

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
EXTENSION = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}  # zarr extension data types (not in the core spec)
COMPLEX = {"complex64", "complex128"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals, ...) of ``dtype``; 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def dtensor_specs() -> dict[str, tuple[torch.Tensor, int | None]]:
    """Flat key -> (global tensor, the dimension it is sharded along over 2 ranks, None: a plain tensor)."""
    specs: dict[str, tuple[torch.Tensor, int | None]] = {}
    for i, dtype in enumerate(DTYPES):
        name = _name(dtype)
        specs[f"model.rows.{name}"] = (_random((5, 6), dtype, seed=i), 0)  # rows 3 + 2
        specs[f"model.cols.{name}"] = (_random((2, 3, 5), dtype, seed=100 + i), 2)  # columns 3 + 2
        specs[f"model.scalar.{name}"] = (_random((), dtype, seed=200 + i), None)  # 0-d, on every rank
    specs["model.edge.one_row"] = (_random((1, 9), torch.float32, seed=300), 0)  # 1 + 0: rank 1 holds nothing
    specs["model.edge.empty_rows"] = (torch.zeros(0, 4), 0)  # zero-size DTensor
    specs["model.edge.empty_cols"] = (torch.zeros(3, 0, dtype=torch.bfloat16), 1)
    specs["model.edge.empty_plain"] = (torch.zeros(0, dtype=torch.complex64), None)
    specs["optim.state.model.rows.float32.exp_avg"] = (torch.zeros(5, 6), 0)  # all zero: still stored
    specs["optim.state.model.rows.float32.step"] = (torch.tensor(7.0), None)
    return specs


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _flat_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state
    return out


def _per_rank_truth(state: Any, world: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``[world, ...]`` arrays of the ``zarrckpt.PerRank`` leaves of ``state``: every rank's row
    (a value's row: its typed JSON, padded with spaces to the longest), gathered."""
    import torch.distributed as dist

    from zarrckpt.plan.perrank import encode_row

    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out |= _per_rank_truth(v, world, f"{prefix}{k}.")
    elif isinstance(state, zarrckpt.PerRank):
        key, value = prefix[:-1], state.value
        row = value if isinstance(value, torch.Tensor) else torch.tensor(list(encode_row(value, key, False)))
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row.detach().clone())
        if not isinstance(value, torch.Tensor):
            n = max(len(r) for r in rows)
            rows = [torch.cat([r, torch.full((n - len(r),), 0x20)]).to(torch.uint8) for r in rows]
        out[key] = torch.stack(rows)
    return out


def _shard(full: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """This rank's part of ``full`` as a DTensor (gloo's scatter, which distribute_tensor uses, knows
    neither uint16/32/64 nor float8)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _save_both(rank: int, world: int, example_url: str, dtensor_url: str, truth: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from zarrckpt.example.config import ModelConfig, Topology, TrainConfig
    from zarrckpt.example.trainer import Trainer

    trainer = Trainer(ModelConfig(), TrainConfig(), Topology(world))
    for _ in range(2):
        trainer.train_step()
    state = trainer.state_dict()
    zarrckpt.save(state, example_url)
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in _flat_tensors(state).items()
    }
    full |= _per_rank_truth(state, world)
    if rank == 0:
        torch.save(full, truth)

    mesh = init_device_mesh("cpu", (world,))
    flat: dict[str, Any] = {}
    for key, (tensor, dim) in dtensor_specs().items():
        if dim is None:
            flat[key] = tensor.clone()
        else:
            flat[key] = _shard(tensor, mesh, [Shard(dim)])
            n, step = tensor.shape[dim], -(-tensor.shape[dim] // world)  # torch.chunk's split: 5 -> 3 + 2
            assert flat[key].to_local().shape[dim] == max(0, min(step, n - rank * step)), key
    flat["model.replicated"] = _shard(_random((3, 4), torch.bfloat16, 400), mesh, [Replicate()])
    # a shard per rank's box even for small tensors: the uneven splits are what this checkpoint covers
    zarrckpt.save(_nest(flat), dtensor_url, chunk_bytes=CHUNK_BYTES, small_tensor_bytes=0)


def _dtensor_truth() -> dict[str, torch.Tensor]:
    truth = {k: t for k, (t, _) in dtensor_specs().items()}
    truth["model.replicated"] = _random((3, 4), torch.bfloat16, 400)
    return truth


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (root, flat key -> the full tensor that was saved)."""
    base = tmp_path_factory.mktemp("matrix")
    example, dtensor, truth = base / "example", base / "dtensor", base / "example_truth.pt"
    spawn(WORLD, _save_both, str(example), str(dtensor), str(truth))
    return {
        "example": (example, torch.load(truth, weights_only=True)),
        "dtensor": (dtensor, _dtensor_truth()),
    }


CHECKPOINTS = ["example", "dtensor"]


def _path(key: str) -> str:
    return key.replace(".", "/")


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """The raw element bytes, shape (*shape, itemsize), so NaN payloads compare too."""
    if isinstance(a, torch.Tensor):
        flat = a.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return flat.reshape((*a.shape, a.element_size()))
    shape = a.shape
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape((*shape, a.dtype.itemsize))


def _assert_same_bits(got: np.ndarray, want: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), what
    assert str(got.dtype) == _name(want.dtype), what  # ml_dtypes' bfloat16 / float8 for those
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


# -- the inputs are what the matrix claims ----------------------------------------------------------


def test_the_checkpoints_hold_every_case(checkpoints) -> None:
    root, flat = checkpoints["dtensor"]
    meta = json.loads((root / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    arrays = {p: m for p, m in meta.items() if m["node_type"] == "array"}
    assert set(arrays) == {_path(k) for k in flat}
    assert len(arrays) == 58
    assert {m["data_type"] for m in arrays.values()} == {_name(d) for d in DTYPES}
    assert any(m["shape"] == [] for m in arrays.values())
    assert any(0 in m["shape"] for m in arrays.values())
    for key, placement, grid in [
        ("model.rows.bfloat16", "Shard(dim=0)", [3, 6]),  # 5 rows as 3 + 2
        ("model.rows.float8_e5m2", "Shard(dim=0)", [3, 6]),
        ("model.cols.complex128", "Shard(dim=2)", [2, 3, 3]),  # 5 columns as 3 + 2
        ("model.cols.uint64", "Shard(dim=2)", [2, 3, 3]),
        ("model.edge.one_row", "Shard(dim=0)", [1, 9]),  # 1 row as 1 + 0
    ]:
        own = json.loads((root / _path(key) / "zarr.json").read_text())
        assert own["attributes"]["zarrckpt"]["topology"]["placements"] == [placement], key
        assert own["chunk_grid"]["configuration"]["chunk_shape"] == grid, key  # a shard per rank
        assert own["codecs"][0]["configuration"]["chunk_shape"] != grid, key  # of several inner chunks
    assert sorted(p.name for p in (root / "model/edge/one_row").glob("c*")) == ["c.0.0"]

    root, flat = checkpoints["example"]
    meta = json.loads((root / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    arrays = {p: m for p, m in meta.items() if m["node_type"] == "array"}
    assert set(arrays) == {_path(k) for k in flat}
    assert len(arrays) == 130
    assert {m["data_type"] for m in arrays.values()} == {"float32", "float64", "uint8"}
    assert sum(m["shape"] == [] for m in arrays.values()) == 31  # Adam's step counters
    w1 = arrays["model/layers/0/moe/experts/w1"]
    assert w1["shape"] == [8, 64, 128]
    assert w1["attributes"]["zarrckpt"]["topology"]["placements"] == ["Shard(dim=0)", "Replicate()"]


def test_zarrckpt_reads_the_saved_tensors(checkpoints) -> None:
    """The baseline every peer is held to: zarrckpt's own reader gives the tensors the ranks saved."""
    for name in CHECKPOINTS:
        root, flat = checkpoints[name]
        ckpt = zarrckpt.open(str(root))
        for key, want in flat.items():
            _assert_same_bits(ckpt[key].numpy(), want, f"{name} zarrckpt.open {key}")


def _check_all(name: str, got: dict[str, Any], flat: dict[str, torch.Tensor], reader: str) -> None:
    """Every array read bit for bit, or failed exactly as ``CANNOT[reader]`` says for its dtype."""
    assert set(got) == {_path(k) for k in flat}, name
    cannot = CANNOT.get(reader, {})
    for key, want in flat.items():
        result = got[_path(key)]
        why = cannot.get(_name(want.dtype))
        if why is not None and want.numel() == 0 and why in READS_WHEN_EMPTY:
            why = None  # nothing to decode: zarr-python returns the empty array without the pipeline
        if why is None:
            assert not isinstance(result, BaseException), f"{reader} {name} {key}: {result!r}"
            _assert_same_bits(result, want, f"{reader} {name} {key}")
        else:
            assert isinstance(result, BaseException), f"{reader} {name} {key} now reads: update CANNOT and the docs"
            why(result)


# -- zarr-python, zarrckpt installed (its entry points register bfloat16 / float8) -------------------


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_zarr_python(checkpoints, name: str) -> None:
    root, flat = checkpoints[name]
    group = zarr.open_group(str(root), mode="r", zarr_format=3)
    assert group.metadata.consolidated_metadata is not None
    got = {p: a[...] for p, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}
    _check_all(name, got, flat, "zarr-python")


_PLAIN_ZARR = """
import json, sys
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
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "zarrckpt", "zarrckpt_dtypes"))
json.dump({"tree": tree, "arrays": got, "modules": loaded}, open(out, "w"))
"""


@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "not-consolidated"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_zarr_python_without_zarrckpt(checkpoints, tmp_path: Path, name: str, consolidated: bool) -> None:
    """A fresh process that imports zarr only: ``open_group`` + ``tree()`` and every array."""
    root, flat = checkpoints[name]
    out = tmp_path / "out.json"
    args = [sys.executable, "-c", _PLAIN_ZARR, str(root), str(out), "1" if consolidated else "0"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["modules"] == ["zarrckpt_dtypes", "zarrckpt_dtypes.zarr_types"]  # no torch, no zarrckpt
    got = {
        path: np.frombuffer(bytes.fromhex(hexbytes), _numpy_dtype(dtype)).reshape(shape)
        for path, (dtype, shape, hexbytes) in report["arrays"].items()
    }
    _check_all(name, got, flat, "zarr-python, no import")
    assert _tree_arrays(report["tree"]) == _tree_arrays_of(flat)


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name) if name in EXTENSION else name)


def _tree_arrays(tree: str) -> Counter[tuple[str, str, str]]:
    """(leaf name, shape, dtype) of each array line of zarr's ``Group.tree()``."""
    lines = (re.search(r"[─ ]([^ ]+) (\([0-9, ]*\)) ([a-z0-9_]+)$", line) for line in tree.splitlines())
    return Counter(m.groups() for m in lines if m)


def _tree_arrays_of(flat: dict[str, torch.Tensor]) -> Counter[tuple[str, str, str]]:
    return Counter((k.rsplit(".", 1)[-1], str(tuple(t.shape)), _name(t.dtype)) for k, t in flat.items())


_OPEN_ARRAY_FIRST = """
import json, sys
import zarr

root, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    zarr.open_array(root + "/" + path, mode="r", zarr_format=3)  # the first thing this process does
    first = None
except ValueError as e:
    first = str(e)
zarr.open_group(root, mode="r", zarr_format=3)  # loads zarr's buffer entry points: ours registers the types
a = zarr.open_array(root + "/" + path, mode="r", zarr_format=3)[...]
json.dump({"first": first, "then": [str(a.dtype), list(a.shape), a.tobytes().hex()]}, open(out, "w"))
"""


@pytest.mark.parametrize("dtype", sorted(EXTENSION))
def test_zarr_python_without_zarrckpt_open_array_first(checkpoints, tmp_path: Path, dtype: str) -> None:
    """Without ``import zarrckpt``, ``zarr.open_array`` of a bfloat16 / float8 array as a process's first
    zarr call fails (zarr has not loaded the entry points yet); after ``open_group`` it reads bit for bit."""
    root, flat = checkpoints["dtensor"]
    key = f"model.rows.{dtype}"
    out = tmp_path / "out.json"
    args = [sys.executable, "-c", _OPEN_ARRAY_FIRST, str(root), _path(key), str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["first"] == f"No Zarr data type found that matches '{dtype}'"
    name, shape, hexbytes = report["then"]
    got = np.frombuffer(bytes.fromhex(hexbytes), _numpy_dtype(name)).reshape(shape)
    _assert_same_bits(got, flat[key], f"open_array after open_group {key}")


# -- TensorStore ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tensorstore(checkpoints, name: str) -> None:
    root, flat = checkpoints[name]
    got: dict[str, Any] = {}
    for key in flat:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root) + "/"}, "path": _path(key)}
        got[_path(key)] = ts.open(spec, open=True).result().read().result()
    _check_all(name, got, flat, "tensorstore")


# -- zarrs (Rust codec pipeline for zarr-python), strict: no fallback to zarr-python's codecs --------


def _zarrs() -> Any:
    return pytest.importorskip("zarrs", reason="zarrs (zarrs-python) is not installed")


def _cannot_bfloat16(err: BaseException) -> None:
    # zarrs-python refuses numpy dtypes of kind "V" (ml_dtypes' bfloat16 is one) before it calls Rust,
    # whose zarrs crate does know bfloat16: the array opens, reading it fails
    from zarrs.pipeline import UnsupportedDataTypeError

    assert type(err) is UnsupportedDataTypeError, repr(err)


# the zarrs crate in zarrs-python's wheel: float8_e4m3fn is TensorStore's name, which it does not know;
# its float8_e5m2 (built without the crate's "float8" feature) takes only "0x.." or integer fill values,
# not the 0.0 zarrckpt writes (a JSON number, as zarr-extensions' float8_e5m2 allows), nor a constant
# array's hex fill value, which zarr-python hands on as a number. Opening fails.
ZARRS_OPEN_ERRORS = {
    "float8_e4m3fn": "data type float8_e4m3fn is not supported",
    "float8_e5m2": "incompatible fill value metadata: data_type=float8_e5m2, fill_value={fill}",
}


def _zarrs_open_errors(root: Path) -> set[str]:
    """What zarrs says of each float8 array of the checkpoint at ``root``: float8_e5m2's message
    names the fill value (0.0, or a constant array's value) as a float."""
    import ml_dtypes

    from zarrckpt.format import fill

    meta = json.loads((root / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    out = set()
    for m in meta.values():
        if m["node_type"] == "array" and m["data_type"] in ZARRS_OPEN_ERRORS:
            bits = fill.from_json(m["data_type"], m["fill_value"])
            assert bits is not None
            value = float(np.frombuffer(bits, dtype=ml_dtypes.float8_e5m2)[0])
            out.add(ZARRS_OPEN_ERRORS[m["data_type"]].format(fill=value))
    return out


def _cannot_float8(err: BaseException) -> None:
    from zarrs.pipeline import UnsupportedMetadataError

    assert type(err) is UnsupportedMetadataError, repr(err)
    assert isinstance(err.__cause__, TypeError), repr(err.__cause__)
    e5m2 = re.escape(ZARRS_OPEN_ERRORS["float8_e5m2"]).replace(re.escape("{fill}"), r"-?[0-9]+\.[0-9]+")
    message = str(err.__cause__)
    assert message == ZARRS_OPEN_ERRORS["float8_e4m3fn"] or re.fullmatch(e5m2, message), repr(err.__cause__)


READS_WHEN_EMPTY = {_cannot_bfloat16}  # it fails at reading a chunk, not at opening the array
CANNOT: dict[str, dict[str, Any]] = {
    "zarrs": {"bfloat16": _cannot_bfloat16, "float8_e4m3fn": _cannot_float8, "float8_e5m2": _cannot_float8},
}


def _zarrs_config(strict: bool) -> dict[str, Any]:
    # dotted keys: a nested {"codec_pipeline": {...}} replaces zarr's whole codec_pipeline section
    # (its batch_size too, which the strict=False fallback needs)
    return {"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "codec_pipeline.strict": strict}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_zarrs_strict(checkpoints, name: str) -> None:
    """zarrs' Rust codecs only (``strict=True``: no fallback), every array opened from the root group."""
    zarrs = _zarrs()
    root, flat = checkpoints[name]
    got: dict[str, Any] = {}
    float8 = sorted({_name(t.dtype) for t in flat.values()} & set(ZARRS_OPEN_ERRORS))
    with zarr.config.set(_zarrs_config(strict=True)):
        group = zarr.open_group(str(root), mode="r", zarr_format=3)
        assert group.metadata.consolidated_metadata is not None
        if float8:  # tree() and members() open every array: one that zarrs cannot open fails them
            with pytest.raises(zarrs.pipeline.UnsupportedMetadataError) as err:
                group.tree()
            assert str(err.value.__cause__) in _zarrs_open_errors(root)
        else:
            assert _tree_arrays(str(group.tree())) == _tree_arrays_of(flat)
        for key in flat:
            try:
                arr = group[_path(key)]
                pipeline = arr._async_array.codec_pipeline
                assert isinstance(pipeline, zarrs.ZarrsCodecPipeline)
                assert pipeline.impl is not None and pipeline.python_impl is None  # Rust, no fallback
                got[_path(key)] = arr[...]
            except (zarrs.pipeline.UnsupportedDataTypeError, zarrs.pipeline.UnsupportedMetadataError) as err:
                got[_path(key)] = err
    _check_all(name, got, flat, "zarrs")


def test_zarrs_strict_partial_reads_cross_shard_edges(checkpoints) -> None:
    _zarrs()
    root, flat = checkpoints["dtensor"]
    with zarr.config.set(_zarrs_config(strict=True)):
        for key, sl in [
            ("model.rows.float32", (slice(1, 5), slice(2, 6))),  # rows 1..4 span rank 0's and rank 1's shards
            ("model.cols.complex64", (slice(None), slice(1, 3), slice(2, 4))),
            ("model.rows.uint64", (slice(2, 4), slice(None))),
            ("model.edge.one_row", (slice(0, 1), slice(3, 8))),
        ]:
            arr = zarr.open_array(str(root / _path(key)), mode="r", zarr_format=3)
            _assert_same_bits(arr[sl], flat[key][sl], f"zarrs {key}{sl}")


def test_zarrs_without_strict_falls_back_for_the_extension_types(checkpoints) -> None:
    """zarrs' default (strict=False) reads every array: float8 through zarr-python's codecs, with a
    warning; bfloat16 silently so."""
    zarrs = _zarrs()
    root, flat = checkpoints["dtensor"]
    with zarr.config.set(_zarrs_config(strict=False)), pytest.warns(UserWarning) as caught:
        group = zarr.open_group(str(root), mode="r", zarr_format=3)
        got = {p: a[...] for p, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}
        for p, a in group.members(max_depth=None):
            if isinstance(a, zarr.Array):
                assert isinstance(a._async_array.codec_pipeline, zarrs.ZarrsCodecPipeline)
                assert (a._async_array.codec_pipeline.impl is None) == (str(a.dtype) in ZARRS_OPEN_ERRORS), p
    _check_all("dtensor", got, flat, "zarrs, strict=False")
    messages = {str(w.message) for w in caught if "ZarrsCodecPipeline" in str(w.message)}
    assert messages == {f"Array is unsupported by ZarrsCodecPipeline: {m}" for m in _zarrs_open_errors(root)}


def test_zarrs_nested_config_drops_zarrs_fallback_settings(checkpoints) -> None:
    """Why ``_zarrs_config`` uses dotted keys: the nested form replaces zarr's codec_pipeline section."""
    _zarrs()
    root, _ = checkpoints["dtensor"]
    batch_size = zarr.config.get("codec_pipeline.batch_size")
    with zarr.config.set({"codec_pipeline": {"path": "zarrs.ZarrsCodecPipeline", "strict": False}}):
        assert zarr.config.get("codec_pipeline.batch_size", None) is None
        with pytest.raises(KeyError, match="batch_size"), pytest.warns(UserWarning, match="ZarrsCodecPipeline"):
            zarr.open_array(str(root / "model/rows/float8_e5m2"), mode="r", zarr_format=3)
    with zarr.config.set(_zarrs_config(strict=False)):
        assert zarr.config.get("codec_pipeline.batch_size") == batch_size


# -- xarray ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "not-consolidated"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_xarray_open_zarr_per_group(checkpoints, name: str, consolidated: bool) -> None:
    xr = pytest.importorskip("xarray")
    root, flat = checkpoints[name]
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        group, _, leaf = _path(key).rpartition("/")
        groups.setdefault(group, {})[leaf] = t
    got: dict[str, Any] = {}
    for group, arrays in groups.items():
        ds = xr.open_zarr(str(root), group=group, consolidated=consolidated)
        assert set(ds.data_vars) == set(arrays), group
        for leaf in arrays:
            got[f"{group}/{leaf}"] = ds[leaf].values
    _check_all(name, got, flat, "xarray")
