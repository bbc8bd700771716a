"""Torch dtypes <-> Zarr v3 data type names <-> the numpy dtype used to move the raw bytes.

Derived from the one table, :data:`zarrckpt_dtypes.TABLE`. Names and numpy dtypes need no
torch: reading a manifest (``zarrckpt ls``) does not import it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from zarrckpt.errors import UnsupportedValueError
from zarrckpt_dtypes import BY_NAME, TABLE, fill_value, value_dtype

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "SUPPORTED",
    "as_numpy",
    "fill_value",
    "is_known",
    "numpy_name",
    "safetensors_name",
    "storage_dtype",
    "torch_dtype",
    "value_dtype",
    "zarr_name",
]

SUPPORTED = tuple(d.name for d in TABLE)


@functools.cache
def _numpy_tables() -> tuple[dict[str, np.dtype], dict[np.dtype, str]]:
    """name -> the numpy dtype of the stored bits, and numpy dtype -> name for numpy arrays (kind
    "ndarray": the dtypes numpy itself has, in native little-endian byte order). Built on first
    use: reading a manifest (`zarrckpt ls`) does not import numpy."""
    import numpy as np

    by_numpy = {np.dtype(d.numpy): d.name for d in TABLE if d.in_zarr_python}
    return {d.name: np.dtype(d.bits) for d in TABLE}, by_numpy


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str], dict[torch.dtype, torch.dtype]]:
    """name -> torch dtype, its inverse, and the unsigned integer dtype of the same width to view
    the dtypes numpy has no type for as (imports torch)."""
    import torch

    by_name: dict[str, torch.dtype] = {d.name: getattr(torch, d.torch) for d in TABLE}
    view_as = {by_name[d.name]: getattr(torch, storage_dtype(d.name).name) for d in TABLE if d.bits != d.numpy}
    return by_name, {t: name for name, t in by_name.items()}, view_as


def zarr_name(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise UnsupportedValueError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED)}") from None


def numpy_name(dtype: np.dtype) -> str:
    """The data_type name of a numpy array's dtype (UnsupportedValueError when there is none)."""
    by_numpy = _numpy_tables()[1]
    try:
        return by_numpy[dtype]
    except (KeyError, TypeError):
        supported = ", ".join(str(d) for d in by_numpy)
        raise UnsupportedValueError(
            f"numpy dtype {dtype} is not supported; supported (little-endian): {supported}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    return _torch_tables()[0][name]


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes equal the stored element bytes (bit pattern for bf16/fp8)."""
    return _numpy_tables()[0][name]


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors dtype name of a supported torch dtype (None: safetensors has none)."""
    name = _torch_tables()[1].get(dtype)
    return None if name is None else BY_NAME[name].safetensors


def is_known(name: object) -> bool:
    return isinstance(name, str) and name in BY_NAME


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor's raw element bits."""
    view_as = _torch_tables()[2]
    return t.view(view_as[t.dtype]).numpy() if t.dtype in view_as else t.numpy()
