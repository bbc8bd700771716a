"""What one rank holds, as the save plan reads it: typed, frozen, and JSON on the wire (pure).

Every save path describes a rank the same way (:meth:`zarrckpt.plan.localstate.LocalState.describe`);
:func:`zarrckpt.plan.save.build_save_plan` reads nothing else. The JSON form is compact: each distinct
part description (shape, dtype, kind, box, topology) is listed once in ``specs`` and ``tensors``
maps each key to its index there (a list of indices when the rank holds several parts of one
tensor). A weight and its Adam moments, or the same shard of every layer, share one entry, so the
gathered descriptions stay small and cheap to decode at thousands of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.jsondoc import frozen, short
from zarrckpt.format.layout import Box, Shape
from zarrckpt.types import ArrayKind


@dataclass(frozen=True)
class TensorSpec:
    """One part of a global tensor that a rank holds: the tensor's shape, dtype and kind, the
    part's box, and how it came to be there (DTensor mesh and placements, ...)."""

    shape: Shape
    dtype: str
    kind: ArrayKind
    box: Box
    topology: Mapping[str, Any]
    python_type: str = ""  # bytes values: "bytearray" or "BytesIO" when not plain bytes
    constant: str = ""  # hex of the one element's bytes when every element of the part has them (zarrckpt.format.fill)
    per_rank: str = ""  # a row of a per-rank array (zarrckpt.plan.perrank): "tensor" or "json"

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": str(self.kind),
            "box": [list(self.box.offsets), list(self.box.sizes)],
            "topology": dict(self.topology),
            **({"python_type": self.python_type} if self.python_type else {}),
            **({"constant": self.constant} if self.constant else {}),
            **({"per_rank": self.per_rank} if self.per_rank else {}),
        }

    def identity(self) -> Any:
        """Equal for specs whose :meth:`to_json` documents are equal (keys sorted), without encoding them."""
        topology = frozen(dict(self.topology), sort_keys=True)
        box, rest = self.box, (self.python_type, self.constant, self.per_rank)
        return self.shape, self.dtype, str(self.kind), box.offsets, box.sizes, topology, rest

    @staticmethod
    def from_json(doc: Any) -> TensorSpec:
        try:
            (offsets, sizes) = doc["box"]
            return TensorSpec(
                shape=tuple(int(n) for n in doc["shape"]),
                dtype=str(doc["dtype"]),
                kind=ArrayKind(doc["kind"]),
                box=Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)),
                topology=dict(doc.get("topology") or {}),
                python_type=str(doc.get("python_type", "")),
                constant=str(doc.get("constant", "")),
                per_rank=str(doc.get("per_rank", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SaveLayoutError(f"a rank sent a malformed tensor description ({e!r}): {short(doc)}") from None


@dataclass(frozen=True)
class RankDescription:
    """Everything a rank contributes to the save plan: its tensor parts and its plain values."""

    specs: tuple[TensorSpec, ...]
    tensors: Mapping[str, tuple[int, ...]]  # key -> indices into ``specs``: one per part this rank holds
    values: Mapping[str, Any]  # key -> JSON-ready value

    @staticmethod
    def of(parts: Iterable[tuple[str, TensorSpec]], values: Mapping[str, Any]) -> RankDescription:
        """The description of ``(key, part)`` pairs (several per key for a tensor held in several
        parts) and ``values``; equal parts share one spec."""
        specs: list[TensorSpec] = []
        index: dict[Any, int] = {}
        tensors: dict[str, tuple[int, ...]] = {}
        for key, spec in parts:
            i = index.setdefault(spec.identity(), len(specs))
            if i == len(specs):
                specs.append(spec)
            tensors[key] = (*tensors.get(key, ()), i)
        return RankDescription(tuple(specs), tensors, dict(values))

    def parts(self, key: str) -> list[TensorSpec]:
        return [self.specs[i] for i in self.tensors[key]]

    def to_json(self) -> dict[str, Any]:
        return {
            "specs": [s.to_json() for s in self.specs],
            "tensors": {k: ix[0] if len(ix) == 1 else list(ix) for k, ix in self.tensors.items()},
            "values": dict(self.values),
        }

    @staticmethod
    def from_json(doc: Any) -> RankDescription:
        """Decode what :meth:`to_json` produced on some rank; a malformed one is a SaveLayoutError."""
        try:
            specs = tuple(TensorSpec.from_json(s) for s in doc["specs"])
            tensors = {
                str(k): (i,) if isinstance(i, int) else tuple(int(j) for j in i) for k, i in doc["tensors"].items()
            }
            values = dict(doc["values"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SaveLayoutError(f"a rank sent a malformed description ({e!r}): {short(doc)}") from None
        if any(not 0 <= i < len(specs) for ix in tensors.values() for i in ix) or any(
            not ix for ix in tensors.values()
        ):
            raise SaveLayoutError(f"a rank sent a description whose tensors refer to no spec: {short(doc)}")
        return RankDescription(specs, tensors, values)
