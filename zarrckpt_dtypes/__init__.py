"""The one table of zarrckpt's data types (no torch, zarr, ml_dtypes or even numpy at import).

This tiny top-level package imports neither torch nor the ``zarrckpt`` package. Its
:mod:`zarrckpt_dtypes.zarr_types` module adds the data types zarr-python lacks (``bfloat16``,
``float8_e4m3fn``, ``float8_e5m2``, backed by :mod:`ml_dtypes`), and zarr-python loads it
through entry points (``pyproject.toml``) in a process that never imports ``zarrckpt``: see
that module for how.

Everything else in zarrckpt derives its dtype knowledge from :data:`TABLE`
(``zarrckpt.dtypes`` adds the torch side, ``zarrckpt.export`` the safetensors names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class DataType:
    """One stored data type."""

    name: str  # Zarr v3 ``data_type``
    torch: str  # the ``torch`` attribute: torch.<torch>
    numpy: str  # numpy dtype of the values; ml_dtypes' for bfloat16 / float8
    bits: str  # numpy dtype whose bytes are the stored element bytes (what zarrckpt moves)
    kind: Literal["bool", "int", "float", "complex"]
    safetensors: str | None  # safetensors dtype name (None: safetensors has none)
    defined_by: Literal["core", "zarr-extensions", "none"]  # where the Zarr name is specified
    in_zarr_python: bool  # zarr-python (3.1) knows the name without this package

    @property
    def itemsize(self) -> int:
        return int(self.bits[2:])  # "<u2", "|b1", "<c16": the byte count follows the kind


# Every data type zarrckpt stores. Names: the Zarr v3 core spec's, else the zarr-extensions
# registry's (https://github.com/zarr-developers/zarr-extensions/tree/main/data-types), else
# TensorStore's. ``float8_e4m3fn`` is not registered in zarr-extensions: its ``float8_e4m3`` is
# a different encoding (IEEE-like, with infinities), so it is not an alias.
TABLE: tuple[DataType, ...] = (
    DataType("bool", "bool", "|b1", "|b1", "bool", "BOOL", "core", True),
    DataType("int8", "int8", "|i1", "|i1", "int", "I8", "core", True),
    DataType("int16", "int16", "<i2", "<i2", "int", "I16", "core", True),
    DataType("int32", "int32", "<i4", "<i4", "int", "I32", "core", True),
    DataType("int64", "int64", "<i8", "<i8", "int", "I64", "core", True),
    DataType("uint8", "uint8", "|u1", "|u1", "int", "U8", "core", True),
    DataType("uint16", "uint16", "<u2", "<u2", "int", "U16", "core", True),
    DataType("uint32", "uint32", "<u4", "<u4", "int", "U32", "core", True),
    DataType("uint64", "uint64", "<u8", "<u8", "int", "U64", "core", True),
    DataType("float16", "float16", "<f2", "<f2", "float", "F16", "core", True),
    DataType("float32", "float32", "<f4", "<f4", "float", "F32", "core", True),
    DataType("float64", "float64", "<f8", "<f8", "float", "F64", "core", True),
    DataType("complex64", "complex64", "<c8", "<c8", "complex", "C64", "core", True),
    DataType("complex128", "complex128", "<c16", "<c16", "complex", None, "core", True),
    DataType("bfloat16", "bfloat16", "bfloat16", "<u2", "float", "BF16", "zarr-extensions", False),
    DataType("float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn", "|u1", "float", "F8_E4M3", "none", False),
    DataType("float8_e5m2", "float8_e5m2", "float8_e5m2", "|u1", "float", "F8_E5M2", "zarr-extensions", False),
)
BY_NAME: dict[str, DataType] = {d.name: d for d in TABLE}


def value_dtype(name: str) -> np.dtype:
    """The numpy dtype of the values (ml_dtypes' bfloat16 / float8 types for those names)."""
    import numpy as np  # here, not at import: reading a manifest (`zarrckpt ls`) needs no numpy

    row = BY_NAME[name]
    if row.in_zarr_python:
        return np.dtype(row.numpy)
    import ml_dtypes

    scalar: type[np.generic] = getattr(ml_dtypes, row.numpy)
    return np.dtype(scalar)


def fill_value(name: str) -> bool | int | float | list[float]:
    """The ``fill_value`` zarrckpt writes: zero (``false``, ``0``, ``0.0``, ``[0.0, 0.0]``)."""
    kind = BY_NAME[name].kind
    return {"bool": False, "int": 0, "float": 0.0}.get(kind, [0.0, 0.0])
