"""Non-tensor values as typed JSON, restored to the same Python type (pure: no I/O).

Plain JSON (``None``, bools, ints within int64, finite floats, strings, lists, string-keyed
dicts) is stored as it is. The other values training code keeps are stored as a one-key object
``{"__zarrckpt__": [TYPE, PAYLOAD]}``: tuples, sets, frozensets, bytes, bytearrays, ``io.BytesIO``,
non-finite floats, ints beyond int64, numpy arrays and scalars (``np.random.get_state()``),
``torch.dtype``, ``torch.Size``, ``datetime`` / ``date`` / ``timedelta``, dicts with non-string
or reserved keys. Anything else is refused (UnsupportedValueError), unless ``allow_pickle``: then
it is stored as ``["pickle", base64]`` and loading it needs ``allow_pickle`` too. docs/FORMAT.md
lists every type.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import math
from collections.abc import Mapping
from typing import Any

from zarrckpt.errors import InvalidCheckpointError, UnsupportedValueError
from zarrckpt.format import pickling

TAG = "__zarrckpt__"
_INT64 = 2**63
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _numpy(dtype: str, data: str) -> Any:
    import numpy as np  # only a stored numpy value needs numpy: `zarrckpt info` does not otherwise

    return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype))


def _torch_dtype(name: str) -> Any:
    import torch  # only a stored torch.dtype / torch.Size needs torch: `zarrckpt info` does not otherwise

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") != name:  # no aliases ("float")
        raise KeyError(name)
    return dtype


def _torch_size(dims: Any) -> Any:
    import torch

    return torch.Size(int(n) for n in dims)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def encode(value: Any, key: str, allow_pickle: bool = False) -> Any:
    """``value`` as typed JSON, or UnsupportedValueError naming ``key``, the type and the opt-in."""
    import numpy as np  # saving has imported both anyway; kept off the import path of reading
    import torch

    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and not isinstance(v, bool):
            return v if -_INT64 <= v < _INT64 else {TAG: ["int", str(v)]}
        if isinstance(v, float):
            return v if math.isfinite(v) else {TAG: ["float", repr(v)]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, Mapping):
            if all(isinstance(k, str) for k in v) and TAG not in v:
                return {k: enc(x) for k, x in v.items()}
            return {TAG: ["dict", [[enc(k), enc(x)] for k, x in v.items()]]}
        if isinstance(v, torch.Size):
            return {TAG: ["torch.Size", list(v)]}
        if isinstance(v, tuple):
            return {TAG: ["tuple", [enc(x) for x in v]]}
        if isinstance(v, (set, frozenset)):
            kind = "set" if isinstance(v, set) else "frozenset"
            return {TAG: [kind, sorted((enc(x) for x in v), key=repr)]}
        if isinstance(v, (bytes, bytearray)):
            return {TAG: [type(v).__name__, _b64(bytes(v))]}
        if isinstance(v, io.BytesIO):
            return {TAG: ["BytesIO", _b64(v.getvalue())]}
        if isinstance(v, np.ndarray) and v.dtype.kind in "biufc" and not v.dtype.hasobject:
            data = np.ascontiguousarray(v)
            return {TAG: ["ndarray", [data.dtype.str, list(data.shape), _b64(data.tobytes())]]}
        if isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return {TAG: ["numpy", [v.dtype.str, _b64(v.tobytes())]]}
        if isinstance(v, torch.dtype):
            return {TAG: ["torch.dtype", str(v).removeprefix("torch.")]}
        if isinstance(v, dt.datetime):
            return {TAG: ["datetime", v.isoformat()]}
        if isinstance(v, dt.date):
            return {TAG: ["date", v.isoformat()]}
        if isinstance(v, dt.timedelta):
            return {TAG: ["timedelta", [v.days, v.seconds, v.microseconds]]}
        if allow_pickle:
            return {TAG: ["pickle", pickling.dumps(v)]}
        raise UnsupportedValueError(
            f"{key!r}: a {type(v).__module__}.{type(v).__qualname__} cannot be stored without pickle. Store "
            "tensors, numpy arrays, bytes, or JSON-like values (also tuples, sets, BytesIO, numpy and datetime "
            "values, torch dtypes); or pass allow_pickle=True to store it pickled (loading it then needs "
            "allow_pickle=True too, and runs code from the checkpoint)"
        )

    return enc(value)


def decode(doc: Any, like: Any = None, *, key: str = "", allow_pickle: bool = False) -> Any:
    """A stored value back as its Python type. ``like`` (the value it replaces) gives a plain list
    saved by an older zarrckpt its tuple-ness back."""

    def bad(why: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"value {key!r} in the checkpoint is invalid: {why}")

    def dec(d: Any, like: Any = None) -> Any:
        if isinstance(d, list):
            items = [
                dec(x, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None) for i, x in enumerate(d)
            ]
            return tuple(items) if isinstance(like, tuple) else items
        if not isinstance(d, dict):
            return d
        if TAG not in d:
            return {k: dec(x, like.get(k) if isinstance(like, Mapping) else None) for k, x in d.items()}
        tagged = d[TAG]
        if len(d) != 1 or not isinstance(tagged, list) or len(tagged) != 2 or not isinstance(tagged[0], str):
            raise bad(f"malformed typed value {str(d)[:80]}")
        kind, payload = tagged
        try:
            return _typed(kind, payload, dec)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
            raise bad(f"cannot decode a {kind!r}: {e}") from None

    def _typed(kind: str, p: Any, dec: Any) -> Any:
        if kind == "pickle":
            return pickling.loads(p, key, allow_pickle)
        simple: dict[str, Any] = {
            "int": lambda: int(p),
            "float": lambda: _FLOATS[p],
            "tuple": lambda: tuple(dec(x) for x in p),
            "set": lambda: {dec(x) for x in p},
            "frozenset": lambda: frozenset(dec(x) for x in p),
            "dict": lambda: {dec(k): dec(x) for k, x in p},
            "bytes": lambda: base64.b64decode(p),
            "bytearray": lambda: bytearray(base64.b64decode(p)),
            "BytesIO": lambda: io.BytesIO(base64.b64decode(p)),
            "ndarray": lambda: _numpy(p[0], p[2]).reshape(p[1]).copy(),
            "numpy": lambda: _numpy(p[0], p[1])[0],
            "torch.dtype": lambda: _torch_dtype(p),
            "torch.Size": lambda: _torch_size(p),
            "datetime": lambda: dt.datetime.fromisoformat(p),
            "date": lambda: dt.date.fromisoformat(p),
            "timedelta": lambda: dt.timedelta(days=p[0], seconds=p[1], microseconds=p[2]),
        }
        if kind not in simple:
            raise ValueError(f"unknown value type {kind!r} (written by a newer zarrckpt?)")
        return simple[kind]()

    return dec(doc, like)


def describe(doc: Any) -> Any:
    """A stored value for display (CLI, ``Checkpoint.metadata``): decoded, except pickles, shown as a placeholder."""
    try:
        return decode(doc)
    except UnsupportedValueError:
        return "<pickled value; load with allow_pickle=True>"
