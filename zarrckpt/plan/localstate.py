"""What this rank holds: a state dict turned into tensor boxes and JSON values (no I/O, no collectives)."""

from __future__ import annotations

import io
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from zarrckpt.errors import UnsupportedValueError
from zarrckpt.format import dtypes, fill
from zarrckpt.format.keys import flat_leaves
from zarrckpt.format.layout import Box, Shape
from zarrckpt.format.values import encode
from zarrckpt.plan import perrank
from zarrckpt.plan.meshlayout import REPLICATE, MeshLayout
from zarrckpt.plan.perrank import PerRank
from zarrckpt.plan.rankdesc import RankDescription, TensorSpec
from zarrckpt.types import ArrayKind

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

BYTES_TYPES = (bytes, bytearray, io.BytesIO)  # stored as 1-D uint8 arrays, restored as the target's type


@dataclass
class LocalTensor:
    """This rank's part of one global tensor (a rank may hold several parts of one tensor)."""

    key: str
    data: torch.Tensor  # the local part (DTensor: its local shard), on any device
    shape: Shape  # global shape
    box: Box  # where ``data`` sits in the global tensor
    dtype: str
    kind: ArrayKind = ArrayKind.TENSOR
    topology: dict[str, Any] = field(default_factory=dict)
    python_type: str = ""  # bytes values: "bytearray" or "BytesIO" when not plain bytes
    layout: MeshLayout | None = None  # a DTensor's: every rank's box derives from it (zarrckpt.plan.compact)
    # a PerRank value's row (zarrckpt.plan.perrank): "tensor" or "json"; its layout's ranks are the group's
    per_rank: str = ""

    def spec(self) -> TensorSpec:
        return TensorSpec(
            self.shape, self.dtype, self.kind, self.box, self.topology, self.python_type, self.constant(), self.per_rank
        )

    def constant(self) -> str:
        """Hex of the one element's bytes when every element of this part has the same bits and the
        part is small enough to check (``fill.CHECK_BYTES``); else "" (and for meta tensors)."""
        data = self.data
        if self.per_rank:  # rows differ by rank: a constant would tell ranks apart (and split their class)
            return ""
        if data.is_meta or not 0 < data.numel() * data.element_size() <= fill.CHECK_BYTES:
            return ""
        found = fill.constant_of(dtypes.as_numpy(data.detach().cpu()), self.dtype)
        return "" if found is None else found.hex()


@dataclass
class LocalState:
    tensors: dict[str, list[LocalTensor]]  # key -> this rank's parts of it (usually one)
    values: dict[str, Any]  # key -> JSON-ready value

    def add(self, tensor: LocalTensor) -> None:
        self.tensors.setdefault(tensor.key, []).append(tensor)

    def parts(self) -> Iterator[LocalTensor]:
        for parts in self.tensors.values():
            yield from parts

    def part_holding(self, key: str, box: Box) -> LocalTensor | None:
        """The part of ``key`` that holds all of ``box`` (None when no part does)."""
        parts = self.tensors.get(key, ())
        return next((part for part in parts if part.box == box or part.box.contains(box)), None)

    def json_rows(self) -> dict[str, int]:
        """Each ``json`` per-rank row's length before padding, by key (sorted)."""
        return {
            key: parts[0].data.shape[1]
            for key, parts in sorted(self.tensors.items())
            if parts[0].per_rank == perrank.JSON_ROWS
        }

    def pad_rows(self, lengths: Mapping[str, int]) -> None:
        """Pad each ``json`` row to the longest of every rank's (``lengths``), with spaces."""
        for key, length in lengths.items():
            (part,) = self.tensors[key]
            world, rank = part.shape[0], part.box.offsets[0]
            row = torch.frombuffer(bytearray(perrank.pad_row(bytes(part.data.numpy()), length)), dtype=torch.uint8)
            self.tensors[key] = [per_rank_part(key, row.reshape(1, -1), rank, world, "uint8", part.kind, part.per_rank)]

    def describe(self) -> RankDescription:
        """What this rank holds, for :func:`zarrckpt.plan.save.build_save_plan` (every save path's
        one description of a rank)."""
        return RankDescription.of(((t.key, t.spec()) for t in self.parts()), self.values)


