"""Hostile checkpoints: clear zarrckpt errors, no file outside the checkpoint touched, no code run.

Every manifest and shard object is untrusted input. Crafted ones must fail with
``InvalidCheckpointError`` (metadata) or ``CorruptChunkError`` (data), quickly and without large
allocations; never with a stray ``KeyError``/``TypeError``/``MemoryError``, never with silent zeros.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import fsspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.errors import CorruptChunkError, InvalidCheckpointError, ModifiedCheckpointError, ZarrckptError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.jsondoc import MAX_RANK
from zarrckpt.format.manifest import Manifest
from zarrckpt.storage.store import Storage

WHERE = "memory://hostile/zarr.json"
PACKAGE = Path(zarrckpt.__file__).parent
PICKLING = PACKAGE / "format" / "pickling.py"  # the one place for opt-in pickled values
IMPORTER = PACKAGE / "convert" / "importer.py"  # reads foreign formats that are pickles by design

# -- process-wide audit hook: file opens and code-execution events, recorded only while armed --------
_AUDIT: list[tuple[str, tuple[Any, ...]]] | None = None
_EXEC_EVENTS = {"pickle.find_class", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _AUDIT is not None and (event == "open" or event in _EXEC_EVENTS):
        _AUDIT.append((event, args))


sys.addaudithook(_audit)


@pytest.fixture
def audit() -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    global _AUDIT
    events: list[tuple[str, tuple[Any, ...]]] = []
    _AUDIT = events
    try:
        yield events
    finally:
        _AUDIT = None


def _opened(events: list[tuple[str, tuple[Any, ...]]]) -> list[str]:
    paths = [a[0] for e, a in events if e == "open" and isinstance(a[0], (str, bytes, os.PathLike))]
    return [os.path.realpath(os.fsdecode(p)) for p in paths]


# -- helpers --------------------------------------------------------------------------------------------
STEPS = 50_000  # about 20 times what rejecting the worst case below takes


def _quickly(fn: Callable[[], Any], limit: int = STEPS) -> Any:
    """``fn()``, failing if it runs more than ``limit`` Python steps (calls and lines) in this thread.

    A deterministic "quickly", whatever the load on the machine: rejecting a hostile document must
    not loop over the elements, shards or chunks it claims (2**70 of them).
    """
    steps = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)
        assert steps <= limit, f"{steps} steps, more than {limit}"


def _state(fill: bool = True) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(64.0).reshape(8, 8) + 1 if fill else torch.zeros(8, 8)},
        "v": torch.arange(4.0).reshape(2, 2) + 1 if fill else torch.zeros(2, 2),
        "blob": b"\x00hello" if fill else b"",
        "step": 7 if fill else 0,
    }


def _save(url: str, state: dict[str, Any] | None = None) -> None:
    zarrckpt.save(_state() if state is None else state, url, chunk_bytes=64)  # model.w: 4 inner chunks of [2, 8]


def _fs(url: str) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _manifest(url: str) -> dict[str, Any]:
    fs, root = _fs(url)
    return json.loads(fs.cat_file(f"{root}/zarr.json"))


def _put_manifest(url: str, doc: Any) -> None:
    fs, root = _fs(url)
    fs.pipe_file(f"{root}/zarr.json", doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _info(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["attributes"]["zarrckpt"]


def _node(doc: dict[str, Any], path: str = "v") -> dict[str, Any]:
    return doc["consolidated_metadata"]["metadata"][path]


def _layout(node: dict[str, Any], shape: Any, shard: Any = None, chunk: Any = None) -> None:
    """Set an array node's shape, shard shape and inner chunk shape together (same ranks)."""
    node["shape"] = shape
    node["chunk_grid"]["configuration"]["chunk_shape"] = shape if shard is None else shard
    node["codecs"][0]["configuration"]["chunk_shape"] = (shape if shard is None else shard) if chunk is None else chunk


@functools.cache
def _valid_raw() -> bytes:
    """The manifest bytes of a real checkpoint (saved once per test session)."""
    with tempfile.TemporaryDirectory() as tmp:
        _save(f"{tmp}/ck", {**_state(), "cfg": {"name": "tiny", "betas": [0.9, 0.99]}, "nested": {"a": {"b": None}}})
        return Path(tmp, "ck", "zarr.json").read_bytes()


def _valid() -> dict[str, Any]:
    return json.loads(_valid_raw())


def _parse(doc: Any) -> Manifest:
    return Manifest.loads(doc if isinstance(doc, bytes) else json.dumps(doc).encode(), WHERE)


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "store" / "ck")
        return
    url = f"memory://{uuid.uuid4().hex}/ck"
    yield url
    fs, root = _fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_valid_manifest_round_trips_and_loads(tmp_path: Path) -> None:
    """Control: the hardened parser accepts what zarrckpt writes, unchanged."""
    manifest = _parse(_valid_raw())
    assert json.loads(manifest.dumps()) == _valid()
    assert Manifest.loads(manifest.dumps(), WHERE) == manifest
    url = str(tmp_path / "ck")
    _save(url)
    got = _state(fill=False)
    zarrckpt.load(got, url)
    assert torch.equal(got["model"]["w"], _state()["model"]["w"]) and got["blob"] == b"\x00hello"


