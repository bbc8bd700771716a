"""One stored global tensor: its ``zarr.json`` document (:class:`ArrayMeta`), built and parsed.

No I/O; parsing treats every document as untrusted input (docs/FORMAT.md §3).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zarrckpt.errors import InvalidCheckpointError, InvalidKeyError
from zarrckpt.format import dtypes, fill
from zarrckpt.format.jsondoc import Bad, check_extensions, get_field, meaning, shape_field, short
from zarrckpt.format.keys import ROLES, key_to_path, validate_keys
from zarrckpt.format.layout import Shape
from zarrckpt.types import ArrayKind, Role
from zarrckpt_dtypes import BY_NAME

if TYPE_CHECKING:
    from zarrckpt.format.deferred import Deferred

FORMAT_VERSION = 4  # the newest this zarrckpt reads; it writes the oldest that describes a checkpoint
CONSTANT_VERSION = 2  # constant arrays (no shard objects) first appeared in format version 2
TABLE_VERSION = 3  # the chunk checksum table (a manifest's commit record outside the JSON) first appeared in 3
PER_RANK_VERSION = 3  # per-rank arrays ([world, ...], rank r's row; "per_rank" attribute) in format version 3
DOT_KEYS_VERSION = 4  # chunk keys "c.0.1" (separator "."), the array's directory holding its objects, in 4
SEPARATORS = ("/", ".")  # the chunk key separators a reader follows ("/": format versions 1-3)
PER_RANK_KINDS = ("tensor", "json")  # an array's "per_rank": a row is the rank's tensor, or its value's JSON text
ARRAY_KINDS: tuple[str, ...] = tuple(kind.value for kind in ArrayKind)  # an array's stored "kind"s
BYTES_TYPE_NAMES = ("bytes", "bytearray", "BytesIO")
MAX_ELEMENTS = 2**62
# Ceilings on what one array's metadata may claim, so that no reader loops over (or sizes a buffer
# from) counts a crafted manifest makes up: every loop or buffer is bounded by these, or by the bytes
# of real objects. zarrckpt's own saves stay far below them (docs/FORMAT.md §3).
MAX_CHUNKS_PER_SHARD = 2**20  # a shard index of 16 MiB
MAX_SLOTS = 2**24  # shards x inner chunks per shard, per array (a commit record of 64 MiB)
# the same for an array the manifest has no commit record of: nothing real backs what it claims, so
# the claim stays small enough to plan in a fraction of a second (zarrckpt has written the record
# since format version 1's second release; an older checkpoint with more: re-save it)
MAX_UNRECORDED_SLOTS = 2**12


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
    per_rank: str = ""  # a per-rank array ("tensor" or "json" rows): row r is rank r's (zarrckpt.plan.perrank)
    separator: str = "."  # its chunk keys': "c.0.1" beside its zarr.json ("/": "c/0/1", written before version 4)
    # integrity.py: the commit's record of every inner chunk's crc32c (bytes; a Deferred while a lazy
    # read fetches them), and where they lie in the chunk checksum table, (offset, bytes, crc32c)
    committed_crc32c: bytes | Deferred = field(default=b"", compare=False, repr=False)
    crc_segment: tuple[int, int, int] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def made(
        cls,
        key: str,
        shape: Shape,
        dtype: str,
        shard_shape: Shape,
        chunk_shape: Shape,
        role: Role,
        kind: ArrayKind,
        topology: dict[str, Any],
        python_type: str,
        constant: bytes | None,
        per_rank: str,
        separator: str = ".",
    ) -> ArrayMeta:
        """``cls(...)`` of these fields (no commit record yet), at a fifth of the cost: a frozen
        dataclass sets each field through ``object.__setattr__`` (4.5 us an array; a save of 20,000
        tensors makes 20,000, a manifest read as many). ``tests/test_arraydoc.py`` checks it is equal."""
        meta = object.__new__(cls)
        meta.__dict__.update(
            key=key,
            shape=shape,
            dtype=dtype,
            shard_shape=shard_shape,
            chunk_shape=chunk_shape,
            role=role,
            kind=kind,
            topology=topology,
            python_type=python_type,
            constant=constant,
            per_rank=per_rank,
            separator=separator,
            committed_crc32c=b"",
            crc_segment=None,
        )
        return meta

    @functools.cached_property
    def path(self) -> str:  # (cached: a save of 20,000 tensors asks for it 400,000 times)
        return key_to_path(self.key)

    @property
    def itemsize(self) -> int:
        return BY_NAME[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize

    @property
    def shards_at(self) -> str:
        """Where its shard objects lie: its own directory (chunk keys ``c.1.0``), or ``PATH/c``."""
        return self.path if self.separator == "." else f"{self.path}/c"

    def shard_path(self, index: Shape) -> str:
        """The shard object's path: ``PATH/c.1.0`` (``PATH/c/1/0`` before version 4; ``PATH/c`` when 0-d)."""
        return self.path + "/" + self.separator.join(["c", *map(str, index)])

    def to_json(self) -> dict[str, Any]:
        """The array's ``zarr.json`` (its grid's fields are shared between arrays: read-only)."""
        grid = _expected_grid(self.shard_shape, self.chunk_shape, self.separator)
        return {
            "zarr_format": grid["zarr_format"],
            "node_type": grid["node_type"],
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": grid["chunk_grid"],
            "chunk_key_encoding": grid["chunk_key_encoding"],
            "fill_value": dtypes.fill_value(self.dtype) if self.constant is None else self.fill_json(),
            "dimension_names": dimension_names(self.path, len(self.shape)),
            "codecs": grid["codecs"],
            "attributes": {
                "zarrckpt": {
                    "format_version": self.version(),
                    "key": self.key,
                    "role": self.role,
                    "kind": self.kind,
                    "order": "C",
                    "topology": self.topology,
                    **({"python_type": self.python_type} if self.python_type else {}),
                    **({"constant": True} if self.constant is not None else {}),
                    **({"per_rank": self.per_rank} if self.per_rank else {}),
                }
            },
        }

    def version(self) -> int:
        """The oldest format version that describes this array."""
        if self.separator == ".":
            return DOT_KEYS_VERSION
        return PER_RANK_VERSION if self.per_rank else 1 if self.constant is None else CONSTANT_VERSION

    def fill_json(self) -> Any:
        """A constant array's ``fill_value``: its elements' exact value (:mod:`zarrckpt.format.fill`)."""
        assert self.constant is not None
        return fill.to_json(self.dtype, self.constant)

    @classmethod
    def from_json(cls, path: str, doc: Any, where: str = "the checkpoint") -> ArrayMeta:
        """Parse an array ``zarr.json`` written by zarrckpt, rejecting anything else clearly."""

        def bad(why: str) -> InvalidCheckpointError:
            return InvalidCheckpointError(f"array metadata {path!r} in {where} is invalid: {why}")

        attrs = "attributes.zarrckpt."
        check_extensions(doc, ARRAY_FIELDS, bad)
        check_version(doc, attrs + "format_version", bad)
        ours = doc["attributes"]["zarrckpt"]  # an object: check_version found a field in it
        key = get_field(ours, "key", str, bad, at=attrs)
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
        role = get_field(ours, "role", str, bad, "other", at=attrs)
        kind = get_field(ours, "kind", str, bad, "tensor", at=attrs)
        topology = get_field(ours, "topology", dict, bad, {}, at=attrs)
        python_type = get_field(ours, "python_type", str, bad, "", at=attrs)
        is_constant = get_field(ours, "constant", bool, bad, False, at=attrs)
        per_rank = get_field(ours, "per_rank", str, bad, "", at=attrs)
        if per_rank not in ("", *PER_RANK_KINDS) or (per_rank and not shape):
            raise bad(f"per_rank {short(per_rank)} is not one of {PER_RANK_KINDS} on an array of at least 1 dimension")
        if per_rank == "json" and (kind != "bytes" or dtype != "uint8" or len(shape) != 2):
            raise bad("a per-rank value (per_rank 'json') must be stored as a 2-D uint8 array of kind bytes")
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
        if too_many := beyond_limits(shape, shard, chunk):
            raise bad(too_many)
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
        if kind == "bytes" and not per_rank and (dtype != "uint8" or len(shape) != 1):
            raise bad(f"a bytes value must be stored as 1-D uint8, not {len(shape)}-D {dtype}")
        if get_field(ours, "order", str, bad, "C", at=attrs) != "C" or doc.get("storage_transformers"):
            raise bad("only C order and no storage transformers are supported")
        constant = None
        if is_constant:  # every element is the fill value, which must spell one element exactly
            constant = fill.from_json(dtype, doc.get("fill_value"))
            if constant is None:
                raise bad(
                    f"field 'fill_value' {short(doc.get('fill_value'))} is not a {dtype} value of a constant array"
                )
        separator = _separator(doc.get("chunk_key_encoding"), bad)
        role_, kind_ = Role(role), ArrayKind(kind)
        meta = cls.made(
            key, shape, dtype, shard, chunk, role_, kind_, topology, python_type, constant, per_rank, separator
        )
        expected = _expected_grid(shard, chunk, separator)  # what to_json writes for them, built once per grid
        if not is_constant:
            expected = {**expected, "fill_value": dtypes.fill_value(dtype)}
        for name, want in expected.items():
            found = doc.get(name)
            if found == want:
                continue  # spelled as zarrckpt spells it: the common case, no meanings to compare
            if meaning(name, found, meta.itemsize) != meaning(name, want, meta.itemsize):
                raise bad(f"field {name!r} is {short(found)}, zarrckpt writes {short(want)}")
        return meta


