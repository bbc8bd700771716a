"""The ``zarrckpt`` command line: ``ls|info|show|verify|diff`` to inspect, ``rm|cp|gc`` to delete, copy
and collect leftovers, ``export|import`` to convert. ``python -m zarrckpt`` is the same command.

Only the public face is used (``zarrckpt``, its ``lifecycle``, ``display`` and ``convert`` modules;
``make lint`` checks it). Exit codes: 0 ok, 1 differences (beyond ``--atol``/``--rtol``) or verify
problems, 2 usage errors, 3 zarrckpt errors (bad URL, missing checkpoint, bucket or source, a file
where a checkpoint goes, unknown key, role or storage option, bad slice, existing output, storage
refusals), 130 interrupted, 141 the reader of stdout went away (``| head``;
the exit status of a tool killed by SIGPIPE), quietly.

torch is imported only by the commands that handle tensor values (show, diff, export, import):
``--help``, ``--version``, ``ls``, ``info``, ``verify``, ``rm``, ``cp`` and ``gc`` start in a fraction
of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import zarrckpt
from zarrckpt.cli.args import CliError, emit_json, parse_duration, parse_storage_options
from zarrckpt.cli.listing import MAX_DEPTH, cmd_ls, newest
from zarrckpt.display import human, pretty
from zarrckpt.types import Role, SourceKind

IMPORT_KINDS = tuple(
    kind.value for kind in SourceKind
)  # zarrckpt.convert.importer.SOURCE_KINDS (a test keeps them equal)
DEFAULT_SHARD_SIZE = "5GB"  # zarrckpt.convert.export.DEFAULT_MAX_SHARD_BYTES (a test keeps them equal)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


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
    from zarrckpt.cli.tensors import cmd_show as show

    return show(args, opts)


def cmd_diff(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.cli.tensors import cmd_diff as diff

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


def cmd_latest(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    root = args.root.rstrip("/")
    found = newest(root, opts)  # the training step: the adapters name checkpoints otherwise
    step, url = (None, None) if found is None else (found["step"], f"{root}/{found['name']}")
    if args.json:
        emit_json({"root": root, "step": step, "url": url})
    elif url is None:
        print(f"no committed checkpoint under {root}", file=sys.stderr)
    else:
        print(url if args.url else step)
    return 0 if step is not None else 1


@contextlib.contextmanager
def _warnings_said() -> Iterator[None]:
    """zarrckpt's warnings meanwhile go to stderr as ``warning: ...`` (a deletion's marker left for its lease)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger = logging.getLogger("zarrckpt")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def cmd_rm(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    for url in args.url:  # in order; the first refusal stops (those before it are deleted, and said so)
        with _warnings_said():
            zarrckpt.delete(url, storage_options=opts, force=args.force)
        if not args.json:
            print(f"deleted {url}")
    if args.json:
        emit_json({"deleted": args.url})
    return 0


def cmd_cp(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    same_scheme = args.src.partition("://")[0] == args.dst.partition("://")[0]
    dst_opts = parse_storage_options(args.to_storage_option) if args.to_storage_option else None
    summary = zarrckpt.copy_checkpoint(
        args.src,
        args.dst,
        storage_options=opts,
        dst_storage_options=dst_opts if args.to_storage_option else (opts if same_scheme else None),
        overwrite=args.overwrite,
        progress=args.progress or sys.stderr.isatty(),
        allow_modified=args.allow_modified,
    )
    if args.json:
        emit_json(summary)
        return 0
    checked = (
        "every chunk checked at the destination against the commit record"
        if summary["recorded"]
        else "every chunk checked at the destination against its own crc32c only, committed WITHOUT a commit "
        "record (reading the copy needs allow_modified=True)"
    )
    print(
        f"copied {summary['src']} -> {summary['dst']}: {summary['tensors']} tensors, {summary['objects']} objects, "
        f"{human(summary['bytes'])}, {checked}, in {summary['seconds']:.2f} s"
    )
    return 0


def cmd_export(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    from zarrckpt.convert.export import export_safetensors

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
    from zarrckpt.convert.importer import import_checkpoint

    summary = import_checkpoint(
        args.src,
        args.url,
        kind=args.kind,
        storage_options=opts,
        overwrite=args.overwrite,
        progress=args.progress or sys.stderr.isatty(),
    )
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
    parser.add_argument("--version", action="version", version=f"zarrckpt {zarrckpt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", parents=[common], help="list a checkpoint's tensors, or the checkpoints under a root")
    p.add_argument(
        "-r",
        "--recursive",
        action="store_true",
        help=f"under a root: also the checkpoints in its other directories, down to {MAX_DEPTH} levels",
    )
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
        help="markers of zarrckpt without heartbeats only: keep those whose save started less than this long ago "
        "(default 1h; 30m, 90s, 2d); a running save is never touched, a dead one is collected at once",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, with sizes; remove nothing")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser(
        "latest", parents=[common], help="the newest committed training step under a root (exit 1: none)"
    )
    p.add_argument("root")
    p.add_argument("--url", action="store_true", help="print the checkpoint's URL instead of its step")
    p.set_defaults(func=cmd_latest)
    p = sub.add_parser("rm", parents=[common], help="delete checkpoints (a save that may still run: only with --force)")
    p.add_argument("url", nargs="+")
    p.add_argument("--force", action="store_true", help="also delete an incomplete checkpoint whose save may still run")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("cp", parents=[common, progress], help="copy a checkpoint to another location or store, checked")
    p.add_argument("src", help="a committed checkpoint")
    p.add_argument("dst", help="where the copy goes (absent or empty, unless --overwrite)")
    p.add_argument(
        "--to-storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for DST (default: --storage-option's when both URLs have one scheme)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument(
        "--allow-modified",
        action="store_true",
        help="copy a SRC without a commit record (written before zarrckpt recorded one, or with the record "
        "removed), or changed after its commit, as it is: each chunk is checked against its own crc32c only, "
        "and the copy is committed without a commit record (refused by load and open unless allow_modified=True)",
    )
    p.set_defaults(func=cmd_cp)
    p = sub.add_parser("export", parents=[common, progress], help="write tensors as (sharded) Hugging Face safetensors")
    p.add_argument("url")
    p.add_argument("out", help="local output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument(
        "--role", action="append", choices=[r.value for r in Role], default=[], help="keep only this role (repeatable)"
    )
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
    p = sub.add_parser("import", parents=[common, progress], help="convert a DCP, torch.save or safetensors checkpoint")
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
