"""The ``zarrckpt`` command line: ``ls|info|show|verify|diff`` to inspect, ``gc`` to collect leftovers,
``export|import`` to convert. ``python -m zarrckpt`` is the same command.

Only the public API is used (``zarrckpt.open``, ``zarrckpt.export``, ``zarrckpt.importer``, the
lifecycle listing). Exit codes: 0 ok, 1 differences (beyond ``--atol``/``--rtol``) or verify
problems, 2 usage errors, 3 zarrckpt errors (bad URL, missing checkpoint or source, unknown key or
role, bad slice, existing output), 130 interrupted, 141 the reader of stdout went away (``| head``;
the exit status of a tool killed by SIGPIPE), quietly.

torch is imported only by the commands that handle tensor values (show, diff, export, import):
``--help``, ``ls``, ``info``, ``verify`` and ``gc`` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import zarrckpt
from zarrckpt import commit as protocol
from zarrckpt.cliargs import CliError, emit_json, parse_duration, parse_storage_options
from zarrckpt.display import human, pretty
from zarrckpt.format import ManifestHead
from zarrckpt.keys import ROLES
from zarrckpt.lifecycle import Entry, scan
from zarrckpt.storage import Storage
from zarrckpt.types import SourceKind

IMPORT_KINDS = tuple(kind.value for kind in SourceKind)  # zarrckpt.importer.SOURCE_KINDS (a test keeps them equal)
DEFAULT_SHARD_SIZE = "5GB"  # zarrckpt.export.DEFAULT_MAX_SHARD_BYTES (a test keeps them equal)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
_STEP_NAME = re.compile(r"step[_-]?(\d+)")  # CheckpointManager's step_0000001000, or step-1000


def table(rows: list[tuple[str, ...]], right: set[int]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells).rstrip())


def cmd_ls(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    try:
        ckpt = zarrckpt.open(args.url, storage_options=opts)
    except (zarrckpt.CheckpointNotFoundError, zarrckpt.IncompleteCheckpointError):
        entries = root_entries(args.url, opts)
        if not entries:
            raise
        return ls_root(args, opts, entries)
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


def root_entries(url: str, opts: dict[str, Any] | None) -> list[Entry]:
    """The checkpoints directly under ``url``; none when ``url`` is a (never committed) checkpoint itself."""
    if protocol.state(Storage(url, opts).names()) is not None:
        return []
    return scan(url, storage_options=opts)


def root_row(entry: Entry, opts: dict[str, Any] | None, sizes: bool = False) -> dict[str, Any]:
    """One checkpoint under a root: its state, step, tensors and size, and time. A committed one costs
    one ranged GET of its manifest's first bytes (:class:`~zarrckpt.format.ManifestHead`), which hold the step and
    time; tensors and size only when they hold the whole manifest, or with ``sizes`` (one whole read)."""
    match = _STEP_NAME.fullmatch(entry.name)
    row: dict[str, Any] = {"name": entry.name, "url": entry.url, "state": entry.state}
    row |= {"step": int(match[1]) if match else None, "tensors": None, "bytes": None, "time": None}
    if entry.state != protocol.COMMITTED:  # time: when its save (or deletion) started
        if entry.age_seconds is not None:
            started = datetime.now(UTC) - timedelta(seconds=entry.age_seconds)
            row["time"] = started.isoformat(timespec="seconds")
        return row
    storage = Storage(entry.url, opts)
    try:
        head = ManifestHead.of(protocol.read_manifest(storage)) if sizes else protocol.read_manifest_head(storage)
    except zarrckpt.ZarrckptError as e:  # deleted meanwhile, or invalid: list it, say why
        return row | {"error": str(e)}
    if row["step"] is None:  # else a metadata value named step (trainer.step), the shallowest
        steps = [k for k, v in head.values.items() if k.split(".")[-1] == "step" and type(v) is int]
        row["step"] = head.values[min(steps, key=lambda k: (k.count("."), k))] if steps else None
    row["tensors"] = head.tensors
    row["bytes"] = head.nbytes
    row["time"] = head.created or None
    return row


def ls_root(args: argparse.Namespace, opts: dict[str, Any] | None, entries: list[Entry]) -> int:
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


def cmd_info(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    ckpt = zarrckpt.open(args.url, storage_options=opts)
    rows = ckpt.tensors()
    by_role: dict[str, int] = {}
    for r in rows:
        by_role[r["role"]] = by_role.get(r["role"], 0) + r["bytes"]
    manifest = ckpt.manifest
    info = {
        "url": args.url,
        "tensors": len(rows),
        "bytes": sum(r["bytes"] for r in rows),
        "bytes_by_role": dict(sorted(by_role.items())),
        "topology": {"world_size": ckpt.saved_world_size},
        "library": manifest.library or None,
        "created": manifest.created or None,
        "save_id": manifest.save_id,
        "metadata": ckpt.metadata,
    }
    if args.json:
        emit_json(info)  # everything, lists whole
        return 0
    print(f"checkpoint   {args.url}")
    print(f"tensors      {info['tensors']}")
    print(f"total        {human(info['bytes'])} ({info['bytes']} bytes)")
    for role, n in info["bytes_by_role"].items():
        print(f"  {role:<20} {human(n)}")
    print(f"world size   {ckpt.saved_world_size} (at save)")
    for name in ("library", "created", "save_id"):
        if info[name] is not None:
            print(f"{name.replace('_', ' '):<12} {info[name]}")
    whole = pretty(info["metadata"], max_items=sys.maxsize)
    shown = whole if args.full else pretty(info["metadata"], max_items=args.max_items)
    print("metadata:" + (f" (lists cut at {args.max_items} items; --full shows all)" if shown != whole else ""))
    print("\n".join("  " + line for line in shown.splitlines()))
    return 0


def cmd_verify(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    progress = args.progress or sys.stderr.isatty()
    summary = zarrckpt.open(args.url, storage_options=opts).verify(progress=progress)
    problems = summary["problems"]
    if args.json:
        emit_json(summary)
    else:
        status = "OK" if not problems else f"{len(problems)} problem(s)"
        print(
            f"{status}: {summary['tensors']} tensors, {human(summary['bytes_read'])} read in {summary['seconds']:.2f} s"
        )
        for p in problems:
            print(f"  - {p}")
    return 1 if problems else 0


def cmd_show(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.clitensors import cmd_show as show

    return show(args, opts)


def cmd_diff(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.clitensors import cmd_diff as diff

    return diff(args, opts)


def cmd_gc(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    grace = parse_duration(args.grace)
    found = zarrckpt.collect_garbage(args.root, grace_seconds=grace, dry_run=args.dry_run, storage_options=opts)
    if args.json:
        removed = [
            {k: getattr(e, k) for k in ("name", "url", "state", "age_seconds", "objects", "nbytes")} for e in found
        ]
        emit_json({"root": args.root, "dry_run": args.dry_run, "grace_seconds": grace, "removed": removed})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for e in found:
        age = "age unknown" if e.age_seconds is None else f"started {e.age_seconds / 3600:.1f} h ago"
        print(f"{verb} {e.name}: {e.state}, {age}, {e.objects} objects, {human(e.nbytes)}")
    total = sum(e.nbytes for e in found)
    print(
        f"{verb} {len(found)} leftovers ({human(total)}) under {args.root}"
        if found
        else f"nothing to collect under {args.root}"
    )
    return 0


def cmd_export(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.export import export_safetensors

    summary = export_safetensors(
        args.url,
        args.out,
        roles=args.role or None,
        dtype=args.dtype,
        include=args.include or None,
        max_shard_bytes=args.max_shard_size,
        strip_prefix=args.strip_prefix,
        storage_options=opts,
        progress=args.progress or sys.stderr.isatty(),
        overwrite=args.overwrite,
    )
    if args.json:
        emit_json(summary)
        return 0
    files = summary["files"] + ([summary["index"]] if summary["index"] else [])
    print(
        f"exported {summary['tensors']} tensors, {human(summary['bytes'])}"
        + (f" as {summary['dtype']}" if summary["dtype"] else "")
        + f" to {summary['out']} in {summary['seconds']:.2f} s"
    )
    for name in files:
        print(f"  {name}")
    return 0


def cmd_import(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.importer import import_checkpoint

    summary = import_checkpoint(args.src, args.url, kind=args.kind, storage_options=opts, overwrite=args.overwrite)
    if args.json:
        emit_json(summary)
        return 0
    print(
        f"imported {summary['kind']} checkpoint {summary['source']} -> {summary['url']}: {summary['tensors']} tensors "
        f"({human(summary['bytes'])}), {summary['values']} values in {summary['seconds']:.2f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable; VALUE parsed as JSON when possible)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable JSON output")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--progress",
        action="store_true",
        help="progress on stderr even when it is not a terminal (default: when it is)",
    )
    parser = argparse.ArgumentParser(
        prog="zarrckpt", description="Inspect zarrckpt checkpoints; export and import them."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", parents=[common], help="list a checkpoint's tensors, or the checkpoints under a root")
    p.add_argument("url", help="a checkpoint, or a root of checkpoints (e.g. a CheckpointManager's)")
    p.add_argument("pattern", nargs="?", help="fnmatch glob on keys (or names under a root), e.g. 'model.layers.*'")
    p.add_argument(
        "--sizes",
        action="store_true",
        help="under a root: tensors and size of every checkpoint, reading each manifest whole "
        "(default: only of those whose manifest fits in the first 64 KiB read for step and time)",
    )
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("info", parents=[common], help="summary, topology and plain values")
    p.add_argument("url")
    p.add_argument("--max-items", type=int, default=10, metavar="N", help="show N items of long lists (default 10)")
    p.add_argument("--full", action="store_true", help="show lists whole")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("show", parents=[common], help="print a tensor or a slice: 'key[5, :4, ...]'")
    p.add_argument("url")
    p.add_argument("target", metavar="KEY[INDEX]")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("verify", parents=[common, progress], help="read every chunk and check checksums")
    p.add_argument("url")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints (exit 1 when they differ)")
    p.add_argument("url_a")
    p.add_argument("url_b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, times |B| (default 0: exact)")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser(
        "gc", parents=[common], help="remove leftovers of died saves and deletions under a root of checkpoints"
    )
    p.add_argument("root")
    p.add_argument(
        "--grace",
        default="1h",
        metavar="DURATION",
        help="keep incomplete checkpoints whose save started less than this long ago (default 1h; 30m, 90s, 2d)",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, with sizes; remove nothing")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser("export", parents=[common, progress], help="write tensors as (sharded) Hugging Face safetensors")
    p.add_argument("url")
    p.add_argument("out", help="local output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--role", action="append", choices=ROLES, default=[], help="keep only this role (repeatable)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN", help="fnmatch glob on keys")
    p.add_argument("--strip-prefix", metavar="PREFIX", help="remove this prefix from tensor names, e.g. 'model.'")
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD_SIZE,
        metavar="SIZE",
        help=f"largest file, e.g. 500MB, 5GB, 2GiB (default {DEFAULT_SHARD_SIZE})",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", parents=[common], help="convert a DCP, torch.save or safetensors checkpoint")
    p.add_argument("src", help="DCP directory, torch.save file, .safetensors file, or directory / index json")
    p.add_argument("url")
    p.add_argument("--from", dest="kind", choices=IMPORT_KINDS, help="source kind (default: detected)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at URL")
    p.set_defaults(func=cmd_import)
    return parser


def run(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "ls" and args.pattern is None and len(extra) == 1 and not extra[0].startswith("-"):
        args.pattern = extra[0]  # `ls URL --json PATTERN`: argparse does not intermix positionals
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        rc: int = args.func(args, parse_storage_options(args.storage_option))
    except (zarrckpt.ZarrckptError, CliError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except BrokenPipeError:  # `zarrckpt ls --json URL | head`: the reader has what it wanted
        # stdout's buffer cannot be written any more: point it at devnull so that exit flushes quietly
        with contextlib.suppress(OSError, ValueError):  # (stdout is no file when captured: nothing to do)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