# -- 1. path traversal ----------------------------------------------------------------------------------
def _move(doc: dict[str, Any], new_path: str, key: str | None = None) -> None:
    nodes = doc["consolidated_metadata"]["metadata"]
    node = nodes.pop("v")
    if key is not None:
        node["attributes"]["zarrckpt"]["key"] = key
    nodes[new_path] = node


TRAVERSALS: dict[str, Callable[[dict[str, Any]], None]] = {
    "array at ../../etc/x": lambda d: _move(d, "../../etc/x"),
    "array at ../../etc/x, key to match": lambda d: _move(d, "../../etc/x", "..........etc.x"),
    "array at /x": lambda d: _move(d, "/x"),
    "array at /x, key .x": lambda d: _move(d, "/x", ".x"),
    "key a..b": lambda d: _move(d, "a//b", "a..b"),
    "key ../x": lambda d: _move(d, "../x", "../x"),
    "key /x": lambda d: _move(d, "/x", "/x"),
    "key with backslash": lambda d: _move(d, "..\\x", "..\\x"),
    "key with NUL": lambda d: _move(d, "x\0y", "x\0y"),
    "key __x": lambda d: _move(d, "__x", "__x"),
    "key does not match path": lambda d: _move(d, "model/other"),
    "array path model/w/.": lambda d: _move(d, "model/w/."),
    "group at ../..": lambda d: d["consolidated_metadata"]["metadata"].update({"../..": {"node_type": "group"}}),
    "group at /etc": lambda d: d["consolidated_metadata"]["metadata"].update({"/etc": {"node_type": "group"}}),
    "group at a//b": lambda d: d["consolidated_metadata"]["metadata"].update({"a//b": {"node_type": "group"}}),
    "group at a/": lambda d: d["consolidated_metadata"]["metadata"].update({"a/": {"node_type": "group"}}),
    "group at the root ''": lambda d: d["consolidated_metadata"]["metadata"].update({"": {"node_type": "group"}}),
    "group at a/./b": lambda d: d["consolidated_metadata"]["metadata"].update({"a/./b": {"node_type": "group"}}),
    "group at a\\b": lambda d: d["consolidated_metadata"]["metadata"].update({"a\\b": {"node_type": "group"}}),
    "group at a NUL b": lambda d: d["consolidated_metadata"]["metadata"].update({"a\0b": {"node_type": "group"}}),
    "value key ../x": lambda d: _info(d)["values"].update({"../x": 1}),
    "value key empty": lambda d: _info(d)["values"].update({"": 1}),
}


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_rejected_by_parser(name: str) -> None:
    doc = _valid()
    TRAVERSALS[name](doc)
    with pytest.raises(InvalidCheckpointError, match=r"hostile/zarr\.json"):
        _parse(doc)


@pytest.mark.parametrize("name", ["array at ../../etc/x", "array at ../../etc/x, key to match", "key ../x"])
def test_traversal_touches_nothing_outside(name: str, tmp_path: Path, audit: list[Any], monkeypatch: Any) -> None:
    """A manifest pointing outside the checkpoint: rejected, and no file outside it is opened or changed."""
    root = tmp_path / "a" / "ck"
    url = str(root)
    _save(url)
    outside = tmp_path / "etc" / "x"  # what ../../etc/x resolves to from the checkpoint root
    outside.mkdir(parents=True)
    for rel in ("zarr.json", "c.0.0"):  # a perfectly readable array, had the path been followed
        (outside / rel).write_bytes((root / "v" / rel).read_bytes())
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("untouched")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()}

    storage_paths: list[str] = []
    for method in ("read", "reading", "read_into"):
        original = getattr(Storage, method)

        def record(self: Storage, path: str, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            storage_paths.append(path)
            return _original(self, path, *args, **kwargs)

        monkeypatch.setattr(Storage, method, record)

    good = (root / "zarr.json").read_bytes()
    doc = json.loads(good)
    TRAVERSALS[name](doc)
    _put_manifest(url, doc)
    audit.clear()
    with pytest.raises(InvalidCheckpointError):
        zarrckpt.load({"v": torch.zeros(2, 2)}, url)
    assert set(storage_paths) == {"zarr.json"}, storage_paths  # (read again before it is believed invalid)
    opened_here = [p for p in _opened(audit) if p.startswith(str(tmp_path.resolve()))]
    assert opened_here and all(p.startswith(str(root.resolve()) + os.sep) for p in opened_here), opened_here
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()}
    for snapshot in (before, after):
        snapshot.pop(root / "zarr.json")  # the manifest we rewrote
    assert after == before

    # Control: the recorders see every object a normal load reads, and those stay inside the root.
    _put_manifest(url, good)
    storage_paths.clear()
    audit.clear()
    got = {"v": torch.zeros(2, 2)}
    zarrckpt.load(got, url, strict=False)
    assert torch.equal(got["v"], _state()["v"])
    assert "zarr.json" in storage_paths and "v/c.0.0" in storage_paths
    opened_here = [p for p in _opened(audit) if p.startswith(str(tmp_path.resolve()))]
    assert opened_here and all(p.startswith(str(root.resolve()) + os.sep) for p in opened_here), opened_here


