"""A stored tensor read lazily (:class:`TensorView`): an index is planned into the one box it reads,
then only the inner chunks (or, for small parts of a chunk, byte ranges) that box touches are read.
torch is imported only to hand tensors out.

Values read from part of an inner chunk are not checked against its CRC-32C (it covers the whole
chunk): such a read says so with an :class:`UncheckedReadWarning` (once per tensor and place in the
caller's code, as Python shows warnings), which names the way to checked values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from zarrckpt.display import tensor_html
from zarrckpt.engine import commit as protocol
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Box
from zarrckpt.format.manifest import Manifest
from zarrckpt.storage.store import Storage
from zarrckpt.types import Role

if TYPE_CHECKING:
    import numpy as np
    import torch

    from zarrckpt.engine.reader import PartRead


class UncheckedReadWarning(UserWarning):
    """A lazy read returned values from inner chunks it read only in part, which their CRC-32C (it
    covers whole chunks) could not check. ``partly``: those chunks, as ``(where, bytes of it used,
    its stored bytes)``. ``open(url, partial_reads=False)`` reads and verifies whole chunks."""

    def __init__(self, message: str, partly: list[PartRead] | None = None) -> None:
        super().__init__(message)
        self.partly = list(partly or [])


class Source(Protocol):
    """What a view reads through: the :class:`~zarrckpt.Checkpoint` it came from."""

    @property
    def storage(self) -> Storage: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def partial_reads(self) -> bool: ...
    @property
    def allow_modified(self) -> bool: ...


@dataclass(frozen=True)
class TensorView:
    """A stored tensor, read lazily: ``view[5, :4]`` reads only the chunks that index touches.

    Got from a :class:`Checkpoint` (``ckpt["model.fc.weight"]``). Indexing (``view[...]``),
    :meth:`read` and :meth:`numpy` read data; everything else comes from the manifest.

    Attributes:
        checkpoint: the checkpoint it is in (a :class:`~zarrckpt.Checkpoint`).
        meta: the array's stored metadata (shape, dtype, shard and chunk shapes, role, kind).
    """

    checkpoint: Source
    meta: ArrayMeta

    @property
    def key(self) -> str:
        """The tensor's key in the checkpoint."""
        return self.meta.key

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape, whatever sharding saved it."""
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype, as a torch dtype (imports torch)."""
        return dtypes.torch_dtype(self.meta.dtype)

    @property
    def role(self) -> Role:
        """What the tensor is for (model weight, optimizer moment, buffer, ...), inferred at save."""
        return self.meta.role

    @property
    def nbytes(self) -> int:
        """The size of the whole tensor in bytes."""
        return self.meta.nbytes

    @property
    def path(self) -> str:
        """Where the array is stored (its URL), for other Zarr readers."""
        return self.checkpoint.storage.where(self.meta.path)

    def __repr__(self) -> str:
        return f"<TensorView {self.key!r} {list(self.shape)} {self.meta.dtype} role={self.role}>"

    def _repr_html_(self) -> str:
        return tensor_html(self.meta, self.path)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Read the indexed part, fetching only the inner chunks it touches.

        Args:
            index: an int (negative too), a slice (with steps), ``...``, or a tuple of them, as
                for a tensor of :attr:`shape`.

        Returns:
            A new CPU tensor of :attr:`dtype` (ints drop their dimension, as in torch).

        Raises:
            ZarrckptError: the index is not of ints, slices and one ``...``, has too many
                entries, or an int is out of range.
            CorruptChunkError: a shard object is missing or truncated, or a chunk fails its checksum.
            ModifiedCheckpointError: the tensor was changed after commit (and the checkpoint was not
                opened with ``allow_modified=True``).
            IncompleteCheckpointError: the checkpoint was overwritten or deleted while being read.
            StorageError: the storage failed a request beyond its retries.
        """
        import torch

        out = torch.from_numpy(self._raw(index))
        return out.view(self.dtype) if out.dtype != self.dtype else out

    def read(self) -> torch.Tensor:
        """Read the whole tensor: ``view[...]``.

        Returns:
            A new CPU tensor of :attr:`shape` and :attr:`dtype`.

        Raises:
            CorruptChunkError, ModifiedCheckpointError, IncompleteCheckpointError, StorageError:
                as for indexing.
        """
        return self[...]

    def numpy(self, index: Any = Ellipsis) -> np.ndarray:
        """Read the indexed part (all of it by default) as numpy, without torch.

        Args:
            index: as for indexing the view; ``...`` (the default) reads the whole tensor.

        Returns:
            A new C-contiguous array; bfloat16 / float8 as ``ml_dtypes`` types, bit-exact.

        Raises:
            ZarrckptError: as for indexing (``CorruptChunkError``, ``ModifiedCheckpointError``,
                ``IncompleteCheckpointError`` and ``StorageError`` are ``ZarrckptError`` s too).
        """

        raw = self._raw(index)
        values = dtypes.value_dtype(self.meta.dtype)
        return raw.view(values) if raw.dtype != values else raw

    def _raw(self, index: Any) -> np.ndarray:
        import numpy as np  # here, not at import: listing a checkpoint (`zarrckpt ls`) needs no numpy

        from zarrckpt.engine.reader import Request, read_regions

        box, local = _plan_index(index, self.shape)
        dtype = dtypes.storage_dtype(self.meta.dtype)
        try:
            buf = np.empty(box.sizes, dtype=dtype)
        except (MemoryError, ValueError):
            nbytes = box.volume * dtype.itemsize
            raise ZarrckptError(
                f"reading {self.key!r}[{index!r}] needs {nbytes} bytes of memory, more than this process can have: "
                "index a smaller part"
            ) from None
        if box.volume:
            ckpt = self.checkpoint
            integrity.refuse_modified(ckpt.manifest.modified, [self.key], ckpt.storage.url)
            partly: list[PartRead] = []
            try:
                read_regions(
                    ckpt.storage,
                    [Request(self.meta, box, buf)],
                    partial=ckpt.partial_reads,
                    lazy=True,
                    any_layout=ckpt.allow_modified,
                    partly=partly,
                )
            except ZarrckptError:
                protocol.check_unchanged(ckpt.storage, ckpt.manifest.save_id)  # an overwrite explains it better
                raise
            if partly:  # (stacklevel 3: whoever indexed the view, or called numpy())
                warnings.warn(_unchecked(self.key, partly), stacklevel=3)
        return np.array(buf[local])  # a C-contiguous copy; 0-d stays 0-d


def _unchecked(key: str, partly: list[PartRead]) -> UncheckedReadWarning:
    """The warning for a read that used ``partly``, chunks it read in part (the same words for every
    read of ``key``, so Python shows it once per place in the caller's code)."""
    return UncheckedReadWarning(
        f"{key!r}: values were read from part of an inner chunk, so its CRC-32C (which covers the whole "
        "chunk) did not check them; for checked values open the checkpoint with partial_reads=False "
        "(whole chunks, each verified: what `zarrckpt show` reads), or run ckpt.verify()",
        partly,
    )


def _plan_index(index: Any, shape: tuple[int, ...]) -> tuple[Box, tuple[Any, ...]]:
    """The bounding box an index reads, and how to index that box to get the result."""
    import numpy as np

    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise ZarrckptError("an index can hold at most one '...'")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise ZarrckptError(f"too many indices ({len(items)}) for a tensor of shape {list(shape)}")
    items += [slice(None)] * (len(shape) - len(items))
    lo: list[int] = []
    size: list[int] = []
    local: list[Any] = []
    for d, (item, n) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item) + n if item < 0 else int(item)
            if not 0 <= i < n:
                raise ZarrckptError(f"index {item} is out of range for dimension {d} of size {n}")
            lo.append(i)
            size.append(1)
            local.append(0)
        elif isinstance(item, slice):
            r = range(*item.indices(n))
            if len(r) == 0:
                lo.append(0)
                size.append(0)
                local.append(slice(0, 0))
                continue
            first, last = min(r[0], r[-1]), max(r[0], r[-1])
            lo.append(first)
            size.append(last - first + 1)
            start = r[0] - first
            stop = start + len(r) * r.step
            local.append(slice(start, stop if stop >= 0 else None, r.step))
        else:
            raise ZarrckptError(f"unsupported index {item!r} for dimension {d}: use ints, slices and '...'")
    return Box(tuple(lo), tuple(size)), tuple(local)
