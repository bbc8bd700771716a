"""Human-facing views of a checkpoint: HTML tables for notebooks, byte counts, metadata text with
long lists cut short, and the progress line of verify and export.

Everything shown comes from the manifest (untrusted text): every string is HTML-escaped.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable
from html import escape
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from zarrckpt.errors import ZarrckptError

if TYPE_CHECKING:  # (the command line imports this module: numpy only when a table is drawn)
    from zarrckpt.format.array import ArrayMeta
    from zarrckpt.format.manifest import Manifest
    from zarrckpt.storage.store import Storage

MAX_ROWS = 50  # tensors listed in a checkpoint's HTML table
MAX_METADATA_CHARS = 4000
_CSS = (
    "<style>.zarrckpt table{border-collapse:collapse;font-size:12px}"
    ".zarrckpt td,.zarrckpt th{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}</style>"
)


def human(n: float) -> str:
    """A byte count for people: ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pretty(value: Any, *, max_items: int = 10, indent: str = "") -> str:
    """A metadata tree as JSON-like text for people: one key a line, lists of plain values on one
    line, and every list longer than ``max_items`` cut short with a count:
    ``[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (+590 more)]``."""
    pad = indent + "  "
    if isinstance(value, dict):
        if not value:
            return "{}"
        lines = [f"{pad}{json.dumps(str(k))}: {pretty(v, max_items=max_items, indent=pad)}" for k, v in value.items()]
        return "{\n" + ",\n".join(lines) + "\n" + indent + "}"
    if isinstance(value, (list, tuple)):
        head = list(value[:max_items])
        shown = [pretty(v, max_items=max_items, indent=pad) for v in head]
        if len(value) > len(head):
            shown.append(f"... (+{len(value) - len(head)} more)")
        if not any(isinstance(v, (dict, list, tuple)) and v for v in head):
            return "[" + ", ".join(shown) + "]"
        return "[\n" + ",\n".join(pad + s for s in shown) + "\n" + indent + "]"
    return json.dumps(value, default=str)


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _table(rows: list[list[str]], header: list[str] | None = None) -> str:
    """An HTML table; cells are already-escaped HTML."""
    head = "<thead><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr></thead>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _box(title: str, inner: str) -> str:
    return f'<div class="zarrckpt">{_CSS}<b>{title}</b>{inner}</div>'


def headline(values: dict[str, Any]) -> str:
    """The step (any value whose key ends in ``step``), else the first few metadata keys."""
    steps = [f"{k} = {v}" for k, v in sorted(values.items()) if k.split(".")[-1] == "step" and not isinstance(v, dict)]
    if steps:
        return ", ".join(steps[:3])[:200]
    keys = sorted(values)
    return ", ".join(keys[:5]) + (f", … ({len(keys)} values)" if len(keys) > 5 else "") if keys else "none"


def checkpoint_html(url: str, m: Manifest, metadata: dict[str, Any]) -> str:
    """A checkpoint as notebooks show it: summary, tensor table, metadata (``metadata``: the nested values)."""
    arrays = sorted(m.arrays.values(), key=lambda a: a.key)
    total = sum(a.nbytes for a in arrays)
    by_role: dict[str, int] = {}
    for a in arrays:
        by_role[a.role] = by_role.get(a.role, 0) + a.nbytes
    summary = [
        ["url", f"<code>{escape(url)}</code>"],
        ["step / metadata", escape(headline(m.values))],
        ["world size at save", str(m.world_size)],
        ["created", escape(m.created or "unknown")],
        ["library", escape(m.library or "unknown")],
        ["tensors", f"{len(arrays):,}"],
        ["total", f"{human(total)} ({total:,} bytes)"],
        ["by role", escape(", ".join(f"{r}: {human(n)}" for r, n in sorted(by_role.items())) or "none")],
    ]
    rows = [
        [
            f"<code>{escape(a.key)}</code>",
            escape(a.role),
            _shape(a.shape),
            escape(a.dtype),
            human(a.nbytes),
            _shape(a.shard_shape),
            _shape(a.chunk_shape),
        ]
        for a in arrays[:MAX_ROWS]
    ]
    note = (
        f"<p><i>showing the first {MAX_ROWS} of {len(arrays):,} tensors (sorted by key); "
        "<code>ckpt.tensors()</code> lists them all</i></p>"
        if len(arrays) > MAX_ROWS
        else ""
    )
    meta = json.dumps(metadata, indent=1, default=str)
    if len(meta) > MAX_METADATA_CHARS:
        meta = meta[:MAX_METADATA_CHARS] + f"\n… ({len(meta):,} characters in all)"
    return _box(
        "zarrckpt checkpoint",
        _table(summary)
        + f"<details open><summary>tensors ({len(arrays):,})</summary>"
        + _table(rows, ["key", "role", "shape", "dtype", "size", "shard", "chunk"])
        + note
        + "</details>"
        + f"<details><summary>metadata ({len(m.values):,} values)</summary><pre>{escape(meta)}</pre></details>",
    )