# -- 2. absurd shapes -----------------------------------------------------------------------------------
SHAPES: dict[str, Callable[[dict[str, Any]], None]] = {
    "negative": lambda n: _layout(n, [-2, 2]),
    "float": lambda n: _layout(n, [2.0, 2]),
    "bool": lambda n: _layout(n, [True, 2], [1, 2]),
    "string": lambda n: _layout(n, "22"),
    "null": lambda n: _layout(n, None),
    "nested list": lambda n: _layout(n, [[2], 2]),
    "2**70 elements": lambda n: _layout(n, [2**35, 2**35], [1, 1], [1, 1]),
    "2**70 in one dim": lambda n: _layout(n, [2**70], [1], [1]),
    "zeros times 2**70": lambda n: _layout(n, [0, 2**35, 2**35], [1, 1, 1], [1, 1, 1]),
    "shard 0": lambda n: _layout(n, [2, 2], [0, 2], [0, 2]),
    "chunk 0": lambda n: _layout(n, [2, 2], [2, 2], [0, 2]),
    "chunk not dividing shard": lambda n: _layout(n, [6, 2], [6, 2], [4, 2]),
    "chunk bigger than shard": lambda n: _layout(n, [2, 2], [1, 2], [2, 2]),
    "shard larger than array": lambda n: _layout(n, [2, 2], [2**31, 2], [1, 1]),
    "rank mismatch shard": lambda n: _layout(n, [2, 2], [2, 2, 1], [2, 2, 1]),
    "rank mismatch chunk": lambda n: _layout(n, [2, 2], [2, 2], [2]),
    "10**6 dimensions": lambda n: _layout(n, [1] * 10**6),
    f"{MAX_RANK + 1} dimensions": lambda n: _layout(n, [1] * (MAX_RANK + 1)),
    "chunk_grid missing": lambda n: n.pop("chunk_grid"),
    "codecs empty": lambda n: n.update(codecs=[]),
    "two codecs": lambda n: n.update(codecs=n["codecs"] * 2),
}


@pytest.mark.parametrize("name", SHAPES)
def test_absurd_shapes_rejected_quickly(name: str, tmp_path: Path) -> None:
    doc = _valid()
    SHAPES[name](_node(doc))
    raw = json.dumps(doc).encode()
    with pytest.raises(InvalidCheckpointError, match=r"hostile/zarr\.json.*'v'|'v'.*hostile/zarr\.json"):
        _quickly(lambda: Manifest.loads(raw, WHERE))
    if len(raw) < 2**20:  # tracing a multi-MB parse is slow; the 10**6-dims case is bounded by its JSON
        tracemalloc.start()
        try:
            with pytest.raises(InvalidCheckpointError):
                Manifest.loads(raw, WHERE)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"parsing took {peak} bytes for a {len(raw)}-byte manifest"

    url = str(tmp_path / "ck")
    _save(url)
    _put_manifest(url, raw)
    with pytest.raises(InvalidCheckpointError):
        _quickly(lambda: zarrckpt.load(_state(fill=False), url))


def test_absurd_shape_direct_from_json() -> None:
    node = _node(_valid())
    assert ArrayMeta.from_json("v", node).shape == (2, 2)
    _layout(node, [2**62, 4], [1, 1], [1, 1])
    with pytest.raises(InvalidCheckpointError, match="absurd shape"):
        ArrayMeta.from_json("v", node)
    with pytest.raises(InvalidCheckpointError, match="JSON object"):
        ArrayMeta.from_json("v", ["not", "an", "object"])


