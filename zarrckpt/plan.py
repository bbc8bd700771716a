"""The global save plan, derived identically on every rank from all ranks' descriptions (no I/O)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .dtypes import storage_dtype
from .errors import SaveLayoutError
from .format import ArrayMeta, group_json, group_paths
from .keys import infer_role, validate_keys
from .layout import Box, Claim, Shape, coverage_problems, inner_chunk_shape, owner_of_cells, shard_shape_for

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SavePlan:
    arrays: dict[str, ArrayMeta]
    owners: dict[str, dict[Shape, int]]  # key -> shard grid index -> the one rank that writes it
    values: dict[str, Any]
    world_size: int

    def shards_of(self, rank: int) -> list[tuple[ArrayMeta, Shape]]:
        return [(self.arrays[k], idx) for k, owner in self.owners.items() for idx, r in owner.items() if r == rank]

    def metadata_of(self, rank: int) -> list[tuple[str, bytes]]:
        """The ``zarr.json`` documents (groups, then arrays) ``rank`` writes: spread round-robin."""
        arrays = list(self.arrays.values())
        nodes = [(p, group_json()) for p in group_paths(arrays)] + [(a.path, a.to_json()) for a in arrays]
        return [
            (f"{path}/zarr.json", json.dumps(doc, allow_nan=False).encode())
            for i, (path, doc) in enumerate(nodes)
            if i % self.world_size == rank
        ]


def build_save_plan(descriptions: Sequence[dict[str, Any]], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> SavePlan:
    """Check that ranks agree and every global tensor is covered exactly once; choose grids and writers.

    ``descriptions[r]`` is rank r's ``LocalState.describe()``. Raises SaveLayoutError listing
    every problem found, before anything is written.
    """
    problems: list[str] = []
    tensors: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    values: dict[str, list[tuple[int, Any]]] = {}
    for rank, desc in enumerate(descriptions):
        for key, t in desc["tensors"].items():
            tensors.setdefault(key, []).append((rank, t))
        for key, v in desc["values"].items():
            values.setdefault(key, []).append((rank, v))

    validate_keys(sorted(tensors.keys() | values.keys()))
    for key in sorted(tensors.keys() & values.keys()):
        problems.append(
            f"{key}: a tensor on ranks {_ranks(tensors[key])} but a plain value on ranks {_ranks(values[key])}"
        )
    for key, held in values.items():
        distinct = {json.dumps(v, sort_keys=True) for _, v in held}
        if len(distinct) > 1:
            problems.append(f"{key}: ranks {_ranks(held)} hold different values; give per-rank state per-rank keys")

    arrays: dict[str, ArrayMeta] = {}
    owners: dict[str, dict[Shape, int]] = {}
    for key in sorted(tensors):
        held = tensors[key]
        first = held[0][1]
        for field_ in ("shape", "dtype", "kind"):
            seen = {json.dumps(t[field_]) for _, t in held}
            if len(seen) > 1:
                detail = ", ".join(f"rank {r}: {t[field_]}" for r, t in held)
                problems.append(f"{key}: ranks disagree on {field_} ({detail})")
        digests = {t["digest"] for _, t in held if "digest" in t}
        if len(digests) > 1:
            problems.append(
                f"{key}: held by ranks {_ranks(held)} as a plain tensor but with different contents; "
                "per-rank state needs per-rank keys (or a DTensor)"
            )
        shape = tuple(first["shape"])
        claims = [Claim(r, Box(tuple(t["box"][0]), tuple(t["box"][1]))) for r, t in held]
        found = coverage_problems(key, shape, claims)
        problems += found
        if found or len(problems) > 50:
            continue
        shard = shard_shape_for(shape, [c.box for c in claims])
        itemsize = storage_dtype(first["dtype"]).itemsize
        topology = {k: v for k, v in first["topology"].items() if v is not None}
        topology.update(world_size=len(descriptions), holders=len(held))
        arrays[key] = ArrayMeta(
            key=key,
            shape=shape,
            dtype=first["dtype"],
            shard_shape=shard,
            chunk_shape=inner_chunk_shape(shard, itemsize, chunk_bytes),
            role=infer_role(key, first["dtype"].startswith(("float", "bfloat")))
            if first["kind"] == "tensor"
            else "other",
            kind=first["kind"],
            topology=topology,
        )
        owners[key] = owner_of_cells(shape, shard, claims)
    if problems:
        raise SaveLayoutError(
            "nothing was written: the ranks' state does not describe each global tensor exactly once:\n  "
            + "\n  ".join(problems[:50])
        )
    return SavePlan(arrays, owners, {k: v[0][1] for k, v in sorted(values.items())}, len(descriptions))


def _ranks(held: Sequence[tuple[int, Any]]) -> list[int]:
    return [r for r, _ in held]