def tensor_html(a: ArrayMeta, location: str) -> str:
    """One stored tensor as notebooks show it; ``location``: where its array is (a URL)."""
    from zarrckpt.format.layout import grid_shape
    from zarrckpt.format.shard import chunks_per_shard

    shards = math.prod(grid_shape(a.shape, a.shard_shape))
    per_shard = math.prod(chunks_per_shard(a.shard_shape, a.chunk_shape))
    topo = a.topology
    saved = ", ".join(f"{k}: {v}" for k, v in sorted(topo.items()) if v is not None) or "one process"
    rows = [
        ["key", f"<code>{escape(a.key)}</code>"],
        ["role", escape(a.role)],
        ["shape", _shape(a.shape)],
        ["dtype", escape(a.dtype)],
        ["size", f"{human(a.nbytes)} ({a.nbytes:,} bytes)"],
        ["shards", f"{shards:,} of {_shape(a.shard_shape)}"],
        [
            "inner chunks",
            f"{per_shard:,} per shard, {_shape(a.chunk_shape)}",
        ],
        ["saved by", escape(saved)],
        ["location", f"<code>{escape(location)}</code>"],
    ]
    return _box("zarrckpt tensor", _table(rows))


class VerifySummary(dict[str, Any]):
    """What :meth:`Checkpoint.verify` returns: a dict (``tensors``, ``bytes_read``, ``seconds``,
    ``problems``) that prints as one line and shows as a table in notebooks."""

    @property
    def ok(self) -> bool:
        return not self["problems"]

    def __str__(self) -> str:
        status = "OK" if self.ok else f"{len(self['problems'])} problem(s)"
        line = (
            f"verify {status}: {self['tensors']} tensors, {human(self['bytes_read'])} read in {self['seconds']:.2f} s"
        )
        return "\n".join([line, *(f"  - {p}" for p in self["problems"])])

    def _repr_html_(self) -> str:
        status = "OK" if self.ok else f"{len(self['problems'])} problem(s)"
        rows = [
            ["status", f"<b>{status}</b>"],
            ["tensors", f"{self['tensors']:,}"],
            ["read", human(self["bytes_read"])],
            ["seconds", f"{self['seconds']:.2f}"],
        ]
        rows += [["problem", escape(p)] for p in self["problems"]]
        return _box("zarrckpt verify", _table(rows))