def _separator(encoding: Any, bad: Bad) -> str:
    """The separator of an array's ``chunk_key_encoding`` (Zarr v3's "default" one, "/" or ".")."""
    conf = encoding.get("configuration", {}) if isinstance(encoding, dict) else None
    sep = conf.get("separator", "/") if isinstance(conf, dict) else None
    if not isinstance(encoding, dict) or encoding.get("name") != "default" or sep not in SEPARATORS:
        raise bad(f"field 'chunk_key_encoding' is {short(encoding)}, not the default encoding with '/' or '.'")
    return str(sep)


def grid_fields(shard: Shape, chunk: Shape, separator: str = ".") -> dict[str, Any]:
    """The fields of an array ``zarr.json`` that follow from its shard and inner chunk shapes and
    its chunk key separator alone."""
    codec = {"endian": "little"}
    inner = [{"name": "bytes", "configuration": codec}, {"name": "crc32c"}]
    sharding = {"chunk_shape": list(chunk), "codecs": inner, "index_codecs": inner, "index_location": "start"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "codecs": [{"name": "sharding_indexed", "configuration": sharding}],
    }


# read-only: shared by the documents of arrays with one grid (a manifest at 16,384 ranks parses
# 35,000 arrays of a few grids; a save of 20,000 small tensors encodes them)
_expected_grid = functools.lru_cache(maxsize=1024)(grid_fields)


