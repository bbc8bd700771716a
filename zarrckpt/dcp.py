"""``torch.distributed.checkpoint`` adapters over the zarrckpt engine and format.

``dcp.save(sd, storage_writer=ZarrWriter(url))`` and ``dcp.load(sd, storage_reader=ZarrReader(url))``
write and read exactly what ``zarrckpt.save`` / ``zarrckpt.load`` do. DCP plans (and dedups
replicas); zarrckpt chooses shard grids, writes shards, and commits. Non-tensor items pass
through the planner's hooks as the ``torch.save`` bytes DCP uses in memory
(:mod:`zarrckpt.pickling`) and are stored as typed JSON: no pickle reaches storage unless
``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import commit as protocol
from . import dtypes, integrity, pickling, values
from .dist import Group
from .errors import ZarrckptError
from .format import MANIFEST, ArrayMeta, Manifest, library_name
from .keys import iter_leaves, nest, validate_keys
from .layout import Box, Shape, cell_box, grid_shape
from .localstate import BYTES_TYPES, LocalState, LocalTensor, collect
from .plan import DEFAULT_CHUNK_BYTES, build_save_plan, metadata_docs
from .reader import Request, allocate, read_regions
from .shard import ShardLayout
from .storage import Storage
from .types import URL, ArrayKind
from .writer import committed_manifest, write_metadata, write_rank


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ZarrWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a zarrckpt checkpoint.

    Like ``FileSystemWriter``, it replaces what is at ``url`` (``overwrite=False`` refuses an
    existing checkpoint instead). Non-tensor items go through the planner's ``resolve_data`` and
    are stored as typed JSON (:mod:`zarrckpt.values`), never pickled unless ``allow_pickle``.
    """

    def __init__(
        self,
        url: URL,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.storage = Storage(url, storage_options)
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.chunk_bytes = chunk_bytes
        self.allow_pickle = allow_pickle
        self._save_id = ""

    def reset(self, checkpoint_id: URL | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = Storage(checkpoint_id, self.storage_options)
        self._save_id = ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: URL) -> bool:
        """True for a URL fsspec can open."""
        return _opens(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False and Group().size > 1:
            raise ZarrckptError(
                "ZarrWriter needs use_collectives=True with several ranks: one rank prepares and commits "
                "the checkpoint for all of them"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.url)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: validate coverage, choose shard grids and writers, prepare the prefix.

        With DCP's plan caching, the plans of a repeated save are empty and unusable: DCP then
        hands ``write_data`` the cached plans, which carry the grids chosen the first time.
        """
        zplan = build_save_plan([_parts(plan, _meta_tensor)[0].describe() for plan in plans], self.chunk_bytes)
        self._save_id = protocol.prepare(self.storage, self.overwrite)
        return [dataclasses.replace(p, storage_data=(zplan, rank)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        zplan, rank = plan.storage_data
        objects = {
            item.index.fqn: pickling.from_planner(planner.resolve_data(item), item.index.fqn)
            for item in plan.items
            if item.type == WriteItemType.BYTE_IO
        }
        local, items = _parts(plan, lambda item: _resolved_tensor(planner, item, zplan.arrays[item.index.fqn]))
        written: integrity.Written = {}
        write_rank(self.storage, zplan, local, rank, written)
        results = []
        for key, parts in items.items():  # the record of a key's shards rides on its first item
            crcs = integrity.to_json({key: written.get(key, {})})
            data = {"arrays": {key: zplan.arrays[key]}, "crc32c": crcs}
            results += [WriteResult(i, t.data.nbytes, data if n == 0 else {}) for n, (i, t) in enumerate(parts)]
        if objects:
            results += self._write_objects(objects, {item.index.fqn: item.index for item in plan.items})
        return _done(results)

    def _write_objects(self, objects: dict[str, Any], indexes: dict[str, Any]) -> list[WriteResult]:
        """Non-tensor items (this rank alone writes each), as ``zarrckpt.save`` stores them: bytes and
        numpy arrays as arrays, the rest as typed JSON values; a dict holding tensors
        (``flatten_state_dict=False``) becomes arrays and values under its key, listed as an object."""
        flat: dict[str, Any] = {}
        values_: dict[str, Any] = {}
        for key, obj in objects.items():
            if isinstance(obj, (*BYTES_TYPES, np.ndarray)) or (isinstance(obj, Mapping) and _holds_tensors(obj)):
                flat[key] = obj
            else:
                values_[key] = values.encode(obj, key, self.allow_pickle)
        extra = collect(flat, self.allow_pickle)
        own = build_save_plan([extra.describe()], self.chunk_bytes)
        written: integrity.Written = {}
        write_rank(self.storage, own, extra, 0, written)  # the zarr.json documents come in finish()
        results = []
        for key in objects:
            if key in own.arrays:
                nbytes = own.arrays[key].nbytes
                crcs = integrity.to_json({key: written.get(key, {})})
                results.append(WriteResult(indexes[key], nbytes, {"arrays": {key: own.arrays[key]}, "crc32c": crcs}))
            elif key in flat:
                under = {k: v for k, v in own.arrays.items() if k.startswith(key + ".")}
                data = {"arrays": under, "values": {k: v for k, v in own.values.items() if k.startswith(key + ".")}}
                data["crc32c"] = integrity.to_json({k: written.get(k, {}) for k in under})
                results.append(
                    WriteResult(indexes[key], sum(m.nbytes for m in under.values()), {**data, "object": key})
                )
            else:
                results.append(WriteResult(indexes[key], 0, {"values": {key: values_[key]}}))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: gather what every rank wrote, then commit the manifest."""
        if not self._save_id:
            raise ZarrckptError("ZarrWriter.finish called before prepare_global_plan on the coordinator")
        arrays: dict[str, ArrayMeta] = {}
        values_: dict[str, Any] = {}
        objects: list[str] = []
        crcs = []
        for result in (r for rank in results for r in rank):
            extra = result.storage_data or {}
            arrays.update(extra.get("arrays", {}))
            crcs.append(extra.get("crc32c", {}))
            values_.update(extra.get("values", {}))
            objects += [extra["object"]] if "object" in extra else []
        validate_keys(sorted(arrays.keys() | values_.keys()))
        dcp: dict[str, Any] = {"objects": sorted(objects)} if objects else {}
        if metadata.planner_data is not None:
            dcp["planner_data"] = values.encode(metadata.planner_data, "Metadata.planner_data", self.allow_pickle)
        write_metadata(self.storage, metadata_docs(list(arrays.values())))  # after every rank's shards
        manifest = committed_manifest(
            self._save_id, arrays, values_, len(results), crcs, library=library_name() + " (dcp)", dcp=dcp
        )
        protocol.commit(self.storage, manifest)


_Items = dict[str, list[tuple[MetadataIndex, LocalTensor]]]  # key -> its write items and their parts


def _parts(plan: SavePlan, data_of: Callable[[WriteItem], torch.Tensor]) -> tuple[LocalState, _Items]:
    """A rank's tensor write items as the parts of global tensors it holds (the data of each from
    ``data_of``), which every save path describes and writes alike."""
    local, items = LocalState({}, {}), _Items()
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        chunk = item.tensor_data.chunk
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        data = data_of(item)
        part = LocalTensor(item.index.fqn, data, tuple(item.tensor_data.size), box, dtypes.zarr_name(data.dtype))
        local.add(part)
        items.setdefault(part.key, []).append((item.index, part))
    return local, items


def _meta_tensor(item: WriteItem) -> torch.Tensor:
    assert item.tensor_data is not None
    return torch.empty(tuple(item.tensor_data.chunk.sizes), dtype=item.tensor_data.properties.dtype, device="meta")


def _resolved_tensor(planner: SavePlanner, item: WriteItem, meta: ArrayMeta) -> torch.Tensor:
    """The planner's data for a tensor write item, checked against what was planned for it."""
    key, data = item.index.fqn, planner.resolve_data(item)
    assert item.tensor_data is not None
    sizes = tuple(item.tensor_data.chunk.sizes)
    if not isinstance(data, torch.Tensor):
        raise ZarrckptError(f"{key}: DCP resolved a tensor write item to {type(data).__name__}")
    if tuple(data.shape) != sizes or dtypes.zarr_name(data.dtype) != meta.dtype:
        raise ZarrckptError(
            f"{key}: the planner resolved a {dtypes.zarr_name(data.dtype)} {list(data.shape)} tensor for a chunk "
            f"planned as {meta.dtype} {list(sizes)}; nothing was committed"
        )
    return data


def _holds_tensors(obj: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for _, v in iter_leaves(obj))


def _opens(checkpoint_id: URL) -> bool:
    try:
        Storage(checkpoint_id)
    except (ZarrckptError, TypeError, ValueError):
        return False
    return True


class ZarrReader(StorageReader):
    """A DCP ``StorageReader`` that reads a zarrckpt checkpoint (saved by either path).

    A tensor target of another dtype receives the saved values converted, as with
    ``FileSystemReader``. Values saved pickled need ``allow_pickle=True``; a checkpoint changed
    by another tool after its commit needs ``allow_modified=True`` (see ``zarrckpt.load``).
    """

    def __init__(
        self,
        url: URL,
        *,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        allow_modified: bool = False,
    ) -> None:
        super().__init__()
        self.storage = Storage(url, storage_options)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.allow_modified = allow_modified
        self.manifest: Manifest | None = None
        self._load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: URL | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = Storage(checkpoint_id, self.storage_options)
        self.manifest = None
        self._load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: URL) -> bool:
        """True when ``checkpoint_id`` holds a zarrckpt checkpoint."""
        try:
            return protocol.is_zarrckpt_manifest(Storage(checkpoint_id))
        except (ZarrckptError, TypeError, ValueError):
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's view of the checkpoint: its tensors' chunks (one per shard), ``planner_data``, and in
        ``storage_data`` where each item lies (a :class:`ZarrStorageInfo` per ``MetadataIndex``)."""
        raw = protocol.read_manifest_bytes(self.storage)
        manifest = Manifest.loads(raw, self.storage.where(MANIFEST))
        if self.allow_modified:
            manifest = manifest.as_is()
        integrity.refuse_modified(manifest.modified, None, self.storage.url)
        self.manifest = manifest
        md, where = _items(manifest, len(raw), self.allow_modified)
        planner_data = manifest.dcp.get("planner_data")
        return Metadata(
            state_dict_metadata=md,
            planner_data=None if planner_data is None else self._decode(planner_data, "Metadata.planner_data"),
            storage_data=where,
            storage_meta=StorageMeta(checkpoint_id=self.storage.url, save_id=manifest.save_id, load_id=self._load_id),
        )

    def _decode(self, doc: Any, key: str, like: Any = None) -> Any:
        return values.decode(doc, like, key=key, allow_pickle=self.allow_pickle)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.manifest is None:
            self.manifest = protocol.read_manifest(self.storage)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self.manifest
        if manifest is None:
            raise ZarrckptError("ZarrReader.read_data called before read_metadata")
        requests: list[Request] = []
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        objects: list[tuple[Any, Callable[[], Any]]] = []
        for item in plan.items:
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                objects.append((item, self._object(key, planner, requests)))
                continue
            meta = manifest.arrays[key]
            origin = tuple(item.storage_index.offset or (0,) * len(meta.shape))
            box = Box(tuple(o + s for o, s in zip(origin, item.storage_offsets, strict=True)), tuple(item.lengths))
            target = planner.resolve_tensor(item).detach()
            stored = dtypes.torch_dtype(meta.dtype)
            staging = None  # read in the stored dtype, then convert as FileSystemReader's copy_ does
            if target.device.type != "cpu" or target.dtype != stored:
                staging = torch.empty(tuple(item.lengths), dtype=stored)
            requests.append(Request(meta, box, dtypes.as_numpy(target if staging is None else staging)))
            commits.append((item, target, staging))
        read_regions(self.storage, requests, any_layout=self.allow_modified)
        protocol.check_unchanged(self.storage, manifest.save_id)
        for item, target, staging in commits:
            if staging is not None:
                target.copy_(staging)
            planner.commit_tensor(item, target)
        for item, build in objects:  # handed over as the planner expects them: torch.save bytes
            planner.load_bytes(item, pickling.to_planner(build()))
        return _done(None)

    def _object(self, key: str, planner: LoadPlanner, requests: list[Request]) -> Callable[[], Any]:
        """How to build the object a BYTE_IO item stands for, once ``requests`` are read."""
        manifest = self.manifest
        assert manifest is not None
        if key in manifest.values:
            value = self._decode(manifest.values[key], key, getattr(planner, "state_dict", {}).get(key))
            return lambda: value
        if key in manifest.arrays:
            meta = manifest.arrays[key]
            buf = allocate(meta)
            requests.append(Request(meta, Box.full(meta.shape), buf))
            return lambda: _as_value(meta, buf)
        prefix = key + "."
        if key not in manifest.dcp.get("objects", []):
            raise ZarrckptError(f"{key}: not in the checkpoint at {self.storage.url!r}")
        flat = {k[len(prefix) :]: self._decode(v, k) for k, v in manifest.values.items() if k.startswith(prefix)}
        bufs = {}
        for k, meta in manifest.arrays.items():
            if k.startswith(prefix):
                bufs[k[len(prefix) :]] = (meta, allocate(meta))
                requests.append(Request(meta, Box.full(meta.shape), bufs[k[len(prefix) :]][1]))

        def build() -> Any:
            arrays = {k: _as_value(meta, buf) for k, (meta, buf) in bufs.items()}
            return nest({**flat, **arrays})

        return build


def dcp_to_torch_save(
    url: URL,
    torch_save_path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` for a zarrckpt checkpoint:
    the whole state, as DCP's ``_EmptyStateDictLoadPlanner`` rebuilds it, in one ``torch.save``
    file. (torch's own function reads through ``FileSystemReader`` only, which looks for a
    ``.metadata`` pickle.) Run it in one process: it loads everything into memory."""
    state: dict[str, Any] = {}
    reader = ZarrReader(url, storage_options=storage_options, allow_pickle=allow_pickle)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(state, torch_save_path)


@dataclass(frozen=True)
class ZarrStorageInfo:
    """Where one saved item lies: what ``ZarrReader.read_metadata().storage_data`` maps its
    ``MetadataIndex`` to (``FileSystemReader`` maps it to a ``_StorageInfo`` with the same first
    three fields).

    A tensor chunk is one shard object: ``relative_path`` (from the checkpoint URL, e.g.
    ``model/w/c/1/0``), ``offset`` 0 and ``length`` its size in bytes (the shard index, then every
    inner chunk with its crc32c), and ``chunk_shape``, the inner chunks a read fetches by byte range.
    A bytes or numpy value stored as one shard is described the same way. A JSON value lies in the
    manifest (``zarr.json``, ``length`` its size, ``chunk_shape`` ``()``); an item stored in several
    objects (a dict saved with ``flatten_state_dict=False``) names the manifest, which lists it, and
    its shard objects in ``parts``. ``length`` is None with ``ZarrReader(allow_modified=True)``:
    another tool may have rewritten the objects since the commit (zarr-python leaves out all-fill
    chunks), and then only each object's own index tells its size.
    """

    relative_path: str
    offset: int
    length: int | None
    chunk_shape: tuple[int, ...] = ()
    parts: tuple[ZarrStorageInfo, ...] = ()

    def holding(self, shards: Sequence[tuple[Box, ZarrStorageInfo]]) -> ZarrStorageInfo:
        return dataclasses.replace(self, parts=tuple(info for _, info in shards))


def _items(
    manifest: Manifest, manifest_nbytes: int, as_is: bool
) -> tuple[dict[str, TensorStorageMetadata | BytesStorageMetadata], dict[MetadataIndex, ZarrStorageInfo]]:
    """Every item of the checkpoint as DCP sees it (a tensor with one chunk per shard, or bytes), and
    where each lies (``Metadata.storage_data``)."""
    objects = manifest.dcp.get("objects", [])
    inside = tuple(o + "." for o in objects)
    in_manifest = ZarrStorageInfo(MANIFEST, 0, manifest_nbytes)
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, ZarrStorageInfo] = {}
    for key, meta in manifest.arrays.items():
        if key.startswith(inside):
            continue
        shards = _shards(meta, as_is)
        if meta.kind != ArrayKind.TENSOR:  # a bytes or numpy value
            md[key] = BytesStorageMetadata()
            where[MetadataIndex(key)] = shards[0][1] if len(shards) == 1 else in_manifest.holding(shards)
            continue
        chunks = []
        for i, (box, info) in enumerate(shards):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)))
            where[MetadataIndex(key, box.offsets, i)] = info
        props = TensorProperties(dtype=dtypes.torch_dtype(meta.dtype))
        md[key] = TensorStorageMetadata(properties=props, size=torch.Size(meta.shape), chunks=chunks)
    for key in manifest.values:
        if not key.startswith(inside):
            md[key] = BytesStorageMetadata()
            where[MetadataIndex(key)] = in_manifest
    for key in objects:  # a dict saved whole (flatten_state_dict=False): its arrays and values under key.
        md[key] = BytesStorageMetadata()
        under = [m for k, m in manifest.arrays.items() if k.startswith(key + ".")]
        where[MetadataIndex(key)] = in_manifest.holding([s for m in under for s in _shards(m, as_is)])
    return md, where


def _shards(meta: ArrayMeta, as_is: bool) -> list[tuple[Box, ZarrStorageInfo]]:
    """Every shard of an array (none for an empty one): its box and its object, and the object's size
    as committed (None ``as_is``: see :class:`ZarrStorageInfo`)."""
    out = []
    for idx in _cells(meta.shape, meta.shard_shape):
        length = None if as_is else ShardLayout.of(meta, idx).nbytes
        info = ZarrStorageInfo(meta.shard_path(idx), 0, length, tuple(meta.chunk_shape))
        out.append((cell_box(idx, meta.shard_shape, meta.shape), info))
    return out


def _as_value(meta: ArrayMeta, buf: np.ndarray) -> Any:
    if meta.kind == ArrayKind.BYTES:
        return {"bytearray": bytearray, "BytesIO": io.BytesIO}.get(meta.python_type, bytes)(buf.tobytes())
    if meta.kind == ArrayKind.NDARRAY:
        return buf
    return torch.from_numpy(buf).view(dtypes.torch_dtype(meta.dtype)) if buf.dtype.itemsize else torch.from_numpy(buf)


def _cells(shape: Shape, shard: Shape) -> Iterator[Shape]:
    return itertools.product(*(range(n) for n in grid_shape(shape, shard)))