def _is_live(stream: IO[str]) -> bool:
    """Whether ``\\r`` redraws in place on ``stream``: a terminal, or a Jupyter cell's output."""
    if type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A progress line on ``stream`` (stderr by default):
    ``label 3/10 tensors [###---] 30% 1.2 GiB, 410 MiB/s, ETA 7s``.

    On a terminal or in a notebook it is redrawn in place (``\\r``) at most 10 times a second; on
    anything else (a pipe, a log file) it is a plain line at most every 30 s, and the last one.
    """

    WIDTH = 30

    def __init__(
        self,
        label: str,
        total_items: int,
        total_bytes: int,
        stream: IO[str] | None = None,
        unit: str = "tensors",
        of: str = "",
    ) -> None:
        self.label, self.total_items, self.total_bytes, self.unit = label, total_items, max(total_bytes, 1), unit
        self.of = of  # after the bytes done: what they are of (" of 2.0 GiB")
        self.lock = threading.Lock()  # advance() from a pool's threads
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_live(self.stream)
        self.interval = 0.1 if self.live else 30.0
        self.start = self.last = time.perf_counter()
        self.items = self.done_bytes = self.moved_bytes = self.width = 0

    def update(self, items: int, done_bytes: int, moved_bytes: int | None = None) -> None:
        """``items`` and ``done_bytes`` (of the totals) are done; ``moved_bytes`` were read or written
        for that (the rate; default ``done_bytes``)."""
        self.items, self.done_bytes = items, done_bytes
        self.moved_bytes = done_bytes if moved_bytes is None else moved_bytes
        now = time.perf_counter()
        if now - self.last >= self.interval and items < self.total_items:  # finish() draws the last state
            self.last = now
            self._draw(now - self.start)

    def advance(self, items: int = 0, nbytes: int = 0) -> None:
        """``items`` more items and ``nbytes`` more bytes are done (safe from several threads)."""
        with self.lock:
            self.update(self.items + items, self.done_bytes + nbytes, self.moved_bytes + nbytes)

    def _draw(self, elapsed: float) -> None:
        frac = min(1.0, self.done_bytes / self.total_bytes) if self.total_items else 1.0
        filled = round(frac * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        rate = f", {human(self.moved_bytes / elapsed)}/s" if elapsed > 0 else ""
        if 0 < frac < 1 and elapsed > 0:  # the rest at the rate so far
            rate += f", ETA {_duration(elapsed * (1 - frac) / frac)}"
        count = f" {self.items}/{self.total_items} {self.unit}" if self.unit else ""  # "": bytes alone
        line = f"{self.label}{count} [{bar}] {frac:4.0%} {human(self.moved_bytes)}{self.of}"
        line += rate
        if self.live:
            self.stream.write("\r" + line.ljust(self.width))  # pad: a shorter line must cover the last one
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, moved_bytes: int | None = None) -> None:
        """Draw the final state and end the line."""
        if moved_bytes is not None:
            self.moved_bytes = moved_bytes
        self._draw(time.perf_counter() - self.start)
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


ProgressOption: TypeAlias = "bool | Callable[[int, int], None]"
"""The ``progress`` argument of save, load, async_save, the manager and import: ``True`` draws a
progress line with rate and ETA on stderr (rank 0's bytes); a callable is called on every rank as
``fn(done_bytes, total_bytes)`` after each object the rank writes or reads (from I/O threads), and
once at the end with ``done_bytes == total_bytes``; ``False``: nothing."""


class Meter:
    """One rank's byte progress for a ``progress`` argument: ``advance`` from any thread, then
    ``finish`` or ``abort`` once; with ``progress=False`` it does nothing (``active`` is False)."""

    def __init__(
        self,
        progress: ProgressOption,
        label: str,
        total_bytes: int,
        rank: int,
        world: int = 1,
        whole: int | None = None,
    ) -> None:
        if not (isinstance(progress, bool) or callable(progress)):
            raise ZarrckptError(
                f"progress must be True, False or a callable(done_bytes, total_bytes), not {progress!r}"
            )
        self.active = progress is not False
        self.total = max(total_bytes, 0)
        self.done = 0
        self.lock = threading.Lock()
        self.callback = None if isinstance(progress, bool) else progress
        self.bar = (
            Progress(label, 1, self.total, unit="", of=_of(self.total, world, whole))
            if progress is True and rank == 0
            else None
        )

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            if self.done >= self.total:  # metadata, index and read-through bytes: finish() reports the end
                return
            done = self.done
            if self.bar is not None:
                self.bar.update(0, done, done)
        if self.callback is not None:
            self.callback(done, self.total)

    def finish(self) -> None:
        """All done: the final state (the line ends; the callback gets ``total, total``)."""
        if self.bar is not None:
            self.bar.update(1, self.total, self.done)
            self.bar.finish()
        if self.callback is not None:
            self.callback(self.total, self.total)

    def abort(self) -> None:
        """The work failed: end a line drawn in place, so the error starts on a line of its own."""
        if self.bar is not None and self.bar.live and self.bar.width:
            self.bar.stream.write("\n")
            self.bar.stream.flush()


def _of(total: int, world: int, whole: int | None) -> str:
    """What a line's bytes are of: this rank's ``total``; on several ranks, rank 0's share (the line is
    rank 0's: it counts only what it moves) and, when known, the ``whole`` operation's bytes."""
    if world <= 1:
        return f" of {human(total)}"
    return f" of rank 0's {human(total)} ({'' if whole is None else human(whole) + ' in all, '}{world} ranks)"


def watch(
    storage: Storage,
    progress: ProgressOption,
    label: str,
    total_bytes: int,
    rank: int,
    world: int = 1,
    whole: int | None = None,
) -> Meter:
    """A :class:`Meter` for ``progress``, fed by every byte ``storage`` moves when active. ``world``:
    the ranks taking part; ``whole``: the bytes of all of them (a save's plan knows them), if known."""
    bar = Meter(progress, label, total_bytes, rank, world, whole)
    storage.traffic.watch = bar.advance if bar.active else None
    return bar


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
