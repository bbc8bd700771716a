"""The on-storage format (docs/FORMAT.md): array and group ``zarr.json`` documents, the manifest.

Building and parsing only; no I/O. Parsing treats every document as untrusted input.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import dtypes
from .errors import InvalidCheckpointError, InvalidKeyError
from .keys import ROLES, key_to_path, validate_keys
from .layout import Shape

FORMAT_VERSION = 1
MANIFEST = "zarr.json"
PENDING = ".zarrckpt-pending.json"  # a save is writing here (or died doing so)
DELETING = ".zarrckpt-deleting.json"  # a deletion is removing this checkpoint (or died doing so)
KINDS = ("tensor", "bytes", "ndarray")
BYTES_TYPE_NAMES = ("bytes", "bytearray", "BytesIO")
MAX_ELEMENTS = 2**62
MAX_RANK = 64  # numpy's limit

Bad = Callable[[str], InvalidCheckpointError]


@dataclass(frozen=True)
class ArrayMeta:
    """One stored global tensor: its identity, layout and how its shards are cut."""

    key: str
    shape: Shape
    dtype: str
    shard_shape: Shape
    chunk_shape: Shape
    role: str = "other"
    kind: str = "tensor"
    topology: dict[str, Any] = field(default_factory=dict, compare=False)
    python_type: str = ""  # kind "bytes": the saved value's type when not bytes ("bytearray" or "BytesIO")

    @property
    def path(self) -> str:
        return key_to_path(self.key)

    @property
    def itemsize(self) -> int:
        return dtypes.storage_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize

    def shard_path(self, index: Shape) -> str:
        return "/".join([self.path, "c", *map(str, index)])

    def to_json(self) -> dict[str, Any]:
        codec = {"endian": "little"}
        inner = [{"name": "bytes", "configuration": codec}, {"name": "crc32c"}]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": dtypes.fill_value(self.dtype),
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": inner,
                        "index_codecs": inner,
                        "index_location": "start",
                    },
                }
            ],
            "attributes": {
                "zarrckpt": {
                    "format_version": FORMAT_VERSION,
                    "key": self.key,
                    "role": self.role,
                    "kind": self.kind,
                    "order": "C",
                    "topology": self.topology,
                    **({"python_type": self.python_type} if self.python_type else {}),
                }
            },
        }

    @classmethod
    def from_json(cls, path: str, doc: Any, where: str = "the checkpoint") -> ArrayMeta:
        """Parse an array ``zarr.json`` written by zarrckpt, rejecting anything else clearly."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"array metadata {path!r} in {where} is invalid: {why}")

        attrs = "attributes.zarrckpt."
        _check_extensions(doc, ARRAY_FIELDS, bad)
        _check_version(doc, attrs + "format_version", bad)
        key = _get(doc, attrs + "key", str, bad)
        try:
            validate_keys([key])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        if key_to_path(key) != path:
            raise bad(f"its key {key!r} does not match its path")
        shape = _shape(doc, "shape", bad)
        shard = _shape(doc, "chunk_grid.configuration.chunk_shape", bad)
        codecs = _get(doc, "codecs", list, bad)
        if len(codecs) != 1:
            raise bad(f"field 'codecs' must hold exactly one sharding_indexed codec, not {_short(codecs)}")
        chunk = _shape(codecs[0], "configuration.chunk_shape", bad, at="codecs[0].")
        dtype = _get(doc, "data_type", str, bad)
        role = _get(doc, attrs + "role", str, bad, "other")
        kind = _get(doc, attrs + "kind", str, bad, "tensor")
        topology = _get(doc, attrs + "topology", dict, bad, {})
        python_type = _get(doc, attrs + "python_type", str, bad, "")
        if python_type not in ("", *BYTES_TYPE_NAMES) or (python_type and kind != "bytes"):
            raise bad(f"python_type {_short(python_type)} is not one of {BYTES_TYPE_NAMES} on a bytes array")
        if not (len(shape) == len(shard) == len(chunk)):
            raise bad("shape, shard shape and chunk shape have different ranks")
        if math.prod(max(n, 1) for n in shape) > MAX_ELEMENTS:
            raise bad(f"absurd shape {_short(shape)}")
        if any(not 1 <= s <= max(n, 1) for n, s in zip(shape, shard, strict=True)):
            raise bad(f"shard shape {_short(shard)} is not within 1..shape {_short(shape)} in every dimension")
        if any(c < 1 or s % c for s, c in zip(shard, chunk, strict=True)):
            raise bad(f"inner chunks {_short(chunk)} do not evenly divide shards {_short(shard)}")
        if not dtypes.is_known(dtype):
            raise bad(f"unsupported data_type {_short(dtype)}")
        if role not in ROLES or kind not in KINDS:
            raise bad(f"unknown role {_short(role)} or kind {_short(kind)}")
        if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
            raise bad(f"a bytes value must be stored as 1-D uint8, not {len(shape)}-D {dtype}")
        if _get(doc, attrs + "order", str, bad, "C") != "C" or doc.get("storage_transformers"):
            raise bad("only C order and no storage transformers are supported")
        meta = cls(key, shape, dtype, shard, chunk, role, kind, topology, python_type)
        expected = meta.to_json()
        for name in ("zarr_format", "node_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"):
            if doc.get(name) != expected[name]:
                raise bad(f"field {name!r} is {_short(doc.get(name))}, zarrckpt writes {_short(expected[name])}")
        return meta


_REQUIRED: Any = object()
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value: Any) -> str:
    """A bounded ``repr`` of an untrusted value, for error messages."""
    return _REPR.repr(value)


