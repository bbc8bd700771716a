"""``zarrckpt ls``: a checkpoint's tensors, or the checkpoints under a root (``-r``: at any depth) with
their state, step, size and time."""

from __future__ import annotations

import argparse
import fnmatch
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import zarrckpt
from zarrckpt.cli.args import CliError, emit_json
from zarrckpt.display import human

_STEP_NAME = re.compile(r"step[_-]?(\d+)")  # CheckpointManager's step_0000001000, or step-1000
MAX_DEPTH = 16  # `ls -r`: directory levels looked into under the root


def table(rows: list[tuple[str, ...]], right: set[int]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells).rstrip())


def cmd_ls(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.lifecycle import scan

    try:
        ckpt = zarrckpt.open(args.url, storage_options=opts)
    except (zarrckpt.CheckpointNotFoundError, zarrckpt.IncompleteCheckpointError, zarrckpt.InvalidCheckpointError) as e:
        entries = scan(args.url, storage_options=opts, depth=MAX_DEPTH if args.recursive else 1)
        if entries:
            return ls_root(args, opts, entries)
        # it holds something else (not what `zarrckpt import` converts: a file, a DCP checkpoint, which say so)
        if isinstance(e, zarrckpt.InvalidCheckpointError) and not args.recursive and "zarrckpt import" not in str(e):
            raise CliError(f"{e}; `zarrckpt ls -r {args.url}` looks for checkpoints in its directories") from None
        raise
    rows = ckpt.tensors()
    if args.pattern:
        rows = [r for r in rows if fnmatch.fnmatchcase(r["key"], args.pattern)]
    if args.json:
        emit_json(rows)
        return 0
    table(
        [("KEY", "ROLE", "DTYPE", "SHAPE", "SIZE")]
        + [(r["key"], r["role"], r["dtype"], str(r["shape"]), human(r["bytes"])) for r in rows],
        right={4},
    )
    print(f"{len(rows)} tensors, {human(sum(r['bytes'] for r in rows))}")
    return 0


def training_step(name: str, values: dict[str, Any], *, loose: bool = True) -> int | None:
    """The training step a checkpoint was saved at, from its manifest's values and its name: the global
    step a Lightning checkpoint records (its names are free: ``epoch=0-step=12.ckpt``, ``last.ckpt``),
    Accelerate's ``accelerate.step`` (its name counts saves: ``step_<iteration>``), else the step in the
    name (``CheckpointManager``'s ``step_0000001000``, torchtitan's ``step-1000``); ``loose``: else a
    value named ``step`` (``trainer.step``, the shallowest). None: none of these."""
    typed = values.get("lightning")  # a tuple (skeleton, places) in typed JSON: docs/FORMAT.md section 6
    saved = typed.get("__zarrckpt__") if isinstance(typed, dict) else None
    skeleton = saved[1][0] if isinstance(saved, list) and len(saved) == 2 and saved[0] == "tuple" and saved[1] else None
    for step in (skeleton.get("global_step") if isinstance(skeleton, dict) else None, values.get("accelerate.step")):
        if type(step) is int:
            return step
    if match := _STEP_NAME.fullmatch(name.rsplit("/", 1)[-1]):
        return int(match[1])
    steps = [k for k, v in values.items() if k.split(".")[-1] == "step" and type(v) is int] if loose else []
    return values[min(steps, key=lambda k: (k.count("."), k))] if steps else None


def newest(root: str, opts: dict[str, Any] | None) -> dict[str, Any] | None:
    """``zarrckpt latest``: the committed checkpoint directly under ``root`` with the highest training
    step (:func:`training_step`, not ``loose``: a checkpoint that only holds a value named ``step`` is
    no candidate), then the newest; its :func:`root_row`. One ranged GET per committed checkpoint."""
    from zarrckpt.lifecycle import scan

    committed = [e for e in scan(root, storage_options=opts) if e.state == "committed"]
    with ThreadPoolExecutor(min(16, max(1, len(committed)))) as pool:
        rows = [r for r in pool.map(lambda e: root_row(e, opts, loose=False), committed) if r["step"] is not None]
    return max(rows, key=lambda r: (r["step"], r["time"] or "", r["name"])) if rows else None


def root_row(entry: Any, opts: dict[str, Any] | None, sizes: bool = False, loose: bool = True) -> dict[str, Any]:
    """One checkpoint under a root: its state, training step (:func:`training_step`), tensors and size,
    and time. A committed one costs one ranged GET of its manifest's first bytes
    (:func:`zarrckpt.lifecycle.read_head`), which hold the step and time; tensors and size only when
    they hold the whole manifest, or with ``sizes`` (one whole read)."""
    from zarrckpt.lifecycle import read_head

    match = _STEP_NAME.fullmatch(entry.name.rsplit("/", 1)[-1])
    row: dict[str, Any] = {"name": entry.name, "url": entry.url, "state": entry.state}
    row |= {"step": int(match[1]) if match else None, "tensors": None, "bytes": None, "time": None}
    if entry.state != "committed":  # time: when its save (or deletion) started
        if entry.age_seconds is not None:
            started = datetime.now(UTC) - timedelta(seconds=entry.age_seconds)
            row["time"] = started.isoformat(timespec="seconds")
        return row
    try:
        head = read_head(entry.url, storage_options=opts, whole=sizes)
    except zarrckpt.ZarrckptError as e:  # deleted meanwhile, or invalid: list it, say why
        return row | {"error": str(e)}
    row["step"] = training_step(entry.name, head.values, loose=loose)
    row["tensors"] = head.tensors
    row["bytes"] = head.nbytes
    row["time"] = head.created or None
    return row


def ls_root(args: argparse.Namespace, opts: dict[str, Any] | None, entries: list[Any]) -> int:
    if args.pattern:
        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, args.pattern)]
    with ThreadPoolExecutor(min(16, max(1, len(entries)))) as pool:  # one manifest GET each
        rows = list(pool.map(lambda e: root_row(e, opts, args.sizes), entries))
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))
    if args.json:
        emit_json(rows)
        return 0

    def cell(value: Any, fmt: Any = str) -> str:
        return "-" if value is None else fmt(value)

    table(
        [("NAME", "STATE", "STEP", "TENSORS", "SIZE", "TIME")]
        + [
            (r["name"], r["state"], cell(r["step"]), cell(r["tensors"]), cell(r["bytes"], human), cell(r["time"]))
            for r in rows
        ],
        right={2, 3, 4},
    )
    states = {s: sum(r["state"] == s for r in rows) for s in ("committed", "incomplete", "deleting")}
    counts = ", ".join(f"{n} {s}" for s, n in states.items() if n)
    print(f"{len(rows)} checkpoints under {args.url}" + (f": {counts}" if counts else ""))
    for r in rows:
        if "error" in r:
            print(f"  {r['name']}: {r['error']}")
    if not args.sizes and any(r["state"] == "committed" and r["tensors"] is None and "error" not in r for r in rows):
        print("(TENSORS and SIZE of large manifests: `--sizes`, which reads each manifest whole)")
    if states["incomplete"] or states["deleting"]:
        print(f"(incomplete or deleting: a save or deletion is running, or died; `zarrckpt gc {args.url}` cleans up)")
    return 0
