"""The zarr-python data types zarr lacks: ``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``.

Importing this module registers them with zarr-python (it imports zarr and ml_dtypes; neither
torch nor ``zarrckpt``). Two entry points point here (``pyproject.toml``):

- ``zarr.data_type`` (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``): the documented way to
  add a data type. zarr-python 3.1.x collects these entry points but never loads them
  (``data_type_registry._lazy_load`` is never called), so on its own it registers nothing yet.
- ``zarr.buffer`` (``zarrckpt_dtypes``): zarr-python loads every ``zarr.buffer`` entry point the
  first time it needs a buffer class, which is before it reads any metadata. Loading it imports
  this module, which registers the data types; the object it names is zarr's own CPU ``Buffer``
  class (registered again under its own name: no change to zarr's buffers).
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from . import TABLE

logger = logging.getLogger(__name__)

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_DTYPES: tuple[Any, ...] = ()
_SETUP_ERROR: Exception | None = None

try:
    import ml_dtypes

    # HasEndianness is what makes the ``bytes`` codec keep/honour ``endian``.
    from zarr.core.dtype.common import HasEndianness, HasItemSize
    from zarr.dtype import DataTypeValidationError, ZDType

    _ML_SCALARS = (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
    _NUMBERS = (int, float, np.integer, np.floating, *_ML_SCALARS)

    @dataclass(frozen=True, kw_only=True)
    class _MLFloat(ZDType[Any, Any], HasItemSize):
        """Shared logic; subclasses set ``_zarr_v3_name`` / ``dtype_cls`` / ``_scalar``."""

        _scalar: ClassVar[Any]

        @classmethod
        def from_native_dtype(cls, dtype: Any) -> Any:
            if cls._check_native_dtype(dtype):
                if issubclass(cls, HasEndianness):
                    big = dtype.byteorder == ">" or (dtype.byteorder in "=|" and sys.byteorder == "big")
                    return cls(endianness="big" if big else "little")
                return cls()
            raise DataTypeValidationError(f"{dtype!r} is not a {cls._zarr_v3_name} dtype")

        def to_native_dtype(self) -> Any:
            dtype = np.dtype(self._scalar)
            if isinstance(self, HasEndianness):
                dtype = dtype.newbyteorder("<" if self.endianness == "little" else ">")
            return dtype

        @classmethod
        def _check_json_v3(cls, data: object) -> bool:
            return data == cls._zarr_v3_name

        @classmethod
        def _from_json_v3(cls, data: Any) -> Any:
            if cls._check_json_v3(data):
                return cls()
            raise DataTypeValidationError(f"expected {cls._zarr_v3_name!r}, got {data!r}")

        @classmethod
        def _from_json_v2(cls, data: Any) -> Any:
            raise DataTypeValidationError(f"{cls._zarr_v3_name} is only supported in Zarr v3")

        def to_json(self, zarr_format: Literal[2, 3]) -> Any:
            if zarr_format == 3:
                return self._zarr_v3_name
            raise ValueError(f"{self._zarr_v3_name} is only supported in Zarr v3")

        @property
        def item_size(self) -> int:
            return int(np.dtype(self._scalar).itemsize)

        def _check_scalar(self, data: object) -> bool:
            if isinstance(data, str):
                return data in _SPECIAL or data.startswith("0x")
            return isinstance(data, _NUMBERS)

        def cast_scalar(self, data: object) -> Any:
            if not self._check_scalar(data):
                raise TypeError(f"cannot cast {data!r} to {self._zarr_v3_name}")
            if isinstance(data, str):
                if data.startswith("0x"):  # raw bit pattern as hex, like TensorStore
                    bits = int(data, 16)
                    if not 0 <= bits < 256**self.item_size:
                        msg = f"hex fill value {data!r} too wide for {self._zarr_v3_name}"
                        raise ValueError(msg)
                    uint = np.dtype(f"u{self.item_size}")
                    return np.asarray(bits, dtype=uint).view(self._scalar)[()]
                data = _SPECIAL[data]
            elif isinstance(data, int):  # avoid object arrays for huge Python ints
                data = float(data)
            return np.asarray(data).astype(self._scalar)[()]

        def default_scalar(self) -> Any:
            return self._scalar(0)

        def from_json_scalar(self, data: Any, *, zarr_format: Literal[2, 3]) -> Any:
            if isinstance(data, bool) or not self._check_scalar(data):
                raise TypeError(f"invalid {self._zarr_v3_name} fill value {data!r}")
            return self.cast_scalar(data)

        def to_json_scalar(self, data: object, *, zarr_format: Literal[2, 3]) -> Any:
            value = self.cast_scalar(data)
            as_float = float(value)
            if math.isnan(as_float):
                if value.tobytes() == self._scalar(math.nan).tobytes():
                    return "NaN"
                # Non-canonical NaN: keep the exact bit pattern (Zarr v3 hex form).
                bits = int(np.asarray(value).view(f"u{self.item_size}"))
                return f"0x{bits:0{2 * self.item_size}x}"
            if math.isinf(as_float):
                return "Infinity" if as_float > 0 else "-Infinity"
            return as_float

    @dataclass(frozen=True, kw_only=True)
    class BFloat16(_MLFloat, HasEndianness):
        _zarr_v3_name: ClassVar[str] = "bfloat16"
        _scalar: ClassVar[Any] = ml_dtypes.bfloat16
        dtype_cls: ClassVar[Any] = type(np.dtype(ml_dtypes.bfloat16))

    @dataclass(frozen=True, kw_only=True)
    class Float8E4M3FN(_MLFloat):
        _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
        _scalar: ClassVar[Any] = ml_dtypes.float8_e4m3fn
        dtype_cls: ClassVar[Any] = type(np.dtype(ml_dtypes.float8_e4m3fn))

    @dataclass(frozen=True, kw_only=True)
    class Float8E5M2(_MLFloat):
        _zarr_v3_name: ClassVar[str] = "float8_e5m2"
        _scalar: ClassVar[Any] = ml_dtypes.float8_e5m2
        dtype_cls: ClassVar[Any] = type(np.dtype(ml_dtypes.float8_e5m2))

    _DTYPES = (BFloat16, Float8E4M3FN, Float8E5M2)
    assert {c._zarr_v3_name for c in _DTYPES} == {d.name for d in TABLE if not d.in_zarr_python}
except Exception as exc:  # zarr/ml_dtypes too old or too new
    _SETUP_ERROR = exc
    logger.debug("zarr custom dtypes unavailable: %r", exc)

try:  # what the ``zarr.buffer`` entry point names (see the module docstring)
    from zarr.core.buffer.cpu import Buffer as ZarrBuffer
except Exception:  # zarr moved it: name a class that no zarr configuration selects

    class ZarrBuffer:  # type: ignore[no-redef]
        """Placeholder for the ``zarr.buffer`` entry point; never used as a buffer."""


def register_zarr_dtypes() -> None:
    """Register bfloat16/float8 with zarr-python's data type registry.

    Idempotent; names that are already registered (by an earlier call or by zarr
    itself) are left untouched. Never raises: failures are logged at debug level.
    """
    if _SETUP_ERROR is not None:
        logger.debug("zarr custom dtypes not registered: %r", _SETUP_ERROR)
        return
    try:
        from zarr.dtype import data_type_registry

        for cls in _DTYPES:
            try:
                data_type_registry.get(cls._zarr_v3_name)
            except KeyError:
                data_type_registry.register(cls._zarr_v3_name, cls)
    except Exception as exc:  # registry API changed
        logger.debug("zarr custom dtypes not registered: %r", exc)


register_zarr_dtypes()
