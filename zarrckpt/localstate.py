"""What this rank holds: a state dict turned into tensor boxes and JSON values (no I/O, no collectives)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Partial

from . import dtypes
from .errors import UnsupportedValueError
from .keys import flat_key, iter_leaves
from .layout import Box, Shape
from .types import ArrayKind
from .values import encode

BYTES_TYPES = (bytes, bytearray, io.BytesIO)  # stored as 1-D uint8 arrays, restored as the target's type


@dataclass
class LocalTensor:
    """This rank's part of one global tensor."""

    key: str
    data: torch.Tensor  # the local part (DTensor: its local shard), on any device
    shape: Shape  # global shape
    box: Box  # where ``data`` sits in the global tensor
    dtype: str
    kind: ArrayKind = ArrayKind.TENSOR
    topology: dict[str, Any] = field(default_factory=dict)
    python_type: str = ""  # bytes values: "bytearray" or "BytesIO" when not plain bytes

    def describe(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind,
            "box": [list(self.box.offsets), list(self.box.sizes)],
            "topology": self.topology,
            **({"python_type": self.python_type} if self.python_type else {}),
        }


@dataclass
class LocalState:
    tensors: dict[str, LocalTensor]
    values: dict[str, Any]  # key -> JSON-ready value

    def describe(self) -> dict[str, Any]:
        """What this rank holds, as JSON for :func:`zarrckpt.plan.build_save_plan`.

        Compact: each distinct tensor description (shape, dtype, kind, box, topology) is
        listed once in ``specs`` and ``tensors`` maps each key to its index there. A weight and
        its Adam moments, or the same shard of every layer, share one entry, so the gathered
        descriptions stay small and cheap to decode at thousands of ranks.
        """
        specs: list[dict[str, Any]] = []
        index: dict[str, int] = {}
        tensors: dict[str, int] = {}
        for key, t in self.tensors.items():
            desc = t.describe()
            tensors[key] = index.setdefault(json.dumps(desc, sort_keys=True), len(specs))
            if tensors[key] == len(specs):
                specs.append(desc)
        return {"specs": specs, "tensors": tensors, "values": self.values}


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
    if not isinstance(value, DTensor):
        return value, tuple(value.shape), Box.full(value.shape), {}
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


def collect(state_dict: Mapping[str, Any], allow_pickle: bool = False) -> LocalState:
    """Split a (nested) state dict into this rank's tensor parts and JSON values (:mod:`zarrckpt.values`)."""
    state = LocalState({}, {})
    for path, value in iter_leaves(state_dict):
        key = flat_key(path)
        try:
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
        state.tensors[key] = LocalTensor(key, data, (len(raw),), box, "uint8", ArrayKind.BYTES, {}, python_type)
    elif isinstance(value, np.ndarray):
        name = dtypes.numpy_name(value.dtype)
        data = torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))  # 0-d stays 0-d
        state.tensors[key] = LocalTensor(key, data, value.shape, Box.full(value.shape), name, ArrayKind.NDARRAY)
    elif isinstance(value, (torch.Tensor, LocalShard)):
        data, shape, box, topology = tensor_box(value)
        dtype = dtypes.zarr_name(data.dtype)
        state.tensors[key] = LocalTensor(key, data, shape, box, dtype, ArrayKind.TENSOR, topology)
    else:
        state.values[key] = encode(value, key, allow_pickle)
