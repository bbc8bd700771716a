"""``torch.distributed.checkpoint`` adapters over the zarrckpt engine and format.

``dcp.save(sd, storage_writer=ZarrWriter(url))`` and ``dcp.load(sd, storage_reader=ZarrReader(url))``
write and read exactly what ``zarrckpt.save`` / ``zarrckpt.load`` do. DCP plans (and dedups
replicas); zarrckpt chooses shard grids, writes shards, and commits. Non-tensor values are
stored as JSON and handed back without ``torch.load``: no pickle reaches storage.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
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
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import commit as protocol
from . import dtypes
from .errors import ZarrckptError
from .format import Manifest, library_name
from .keys import validate_keys
from .layout import Box, Shape, cell_box, grid_shape
from .localstate import LocalState, LocalTensor, collect, from_json_value
from .plan import DEFAULT_CHUNK_BYTES, build_save_plan
from .plan import SavePlan as ZSavePlan
from .reader import Request, allocate, read_regions
from .storage import Storage
from .writer import write_rank

URL = str | os.PathLike[str]


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ZarrWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a zarrckpt checkpoint."""

    def __init__(
        self,
        url: URL,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        self.storage = Storage(url, storage_options)
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.chunk_bytes = chunk_bytes
        self._plan: ZSavePlan | None = None
        self._save_id = ""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = Storage(checkpoint_id, self.storage_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bool(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.url)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: validate coverage, choose shard grids and writers, prepare the prefix."""
        descriptions = []
        for plan in plans:
            tensors: dict[str, Any] = {}
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                    continue
                key, chunk = item.index.fqn, item.tensor_data.chunk
                if key in tensors:
                    raise ZarrckptError(f"{key}: a rank holds several chunks of one tensor; ZarrWriter supports one")
                tensors[key] = {
                    "shape": list(item.tensor_data.size),
                    "dtype": dtypes.zarr_name(item.tensor_data.properties.dtype),
                    "kind": "tensor",
                    "box": [list(chunk.offsets), list(chunk.sizes)],
                    "topology": {},
                }
            descriptions.append({"tensors": tensors, "values": {}})
        zplan = build_save_plan(descriptions, self.chunk_bytes)
        self._plan = zplan
        self._save_id = protocol.prepare(self.storage, self.overwrite)
        return [dataclasses.replace(p, storage_data=(zplan, rank)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        zplan, rank = plan.storage_data
        local = LocalState({}, {}, {})
        others: dict[str, Any] = {}
        results = []
        for item in plan.items:
            key = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                others[key] = planner.lookup_object(item.index)  # type: ignore[attr-defined]
                continue
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor) or item.tensor_data is None:
                raise ZarrckptError(f"{key}: DCP resolved a tensor write item to {type(data).__name__}")
            chunk = item.tensor_data.chunk
            meta = zplan.arrays[key]
            box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            local.tensors[key] = LocalTensor(key, (key,), data, meta.shape, box, meta.dtype)
            results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes, storage_data=None))
        write_rank(self.storage, zplan, local, rank)
        # non-tensor items: bytes / numpy arrays become arrays this rank writes alone; the rest is JSON
        extra = collect(others)
        own = build_save_plan([extra.describe()], self.chunk_bytes)
        write_rank(self.storage, own, extra, 0)
        for item in plan.items:
            key = item.index.fqn
            if key in own.arrays:
                results.append(WriteResult(item.index, extra.tensors[key].data.nbytes, {"array": own.arrays[key]}))
            elif key in extra.values:
                results.append(WriteResult(item.index, 0, {"value": extra.values[key]}))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: gather values and byte arrays, then commit the manifest."""
        if self._plan is None:
            raise ZarrckptError("ZarrWriter.finish called before prepare_global_plan on the coordinator")
        arrays = dict(self._plan.arrays)
        values: dict[str, Any] = {}
        for result in (r for rank in results for r in rank):
            extra = result.storage_data or {}
            if "value" in extra:
                values[result.index.fqn] = extra["value"]
            elif "array" in extra:
                arrays[result.index.fqn] = extra["array"]
        validate_keys(sorted(arrays.keys() | values.keys()))
        manifest = Manifest(
            self._save_id, arrays, dict(sorted(values.items())), len(results), protocol.now(), library_name() + " (dcp)"
        )
        protocol.commit(self.storage, manifest)


class ZarrReader(StorageReader):
    """A DCP ``StorageReader`` that reads a zarrckpt checkpoint (saved by either path)."""

    def __init__(self, url: URL, *, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage = Storage(url, storage_options)
        self.storage_options = storage_options
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = Storage(checkpoint_id, self.storage_options)
        self.manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bool(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.manifest = protocol.read_manifest(self.storage)
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for key, meta in self.manifest.arrays.items():
            if meta.kind != "tensor":
                md[key] = BytesStorageMetadata()
                continue
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in (cell_box(idx, meta.shard_shape, meta.shape) for idx in _cells(meta.shape, meta.shard_shape))
            ]
            props = TensorProperties(dtype=dtypes.torch_dtype(meta.dtype))
            md[key] = TensorStorageMetadata(properties=props, size=torch.Size(meta.shape), chunks=chunks)
        md.update({key: BytesStorageMetadata() for key in self.manifest.values})
        return Metadata(state_dict_metadata=md, storage_meta=StorageMeta(checkpoint_id=self.storage.url))

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
        values: list[tuple[Any, Any]] = []
        for item in plan.items:
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if key in manifest.values:
                    values.append((item, manifest.values[key]))
                else:
                    meta = manifest.arrays[key]
                    buf = allocate(meta)
                    requests.append(Request(meta, Box.full(meta.shape), buf))
                    values.append((item, buf))
                continue
            meta = manifest.arrays[key]
            origin = tuple(item.storage_index.offset or (0,) * len(meta.shape))
            box = Box(tuple(o + s for o, s in zip(origin, item.storage_offsets, strict=True)), tuple(item.lengths))
            target = planner.resolve_tensor(item).detach()
            staging = None if target.device.type == "cpu" else torch.empty(target.shape, dtype=target.dtype)
            requests.append(Request(meta, box, dtypes.as_numpy(target if staging is None else staging)))
            commits.append((item, target, staging))
        read_regions(self.storage, requests)
        protocol.check_unchanged(self.storage, manifest.save_id)
        for item, target, staging in commits:
            if staging is not None:
                target.copy_(staging)
            planner.commit_tensor(item, target)
        for item, value in values:
            stored = manifest.arrays.get(item.storage_index.fqn)
            if stored is not None and stored.kind == "bytes":
                value = value.tobytes()
            _set_value(planner, item.dest_index.fqn, value)
        return _done(None)


def _set_value(planner: LoadPlanner, fqn: str, value: Any) -> None:
    """What DefaultLoadPlanner.load_bytes does, minus torch.load (no pickle)."""
    old = getattr(planner, "state_dict", {}).get(fqn)
    value = from_json_value(value, old)
    if getattr(planner, "flatten_state_dict", False) and hasattr(planner, "mappings"):
        set_element(planner.original_state_dict, planner.mappings[fqn], value)  # type: ignore[attr-defined]
    elif hasattr(planner, "state_dict"):
        planner.state_dict[fqn] = value
    else:
        raise ZarrckptError(f"{fqn}: cannot hand a non-tensor value to planner {type(planner).__name__}")


def _cells(shape: Shape, shard: Shape) -> Iterator[Shape]:
    return itertools.product(*(range(n) for n in grid_shape(shape, shard)))
