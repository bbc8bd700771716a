"""DCP's file-per-rank layout under the scale model: the same state, saved and loaded the DCP way.

``dcp.save`` with ``FsspecWriter`` (one thread per rank): every rank writes one file holding its
deduplicated write items (a replicated item goes to the holder with the least bytes so far, as
``dedup_save_plans`` does by default) and the coordinator writes ``.metadata``, a pickle listing
every chunk. ``dcp.load`` with ``FsspecReader``: every rank reads ``.metadata``, then one ranged
read per read item, and a read item is a whole saved chunk that overlaps a target region (DCP
narrows it in memory). The ``.metadata`` size is measured by pickling the real DCP ``Metadata``
of the simulated checkpoint. Pure counting: nothing is written or sent.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from zarrckpt.format.dtypes import storage_dtype, torch_dtype
from zarrckpt.format.layout import Box, Shape, cells_in
from zarrckpt.plan.fetch import Request
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import build_save_plan


@dataclass
class DcpSave:
    files: int  # one per rank that writes anything, plus .metadata
    metadata_bytes: int
    per_rank_bytes: list[int]
    per_rank_files: list[int]  # bytes of each rank's one file (for the PUT count)
    chunks: int  # saved chunks (storage items) listed in .metadata


class DcpLayout:
    """Where every saved chunk of the simulated checkpoint lives, the DCP way."""

    def __init__(self, descs: Sequence[RankDescription]) -> None:
        plan = build_save_plan(descs)  # the finest grid on which every rank's box is whole cells
        self.shard = {k: m.shard_shape for k, m in plan.arrays.items()}
        self.itemsize = {k: storage_dtype(m.dtype).itemsize for k, m in plan.arrays.items()}
        self.cell_box: dict[str, dict[Shape, Box]] = {}  # key -> grid cell -> the saved chunk holding it
        writer: dict[tuple[str, Box], int] = {}
        totals = [0] * len(descs)
        for key in sorted(plan.arrays):
            holders: dict[Box, list[int]] = {}
            for rank, desc in enumerate(descs):
                for spec in desc.parts(key) if key in desc.tensors else []:
                    holders.setdefault(spec.box, []).append(rank)
            cells = self.cell_box[key] = {}
            for box, ranks in holders.items():
                rank = min(ranks, key=lambda r: (totals[r], r))  # dedup_save_plans: the least loaded holder
                totals[rank] += box.volume * self.itemsize[key]
                writer[(key, box)] = rank
                for cell in cells_in(box, self.shard[key]):  # a 0-d box is the one cell ()
                    cells[cell] = box
        self.writer = writer
        self.totals = totals
        self.arrays = plan.arrays

    def save(self) -> DcpSave:
        per_rank = list(self.totals)
        files = sum(1 for n in per_rank if n) + 1
        return DcpSave(files, len(self.metadata()), per_rank, per_rank, len(self.writer))

    def metadata(self) -> bytes:
        """The pickled ``.metadata`` DCP would write for this checkpoint."""
        md: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        chunks: dict[str, list[ChunkStorageMetadata]] = {}
        at = [0] * len(self.totals)
        for (key, box), rank in self.writer.items():
            chunks.setdefault(key, []).append(ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)))
            n = box.volume * self.itemsize[key]
            storage[MetadataIndex(key, torch.Size(box.offsets))] = _StorageInfo(f"__{rank}_0.distcp", at[rank], n)
            at[rank] += n
        for key, meta in self.arrays.items():
            props = TensorProperties(dtype=torch_dtype(meta.dtype))
            md[key] = TensorStorageMetadata(props, torch.Size(meta.shape), chunks.get(key, []))
        return pickle.dumps(Metadata(state_dict_metadata=dict(md), storage_data=storage))

    def reads(self, requests: Sequence[Request]) -> tuple[int, int]:
        """(read items = ranged GETs, bytes read) for one target rank's regions: every saved chunk
        that overlaps a region is read whole."""
        gets = nbytes = 0
        for req in requests:
            key = req.meta.key
            cells = self.cell_box[key]
            touched = {cells[c] for c in cells_in(req.box, self.shard[key])}
            gets += len(touched)
            nbytes += sum(b.volume for b in touched) * self.itemsize[key]
        return gets, nbytes
