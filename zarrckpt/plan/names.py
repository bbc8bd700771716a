"""The object names a save plan writes, against the limits of the storage (pure).

A name the storage refuses half-way (a 300-byte key segment on local disk, an S3 key over 1,024
bytes) would leave an incomplete checkpoint behind; checking every name the plan will write
before the first request refuses such a save with nothing written.
"""

from __future__ import annotations

from zarrckpt.errors import InvalidKeyError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import grid_shape
from zarrckpt.storage.caps import NameLimits


def longest_names(meta: ArrayMeta) -> list[str]:
    """The longest object names (relative to the checkpoint) written for ``meta``: its ``zarr.json``
    and its last shard object (the one with the widest indexes)."""
    last = tuple(n - 1 for n in grid_shape(meta.shape, meta.shard_shape))
    return [f"{meta.path}/zarr.json", meta.shard_path(last)]


def check_names(arrays: list[ArrayMeta], limits: NameLimits, where: str) -> None:
    """Raise InvalidKeyError naming the first key whose object names ``limits`` refuse."""
    component = 10**9 if limits.component_bytes is None else limits.component_bytes
    whole = 10**9 if limits.name_bytes is None else limits.name_bytes
    for meta in arrays:
        for name in longest_names(meta):
            most = 4 * len(name) + limits.temp_suffix_bytes  # (UTF-8: at most 4 bytes a character)
            if most <= component and limits.base_bytes + 1 + most <= whole:
                continue  # far within both limits: no segment to measure
            parts = name.split("/")
            for i, part in enumerate(parts):
                nbytes = len(part.encode()) + (limits.temp_suffix_bytes if i == len(parts) - 1 else 0)
                if limits.component_bytes is not None and nbytes > limits.component_bytes:
                    shown = part if len(part) <= 40 else part[:40] + "..."
                    raise InvalidKeyError(
                        f"key {meta.key!r} cannot be saved to {where}: its segment {shown!r} is {len(part.encode())} "
                        f"bytes, and {limits.kind} allow at most {limits.component_bytes} per name"
                        + (
                            f" (with the {limits.temp_suffix_bytes}-byte temporary suffix)"
                            if i == len(parts) - 1
                            else ""
                        )
                        + "; nothing was written"
                    )
            total = limits.base_bytes + 1 + len(name.encode()) + limits.temp_suffix_bytes
            if limits.name_bytes is not None and total > limits.name_bytes:
                raise InvalidKeyError(
                    f"key {meta.key!r} cannot be saved to {where}: its object {name[:60] + '...'!r} would be named by "
                    f"{total} bytes, and {limits.kind} allow at most {limits.name_bytes}; use a shorter key or URL; "
                    "nothing was written"
                )
