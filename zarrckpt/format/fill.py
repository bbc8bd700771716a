"""Constant arrays: finding them, and their exact ``fill_value`` (pure: no torch, no I/O; numpy only to scan data).

An array whose every element has the same bits is stored as metadata only (FORMAT.md §2): no
shard objects, and a ``fill_value`` that every Zarr reader turns into exactly those bits, since
they return it for the missing chunks. Constancy is checked per local part and only for parts
of at most :data:`CHECK_BYTES` (it needs the data); a 0-d tensor (an Adam ``step``) is one
element, so it always is constant.

Spelling (measured with zarr-python 3.1 and TensorStore 0.1.86, both read every one bit for
bit): integers as JSON integers, ``bool`` as ``true`` / ``false``; ``float16`` / ``float32`` /
``float64`` as the JSON number (exact: each value is a float64, printed to round-trip), ``"NaN"``,
``"Infinity"``, ``"-Infinity"``, and ``-0.0`` as hex (``"0x80000000"``, the bit pattern as an
unsigned integer); ``bfloat16`` and the float8 types always as hex; complex types as
``[real, imaginary]``, each part spelled as its float type. A NaN other than the type's
canonical quiet NaN (``0x7fc00000`` for float32) is not stored as a constant: zarr-python 3.1
reads other float16 NaNs, and signalling float32 NaNs, as another NaN.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

from zarrckpt_dtypes import BY_NAME, value_dtype

if TYPE_CHECKING:
    import numpy as np

CHECK_BYTES = 64 * 1024  # a local part is checked for constancy only up to this size
_HALF = {"complex64": "float32", "complex128": "float64"}  # the float type of each part
# the core float types through struct, so that reading a manifest (`zarrckpt ls`) needs no numpy;
# bfloat16 and the float8 types through numpy and ml_dtypes
_CORE_FLOATS = {"float16": "<e", "float32": "<f", "float64": "<d"}


def constant_of(bits: np.ndarray, name: str) -> bytes | None:
    """The element bytes (little-endian) when every element of ``bits`` (a local part, as its
    stored bits) has the same bytes, the part is at most CHECK_BYTES, and a fill value can carry
    them exactly; else None."""
    if bits.size == 0 or bits.nbytes > CHECK_BYTES:
        return None
    if bits.size > 1:  # most parts differ in their first two elements: no copy of the rest
        two = bits.reshape(-1)[:2]
        if two[:1].tobytes() != two[1:].tobytes():
            return None
    raw = bits.tobytes()  # C order; at most CHECK_BYTES
    item = bits.itemsize
    first = raw[:item]
    if raw[item : 2 * item] not in (first, b"") or raw != first * bits.size:  # (most parts differ at once)
        return None
    return first if storable(name, first) else None


def storable(name: str, bits: bytes) -> bool:
    """Whether ``fill_value`` carries the element ``bits`` exactly to every reader (not a NaN
    other than the canonical one)."""
    kind = BY_NAME[name].kind
    if kind == "complex":
        half = len(bits) // 2
        return storable(_HALF[name], bits[:half]) and storable(_HALF[name], bits[half:])
    if kind != "float":
        return True
    if name in _CORE_FLOATS:
        return not math.isnan(struct.unpack(_CORE_FLOATS[name], bits)[0]) or bits == _canonical_nan(name)
    import numpy as np

    return not np.isnan(np.frombuffer(bits, dtype=value_dtype(name))[0]) or bits == _canonical_nan(name)


def to_json(name: str, bits: bytes) -> bool | int | float | str | list[float | str]:
    """The ``fill_value`` of a constant array of data type ``name`` whose elements are ``bits``."""
    row = BY_NAME[name]
    if row.kind == "bool":
        return bits != b"\x00"
    if row.kind == "int":
        return int.from_bytes(bits, "little", signed=row.bits[1] == "i")
    if row.kind == "complex":
        half = len(bits) // 2
        return [_float_json(_HALF[name], bits[:half]), _float_json(_HALF[name], bits[half:])]
    return _float_json(name, bits)


def from_json(name: str, value: object) -> bytes | None:
    """The element bytes a ``fill_value`` means for data type ``name``; None when it means none."""
    row = BY_NAME[name]
    size = row.itemsize
    if row.kind == "bool":
        return (b"\x01" if value else b"\x00") if isinstance(value, bool) else None
    if row.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        try:
            return value.to_bytes(size, "little", signed=row.bits[1] == "i")
        except OverflowError:
            return None
    if row.kind == "complex":
        if not isinstance(value, list) or len(value) != 2:
            return None
        parts = [from_json(_HALF[name], v) for v in value]
        return None if None in parts else b"".join(p for p in parts if p is not None)
    return _float_bits(name, value, size)


def _float_json(name: str, bits: bytes) -> float | str:
    hexadecimal = f"0x{int.from_bytes(bits, 'little'):0{2 * len(bits)}x}"
    if name not in _CORE_FLOATS:
        return hexadecimal
    value: float = struct.unpack(_CORE_FLOATS[name], bits)[0]
    if value == 0 and math.copysign(1.0, value) < 0:
        return hexadecimal
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _float_bits(name: str, value: object, size: int) -> bytes | None:
    if isinstance(value, str) and value.startswith("0x"):
        try:
            pattern = int(value, 16)
        except ValueError:
            return None
        return pattern.to_bytes(size, "little") if 0 <= pattern < 256**size else None
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    if isinstance(value, str) and value in special:
        number = special[value]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float64 is no value of a float type
            return None
    else:
        return None
    return _to_bits(name, number)


def _to_bits(name: str, number: float) -> bytes:
    """``number`` (a float64) rounded to the float type ``name``, as numpy's ``astype`` rounds
    (to nearest, ties to even; beyond the largest finite value to infinity)."""
    if name in _CORE_FLOATS:
        try:
            return struct.pack(_CORE_FLOATS[name], number)
        except OverflowError:
            return struct.pack(_CORE_FLOATS[name], math.copysign(math.inf, number))
    import numpy as np

    with np.errstate(over="ignore"):
        return np.array(number, dtype=np.float64).astype(value_dtype(name)).tobytes()


def _canonical_nan(name: str) -> bytes:
    return _to_bits(name, math.nan)
