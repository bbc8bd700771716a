"""The on-storage format (docs/FORMAT.md): array and group ``zarr.json`` documents, the manifest.

Building and parsing only; no I/O. Parsing treats every document as untrusted input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from . import dtypes, fill, integrity, jsondoc
from .errors import InvalidCheckpointError, InvalidKeyError
from .jsondoc import Bad, check_extensions, finite_float, get_field, meaning, no_constant, shape_field, short
from .keys import ROLES, key_to_path, validate_keys
from .layout import Shape
from .types import ArrayKind, Role

FORMAT_VERSION = 2  # the newest this zarrckpt reads; it writes the oldest that describes a checkpoint
CONSTANT_VERSION = 2  # constant arrays (no shard objects) first appeared in format version 2
MANIFEST = "zarr.json"
PENDING = ".zarrckpt-pending.json"  # a save is writing here (or died doing so)
DELETING = ".zarrckpt-deleting.json"  # a deletion is removing this checkpoint (or died doing so)
ARRAY_KINDS: tuple[str, ...] = tuple(kind.value for kind in ArrayKind)  # an array's stored "kind"s
BYTES_TYPE_NAMES = ("bytes", "bytearray", "BytesIO")
MAX_ELEMENTS = 2**62
HEAD_BYTES = 64 * 1024  # the prefix of a manifest read for its head (ManifestHead)
_HEAD_FIELDS = ("format_version", "save_id", "world_size", "values")  # those a head needs; "created" optional


@dataclass(frozen=True)
class ArrayMeta:
    """One stored global tensor: its identity, layout and how its shards are cut."""

    key: str
    shape: Shape
    dtype: str
    shard_shape: Shape
    chunk_shape: Shape
    role: Role = Role.OTHER
    kind: ArrayKind = ArrayKind.TENSOR
    topology: dict[str, Any] = field(default_factory=dict, compare=False)
    python_type: str = ""  # kind "bytes": the saved value's type when not bytes ("bytearray" or "BytesIO")
    constant: bytes | None = None  # a constant array: every element's bytes (little-endian); no shard objects
    committed_crc32c: bytes = field(default=b"", compare=False, repr=False)  # integrity.py: the commit's record

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
            "fill_value": dtypes.fill_value(self.dtype) if self.constant is None else self.fill_json(),
            "dimension_names": dimension_names(self.path, len(self.shape)),
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
                    "format_version": 1 if self.constant is None else CONSTANT_VERSION,
                    "key": self.key,
                    "role": self.role,
                    "kind": self.kind,
                    "order": "C",
                    "topology": self.topology,
                    **({"python_type": self.python_type} if self.python_type else {}),
                    **({"constant": True} if self.constant is not None else {}),
                }
            },
        }

    def fill_json(self) -> Any:
        """A constant array's ``fill_value``: its elements' exact value (:mod:`zarrckpt.fill`)."""
        assert self.constant is not None
        return fill.to_json(self.dtype, self.constant)

    @classmethod
    def from_json(cls, path: str, doc: Any, where: str = "the checkpoint") -> ArrayMeta:
        """Parse an array ``zarr.json`` written by zarrckpt, rejecting anything else clearly."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"array metadata {path!r} in {where} is invalid: {why}")

        attrs = "attributes.zarrckpt."
        check_extensions(doc, ARRAY_FIELDS, bad)
        _check_version(doc, attrs + "format_version", bad)
        key = get_field(doc, attrs + "key", str, bad)
        try:
            validate_keys([key])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        if key_to_path(key) != path:
            raise bad(f"its key {key!r} does not match its path")
        shape = shape_field(doc, "shape", bad)
        shard = shape_field(doc, "chunk_grid.configuration.chunk_shape", bad)
        codecs = get_field(doc, "codecs", list, bad)
        if len(codecs) != 1:
            raise bad(f"field 'codecs' must hold exactly one sharding_indexed codec, not {short(codecs)}")
        chunk = shape_field(codecs[0], "configuration.chunk_shape", bad, at="codecs[0].")
        dtype = get_field(doc, "data_type", str, bad)
        role = get_field(doc, attrs + "role", str, bad, "other")
        kind = get_field(doc, attrs + "kind", str, bad, "tensor")
        topology = get_field(doc, attrs + "topology", dict, bad, {})
        python_type = get_field(doc, attrs + "python_type", str, bad, "")
        is_constant = get_field(doc, attrs + "constant", bool, bad, False)
        if python_type not in ("", *BYTES_TYPE_NAMES) or (python_type and kind != "bytes"):
            raise bad(f"python_type {short(python_type)} is not one of {BYTES_TYPE_NAMES} on a bytes array")
        if not (len(shape) == len(shard) == len(chunk)):
            raise bad("shape, shard shape and chunk shape have different ranks")
        if math.prod(max(n, 1) for n in shape) > MAX_ELEMENTS:
            raise bad(f"absurd shape {short(shape)}")
        if any(not 1 <= s <= max(n, 1) for n, s in zip(shape, shard, strict=True)):
            raise bad(f"shard shape {short(shard)} is not within 1..shape {short(shape)} in every dimension")
        if any(c < 1 or s % c for s, c in zip(shard, chunk, strict=True)):
            raise bad(f"inner chunks {short(chunk)} do not evenly divide shards {short(shard)}")
        if not dtypes.is_known(dtype):
            raise bad(f"unsupported data_type {short(dtype)}")
        names = doc.get("dimension_names", None)  # optional: checkpoints written before it was added lack it
        if names is not None and (
            not isinstance(names, list)
            or len(names) != len(shape)
            or not all(n is None or isinstance(n, str) for n in names)
        ):
            raise bad(
                f"field 'dimension_names' must list one name (a string or null) per dimension "
                f"({len(shape)}), not {short(names)}"
            )
        if role not in ROLES or kind not in ARRAY_KINDS:
            raise bad(f"unknown role {short(role)} or kind {short(kind)}")
        if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
            raise bad(f"a bytes value must be stored as 1-D uint8, not {len(shape)}-D {dtype}")
        if get_field(doc, attrs + "order", str, bad, "C") != "C" or doc.get("storage_transformers"):
            raise bad("only C order and no storage transformers are supported")
        constant = None
        if is_constant:  # every element is the fill value, which must spell one element exactly
            constant = fill.from_json(dtype, doc.get("fill_value"))
            if constant is None:
                raise bad(
                    f"field 'fill_value' {short(doc.get('fill_value'))} is not a {dtype} value of a constant array"
                )
        meta = cls(key, shape, dtype, shard, chunk, Role(role), ArrayKind(kind), topology, python_type, constant)
        expected = meta.to_json()
        for name in (
            "zarr_format",
            "node_type",
            "chunk_grid",
            "chunk_key_encoding",
            "codecs",
            *(() if is_constant else ("fill_value",)),
        ):
            if meaning(name, doc.get(name), meta.itemsize) != meaning(name, expected[name], meta.itemsize):
                raise bad(f"field {name!r} is {short(doc.get(name))}, zarrckpt writes {short(expected[name])}")
        return meta


