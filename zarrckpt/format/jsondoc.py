"""Reading untrusted JSON metadata documents: typed field access, bounded reprs in messages,
Zarr v3's rule for unknown fields, comparison of metadata by meaning, and the leading members of
a document from a prefix of it (no I/O)."""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable
from typing import Any

from zarrckpt.errors import InvalidCheckpointError
from zarrckpt.format.layout import Shape

Bad = Callable[[str], InvalidCheckpointError]  # makes the error for what is wrong, naming the document
MAX_RANK = 64  # numpy's limit


_REQUIRED: Any = object()
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def short(value: Any) -> str:
    """A bounded ``repr`` of an untrusted value, for error messages."""
    return _REPR.repr(value)


def get_field(doc: Any, path: str, kind: type, bad: Bad, default: Any = _REQUIRED, at: str = "") -> Any:
    """``doc[a][b]...`` for ``path`` ``"a.b..."``, checked to be a ``kind`` (a bool is no int)."""
    node = doc
    for part in path.split("."):  # the common case first: every level there, the value of exactly that type
        if type(node) is not dict or part not in node:
            return _get_field(doc, path, kind, bad, default, at)
        node = node[part]
    return node if type(node) is kind else _get_field(doc, path, kind, bad, default, at)


def _get_field(doc: Any, path: str, kind: type, bad: Bad, default: Any, at: str) -> Any:
    node, name, parts = doc, at + path, path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict):
            parent = (at + ".".join(parts[:i])).rstrip(".")
            raise bad(f"{repr(parent) if parent else 'the document'} must be a JSON object, not {short(node)}")
        if part not in node:
            if default is _REQUIRED:
                raise bad(f"field {name!r} is missing")
            return default
        node = node[part]
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is not bool):
        raise bad(f"field {name!r} must be {_TYPE_NAMES[kind]}, not {short(node)}")
    return node


def shape_field(doc: Any, path: str, bad: Bad, at: str = "") -> Shape:
    value = get_field(doc, path, list, bad, at=at)
    if len(value) > MAX_RANK or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise bad(f"field {at + path!r} must be at most {MAX_RANK} non-negative integers, not {short(value)}")
    return tuple(value)


def check_extensions(doc: Any, known: frozenset[str], bad: Bad) -> None:
    """Zarr v3: an unknown top-level field may be ignored only when it says ``"must_understand": false``."""
    if not isinstance(doc, dict):
        return
    for name in sorted(doc.keys() - known):
        value = doc[name]
        if not (isinstance(value, dict) and value.get("must_understand") is False):
            raise bad(f'unknown field {short(name)} without "must_understand": false (a Zarr extension it needs)')


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text}")
    return value


def no_constant(text: str) -> Any:
    raise ValueError(f"non-finite number {text}")


def meaning(field: str, value: Any, itemsize: int) -> Any:
    """What a metadata field means, so that equal meanings compare equal however they are spelled:
    defaults left out, ``endian`` of 1-byte types (zarr-python drops it), key order (dicts)."""
    if field == "codecs":
        return [_codec_meaning(c, itemsize) for c in value] if isinstance(value, list) else value
    if field == "chunk_key_encoding" and isinstance(value, dict) and value.get("name") == "default":
        conf = value.get("configuration", {})
        return (
            {**value, "configuration": {"separator": conf.get("separator", "/")}} if isinstance(conf, dict) else value
        )
    if field == "fill_value":
        return _fill_meaning(value)
    return value


def _codec_meaning(codec: Any, itemsize: int) -> Any:
    if not isinstance(codec, dict) or not isinstance(codec.get("configuration", {}), dict):
        return codec
    name, conf = codec.get("name"), dict(codec.get("configuration", {}))
    if name == "bytes" and itemsize == 1:
        conf["endian"] = "little"  # the byte order of 1-byte elements means nothing
    elif name == "sharding_indexed":
        for inner, size in (("codecs", itemsize), ("index_codecs", 8)):  # the index holds uint64
            if isinstance(conf.get(inner), list):
                conf[inner] = [_codec_meaning(c, size) for c in conf[inner]]
        conf.setdefault("index_location", "end")  # the spec's default
    return {**codec, "configuration": conf}