# -- 3. malformed JSON and wrong types ------------------------------------------------------------------
def _with(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: _info(d).update({field: value})


def _without(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: _info(d).pop(field)


RAW: dict[str, tuple[bytes, str]] = {
    "not JSON": (b"{not json", "not JSON"),
    "empty": (b"", "not JSON"),
    "binary": (b"\xff\xfe\x00garbage\x80", "not JSON"),
    "pickle": (pickle.dumps({"a": 1}), "not JSON"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    "deeply nested object": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "not JSON|not a Zarr"),
    "NaN": (_valid_raw().replace(b'"step":7', b'"step":NaN'), "not JSON"),
    "Infinity": (_valid_raw().replace(b'"step":7', b'"step":-Infinity'), "not JSON"),
    "1e999": (_valid_raw().replace(b'"step":7', b'"step":1e999'), "not JSON"),
    "huge int": (_valid_raw().replace(b'"step":7', b'"step":' + b"9" * 5000), "not JSON"),
    "array": (b"[]", "not a Zarr v3 group"),
    "null": (b"null", "not a Zarr v3 group"),
    "string": (b'"zarr.json"', "not a Zarr v3 group"),
    "number": (b"3", "not a Zarr v3 group"),
}

DOCS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "zarr v2": (lambda d: d.update(zarr_format=2), "not a Zarr v3 group"),
    "array root": (lambda d: d.update(node_type="array"), "not a Zarr v3 group"),
    "attributes list": (lambda d: d.update(attributes=[]), "not a zarrckpt checkpoint"),
    "no zarrckpt attribute": (lambda d: d["attributes"].pop("zarrckpt"), "not a zarrckpt checkpoint"),
    "zarrckpt attribute a string": (lambda d: d["attributes"].update(zarrckpt="x"), "not a zarrckpt checkpoint"),
    "format_version '1'": (_with("format_version", "1"), r"format_version' must be an integer, not '1'"),
    "format_version 1.5": (_with("format_version", 1.5), r"format_version' must be an integer, not 1.5"),
    "format_version true": (_with("format_version", True), r"format_version' must be an integer, not True"),
    "format_version 99": (_with("format_version", 99), r"format version 99 is newer"),
    "format_version 0": (_with("format_version", 0), r"format_version.*0"),
    "format_version -1": (_with("format_version", -1), r"format_version.*-1"),
    "format_version missing": (_without("format_version"), r"format_version' is missing"),
    "values a list": (_with("values", []), r"values' must be an object, not \[\]"),
    "values null": (_with("values", None), r"values' must be an object, not None"),
    "values missing": (_without("values"), r"values' is missing"),
    "save_id int": (_with("save_id", 5), r"save_id' must be a string, not 5"),
    "save_id missing": (_without("save_id"), r"save_id' is missing"),
    "world_size string": (_with("world_size", "4"), r"world_size' must be an integer, not '4'"),
    "world_size bool": (_with("world_size", True), r"world_size' must be an integer, not True"),
    "world_size 0": (_with("world_size", 0), r"world_size' must be a positive integer"),
    "world_size float": (_with("world_size", 4.0), r"world_size' must be an integer, not 4.0"),
    "created a dict": (_with("created", {"x": 1}), r"created' must be a string"),
    "library a list": (_with("library", ["x"]), r"library' must be a string"),
    "consolidated_metadata missing": (lambda d: d.pop("consolidated_metadata"), r"consolidated_metadata.metadata'"),
    "consolidated_metadata a list": (lambda d: d.update(consolidated_metadata=[1]), r"'consolidated_metadata' must"),
    "metadata a list": (lambda d: d["consolidated_metadata"].update(metadata=[]), r"metadata' must be an object"),
    "node a list": (lambda d: d["consolidated_metadata"]["metadata"].update(v=[]), r"node 'v'"),
    "node of unknown type": (lambda d: _node(d).update(node_type="banana"), r"node 'v'"),
    "array attributes a string": (lambda d: _node(d).update(attributes="x"), r"'v'.*'attributes' must be"),
    "array zarrckpt attribute missing": (lambda d: _node(d)["attributes"].pop("zarrckpt"), r"'v'.*format_version"),
    "array format_version 99": (lambda d: _node(d)["attributes"]["zarrckpt"].update(format_version=99), "newer"),
    "array format_version '1'": (
        lambda d: _node(d)["attributes"]["zarrckpt"].update(format_version="1"),
        r"'v'.*format_version' must be an integer",
    ),
    "array key an int": (lambda d: _node(d)["attributes"]["zarrckpt"].update(key=3), r"key' must be a string"),
    "array key missing": (lambda d: _node(d)["attributes"]["zarrckpt"].pop("key"), r"key' is missing"),
    "data_type unknown": (lambda d: _node(d).update(data_type="complex32"), r"unsupported data_type 'complex32'"),
    # zarr-extensions' float8_e4m3 is another encoding than float8_e4m3fn: no alias
    "data_type float8_e4m3": (
        lambda d: _node(d).update(data_type="float8_e4m3"),
        r"unsupported data_type 'float8_e4m3'",
    ),
    "dimension_names too few": (
        lambda d: _node(d).update(dimension_names=[]),
        r"'dimension_names' must list one name .* \(2\), not \[\]",
    ),
    "dimension_names a string": (
        lambda d: _node(d).update(dimension_names="v_dim_0"),
        r"'dimension_names' must list one name",
    ),
    "dimension_names of ints": (
        lambda d: _node(d).update(dimension_names=[0]),
        r"'dimension_names' must list one name",
    ),
    "data_type a list": (lambda d: _node(d).update(data_type=["float32"]), r"data_type' must be a string"),
    "role unknown": (lambda d: _node(d)["attributes"]["zarrckpt"].update(role="boss"), r"role 'boss'"),
    "kind unknown": (lambda d: _node(d)["attributes"]["zarrckpt"].update(kind="pickle"), r"kind 'pickle'"),
    "kind a dict": (lambda d: _node(d)["attributes"]["zarrckpt"].update(kind={}), r"kind' must be a string"),
    "bytes kind, 2-D": (lambda d: _node(d)["attributes"]["zarrckpt"].update(kind="bytes"), r"1-D uint8"),
    "topology a list": (lambda d: _node(d)["attributes"]["zarrckpt"].update(topology=[]), r"topology' must be"),
    "order F": (lambda d: _node(d)["attributes"]["zarrckpt"].update(order="F"), r"C order"),
    "big endian": (
        lambda d: _node(d)["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(endian="big"),
        r"'codecs'",
    ),
    "index at the end": (lambda d: _node(d)["codecs"][0]["configuration"].update(index_location="end"), "'codecs'"),
    "gzip codec": (lambda d: _node(d)["codecs"][0]["configuration"]["codecs"].append({"name": "gzip"}), "'codecs'"),
    "codecs a dict": (lambda d: _node(d).update(codecs={"a": 1}), r"'codecs' must be a list"),
    "codec a string": (lambda d: _node(d).update(codecs=["x"]), r"'codecs\[0\]' must be a JSON object"),
    "configuration a list": (lambda d: _node(d)["codecs"][0].update(configuration=[]), r"'codecs\[0\].configuration'"),
    "chunk keys with '-'": (lambda d: _node(d)["chunk_key_encoding"]["configuration"].update(separator="-"), "key_enc"),
    "v2 chunk keys": (lambda d: _node(d)["chunk_key_encoding"].update(name="v2"), "chunk_key_encoding"),
    "rectilinear grid": (lambda d: _node(d)["chunk_grid"].update(name="rectilinear"), "chunk_grid"),
    "fill value 1": (lambda d: _node(d).update(fill_value=1.5), "fill_value"),
    "storage transformer": (lambda d: _node(d).update(storage_transformers=[{"name": "x"}]), "storage transformers"),
    "zarr v2 array": (lambda d: _node(d).update(zarr_format=2), "zarr_format"),
    "key both array and value": (lambda d: _info(d)["values"].update(v=1), r"both as an array and as a value: \['v'\]"),
    "array key prefix of a value": (lambda d: _info(d)["values"].update({"v.x": 1}), "prefix"),
    "value key prefix of an array": (lambda d: _info(d)["values"].update({"model": 1}), "prefix"),
}


@pytest.mark.parametrize("name", RAW)
def test_malformed_json(name: str) -> None:
    raw, match = RAW[name]
    with pytest.raises(InvalidCheckpointError, match=match) as err:
        _quickly(lambda: Manifest.loads(raw, WHERE))
    assert WHERE in str(err.value) and len(str(err.value)) < 1000


@pytest.mark.parametrize("name", DOCS)
def test_wrong_types(name: str) -> None:
    mutate, match = DOCS[name]
    doc = _valid()
    mutate(doc)
    with pytest.raises(InvalidCheckpointError, match=match) as err:
        _parse(doc)
    assert WHERE in str(err.value)


@pytest.mark.parametrize("name", ["not JSON", "deeply nested", "NaN", "pickle"])
def test_malformed_json_through_load(name: str, url: str) -> None:
    _save(url)
    _put_manifest(url, RAW[name][0])
    with pytest.raises(InvalidCheckpointError, match=r"zarr\.json"):
        zarrckpt.load(_state(fill=False), url)


@pytest.mark.parametrize(
    "name", ["format_version '1'", "world_size string", "values a list", "big endian", "key both array and value"]
)
def test_wrong_types_through_load(name: str, url: str) -> None:
    _save(url)
    doc = _manifest(url)
    DOCS[name][0](doc)
    _put_manifest(url, doc)
    with pytest.raises(InvalidCheckpointError, match=r"zarr\.json"):
        zarrckpt.load(_state(fill=False), url)


# -- 4. metadata that disagrees with the stored objects -------------------------------------------------
def _index(url: str, path: str, n: int, edit: Callable[[np.ndarray], None]) -> None:
    """Rewrite the index of the shard object at ``path`` (with a valid checksum: a crafted shard)."""
    fs, root = _fs(url)
    raw = bytearray(fs.cat_file(f"{root}/{path}"))
    index = np.frombuffer(bytes(raw[: 16 * n]), dtype="<u8").reshape(n, 2).copy()
    edit(index)
    new = index.astype("<u8").tobytes()
    raw[: 16 * n + 4] = new + struct.pack("<I", crc32c.crc32c(new))
    fs.pipe_file(f"{root}/{path}", bytes(raw))


EMPTY = 2**64 - 1


def _set_entry(k: int, offset: int, nbytes: int) -> Callable[[np.ndarray], None]:
    def edit(index: np.ndarray) -> None:
        index[k] = (offset, nbytes)

    return edit


MISMATCHES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "shape [4,4] over [2,2] shards": (lambda d: _layout(_node(d), [4, 4]), "wrong size|truncated"),
    "shape [4,4], chunks [2,2]": (lambda d: _layout(_node(d), [4, 4], [4, 4], [2, 2]), "truncated|checksum"),
    "shape [4,4], shards [2,2]": (lambda d: _layout(_node(d), [4, 4], [2, 2], [2, 2]), "missing"),
    "shape [2,4], shards [2,4]": (lambda d: _layout(_node(d), [2, 4]), "wrong size|truncated"),
    "finer chunks than stored": (
        lambda d: _layout(_node(d, "model/w"), [8, 8], [8, 8], [1, 8]),
        "truncated|checksum|wrong size",
    ),
    "coarser chunks than stored": (
        lambda d: _layout(_node(d, "model/w"), [8, 8], [8, 8], [4, 8]),
        "truncated|checksum|wrong size",
    ),
    "float64 over float32": (lambda d: _node(d).update(data_type="float64", fill_value=0.0), "wrong size|truncated"),
    "int16 over float32": (lambda d: _node(d).update(data_type="int16", fill_value=0), "wrong size|truncated"),
    "uint8 over float32": (lambda d: _node(d).update(data_type="uint8", fill_value=0), "wrong size|truncated"),
}

_TARGET_DTYPES = {"float64": torch.float64, "int16": torch.int16, "uint8": torch.uint8}


def _strip_commit_record(doc: dict[str, Any]) -> None:
    """Make ``doc`` a manifest as written before commit records existed (no integrity, no digest)."""
    del _info(doc)["integrity"], _info(doc)["attributes_crc32c"]


@pytest.mark.parametrize("recorded", [True, False], ids=["with-commit-record", "without-commit-record"])
@pytest.mark.parametrize("name", MISMATCHES)
def test_metadata_disagrees_with_shards(name: str, recorded: bool, url: str) -> None:
    """The commit record catches the edit first; without one (older checkpoints, or the record
    edited away too) the shard objects still tell."""
    _save(url)
    doc = _manifest(url)
    mutate, match = MISMATCHES[name]
    mutate(doc)
    if not recorded:
        _strip_commit_record(doc)
    _put_manifest(url, doc)
    metas = _parse(doc).arrays  # consistent in itself: only the record or the objects can tell
    zeros = {k: torch.zeros(m.shape, dtype=_TARGET_DTYPES.get(m.dtype, torch.float32)) for k, m in metas.items()}
    target = {"model": {"w": zeros["model.w"]}, "v": zeros["v"], "blob": b"", "step": 0}
    if recorded:
        with pytest.raises(ModifiedCheckpointError, match=r"was committed as|not what was committed"):
            zarrckpt.load(target, url)
        return
    with pytest.raises(ModifiedCheckpointError, match="has no commit record"):  # nothing to compare with
        zarrckpt.load(target, url)
    with pytest.raises(CorruptChunkError, match=rf"{match}|index entry|checksum|missing"):  # read as it is now,
        zarrckpt.load(target, url, allow_modified=True)  # the shard objects still tell


def _stored_at(k: int) -> int:
    return 16 * 4 + 4 + k * (64 + 4)  # model.w: 4 inner chunks of 2x8 float32 each


SHARD_EDITS: dict[str, tuple[Callable[[np.ndarray], None], str]] = {
    "in-bounds chunk marked empty": (_set_entry(2, EMPTY, EMPTY), "inner chunk 2 .*missing"),
    "offset empty, size right": (_set_entry(1, EMPTY, 68), "missing"),
    "size empty": (_set_entry(1, _stored_at(1), EMPTY), "wrong size"),
    "size too small": (_set_entry(3, _stored_at(3), 4), "wrong size"),
    "size too large": (_set_entry(0, _stored_at(0), 2**40), "wrong size"),
    "size zero": (_set_entry(0, _stored_at(0), 0), "wrong size"),
    "offset beyond the object": (_set_entry(3, 10_000, 68), "stored at offset"),
    "offset straddles the end": (_set_entry(3, _stored_at(3) + 10, 68), "stored at offset"),
    "offset into the index": (_set_entry(0, 4, 68), "stored at offset"),
    "offset inside a chunk": (_set_entry(1, _stored_at(1) + 8, 68), "stored at offset"),
    "offset 2**63": (_set_entry(3, 2**63, 68), "stored at offset"),
    "offset 2**64-2": (_set_entry(3, 2**64 - 2, 68), "stored at offset"),
}


@pytest.mark.parametrize("name", SHARD_EDITS)
def test_crafted_shard_index(name: str, url: str) -> None:
    _save(url)
    edit, match = SHARD_EDITS[name]
    _index(url, "model/w/c.0.0", 4, edit)
    with pytest.raises(CorruptChunkError, match=match) as err:
        zarrckpt.load(_state(fill=False), url)
    assert err.value.key == "model.w"


def test_crafted_index_partial_read(url: str) -> None:
    """A rank that reads only the broken chunk's rows is refused too; one reading other rows is not."""
    _save(url)
    _index(url, "model/w/c.0.0", 4, _set_entry(2, EMPTY, EMPTY))
    with pytest.raises(CorruptChunkError, match="missing"):
        zarrckpt.load({"model": {"w": zarrckpt.LocalShard(torch.zeros(2, 8), (8, 8), (4, 0))}}, url, strict=False)
    part = zarrckpt.LocalShard(torch.zeros(2, 8), (8, 8), (6, 0))
    zarrckpt.load({"model": {"w": part}}, url, strict=False)
    assert torch.equal(part.data, _state()["model"]["w"][6:8])


# -- 5. nothing is ever executed ------------------------------------------------------------------------
class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_no_code_executed(tmp_path: Path, audit: list[Any]) -> None:
    pwned = tmp_path / "pwned"
    code = f"__import__('os').system('touch {pwned}')"
    payload = pickle.dumps(_Evil(pwned))
    torch_payload = tmp_path / "evil.pt"
    torch.save({"x": _Evil(pwned)}, torch_payload)
    url = str(tmp_path / "ck")
    state: dict[str, Any] = {
        "w": torch.ones(3),
        "blob": payload,
        "torch_blob": torch_payload.read_bytes(),
        "note": code,
        "cfg": {"cmd": code, "pickled": payload.decode("latin-1"), "list": [code, "cos\nsystem\n(S'id'\ntR."]},
        "np": np.frombuffer(payload, dtype=np.uint8).copy(),
    }
    zarrckpt.save(state, url)
    doc = _manifest(url)
    _info(doc).update(evil=code, __reduce__=payload.decode("latin-1"))
    doc["attributes"]["__class__"] = code
    _node(doc, "w")["attributes"]["zarrckpt"]["topology"] = {"placements": [code], "__reduce__": [code]}
    _node(doc, "w")["attributes"]["pickle"] = payload.decode("latin-1")
    _put_manifest(url, doc)

    audit.clear()
    got: dict[str, Any] = {
        "w": torch.zeros(3),
        "blob": b"",
        "torch_blob": b"",
        "note": "",
        "cfg": {},
        "np": np.zeros(len(payload), np.uint8),
    }
    with pytest.raises(ModifiedCheckpointError, match="attributes"):  # the edit is caught ...
        zarrckpt.load(got, url)
    zarrckpt.load(got, url, allow_modified=True)  # ... and read as it is now, still without running code
    assert not pwned.exists()
    assert not [e for e, _ in audit if e != "open"], audit  # no unpickling, no process started
    assert got["blob"] == payload and got["torch_blob"] == torch_payload.read_bytes()
    assert got["note"] == code and got["cfg"]["cmd"] == code and np.array_equal(got["np"], state["np"])


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"torch.load", "torch.serialization.load", "eval", "exec", "__import__", "pickle.loads"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def test_package_never_unpickles() -> None:
    """Static check over zarrckpt's own sources: no pickle-family import, no torch.load, eval or exec.

    Two exceptions, checked separately below: ``importer.py`` reads *foreign* formats (DCP,
    ``torch.save``) that are pickles by design, and does so only in restricted ways; ``pickling.py``
    is the one place for opt-in pickled values (``allow_pickle=True``) and DCP's in-memory
    planner bytes.
    """
    sources = sorted(p for p in PACKAGE.rglob("*.py") if p not in (IMPORTER, PICKLING))
    assert len(sources) > 10
    problems = []
    for source in sources:
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] in FORBIDDEN_MODULES for n in names):
                problems.append(f"{source.name}:{getattr(node, 'lineno', 0)} imports {names}")
            if isinstance(node, ast.Call):
                if _dotted(node.func) in FORBIDDEN_CALLS:
                    problems.append(f"{source.name}:{node.lineno} calls {_dotted(node.func)}")
                if any(k.arg == "weights_only" for k in node.keywords) or (
                    _dotted(node.func).endswith(("np.load", "numpy.load"))
                    and any(k.arg == "allow_pickle" for k in node.keywords)
                ):
                    problems.append(f"{source.name}:{node.lineno} passes allow_pickle/weights_only")
    assert not problems, problems
    text = "\n".join(s.read_text() for s in sources)
    assert "import pickle" not in text and "torch.load(" not in text


