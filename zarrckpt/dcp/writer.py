"""The ``torch.distributed.checkpoint`` writer over the zarrckpt engine and format: :class:`ZarrWriter`.

``dcp.save(sd, storage_writer=ZarrWriter(url))`` writes exactly what ``zarrckpt.save`` does. DCP
plans (and dedups replicas); zarrckpt chooses shard grids, writes shards, and commits. Non-tensor items pass
through the planner's hooks as the ``torch.save`` bytes DCP uses in memory
(:mod:`zarrckpt.format.pickling`) and are stored as typed JSON: no pickle reaches storage unless
``allow_pickle=True``. The reader is in :mod:`zarrckpt.dcp.reader`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.engine.dist import Group
from zarrckpt.engine.markers import abandon
from zarrckpt.engine.writer import committed_manifest, write_metadata, write_rank
from zarrckpt.errors import InvalidKeyError, ZarrckptError
from zarrckpt.format import dtypes, integrity, pickling, values
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.keys import check_distinct, iter_leaves, validate_keys
from zarrckpt.format.layout import Box
from zarrckpt.format.manifest import library_name
from zarrckpt.plan.localstate import BYTES_TYPES, LocalState, LocalTensor, collect
from zarrckpt.plan.names import check_names
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, build_save_plan, metadata_docs
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ZarrWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a zarrckpt checkpoint.

    Like ``FileSystemWriter``, it replaces what is at ``url`` (``overwrite=False`` refuses an
    existing checkpoint instead). Non-tensor items go through the planner's ``resolve_data`` and
    are stored as typed JSON (:mod:`zarrckpt.format.values`), never pickled unless ``allow_pickle``.
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
        self._unfinished: weakref.finalize[Any, Any] | None = None  # abandons a prepared save not committed

    def reset(self, checkpoint_id: URL | None = None) -> None:
        self._abandon_unfinished()
        if checkpoint_id is not None:
            self.storage = Storage(checkpoint_id, self.storage_options)
        self._save_id = ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: URL) -> bool:
        """True for a URL fsspec can open."""
        return _opens(checkpoint_id)

    def _abandon_unfinished(self) -> None:
        """A save of this writer failed after its prepare (DCP says nothing of it): abandon it now."""
        if self._unfinished is not None:
            self._unfinished()
            self._unfinished = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._abandon_unfinished()  # (DCP resets a writer only when given a checkpoint_id)
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
        _check_keys(plans)
        zplan = build_save_plan([_parts(plan, _meta_tensor)[0].describe() for plan in plans], self.chunk_bytes)
        check_names(list(zplan.arrays.values()), self.storage.name_limits, self.storage.url)
        self.storage.guard = None  # (a reused writer: the last save's check is not this one's)
        self._save_id = protocol.prepare(self.storage, self.overwrite, len(plans))
        self.storage.guard = markers.Ownership(self.storage, self._save_id).check  # (this rank's writes)
        # DCP tells a writer nothing when a save fails after this: the save is abandoned (its
        # heartbeat stopped, so that the next save may take it over) at the next reset, or when
        # the writer is collected, unless finish commits it
        self._unfinished = weakref.finalize(self, abandon, self.storage, self._save_id)
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
        self.storage.flush()  # this rank's objects are durable before rank 0 commits (finish)
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
        properties = {
            key: found
            for key, item in sorted(metadata.state_dict_metadata.items())
            if isinstance(item, TensorStorageMetadata) and (found := _properties(item.properties))
        }
        if properties:
            dcp["properties"] = properties
        write_metadata(self.storage, metadata_docs(list(arrays.values())))  # after every rank's shards
        manifest = committed_manifest(
            self._save_id, arrays, values_, len(results), crcs, library=library_name() + " (dcp)", dcp=dcp
        )
        protocol.commit(self.storage, manifest)
        if self._unfinished is not None:
            self._unfinished.detach()
            self._unfinished = None


def _properties(props: TensorProperties) -> dict[str, Any]:
    """A tensor's DCP properties beyond its dtype (stored in the array): those that differ from the
    defaults, as ``read_metadata()`` gives them back (``dcp.properties`` in docs/FORMAT.md)."""
    out: dict[str, Any] = {}
    if props.requires_grad:
        out["requires_grad"] = True
    if props.pin_memory:
        out["pin_memory"] = True
    if props.memory_format != torch.contiguous_format:
        out["memory_format"] = str(props.memory_format).removeprefix("torch.")
    return out


def _check_keys(plans: list[SavePlan]) -> None:
    """Before anything is written: every key storable, no two entries of one rank's state dict saved
    at one place (with ``flatten_state_dict=False``, DCP turns ``1`` and ``"1"`` both into ``"1"``, and
    its own writers then keep one of the two), no two keys the same text in two Unicode spellings."""
    for rank, plan in enumerate(plans):
        seen: set[tuple[str, tuple[int, ...] | None]] = set()
        for item in plan.items:
            fqn, offset = item.index.fqn, item.index.offset
            at = (str(fqn), None if offset is None else tuple(offset))
            if at in seen:
                raise InvalidKeyError(
                    f"rank {rank}: two entries of the state dict are both saved as {str(fqn)!r}"
                    + (f" at {list(offset)}" if offset is not None else "")
                    + ": keys are turned into strings (1 and '1' are one key), so rename one"
                )
            seen.add(at)
    keys = sorted({str(item.index.fqn) for plan in plans for item in plan.items})
    check_distinct((key, repr(key)) for key in keys)
    validate_keys(keys)


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