def dimension_names(path: str, rank: int) -> list[str]:
    """An array's ``dimension_names``: ``NAME_dim_0``, ``NAME_dim_1``, ... (``[]`` for 0-d), NAME
    being the last segment of its path (``model/fc/weight`` -> ``weight_dim_0``, ``weight_dim_1``).

    Unique within the array's group, so xarray can open any group as a Dataset: plain ``dim_0``
    names would be shared by sibling arrays, and xarray refuses shared names of different sizes
    (``cls_token`` [1, 1, D] beside ``pos_embed`` [1, N, D])."""
    name = path.rsplit("/", 1)[-1]
    return [f"{name}_dim_{i}" for i in range(rank)]


def _check_version(doc: Any, path: str, bad: Bad) -> None:
    version = get_field(doc, path, int, bad)
    if version > FORMAT_VERSION:
        raise bad(f"format version {version} is newer than this zarrckpt reads (1..{FORMAT_VERSION}): upgrade zarrckpt")
    if version < 1:
        raise bad(f"field {path!r}: format version {version} does not exist")


ARRAY_FIELDS = frozenset(
    {"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"}
    | {"attributes", "storage_transformers", "dimension_names"}
)
GROUP_FIELDS = frozenset({"zarr_format", "node_type", "attributes", "consolidated_metadata"})


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
    integrity: dict[str, Any] | None = None  # array path -> record (integrity.records); None: not recorded
    # loads(): key -> what changed since commit ("": the attributes); see integrity.refuse_modified
    modified: dict[str, str] = field(default_factory=dict, compare=False)

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
                    "format_version": max((1, *(CONSTANT_VERSION for a in arrays if a.constant is not None))),
                    "save_id": self.save_id,
                    "created": self.created,
                    "library": self.library,
                    "world_size": self.world_size,
                    "values": self.values,
                    **({"dcp": self.dcp} if self.dcp else {}),
                    **({"integrity": {"arrays": self.integrity}} if self.integrity is not None else {}),
                }
            },
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes},
        }

    def dumps(self) -> bytes:
        doc = self.to_json()
        attributes = doc["attributes"]["zarrckpt"]
        attributes[integrity.ATTRIBUTES_DIGEST] = integrity.attributes_digest(attributes)
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    def as_is(self) -> Manifest:
        """This manifest without its commit record: reads accept the checkpoint as it is now."""
        arrays = {k: replace(m, committed_crc32c=b"") for k, m in self.arrays.items()}
        return replace(self, arrays=arrays, modified={})

    @classmethod
    def loads(cls, raw: bytes, where: str) -> Manifest:
        """Parse a manifest (untrusted bytes); every problem is an InvalidCheckpointError naming ``where``."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"checkpoint manifest {where} is invalid: {why}")

        try:
            doc = json.loads(raw, parse_float=finite_float, parse_constant=no_constant)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad(f"not JSON ({short(e)})") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
            raise bad("not a Zarr v3 group")
        if not isinstance(doc.get("attributes"), dict) or not isinstance(doc["attributes"].get("zarrckpt"), dict):
            raise bad("it is a Zarr group but not a zarrckpt checkpoint (no 'zarrckpt' attribute)")
        info = "attributes.zarrckpt."
        check_extensions(doc, GROUP_FIELDS, bad)
        save_id, world, values = _checkpoint_fields(doc, bad)
        created, library = (
            get_field(doc, info + "created", str, bad, ""),
            get_field(doc, info + "library", str, bad, ""),
        )
        dcp = get_field(doc, info + "dcp", dict, bad, {})
        objects = dcp.get("objects", [])
        if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
            raise bad(f"field {info + 'dcp.objects'!r} must be a list of keys, not {short(objects)}")
        nodes = get_field(doc, "consolidated_metadata.metadata", dict, bad)
        arrays = {}
        for path, node in nodes.items():
            if not path or any(s in ("", ".", "..") or "\\" in s or "\0" in s for s in path.split("/")):
                raise bad(f"consolidated metadata has a node at the unsafe path {short(path)}")
            node_type = node.get("node_type") if isinstance(node, dict) else None
            if node_type == "array":
                meta = ArrayMeta.from_json(path, node, where)
                arrays[meta.key] = meta
            elif node_type != "group":
                raise bad(f"consolidated metadata node {short(path)} is neither a group nor an array: {short(node)}")
        try:
            validate_keys([*arrays, *values])
        except InvalidKeyError as e:
            raise bad(str(e)) from None
        if both := sorted(arrays.keys() & values.keys()):
            raise bad(f"keys stored both as an array and as a value: {short(both)}")
        attributes = doc["attributes"]["zarrckpt"]
        modified: dict[str, str] = {}
        digest = attributes.get(integrity.ATTRIBUTES_DIGEST)
        if digest is not None and digest != integrity.attributes_digest(attributes):
            modified[""] = "its zarrckpt attributes (the saved values, the commit records) were edited"
        record = get_field(doc, info + "integrity", dict, bad, None)
        if record is not None:
            arrays, changed = integrity.compare(arrays, get_field(record, "arrays", dict, bad, at="integrity."), bad)
            modified |= changed
        arrays_record = None if record is None else record.get("arrays")
        return cls(save_id, arrays, values, world, created, library, dcp, arrays_record, modified)


@dataclass(frozen=True)
class ManifestHead:
    """A manifest's checkpoint-wide fields; ``tensors`` and ``nbytes`` only when the whole document was parsed.

    zarrckpt writes those fields (``format_version``, ``save_id``, ``created``, ``world_size``,
    ``values``) before the commit record and the consolidated metadata, which grow with the tensors
    and the saving ranks (megabytes at a thousand ranks): :meth:`parse` reads them from a prefix.
    """

    save_id: str
    world_size: int
    values: dict[str, Any]
    created: str = ""
    tensors: int | None = None
    nbytes: int | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestHead:
        """The head of a whole, parsed manifest (tensor count and bytes included)."""
        m, nbytes = manifest, sum(a.nbytes for a in manifest.arrays.values())
        return cls(m.save_id, m.world_size, m.values, m.created, len(m.arrays), nbytes)

    @classmethod
    def parse(cls, raw: bytes, where: str, *, whole: bool) -> ManifestHead:
        """The head of the manifest whose first bytes are ``raw`` (all of it when ``whole``: then
        parsed by :meth:`Manifest.loads`, every check included).

        Raises:
            InvalidCheckpointError: what the prefix holds is invalid, worded as :meth:`Manifest.loads`
                words it; with ``whole``, anything :meth:`Manifest.loads` refuses.
            Unsettled: not ``whole``, and the prefix does not settle it (the fields run past it, the
                document is laid out otherwise, as after an edit by another tool, or is not JSON):
                parse the whole manifest.
        """
        if whole:
            return cls.of(Manifest.loads(raw, where))

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"checkpoint manifest {where} is invalid: {why}")

        large = frozenset({"integrity", "consolidated_metadata"})  # the head ends before them
        doc = jsondoc.leading_members(raw, ("attributes", "zarrckpt"), large)
        # a field the walk did not reach may come after the large parts: only the whole manifest tells
        if "zarr_format" not in doc or "node_type" not in doc:
            raise jsondoc.Unsettled
        if doc["zarr_format"] != 3 or doc["node_type"] != "group":
            raise bad("not a Zarr v3 group")
        fields = doc.get("attributes", {}).get("zarrckpt")  # a dict when present: the walk descends into it
        if not isinstance(fields, dict) or any(f not in fields for f in _HEAD_FIELDS):
            raise jsondoc.Unsettled
        save_id, world, values = _checkpoint_fields(doc, bad)  # checked as Manifest.loads checks them
        return cls(save_id, world, values, get_field(doc, "attributes.zarrckpt.created", str, bad, ""))


def _checkpoint_fields(doc: dict[str, Any], bad: Bad) -> tuple[str, int, dict[str, Any]]:
    """A manifest's format version (checked), save id, world size and values."""
    info = "attributes.zarrckpt."
    _check_version(doc, info + "format_version", bad)
    save_id = get_field(doc, info + "save_id", str, bad)
    world = get_field(doc, info + "world_size", int, bad)
    if world < 1:
        raise bad(f"field {info + 'world_size'!r} must be a positive integer, not {world}")
    return save_id, world, get_field(doc, info + "values", dict, bad)