def test_pickled_values_need_the_loaders_consent() -> None:
    """``pickling.py``: a pickled value is refused unless the loader passes allow_pickle=True; it is
    the only module besides importer.py that may call pickle.loads or torch.load."""
    from zarrckpt.format import pickling

    text = pickling.dumps({"x": 1})
    with pytest.raises(zarrckpt.UnsupportedValueError, match="saved pickled"):
        pickling.loads(text, "k", allow_pickle=False)
    assert pickling.loads(text, "k", allow_pickle=True) == {"x": 1}
    tree = ast.parse(PICKLING.read_text())
    calls = sorted({_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)} & FORBIDDEN_CALLS)
    assert calls == ["pickle.loads", "torch.load"], calls
    loads = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "loads")
    assert isinstance(loads.body[1], ast.If), "loads() checks allow_pickle before anything else"


def test_importer_unpickles_only_in_restricted_ways() -> None:
    """``importer.py``: torch.load only with weights_only=True; pickle only through an Unpickler
    subclass whose find_class admits a fixed allow-list (DCP's metadata classes)."""
    tree = ast.parse(IMPORTER.read_text())
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    problems.append(f"line {node.lineno}: torch.load without weights_only=True")
            elif name in FORBIDDEN_CALLS or name.startswith(("pickle.load", "pickle.Unpickler")):
                problems.append(f"line {node.lineno}: calls {name}")
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    unpicklers = [c for c in classes if any(_dotted(b) == "pickle.Unpickler" for b in c.bases)]
    assert len(unpicklers) == 1 and any(
        isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in unpicklers[0].body
    ), "DCP metadata must go through one Unpickler subclass that overrides find_class"
    assert not problems, problems


