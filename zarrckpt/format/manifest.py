"""The checkpoint's manifest (docs/FORMAT.md): the root ``zarr.json`` with the checkpoint-wide
attributes, the consolidated metadata of every array and group, and the commit record; its head.

Building and parsing only; no I/O. Parsing treats every document as untrusted input.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from zarrckpt.errors import InvalidCheckpointError, InvalidKeyError
from zarrckpt.format import integrity, jsondoc
from zarrckpt.format.array import MAX_UNRECORDED_SLOTS, TABLE_VERSION, ArrayMeta, check_version, slots
from zarrckpt.format.arraydoc import COMPACT
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.jsondoc import (
    Bad,
    check_extensions,
    finite_float,
    get_field,
    no_constant,
    short,
)
from zarrckpt.format.keys import validate_keys

MANIFEST = "zarr.json"
PENDING = ".zarrckpt-pending.json"  # a save is writing here (or died doing so)
DELETING = ".zarrckpt-deleting.json"  # a deletion is removing this checkpoint (or died doing so)
HEAD_BYTES = 64 * 1024  # the prefix of a manifest read for its head (ManifestHead)
TOMBSTONE_BYTES = 1024  # a tombstone's exact size (padded), so a listing's sizes tell which manifests may be one
_HEAD_FIELDS = ("format_version", "save_id", "world_size", "values")  # those a head needs; "created" optional
GROUP_FIELDS = frozenset({"zarr_format", "node_type", "attributes", "consolidated_metadata"})
log = logging.getLogger("zarrckpt")


def tombstone(marker: dict[str, Any]) -> bytes:
    """What replaces a committed manifest as the first step of its deletion: a Zarr group saying
    ``"deleting"`` (with the deleting marker's content), so every reader refuses the checkpoint from
    that one PUT on, at no extra request of its own (docs/FORMAT.md §6)."""
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {"zarrckpt": {"deleting": marker}}}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) > TOMBSTONE_BYTES:  # (a marker far larger than zarrckpt writes)
        raw = tombstone({"started": marker.get("started", "")})
    return raw.ljust(TOMBSTONE_BYTES)  # JSON allows the trailing spaces


def tombstone_marker(raw: bytes) -> dict[str, Any] | None:
    """The deleting marker in a tombstone's bytes; None for anything else (a manifest, say)."""
    if len(raw) != TOMBSTONE_BYTES:
        return None
    try:
        found = json.loads(raw)["attributes"]["zarrckpt"]["deleting"]
    except (ValueError, KeyError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def library_name() -> str:
    from zarrckpt._version import __version__

    return f"zarrckpt {__version__}"


def group_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def group_paths(arrays: list[ArrayMeta]) -> list[str]:
    """Every intermediate group path (not the root), parents first."""
    paths: set[str] = set()
    for a in arrays:
        path = a.path
        while (cut := path.rfind("/")) > 0 and (path := path[:cut]) not in paths:
            paths.add(path)  # (a path found already came with its parents)
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
    # the chunk checksum table's integrity.table (integrity.table_ref); None: none (records inline, or none)
    table_ref: dict[str, Any] | None = None
    # the table itself: what a commit writes beside the manifest (with_table: what was read)
    table: bytes = field(default=b"", compare=False, repr=False)
    # loads(): key -> what changed since commit ("": the attributes, or an integrity.Unrecorded: no
    # record at all); see integrity.refuse_modified
    modified: dict[str, str] = field(default_factory=dict, compare=False)
    # why it has no commit record (loads(): an integrity.Unrecorded), "" when it has one; dumps() then
    # writes no attributes_crc32c, so what was never checked never gets a record
    unrecorded: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        arrays = list(self.arrays.values())
        nodes: dict[str, Any] = {p: group_json() for p in group_paths(arrays)}
        nodes.update({a.path: a.to_json() for a in arrays})
        return self._document(dict(sorted(nodes.items())))  # zarr-python rebuilds the tree by grouping sorted keys

    def _document(self, nodes: dict[str, Any]) -> dict[str, Any]:
        """The manifest's document, ``nodes`` its consolidated metadata."""
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {
                "zarrckpt": {
                    "format_version": self.format_version,
                    "save_id": self.save_id,
                    "created": self.created,
                    "library": self.library,
                    "world_size": self.world_size,
                    "values": self.values,
                    **({"dcp": self.dcp} if self.dcp else {}),
                    **({"integrity": self._record()} if self.integrity is not None else {}),
                }
            },
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes},
        }

    @property
    def format_version(self) -> int:
        """The oldest format version that describes this manifest (docs/FORMAT.md §7)."""
        table = TABLE_VERSION if self.table_ref is not None and self.integrity is not None else 1
        return max((table, *(a.version() for a in self.arrays.values())))

    def _record(self) -> dict[str, Any]:
        return (
            {"table": self.table_ref, "arrays": self.integrity}
            if self.table_ref is not None
            else {"arrays": self.integrity}
        )

    def with_table(self, table: bytes) -> Manifest:
        """This manifest with every array's committed chunk checksums from the chunk checksum table
        as read (``b""``: missing); arrays whose segment is not the committed one are ``modified``."""
        if self.table_ref is None:
            return self
        arrays, changed = integrity.attach(self.arrays, table, self.table_ref)
        return replace(self, arrays=arrays, modified=self.modified | changed, table=table)

    def dumps(self) -> bytes:
        """The manifest's bytes: ``json.dumps(to_json(), separators=(",", ":"))``, the ``attributes_crc32c``
        added, made as the document less its nodes with every node's text put in (the arrays' from
        templates, :mod:`zarrckpt.format.arraydoc`)."""
        doc = self._document({})
        attributes = doc["attributes"]["zarrckpt"]
        if not self.unrecorded:
            attributes[integrity.ATTRIBUTES_DIGEST] = integrity.attributes_digest(attributes)
        shell = COMPACT.encoder.encode(doc)
        assert shell.endswith('"metadata":{}}}')  # (the nodes are the document's last member)
        arrays = list(self.arrays.values())
        group = COMPACT.encoder.encode(group_json())
        nodes = dict.fromkeys(group_paths(arrays), group)
        nodes.update({a.path: COMPACT.text(a) for a in arrays})
        encode = COMPACT.encoder.encode
        inner = ",".join([f"{encode(path)}:{text}" for path, text in sorted(nodes.items())])
        return (shell[:-3] + inner + "}}}").encode()

    def as_is(self, *, warn: bool = True) -> Manifest:
        """This manifest without its commit record: reads accept the checkpoint as it is now
        (``allow_modified=True``). An unrecorded one is logged (``warn``): nothing is checked but
        each chunk's own crc32c."""
        if self.unrecorded and warn:
            log.warning(
                "reading unchecked, as it is now (allow_modified=True): %s; only each chunk's own crc32c is checked",
                self.unrecorded,
            )
        arrays = {k: replace(m, committed_crc32c=b"", crc_segment=None) for k, m in self.arrays.items()}
        return replace(self, arrays=arrays, modified={}, table_ref=None, table=b"")

    @classmethod
    @gc_paused()  # a manifest decodes into millions of small objects, none in a cycle
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
        properties = dcp.get("properties", {})
        if not isinstance(properties, dict) or not all(
            isinstance(k, str) and _valid_properties(p) for k, p in properties.items()
        ):
            raise bad(
                f"field {info + 'dcp.properties'!r} must map keys to {{'requires_grad': bool, 'pin_memory': bool, "
                f"'memory_format': one of {list(DCP_MEMORY_FORMATS)}}}, not {short(properties)}"
            )
        nodes = get_field(doc, "consolidated_metadata.metadata", dict, bad)
        arrays = {}
        for path, node in nodes.items():
            parts = path.split("/")
            if "\\" in path or "\0" in path or not all(parts) or "." in parts or ".." in parts:
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
        record = get_field(doc, info + integrity.RECORD, dict, bad, None)
        table = None
        if record is not None:
            if "table" in record:
                table = integrity.check_table_ref(record["table"], bad)
            recorded = get_field(record, "arrays", dict, bad, at="integrity.")
            arrays, changed = integrity.compare(arrays, recorded, bad, table)
            modified |= changed
        # without either field nothing can be compared with the commit, whatever format_version says (an
        # older zarrckpt's checkpoint and a stripped one look alike): reads need allow_modified
        missing = [
            name for name, found in ((integrity.RECORD, record), (integrity.ATTRIBUTES_DIGEST, digest)) if found is None
        ]
        unrecorded = integrity.Unrecorded.of(where, missing) if missing else ""
        if unrecorded:
            modified[""] = unrecorded
        for meta in arrays.values():  # no record to back them: a crafted manifest's claims cost nothing to make
            if meta.constant is not None or meta.committed_crc32c or meta.crc_segment:
                continue
            shards, per_shard = slots(meta.shape, meta.shard_shape, meta.chunk_shape)
            if shards * per_shard > MAX_UNRECORDED_SLOTS:
                raise bad(
                    f"array {meta.key!r} claims {shards} shards of {per_shard} inner chunks without a commit "
                    f"record to back them (at most {MAX_UNRECORDED_SLOTS} without one)"
                )
        arrays_record = None if record is None else record.get("arrays")
        return cls(
            save_id, arrays, values, world, created, library, dcp, arrays_record, table, b"", modified, unrecorded
        )


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
    check_version(doc, info + "format_version", bad)
    save_id = get_field(doc, info + "save_id", str, bad)
    world = get_field(doc, info + "world_size", int, bad)
    if world < 1:
        raise bad(f"field {info + 'world_size'!r} must be a positive integer, not {world}")
    return save_id, world, get_field(doc, info + "values", dict, bad)


DCP_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")  # (the ones DCP can pickle)


def _valid_properties(found: Any) -> bool:
    """A ``dcp.properties`` entry: DCP's ``TensorProperties`` fields that differ from their defaults."""
    if not isinstance(found, dict) or not found.keys() <= {"requires_grad", "pin_memory", "memory_format"}:
        return False
    flags = all(isinstance(found.get(k, False), bool) for k in ("requires_grad", "pin_memory"))
    return flags and found.get("memory_format", "contiguous_format") in DCP_MEMORY_FORMATS
