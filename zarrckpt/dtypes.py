"""Torch dtypes <-> Zarr v3 data type names <-> the numpy dtype used to move the raw bytes.

Names and numpy dtypes need no torch: reading a manifest (``zarrckpt ls``) does not import it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from .errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

# name in zarr.json (TensorStore's zarr3 names) -> numpy dtype holding the same bits
_NUMPY: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

SUPPORTED = tuple(_NUMPY)


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str], dict[torch.dtype, torch.dtype]]:
    """name -> torch dtype, its inverse, and the integer dtype to view exotic floats as (imports torch)."""
    import torch

    by_name = {name: getattr(torch, name) for name in SUPPORTED}
    view_as = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    return by_name, {t: name for name, t in by_name.items()}, view_as


def zarr_name(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise UnsupportedValueError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED)}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _torch_tables()[0][name]


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes equal the stored element bytes (bit pattern for bf16/fp8)."""
    return _NUMPY[name]


def is_known(name: object) -> bool:
    return isinstance(name, str) and name in _NUMPY


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor's raw element bits."""
    view_as = _torch_tables()[2]
    return t.view(view_as[t.dtype]).numpy() if t.dtype in view_as else t.numpy()


def fill_value(name: str) -> bool | float | int:
    if name == "bool":
        return False
    return 0.0 if name.startswith(("float", "bfloat")) else 0