@dataclass(frozen=True)
class LocalShard:
    """A plain tensor that is one rank's block of a larger global tensor (no DTensor needed).

    ``data`` holds the elements ``[offsets, offsets + data.shape)`` of a tensor of shape
    ``global_shape``. Ranks holding the same block are replicas (one of them writes it). On load,
    ``data`` is filled in place.
    """

    data: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.global_shape) != self.data.dim() or len(self.offsets) != self.data.dim():
            raise UnsupportedValueError(
                f"LocalShard: data has {self.data.dim()} dims but global_shape {list(self.global_shape)} "
                f"and offsets {list(self.offsets)} do not match"
            )


def tensor_box(value: torch.Tensor | LocalShard) -> tuple[torch.Tensor, Shape, Box, dict[str, Any]]:
    """(local data, global shape, box of the local data, topology) of a tensor, DTensor or LocalShard."""
    if isinstance(value, LocalShard):
        shape, offsets = tuple(value.global_shape), tuple(value.offsets)
        return value.data, shape, Box(offsets, tuple(value.data.shape)), {"placements": ["LocalShard"]}
    if is_dtensor(value):
        return _dtensor_box(value)
    return value, tuple(value.shape), Box.full(value.shape), {}


def _dtensor_box(value: DTensor) -> tuple[torch.Tensor, Shape, Box, dict[str, Any]]:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in value.placements):
        raise UnsupportedValueError("a DTensor with a Partial placement holds unreduced values; redistribute it first")
    mesh = value.device_mesh
    local_shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise UnsupportedValueError(f"DTensor local shard has shape {list(local.shape)}, expected {list(local_shape)}")
    topology = {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [repr(p) for p in value.placements],
    }
    return local, tuple(value.shape), Box(tuple(offset), tuple(local_shape)), topology