def slots(shape: Shape, shard: Shape, chunk: Shape) -> tuple[int, int]:
    """(shard objects, inner chunks per shard) of an array's grid, by arithmetic."""
    shards = math.prod(-(-n // s) for n, s in zip(shape, shard, strict=True))
    return shards, math.prod(s // c for s, c in zip(shard, chunk, strict=True))


def beyond_limits(shape: Shape, shard: Shape, chunk: Shape) -> str | None:
    """What makes a grid exceed :data:`MAX_CHUNKS_PER_SHARD` or :data:`MAX_SLOTS` (None: nothing)."""
    shards, per_shard = slots(shape, shard, chunk)
    if per_shard > MAX_CHUNKS_PER_SHARD:
        grid = f"shard {list(shard)}, chunk {list(chunk)}"
        return f"{per_shard} inner chunks per shard ({grid}), more than {MAX_CHUNKS_PER_SHARD}"
    if shards * per_shard > MAX_SLOTS:
        grid = f"shape {list(shape)}, shard {list(shard)}"
        return f"{shards} shards of {per_shard} inner chunks ({grid}), more than {MAX_SLOTS} in all"
    return None


def dimension_names(path: str, rank: int) -> list[str]:
    """An array's ``dimension_names``: ``NAME_dim_0``, ``NAME_dim_1``, ... (``[]`` for 0-d), NAME
    being the last segment of its path (``model/fc/weight`` -> ``weight_dim_0``, ``weight_dim_1``).

    Unique within the array's group, so xarray can open any group as a Dataset: plain ``dim_0``
    names would be shared by sibling arrays, and xarray refuses shared names of different sizes
    (``cls_token`` [1, 1, D] beside ``pos_embed`` [1, N, D])."""
    name = path.rsplit("/", 1)[-1]
    return [f"{name}_dim_{i}" for i in range(rank)]


def check_version(doc: Any, path: str, bad: Bad) -> None:
    version = get_field(doc, path, int, bad)
    if version > FORMAT_VERSION:
        raise bad(f"format version {version} is newer than this zarrckpt reads (1..{FORMAT_VERSION}): upgrade zarrckpt")
    if version < 1:
        raise bad(f"field {path!r}: format version {version} does not exist")


ARRAY_FIELDS = frozenset(
    {"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"}
    | {"attributes", "storage_transformers", "dimension_names"}
)
