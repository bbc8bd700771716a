"""``torch.distributed.checkpoint`` reader over the zarrckpt engine and format: :class:`ZarrReader`
(re-exported by :mod:`zarrckpt.dcp`), what its metadata says of where each item lies
(:class:`ZarrStorageInfo`), and :func:`dcp_to_torch_save`.

The reader loads a checkpoint saved by ``zarrckpt.save`` or by ``dcp.save(...,
storage_writer=ZarrWriter(url))``: DCP plans the reads from :meth:`ZarrReader.read_metadata`;
zarrckpt reads the inner chunks each read item needs, by byte range.
"""

from __future__ import annotations

import io
import itertools
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from zarrckpt.engine import commit as protocol
from zarrckpt.engine import crctable
from zarrckpt.engine.reader import read_regions
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import dtypes, integrity, pickling, values
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.keys import nest
from zarrckpt.format.layout import Box, Shape, cell_box, grid_shape
from zarrckpt.format.manifest import MANIFEST, Manifest
from zarrckpt.format.shard import ShardLayout
from zarrckpt.plan.fetch import Request, allocate
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL, ArrayKind


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ZarrReader(StorageReader):
    """A DCP ``StorageReader`` that reads a zarrckpt checkpoint (saved by either path).

    A tensor target of another dtype receives the saved values converted, as with
    ``FileSystemReader``. Values saved pickled need ``allow_pickle=True``; a checkpoint changed
    by another tool after its commit, or one without a commit record (written before zarrckpt
    recorded one, or with the record removed), needs ``allow_modified=True`` (see ``zarrckpt.load``).
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
        else:  # every chunk checksum, from the table beside the manifest (one GET)
            read, table = partial(crctable.read_table, self.storage), self.storage.where(integrity.TABLE)
            manifest = crctable.with_table(manifest, read, self.storage.retry.attempts, table)
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
            self.manifest = protocol.read_manifest(self.storage, table=True)

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
        if not integrity.reads_are_checked([r.meta for r in requests], self.allow_modified):
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
    ``model/w/c.1.0``), ``offset`` 0 and ``length`` its size in bytes (the shard index, then every
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
        return replace(self, parts=tuple(info for _, info in shards))


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
        shards = _shards(meta, as_is, in_manifest)
        if meta.kind != ArrayKind.TENSOR:  # a bytes or numpy value
            md[key] = BytesStorageMetadata()
            where[MetadataIndex(key)] = shards[0][1] if len(shards) == 1 else in_manifest.holding(shards)
            continue
        if not shards:  # no elements, no objects: one empty chunk, as DCP's own metadata lists it
            shards = [(Box.full(meta.shape), in_manifest)]
        chunks = []
        for i, (box, info) in enumerate(shards):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)))
            where[MetadataIndex(key, box.offsets, i)] = info
        props = _properties(meta.dtype, manifest.dcp.get("properties", {}).get(key, {}))
        md[key] = TensorStorageMetadata(properties=props, size=torch.Size(meta.shape), chunks=chunks)
    for key in manifest.values:
        if not key.startswith(inside):
            md[key] = BytesStorageMetadata()
            where[MetadataIndex(key)] = in_manifest
    for key in objects:  # a dict saved whole (flatten_state_dict=False): its arrays and values under key.
        md[key] = BytesStorageMetadata()
        under = [m for k, m in manifest.arrays.items() if k.startswith(key + ".")]
        shards = [s for m in under if m.constant is None for s in _shards(m, as_is, in_manifest)]
        where[MetadataIndex(key)] = in_manifest.holding(shards)
    return md, where


def _properties(dtype: str, stored: dict[str, Any]) -> TensorProperties:
    """DCP's ``TensorProperties`` of an array: its dtype, and what ``ZarrWriter`` kept of the rest
    (validated with the manifest)."""
    return TensorProperties(
        dtype=dtypes.torch_dtype(dtype),
        requires_grad=stored.get("requires_grad", False),
        pin_memory=stored.get("pin_memory", False),
        memory_format=getattr(torch, stored.get("memory_format", "contiguous_format")),
    )


def _shards(meta: ArrayMeta, as_is: bool, in_manifest: ZarrStorageInfo) -> list[tuple[Box, ZarrStorageInfo]]:
    """Every shard of an array (none for an empty one): its box and its object, and the object's size
    as committed (None ``as_is``: see :class:`ZarrStorageInfo`); a constant array has no objects,
    its value is in the manifest."""
    out = []
    for idx in _cells(meta.shape, meta.shard_shape):
        if meta.constant is not None:
            out.append((cell_box(idx, meta.shard_shape, meta.shape), in_manifest))
            continue
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
