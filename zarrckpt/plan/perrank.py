"""Per-rank state (:class:`PerRank`) as one array with a leading rank axis (pure: no I/O, no collectives).

State that differs by rank (RNG states, data-loader positions) is saved under one key as an array of
shape ``[world, ...]``, rank ``r`` writing row ``r`` as its own shard, instead of as ``world``
separately named arrays or values (docs/FORMAT.md §2, "Per-rank arrays"). A tensor (or numpy array)
row is the value itself (``per_rank: "tensor"``); any other value is its typed JSON
(:mod:`zarrckpt.format.values`) as UTF-8 bytes in a ``uint8`` row of ``L`` bytes, right-padded with
spaces, ``L`` the longest over the ranks (``per_rank: "json"``). Every rank describes such an array
by the same layout (a one-dimensional mesh of the whole group sharding dimension 0), so the save
planner's classes of ranks do not split by rank (:mod:`zarrckpt.plan.compact`).
"""

from __future__ import annotations

import json
from typing import Any

from zarrckpt.errors import InvalidCheckpointError, UnsupportedValueError
from zarrckpt.format import values
from zarrckpt.format.layout import Box, Shape
from zarrckpt.plan.meshlayout import MeshLayout
from zarrckpt.plan.rankdesc import TensorSpec

TENSOR_ROWS = "tensor"  # ``per_rank``: a row is the rank's tensor (or numpy array)
JSON_ROWS = "json"  # ``per_rank``: a row is the rank's value as typed JSON text, padded with spaces
LOAD_MODES = ("error", "modulo", "skip")  # ``load(..., per_rank=...)`` on another world size
PAD = 0x20  # a space: JSON allows it after the value


class PerRank:
    """A value that differs by rank, saved as one array with a leading rank axis.

    ``zarrckpt.save({"rng": zarrckpt.PerRank(torch.get_rng_state())}, url)`` stores ``rng`` as one
    ``[world, 5056]`` ``uint8`` array, rank ``r`` writing row ``r``, instead of one key per rank. A
    tensor or numpy array must have the same shape and dtype on every rank; any other value (a dict of
    data-loader positions, ``random.getstate()``, a numpy generator's ``bit_generator.state``) is stored
    as its typed JSON text, one padded row per rank.

    As a load target, a tensor is filled in place with this rank's row, and any other value is
    replaced: the target's leaf becomes a new ``PerRank`` holding the saved value (of the type the
    target's ``value`` has, as for plain values). A load on another world size than the save's
    needs ``load(..., per_rank="modulo")`` (rank ``r`` takes row ``r % saved_world``) or
    ``per_rank="skip"`` (the target is left as it is); by default it is a ``LayoutMismatchError``.
    """

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerRank) and _same(self.value, other.value)

    __hash__ = None  # type: ignore[assignment]  # (mutable, like the values it holds)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # tensors and arrays: elementwise
        import torch

        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        return False


def row_layout(world: int, row_shape: Shape) -> MeshLayout:
    """The layout every rank gives a per-rank array: ``[world, *row_shape]`` sharded over the group's ranks."""
    return MeshLayout((world, *row_shape), (world,), tuple(range(world)), (0,))


def row_box(rank: int, row_shape: Shape) -> Box:
    """Row ``rank`` of a per-rank array whose rows have ``row_shape``."""
    return Box((rank, *(0 for _ in row_shape)), (1, *row_shape))


def row_problems(key: str, ranks: list[int], specs: list[TensorSpec]) -> list[str]:
    """The save's problem when the holders of a per-rank array's rows disagree on their shape, dtype
    or kind (json rows are padded alike), naming which ranks hold which; else none."""
    rows: dict[tuple[str, Shape, str, str], list[int]] = {}
    for r, t in zip(ranks, specs, strict=True):
        rows.setdefault((t.per_rank, t.shape[1:], t.dtype, t.kind), []).append(r)
    if len(rows) == 1:
        return []
    found = "; ".join(f"ranks {_ranges(rs)}: {list(s)} {d} {k}" for (_, s, d, k), rs in rows.items())
    return [f"{key}: PerRank rows must have one shape and dtype on every rank ({found})"]


def exact_rows(ranks: list[int], specs: list[TensorSpec]) -> bool:
    """Whether holder ``i`` is rank ``i`` holding row ``i`` of ``[len(ranks), ...]``, as every save of
    ``PerRank`` values gives: then the rows tile the array exactly once and each row is a shard, which
    the planner takes without checking ``world`` boxes one by one."""
    first = specs[0]
    if not first.per_rank or not first.shape or first.shape[0] != len(ranks) or 0 in first.shape:
        return False  # (an empty array has no shard to write: the general path says so)
    rest = first.shape[1:]
    zeros, sizes = (0,) * len(rest), (1, *rest)
    return all(
        r == i and t.shape == first.shape and t.box.offsets == (i, *zeros) and t.box.sizes == sizes
        for i, (r, t) in enumerate(zip(ranks, specs, strict=True))
    )


def _ranges(ranks: list[int]) -> str:
    """``0-3, 7`` for ranks 0, 1, 2, 3 and 7."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def encode_row(value: Any, key: str, allow_pickle: bool) -> bytes:
    """A ``json`` row's bytes before padding: the value's typed JSON, compact, UTF-8."""
    doc = values.encode(value, key, allow_pickle)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def pad_row(raw: bytes, length: int) -> bytes:
    return raw + b" " * (length - len(raw))


def decode_row(raw: bytes, like: Any, key: str, allow_pickle: bool) -> Any:
    """The value of a ``json`` row (padding stripped), restored as :func:`zarrckpt.format.values.decode` does."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise InvalidCheckpointError(f"{key!r}: this rank's row of the per-rank value is no JSON text ({e})") from None
    return values.decode(doc, like, key=key, allow_pickle=allow_pickle)


def check_mode(per_rank: str) -> None:
    if per_rank not in LOAD_MODES:
        raise UnsupportedValueError(f"load(..., per_rank={per_rank!r}): choose one of {', '.join(LOAD_MODES)}")


def row_of(rank: int, world: int, saved_world: int, per_rank: str) -> int | None:
    """The row rank ``rank`` of ``world`` loads from an array saved by ``saved_world`` ranks: its own
    on the same world size; else ``rank % saved_world`` (``"modulo"``) or none (``"skip"``; and
    ``"error"``, which :func:`world_problem` reports)."""
    if world == saved_world:
        return rank
    return rank % saved_world if per_rank == "modulo" else None


def world_problem(key: str, world: int, saved_world: int) -> str:
    """The mismatch a load on another world size reports by default."""
    return (
        f"{key}: saved per rank by {saved_world} ranks, loading on {world}: pass "
        f"load(..., per_rank='modulo') (rank r takes row r % {saved_world}) or per_rank='skip' "
        "(the target is left as it is, e.g. to reseed)"
    )
