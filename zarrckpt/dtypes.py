"""Torch dtypes <-> Zarr v3 data type names <-> the numpy dtype used to move the raw bytes."""

from __future__ import annotations

import numpy as np
import torch

from .errors import UnsupportedValueError

# name in zarr.json (TensorStore's zarr3 names) -> (torch dtype, numpy dtype holding the same bits)
_TABLE: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.dtype("u1")),
    "float8_e5m2": (torch.float8_e5m2, np.dtype("u1")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_BY_TORCH = {t: name for name, (t, _) in _TABLE.items()}
_VIEW_AS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}

SUPPORTED = tuple(_TABLE)


def zarr_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedValueError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED)}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _TABLE[name][0]


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes equal the stored element bytes (bit pattern for bf16/fp8)."""
    return _TABLE[name][1]


def is_known(name: object) -> bool:
    return isinstance(name, str) and name in _TABLE


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor's raw element bits."""
    return t.view(_VIEW_AS[t.dtype]).numpy() if t.dtype in _VIEW_AS else t.numpy()


def fill_value(name: str) -> bool | float | int:
    if name == "bool":
        return False
    return 0.0 if name.startswith(("float", "bfloat")) else 0
