"""What the ``zarrckpt`` commands share: parsing storage options, ``key[slice]`` targets and
durations; the CLI's error type; JSON output."""

from __future__ import annotations

import json
import math
import re
from typing import Any

_INT = re.compile(r"^[+-]?\d+$")


class CliError(Exception):
    """A user error the CLI reports as ``error: ...`` with exit code 3."""


def emit_json(obj: Any, indent: int | None = 2) -> None:
    print(json.dumps(obj, indent=indent, default=str))


def parse_storage_options(items: list[str]) -> dict[str, Any] | None:
    opts: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise CliError(f"--storage-option expects key=value, got {item!r}")
        try:
            opts[name] = json.loads(raw)
        except ValueError:
            opts[name] = raw
    return opts or None


def parse_target(text: str) -> tuple[str, str | None, Any]:
    """``'key[5, :4, ::-1, ...]'`` -> (key, bracket text or None, index) without eval."""
    at = text.find("[")
    if at < 0:
        return text.strip(), None, Ellipsis
    key, inner = text[:at].strip(), text[at:]
    if not inner.endswith("]") or inner.count("[") != 1 or inner.count("]") != 1:
        raise CliError(f"bad slice {inner!r}: expected one [...] at the end of the key")
    body = inner[1:-1].strip()
    if not body:
        return key, inner, ()
    items: list[Any] = []
    for part in (p.strip() for p in body.split(",")):
        if part == "...":
            items.append(Ellipsis)
        elif ":" in part:
            fields = [f.strip() for f in part.split(":")]
            if len(fields) > 3 or any(f and not _INT.match(f) for f in fields):
                raise CliError(f"bad slice {inner!r}: cannot parse {part!r} (use start:stop:step of ints)")
            nums = [int(f) if f else None for f in fields]
            if len(nums) == 3 and nums[2] == 0:
                raise CliError(f"bad slice {inner!r}: slice step cannot be zero")
            items.append(slice(*nums))
        elif _INT.match(part):
            items.append(int(part))
        else:
            raise CliError(f"bad slice {inner!r}: cannot parse {part!r} (use ints, start:stop:step and ...)")
    return key, inner, tuple(items)


def parse_duration(text: str) -> float:
    """``'3600'``, ``'90s'``, ``'30m'``, ``'1h'``, ``'2d'`` -> seconds."""
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(text[-1:].lower(), 0)
    number = text[:-1] if scale else text
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise CliError(f"bad duration {text!r}: use seconds or a number with s, m, h or d (e.g. 30m)") from None
    if not math.isfinite(value) or value < 0:
        raise CliError(f"bad duration {text!r}: it must be a non-negative number")
    return value