# -- 6. fuzzing the parser -------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=5),
    max_leaves=30,
)
# Replacement values: any JSON, plus the near-misses that parsers get wrong (shapes, keys, versions).
VALUES = (
    JSON
    | st.lists(st.integers(-1, 2**70), max_size=4)
    | st.sampled_from(["..", "../x", "/x", "a..b", "__x", "", True, False, 0, -1, 1.5, "1", 2, 99, 2**64, [], {}])
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_parse(raw: bytes) -> Manifest | None:
    """Parse fuzzed bytes: InvalidCheckpointError is the only failure allowed; what parses is sane."""
    try:
        manifest = Manifest.loads(raw, WHERE)
    except InvalidCheckpointError as e:
        assert WHERE in str(e)
        return None
    assert isinstance(manifest.save_id, str) and isinstance(manifest.values, dict)
    assert isinstance(manifest.world_size, int) and manifest.world_size >= 1
    for key, meta in manifest.arrays.items():
        assert key == meta.key and ".." not in meta.path.split("/") and not meta.path.startswith("/")
        assert len(meta.shape) == len(meta.shard_shape) == len(meta.chunk_shape) <= MAX_RANK
        for n, s, c in zip(meta.shape, meta.shard_shape, meta.chunk_shape, strict=True):
            assert 1 <= c <= s <= max(n, 1) and s % c == 0
        assert meta.itemsize >= 1 and meta.chunk_nbytes >= 1
    assert not manifest.arrays.keys() & manifest.values.keys()
    json.dumps(manifest.values, allow_nan=False)
    return manifest


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every location inside a JSON document (dict keys and list indices)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


def _mutate(doc: Any, data: st.DataObject) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = list(_paths(doc))
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent = functools.reduce(lambda node, k: node[k], path[:-1], doc)
        if data.draw(st.booleans(), label="delete"):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(VALUES, label="value")
    return doc


@FUZZ
@given(JSON)
def test_fuzz_random_json(value: Any) -> None:
    _check_parse(json.dumps(value).encode())
    _check_parse(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"zarrckpt": value}}).encode())