def _get(doc: Any, path: str, kind: type, bad: Bad, default: Any = _REQUIRED, at: str = "") -> Any:
    """``doc[a][b]...`` for ``path`` ``"a.b..."``, checked to be a ``kind`` (a bool is no int)."""
    node, name, parts = doc, at + path, path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict):
            parent = (at + ".".join(parts[:i])).rstrip(".")
            raise bad(f"{repr(parent) if parent else 'the document'} must be a JSON object, not {_short(node)}")
        if part not in node:
            if default is _REQUIRED:
                raise bad(f"field {name!r} is missing")
            return default
        node = node[part]
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is not bool):
        raise bad(f"field {name!r} must be {_TYPE_NAMES[kind]}, not {_short(node)}")
    return node


def _shape(doc: Any, path: str, bad: Bad, at: str = "") -> Shape:
    value = _get(doc, path, list, bad, at=at)
    if len(value) > MAX_RANK or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise bad(f"field {at + path!r} must be at most {MAX_RANK} non-negative integers, not {_short(value)}")
    return tuple(value)


def _check_version(doc: Any, path: str, bad: Bad) -> None:
    version = _get(doc, path, int, bad)
    if version > FORMAT_VERSION:
        raise bad(f"format version {version} is newer than this zarrckpt reads (1..{FORMAT_VERSION}): upgrade zarrckpt")
    if version < 1:
        raise bad(f"field {path!r}: format version {version} does not exist")


ARRAY_FIELDS = frozenset(
    {"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"}
    | {"attributes", "storage_transformers", "dimension_names"}
)
GROUP_FIELDS = frozenset({"zarr_format", "node_type", "attributes", "consolidated_metadata"})


def _check_extensions(doc: Any, known: frozenset[str], bad: Bad) -> None:
    """Zarr v3: an unknown top-level field may be ignored only when it says ``"must_understand": false``."""
    if not isinstance(doc, dict):
        return
    for name in sorted(doc.keys() - known):
        value = doc[name]
        if not (isinstance(value, dict) and value.get("must_understand") is False):
            raise bad(f'unknown field {_short(name)} without "must_understand": false (a Zarr extension it needs)')


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text}")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"non-finite number {text}")


def library_name() -> str:
    from ._version import __version__

    return f"zarrckpt {__version__}"


def group_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def group_paths(arrays: list[ArrayMeta]) -> list[str]:
    """Every intermediate group path (not the root), parents first."""
    paths = {"/".join(a.path.split("/")[:i]) for a in arrays for i in range(1, a.path.count("/") + 1)}
    return sorted(paths, key=lambda p: (p.count("/"), p))


@dataclass(frozen=True)
class Manifest:
    """The committed root ``zarr.json``: checkpoint-wide attributes and consolidated metadata."""

    save_id: str
    arrays: dict[str, ArrayMeta]
    values: dict[str, Any]
    world_size: int
    created: str = ""
    library: str = ""
    dcp: dict[str, Any] = field(default_factory=dict)  # DCP adapter: "objects", "planner_data" (both optional)

    def to_json(self) -> dict[str, Any]:
        arrays = list(self.arrays.values())
        nodes: dict[str, Any] = {p: group_json() for p in group_paths(arrays)}
        nodes.update({a.path: a.to_json() for a in arrays})
        nodes = dict(sorted(nodes.items()))  # zarr-python rebuilds the tree by grouping sorted keys
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {
                "zarrckpt": {
                    "format_version": FORMAT_VERSION,
                    "save_id": self.save_id,
                    "created": self.created,
                    "library": self.library,
                    "world_size": self.world_size,
                    "values": self.values,
                    **({"dcp": self.dcp} if self.dcp else {}),
                }
            },
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes},
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), allow_nan=False, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes, where: str) -> Manifest:
        """Parse a manifest (untrusted bytes); every problem is an InvalidCheckpointError naming ``where``."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"checkpoint manifest {where} is invalid: {why}")

        try:
            doc = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad(f"not JSON ({_short(e)})") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
            raise bad("not a Zarr v3 group")
        if not isinstance(doc.get("attributes"), dict) or not isinstance(doc["attributes"].get("zarrckpt"), dict):
            raise bad("it is a Zarr group but not a zarrckpt checkpoint (no 'zarrckpt' attribute)")
        info = "attributes.zarrckpt."
        _check_extensions(doc, GROUP_FIELDS, bad)
        _check_version(doc, info + "format_version", bad)
        save_id = _get(doc, info + "save_id", str, bad)
        world = _get(doc, info + "world_size", int, bad)
        if world < 1:
            raise bad(f"field {info + 'world_size'!r} must be a positive integer, not {world}")
        values = _get(doc, info + "values", dict, bad)
        created, library = _get(doc, info + "created", str, bad, ""), _get(doc, info + "library", str, bad, "")
        dcp = _get(doc, info + "dcp", dict, bad, {})
        objects = dcp.get("objects", [])
        if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
            raise bad(f"field {info + 'dcp.objects'!r} must be a list of keys, not {_short(objects)}")
        nodes = _get(doc, "consolidated_metadata.metadata", dict, bad)
        arrays = {}
        for path, node in nodes.items():
            if not path or any(s in ("", ".", "..") or "\\" in s or "\0" in s for s in path.split("/")):
                raise bad(f"consolidated metadata has a node at the unsafe path {_short(path)}")
            node_type = node.get("node_type") if isinstance(node, dict) else None
            if node_type == "array":
                meta = ArrayMeta.from_json(path, node, where)
                arrays[meta.key] = meta
            elif node_type != "group":
                raise bad(f"consolidated metadata node {_short(path)} is neither a group nor an array: {_short(node)}")
        try:
            validate_keys([*arrays, *values])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        if both := sorted(arrays.keys() & values.keys()):
            raise bad(f"keys stored both as an array and as a value: {_short(both)}")
        return cls(save_id, arrays, values, world, created, library, dcp)