def _fill_meaning(value: Any) -> Any:
    """A fill value as a comparable number: 0, 0.0, false and a hex zero (``"0x0000"``) are the same."""
    if isinstance(value, list):
        return [_fill_meaning(v) for v in value]
    if isinstance(value, str) and value.startswith("0x"):
        try:
            return int(value, 16)
        except ValueError:
            return value
    if isinstance(value, (bool, int, float)) and value == 0 and str(value) != "-0.0":
        return 0
    return value


_SCALARS = frozenset({str, int, bool, type(None)})  # (their own hashable stand-ins, with their type)


def frozen(value: Any, sort_keys: bool = False) -> Any:
    """A hashable stand-in for a JSON value, equal only for values a JSON encoder spells alike
    (``sort_keys``: with its objects' keys sorted): types kept (``1``, ``1.0`` and ``true``
    differ), floats by their repr (``0.0`` and ``-0.0`` differ), a tuple as a list; a value of
    any other type as its JSON text. For caches keyed by documents, without encoding them."""
    kind = type(value)
    if kind in _SCALARS:
        return kind, value
    if kind is float:
        return kind, repr(value)
    if kind is dict:
        items = tuple(
            (type(k), k, (type(v), v) if type(v) in _SCALARS else frozen(v, sort_keys)) for k, v in value.items()
        )
        return kind, tuple(sorted(items, key=lambda item: item[1])) if sort_keys else items
    if kind is list or kind is tuple:
        return list, tuple(frozen(v, sort_keys) for v in value)  # (both a JSON array)
    return "json", json.dumps(value, allow_nan=False, sort_keys=sort_keys, separators=(",", ":"))


class Unsettled(Exception):
    """A prefix of a document does not settle what was asked of it (cut short, laid out otherwise, or not JSON)."""


def leading_members(raw: bytes, into: tuple[str, ...], stop: frozenset[str]) -> dict[str, Any]:
    """The members of the JSON object whose first bytes are ``raw``, decoded one by one in document
    order, descending into the member named ``into[0]`` (then ``into[1]`` inside it...), up to the
    first member named in ``stop`` at any of those levels or the end of the object.

    Raises Unsettled when the prefix ends before that point or is not JSON up to it.
    """
    for cut in range(4):  # less a UTF-8 sequence the prefix cut in two
        try:
            text = raw[: len(raw) - cut].decode()
            break
        except UnicodeDecodeError:
            continue
    else:
        raise Unsettled
    return _members(text, 0, into, stop)[0]


_DECODER = json.JSONDecoder(parse_float=finite_float, parse_constant=no_constant)
_SPACE = " \t\n\r"


def _members(text: str, at: int, into: tuple[str, ...], stop: frozenset[str]) -> tuple[dict[str, Any], int, bool]:
    """The object at ``at`` as :func:`leading_members` reads it; also where it stopped, and whether at a ``stop``."""
    at = _skip(text, at)
    if text[at : at + 1] != "{":
        raise Unsettled
    out: dict[str, Any] = {}
    at = _skip(text, at + 1)
    if text[at : at + 1] == "}":
        return out, at + 1, False
    while True:
        try:
            key, at = _DECODER.raw_decode(text, at)
        except ValueError:
            raise Unsettled from None
        at = _skip(text, at)
        if not isinstance(key, str) or text[at : at + 1] != ":":
            raise Unsettled
        if key in stop:
            return out, at, True
        if into and key == into[0]:
            out[key], at, stopped = _members(text, at + 1, into[1:], stop)
            if stopped:
                return out, at, True
        else:
            try:
                out[key], at = _DECODER.raw_decode(text, _skip(text, at + 1))
            except (ValueError, RecursionError):  # cut by the prefix's end, or not JSON
                raise Unsettled from None
        at = _skip(text, at)
        if text[at : at + 1] == "}":
            return out, at + 1, False
        if text[at : at + 1] != ",":
            raise Unsettled
        at = _skip(text, at + 1)


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at