@FUZZ
@given(st.data())
def test_fuzz_mutated_manifest(data: st.DataObject) -> None:
    _check_parse(json.dumps(_mutate(_valid(), data)).encode())


@FUZZ
@given(st.data())
def test_fuzz_mutated_array_node(data: st.DataObject) -> None:
    """Mutations focused on one array's metadata (the part with shapes, codecs and keys)."""
    doc = _valid()
    path = data.draw(st.sampled_from(sorted(_valid()["consolidated_metadata"]["metadata"])), label="node")
    _node(doc, path).update(_mutate(_node(doc, path), data))
    _check_parse(json.dumps(doc).encode())


@FUZZ
@given(st.data())
def test_fuzz_mutated_bytes(data: st.DataObject) -> None:
    raw = bytearray(_valid_raw())
    op = data.draw(st.sampled_from(["truncate", "flip", "insert", "splice"]), label="op")
    if op == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)), label="at")]
    elif op == "flip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= data.draw(st.integers(1, 255), label="mask")
    elif op == "insert":
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
    else:
        lo = data.draw(st.integers(0, len(raw)), label="lo")
        hi = data.draw(st.integers(lo, len(raw)), label="hi")
        raw[lo:hi] = data.draw(st.sampled_from([b"", b"-1", b"1e999", b"[[[[", b'"..', b"{}", b"null", b"true"]))
    _check_parse(bytes(raw))


