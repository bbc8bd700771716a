"""Read safetensors files (one, a directory of them, or an ``*.safetensors.index.json``) as
memory-mapped tensors, checking every header against the file: no copy of the data, no pickle."""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from zarrckpt.convert.export import SAFETENSORS_DTYPES
from zarrckpt.errors import UnsupportedValueError, ZarrckptError
from zarrckpt.format import dtypes

__all__ = ["MAX_HEADER", "read_safetensors"]

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

_ST_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, a directory of them, or an index json, memory-mapped.

    The tensors are read-only views of the files (copy-on-write): nothing is read until used.
    """
    p = Path(os.fspath(path))
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise ZarrckptError(f"{str(p)!r} holds several index files ({[i.name for i in indexes]}); pass one of them")
        files = _index_files(indexes[0]) if indexes else sorted(p.glob("*.safetensors"))
        if not files:
            raise ZarrckptError(f"no *.safetensors files in {str(p)!r}")
    elif p.name.endswith(".json"):
        files = _index_files(p)
    else:
        files = [p]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _read_safetensors_file(f).items():
            if name in out:
                raise ZarrckptError(f"tensor {name!r} appears in more than one file (again in {str(f)!r})")
            out[name] = t
    return out


def _index_files(index: Path) -> list[Path]:
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise ZarrckptError(
            f"{str(index)!r} is not a safetensors index (a 'weight_map' of name -> file): {e}"
        ) from None
    files = []
    for name in sorted(set(weight_map.values())):
        f = index.parent / name
        if Path(name).name != name or not f.is_file():
            raise ZarrckptError(f"{str(index)!r} names the file {name!r}, which is not in {str(index.parent)!r}")
        files.append(f)
    return files


def _read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    def bad(why: str) -> ZarrckptError:
        return ZarrckptError(f"{str(path)!r} is not a valid safetensors file: {why}")

    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n + 8 > size:
            raise bad(f"header length {n} is beyond the file size ({size} bytes) or the {MAX_HEADER}-byte limit")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    base, data_size = 8 + n, size - 8 - n
    spans = []
    out: dict[str, torch.Tensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="c", offset=base, shape=(data_size,)) if data_size else None
    for name, entry in header.items():
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except KeyError as e:
            if isinstance(entry, dict) and entry.get("dtype") not in _ST_DTYPES:
                raise UnsupportedValueError(
                    f"{str(path)!r}: tensor {name!r} has dtype {entry.get('dtype')!r}, which zarrckpt cannot store; "
                    f"supported: {', '.join(_ST_DTYPES)}"
                ) from None
            raise bad(f"entry {name!r} lacks {e}") from None
        except (TypeError, ValueError):
            raise bad(f"entry {name!r} is malformed: {entry!r}") from None
        if any(s < 0 for s in shape) or not 0 <= begin <= end <= data_size:
            raise bad(f"tensor {name!r}: shape {shape} or data_offsets {[begin, end]} out of range")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise bad(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {entry['dtype']}")
        spans.append((begin, end, name))
        raw = mm[begin:end] if mm is not None else np.empty(0, np.uint8)
        np_dtype = dtypes.storage_dtype(dtypes.zarr_name(dtype))
        if raw.ctypes.data % np_dtype.itemsize:
            raw = raw.copy()  # an unaligned tensor: copy it rather than hand torch a misaligned view
        arr = raw.view(np_dtype).reshape(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.from_numpy on a memmap warns about its subclass
            t = torch.from_numpy(arr)
        out[name] = t.view(dtype) if t.dtype != dtype else t
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise bad(f"tensor {name!r} starts at {begin}, expected {at} (data must be contiguous, no overlaps)")
        at = end
    if at != data_size:
        raise bad(f"data ends at {at} but the file holds {data_size} data bytes")
    return out
