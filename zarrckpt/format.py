"""The on-storage format (docs/FORMAT.md): array and group ``zarr.json`` documents, the manifest.

Building and parsing only; no I/O. Parsing treats every document as untrusted input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from . import dtypes
from .errors import InvalidCheckpointError, InvalidKeyError
from .keys import ROLES, key_to_path, validate_keys
from .layout import Shape

FORMAT_VERSION = 1
MANIFEST = "zarr.json"
PENDING = ".zarrckpt-pending.json"
KINDS = ("tensor", "bytes", "ndarray")
MAX_ELEMENTS = 2**62


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
                }
            },
        }

    @classmethod
    def from_json(cls, path: str, doc: Any) -> ArrayMeta:
        """Parse an array ``zarr.json`` written by zarrckpt, rejecting anything else clearly."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"array metadata at {path!r} is invalid: {why}")

        try:
            attrs = doc["attributes"]["zarrckpt"]
            key = attrs["key"]
            shape = _int_tuple(doc["shape"], "shape")
            dtype = doc["data_type"]
            shard = _int_tuple(doc["chunk_grid"]["configuration"]["chunk_shape"], "chunk_grid")
            (codec,) = doc["codecs"]
            conf = codec["configuration"]
            chunk = _int_tuple(conf["chunk_shape"], "inner chunk_shape")
            role, kind = attrs.get("role", "other"), attrs.get("kind", "tensor")
            inner = [c["name"] for c in conf["codecs"]]
            index_codecs = [c["name"] for c in conf["index_codecs"]]
            location = conf.get("index_location", "end")
            topology = attrs.get("topology", {})
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"missing or malformed field ({e!r})") from None
        if not isinstance(key, str):
            raise bad("key is not a string")
        try:
            validate_keys([key])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        if key_to_path(key) != path:
            raise bad(f"its key {key!r} does not match its path")
        if not dtypes.is_known(dtype):
            raise bad(f"unsupported data_type {dtype!r}")
        if codec.get("name") != "sharding_indexed" or location != "start":
            raise bad("expected one sharding_indexed codec with index_location 'start'")
        if inner != ["bytes", "crc32c"] or index_codecs != ["bytes", "crc32c"]:
            raise bad(f"unsupported codecs {inner} / {index_codecs}")
        if not (len(shape) == len(shard) == len(chunk)):
            raise bad("shape, shard shape and chunk shape have different ranks")
        if any(c < 1 or s < 1 or s % c for s, c in zip(shard, chunk, strict=True)):
            raise bad(f"inner chunks {list(chunk)} do not evenly divide shards {list(shard)}")
        if math.prod(shape) > MAX_ELEMENTS or math.prod(shard) > MAX_ELEMENTS:
            raise bad(f"absurd shape {list(shape)}")
        if role not in ROLES or kind not in KINDS or not isinstance(topology, dict):
            raise bad(f"unknown role {role!r} or kind {kind!r}")
        return cls(key, shape, dtype, shard, chunk, role, kind, topology)


def _int_tuple(value: Any, what: str) -> Shape:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{what} must be a list of non-negative integers")
    return tuple(value)


def library_name() -> str:
    from . import __version__

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

    def to_json(self) -> dict[str, Any]:
        arrays = list(self.arrays.values())
        nodes: dict[str, Any] = {p: group_json() for p in group_paths(arrays)}
        nodes.update({a.path: a.to_json() for a in arrays})
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
                }
            },
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes},
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), allow_nan=False, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes, where: str) -> Manifest:
        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"checkpoint manifest {where} is invalid: {why}")

        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
            raise bad("not a Zarr v3 group")
        attrs = doc.get("attributes")
        info = attrs.get("zarrckpt") if isinstance(attrs, dict) else None
        if not isinstance(info, dict):
            raise bad("it is a Zarr group but not a zarrckpt checkpoint (no 'zarrckpt' attribute)")
        version = info.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION or version < 1:
            raise bad(f"format version {version!r} is not supported by this zarrckpt (reads 1..{FORMAT_VERSION})")
        try:
            nodes = doc["consolidated_metadata"]["metadata"]
            save_id, values, world = info["save_id"], info["values"], info["world_size"]
            if not isinstance(nodes, dict) or not isinstance(values, dict) or not isinstance(save_id, str):
                raise TypeError("wrong types")
            if not isinstance(world, int):
                raise TypeError("world_size must be an integer")
        except (KeyError, TypeError) as e:
            raise bad(f"missing or malformed field ({e!r})") from None
        arrays = {}
        for path, node in nodes.items():
            if isinstance(node, dict) and node.get("node_type") == "array":
                meta = ArrayMeta.from_json(path, node)
                arrays[meta.key] = meta
        try:
            validate_keys([*arrays, *values])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        return cls(save_id, arrays, values, world, str(info.get("created", "")), str(info.get("library", "")))