@functools.cache
def _fuzz_checkpoint() -> tuple[str, bytes]:
    url = f"memory://{uuid.uuid4().hex}/fuzz"
    _save(url)
    fs, root = _fs(url)
    return url, fs.cat_file(f"{root}/zarr.json")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_load_with_mutated_manifest(data: st.DataObject) -> None:
    """Whole loads over a mutated manifest: a ZarrckptError, or exactly the saved state."""
    url, original = _fuzz_checkpoint()
    doc = json.loads(original)
    if data.draw(st.booleans(), label="whole manifest"):
        doc = _mutate(doc, data)
    else:
        path = data.draw(st.sampled_from(sorted(doc["consolidated_metadata"]["metadata"])), label="node")
        _node(doc, path).update(_mutate(_node(doc, path), data))
    _put_manifest(url, doc)
    try:
        got = _state(fill=False)
        try:
            zarrckpt.load(got, url)
        except ZarrckptError:
            return
        want = _state()
        assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["v"], want["v"])
        assert got["blob"] == want["blob"]
    finally:
        _put_manifest(url, original)


def test_a_bytes_value_claiming_a_terabyte(url: str) -> None:
    """The manifest says the blob holds 2**40 bytes: a clear error, not a 1 TiB allocation or zeros."""
    _save(url)
    doc = _manifest(url)
    node = doc["consolidated_metadata"]["metadata"]["blob"]
    node["shape"] = node["chunk_grid"]["configuration"]["chunk_shape"] = [2**40]
    node["codecs"][0]["configuration"]["chunk_shape"] = [2**40]
    _put_manifest(url, doc)
    with pytest.raises(zarrckpt.ZarrckptError, match="blob"):
        zarrckpt.load(_state(fill=False), url)


# -- 7. objects that are no files ------------------------------------------------------------------------
_READ_IN_A_CHILD = """
import resource, sys
import zarrckpt
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    zarrckpt.open(sys.argv[1])
except BaseException as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_manifest_linked_to_a_device_is_refused_unread(device: str, tmp_path: Path) -> None:
    """A crafted local checkpoint whose manifest is a link to a device that never ends: the manifest
    is read to its end, so reading it would allocate until the process dies. Refused at once, naming
    the path and what it is. (In a child allowed 1 GiB more address space than it starts with.)"""
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    url = tmp_path / "ck"
    _save(str(url))
    (url / "zarr.json").unlink()
    (url / "zarr.json").symlink_to(device)
    done = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_CHILD, str(url)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.startswith("StorageError"), (done.stdout, done.stderr[-2000:])
    assert f"{url / 'zarr.json'} is a character device, not a regular file" in done.stdout