Part = tuple[torch.Tensor, Shape, Box, dict[str, Any]]  # (local data, global shape, its box, topology)


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing DTensor's module where nothing did (it
    imports sympy: most of a second, which a state of plain tensors would pay in its first save)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_local_shards(value: Any) -> bool:
    """A list or tuple of :class:`LocalShard`: several blocks of one global tensor on this rank."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, LocalShard) for v in value)


def is_tensor_target(value: Any) -> bool:
    """A value saved as (and loaded into) a global tensor: a tensor, DTensor, ShardedTensor,
    :class:`LocalShard`, or a list of LocalShards."""
    return isinstance(value, (torch.Tensor, LocalShard)) or is_local_shards(value)


def tensor_parts(value: torch.Tensor | LocalShard | Sequence[LocalShard]) -> list[Part]:
    """The parts of a global tensor this rank holds: one for a tensor, DTensor or LocalShard;
    each local shard of a ShardedTensor or each entry of a list of LocalShards (possibly none)."""
    sharded = sys.modules.get("torch.distributed._shard.sharded_tensor.api")  # (none exists before it is imported)
    if sharded is not None and isinstance(value, sharded.ShardedTensor):
        shape = tuple(value.size())
        return [
            (s.tensor, shape, Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), {})
            for s in value.local_shards()
        ]
    if isinstance(value, (torch.Tensor, LocalShard)):
        return [tensor_box(value)]
    parts = [tensor_box(v) for v in value]
    shapes = {p[1] for p in parts}
    if len(shapes) > 1:
        raise UnsupportedValueError(f"LocalShards of one tensor give different global shapes {sorted(shapes)}")
    return parts


def tensor_info(value: torch.Tensor | LocalShard | Sequence[LocalShard]) -> tuple[Shape, torch.dtype]:
    """The global shape and the dtype of a tensor target (whatever this rank holds of it)."""
    sharded = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    if sharded is not None and isinstance(value, sharded.ShardedTensor):
        return tuple(value.size()), value.metadata().tensor_properties.dtype
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    first = value if isinstance(value, LocalShard) else value[0]
    return tuple(first.global_shape), first.data.dtype


def collect(
    state_dict: Mapping[str, Any], allow_pickle: bool = False, rank: int | None = None, world: int | None = None
) -> LocalState:
    """Split a (nested) state dict into this rank's tensor parts and JSON values (:mod:`zarrckpt.format.values`).

    ``rank`` of ``world`` (default: the default process group's, else 0 of 1) places the rows of
    :class:`~zarrckpt.PerRank` values; a ``json`` row is left unpadded (:meth:`LocalState.pad_rows`)."""
    state = LocalState({}, {})
    if rank is None or world is None:
        rank, world = _default_rank()
    for key, (_, value) in flat_leaves(state_dict).items():
        try:
            if isinstance(value, PerRank):
                state.add(_row(key, value.value, rank, world, allow_pickle))
                continue
            _collect_leaf(state, key, value, allow_pickle)
        except UnsupportedValueError as e:
            raise e if str(e).startswith(repr(key)) else UnsupportedValueError(f"{key!r}: {e}") from None
    return state


def _collect_leaf(state: LocalState, key: str, value: Any, allow_pickle: bool) -> None:
    if isinstance(value, BYTES_TYPES):
        raw = value.getvalue() if isinstance(value, io.BytesIO) else value
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        python_type = "" if isinstance(value, bytes) else type(value).__name__
        box = Box.full((len(raw),))
        state.add(LocalTensor(key, data, (len(raw),), box, "uint8", ArrayKind.BYTES, {}, python_type))
    elif isinstance(value, np.ndarray):
        name = dtypes.numpy_name(value.dtype)
        data = torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))  # 0-d stays 0-d
        state.add(LocalTensor(key, data, value.shape, Box.full(value.shape), name, ArrayKind.NDARRAY))
    elif is_tensor_target(value):
        for data, shape, box, topology in tensor_parts(value):
            layout = mesh_layout(value, box) if is_dtensor(value) else None
            name = dtypes.zarr_name(data.dtype)
            state.add(LocalTensor(key, data, shape, box, name, ArrayKind.TENSOR, topology, layout=layout))
    else:
        state.values[key] = encode(value, key, allow_pickle)


def _default_rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _row(key: str, value: Any, rank: int, world: int, allow_pickle: bool) -> LocalTensor:
    """This rank's row of a :class:`~zarrckpt.PerRank` value."""
    if isinstance(value, np.ndarray) or (isinstance(value, torch.Tensor) and not is_dtensor(value)):
        data = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
        name = dtypes.numpy_name(value.dtype) if isinstance(value, np.ndarray) else dtypes.zarr_name(data.dtype)
        kind, how = (ArrayKind.NDARRAY if isinstance(value, np.ndarray) else ArrayKind.TENSOR), perrank.TENSOR_ROWS
    elif is_tensor_target(value):
        raise UnsupportedValueError("PerRank holds a rank's own plain tensor, not a DTensor or LocalShard")
    else:  # JSON text: never empty
        data = torch.frombuffer(bytearray(perrank.encode_row(value, key, allow_pickle)), dtype=torch.uint8)
        name, kind, how = "uint8", ArrayKind.BYTES, perrank.JSON_ROWS
    return per_rank_part(key, data.reshape(1, *data.shape), rank, world, name, kind, how)


def per_rank_part(
    key: str, row: torch.Tensor, rank: int, world: int, dtype: str, kind: ArrayKind, how: str
) -> LocalTensor:
    """Row ``rank`` (``row``: shape ``[1, ...]``) of a per-rank array of ``world`` rows."""
    shape = tuple(row.shape[1:])
    layout = perrank.row_layout(world, shape)
    box = perrank.row_box(rank, shape)
    return LocalTensor(
        key, row, layout.shape, box, dtype, kind, {"placements": ["PerRank"]}, layout=layout, per_rank=how
    )


def mesh_layout(value: DTensor, box: Box) -> MeshLayout | None:
    """The layout of a DTensor whose placements are ``Shard`` and ``Replicate`` only and whose box
    on this rank is the one the layout implies; else None (its box is then sent as it is)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = []
    for p in value.placements:
        if isinstance(p, Shard) and not isinstance(p, _StridedShard):
            placements.append(p.dim if p.dim >= 0 else p.dim + value.dim())
        elif isinstance(p, Replicate):
            placements.append(REPLICATE)
        else:
            return None
    facts = _mesh_facts(value.device_mesh)
    if facts is None:
        return None
    shape, ranks, coordinate = facts
    layout = MeshLayout(tuple(value.shape), shape, ranks, tuple(placements))
    return layout if layout.box_at(coordinate) == box else None


_MESHES: dict[int, tuple[weakref.ref[Any], tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None]] = {}


def _mesh_facts(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(shape, ranks in mesh order, this rank's coordinate) of a DeviceMesh, or None when this rank
    is not in it; remembered per mesh (``DeviceMesh.mesh`` builds a tensor each time: a fifth of
    collecting an FSDP state's 54 DTensors)."""
    entry = _MESHES.get(id(mesh))
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    coordinate = mesh.get_coordinate()
    facts = None
    if coordinate is not None:
        facts = (tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(coordinate))
    if len(_MESHES) > 64:
        _MESHES.clear()
    _MESHES[id(mesh)] = (weakref.ref(mesh), facts)
    return facts
