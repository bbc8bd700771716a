"""The ``zarrckpt`` command line: ``ls|info|show|verify|diff`` to inspect, ``gc`` to collect leftovers,
``export|import`` to convert.

Only the public API is used (``zarrckpt.open``, ``zarrckpt.export``, ``zarrckpt.importer``).
Exit codes: 0 ok, 1 differences or verify problems, 2 usage errors, 3 zarrckpt errors (bad URL,
missing checkpoint or source, unknown key or role, bad slice, existing output).

torch is imported only by the commands that handle tensor values (show, diff, export, import):
``--help``, ``ls``, ``info``, ``verify`` and ``gc`` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from typing import TYPE_CHECKING, Any

import zarrckpt
from zarrckpt.cliargs import CliError, parse_duration, parse_storage_options, parse_target
from zarrckpt.display import human
from zarrckpt.keys import ROLES

if TYPE_CHECKING:
    import torch

BLOCK_BYTES = 64 << 20  # tensors larger than this are compared in row blocks
IMPORT_KINDS = ("dcp", "torch", "safetensors")  # zarrckpt.importer.KINDS (a test keeps them equal)
DEFAULT_SHARD_SIZE = "5GB"  # zarrckpt.export.DEFAULT_MAX_SHARD_BYTES (a test keeps them equal)


def to_jsonable(t: torch.Tensor) -> Any:
    import torch

    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.float()  # bfloat16 / float16 / float8
    return t.tolist()


def emit_json(obj: Any, indent: int | None = 2) -> None:
    print(json.dumps(obj, indent=indent, default=str))


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and (d or not prefix):  # a nested {} is a value; the top-level {} has none
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def cmd_ls(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    rows = zarrckpt.open(args.url, storage_options=opts).tensors()
    if args.pattern:
        rows = [r for r in rows if fnmatch.fnmatchcase(r["key"], args.pattern)]
    if args.json:
        emit_json(rows)
        return 0
    table = [("KEY", "ROLE", "DTYPE", "SHAPE", "SIZE")]
    table += [(r["key"], r["role"], r["dtype"], str(r["shape"]), human(r["bytes"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for *left, size in table:
        print("  ".join(c.ljust(w) for c, w in zip(left, widths, strict=False)), size.rjust(widths[4]), sep="  ")
    print(f"{len(rows)} tensors, {human(sum(r['bytes'] for r in rows))}")
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
        "topology": ckpt.topology,
        "library": getattr(manifest, "library", None) or None,
        "created": getattr(manifest, "created", None) or None,
        "save_id": getattr(manifest, "save_id", None),
        "metadata": ckpt.metadata,
    }
    if args.json:
        emit_json(info)
        return 0
    print(f"checkpoint   {args.url}")
    print(f"tensors      {info['tensors']}")
    print(f"total        {human(info['bytes'])} ({info['bytes']} bytes)")
    for role, n in info["bytes_by_role"].items():
        print(f"  {role:<20} {human(n)}")
    print(f"world size   {ckpt.topology.get('world_size')} (at save)")
    for name in ("library", "created", "save_id"):
        if info[name] is not None:
            print(f"{name.replace('_', ' '):<12} {info[name]}")
    print("metadata:")
    print("\n".join("  " + line for line in json.dumps(info["metadata"], indent=2, default=str).splitlines()))
    return 0


def cmd_show(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    key, text, index = parse_target(args.target)
    view = zarrckpt.open(args.url, storage_options=opts)[key]
    try:
        t = view[index]
    except zarrckpt.ZarrckptError as e:
        raise CliError(f"bad slice {text!r} for {key!r} of shape {list(view.shape)}: {e}") from None
    import torch

    dtype = str(view.dtype).removeprefix("torch.")
    if args.json:
        emit_json({"key": key, "index": text, "shape": list(t.shape), "dtype": dtype, "values": to_jsonable(t)}, None)
        return 0
    print(f"{key}{text or ''}  shape={list(t.shape)}  dtype={dtype}  (stored {list(view.shape)}, role={view.role})")
    shown = t.float() if t.is_floating_point() and t.element_size() == 1 else t  # float8 has no printer
    torch.set_printoptions(precision=6, threshold=1000, edgeitems=4, linewidth=120)
    try:
        print(shown)
    finally:
        torch.set_printoptions(profile="default")
    return 0


def cmd_verify(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    summary = zarrckpt.open(args.url, storage_options=opts).verify(progress=True)
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


def compare(a: zarrckpt.TensorView, b: zarrckpt.TensorView) -> dict[str, Any]:
    """Max abs difference and relative L2 of two same-shape tensors, read in bounded row blocks."""
    import torch

    rows = a.shape[0] if a.shape else 1
    biggest = max(a.nbytes, b.nbytes)
    step = max(1, rows if biggest <= BLOCK_BYTES else BLOCK_BYTES // max(biggest // max(rows, 1), 1))
    max_abs, diff_sq, ref_sq, equal = 0.0, 0.0, 0.0, True
    for lo in range(0, rows, step):
        index: Any = slice(lo, lo + step) if a.shape else ()
        x, y = a[index], b[index]
        if x.dtype == y.dtype and torch.equal(x, y):
            ref_sq += float((x.to(torch.float64) ** 2).sum())
            continue
        x64, y64 = x.to(torch.float64), y.to(torch.float64)
        d = (x64 - y64).abs()
        d[x64.isnan() & y64.isnan()] = 0.0  # NaN in both places counts as equal
        d = d.nan_to_num(nan=math.inf)
        equal = equal and bool((d == 0).all())
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
        diff_sq += float((d**2).sum())
        ref_sq += float((x64**2).nan_to_num(nan=0.0).sum())
    rel = 0.0 if diff_sq == 0 else (math.sqrt(diff_sq / ref_sq) if ref_sq else math.inf)
    return {"equal": equal, "max_abs_diff": max_abs, "rel_l2": rel}


def cmd_diff(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    ca = zarrckpt.open(args.url_a, storage_options=opts)
    cb = zarrckpt.open(args.url_b, storage_options=opts)
    ka, kb = set(ca.keys()), set(cb.keys())
    report: dict[str, Any] = {"only_in_a": sorted(ka - kb), "only_in_b": sorted(kb - ka), "layout": [], "values": []}
    for key in sorted(ka & kb):
        va, vb = ca[key], cb[key]
        if va.shape != vb.shape or va.dtype != vb.dtype:
            report["layout"].append(
                {"key": key, "a": [list(va.shape), str(va.dtype)], "b": [list(vb.shape), str(vb.dtype)]}
            )
        if va.shape == vb.shape:
            res = compare(va, vb)
            if not res["equal"]:
                report["values"].append({"key": key, **res})
    ma, mb = flatten(ca.metadata), flatten(cb.metadata)
    report["metadata"] = [
        {"key": k, "a": ma.get(k, "<missing>"), "b": mb.get(k, "<missing>")}
        for k in sorted(ma.keys() | mb.keys())
        if k not in ma or k not in mb or ma[k] != mb[k]
    ]
    differ = any(report[k] for k in ("only_in_a", "only_in_b", "layout", "values", "metadata"))
    if args.json:
        emit_json({"identical": not differ, **report})
        return 1 if differ else 0
    for key in report["only_in_a"]:
        print(f"only in A: {key}")
    for key in report["only_in_b"]:
        print(f"only in B: {key}")
    for d in report["layout"]:
        print(f"layout:    {d['key']}: A {d['a'][0]} {d['a'][1]} vs B {d['b'][0]} {d['b'][1]}")
    for d in report["values"]:
        print(f"values:    {d['key']}: max_abs_diff={d['max_abs_diff']:.6g} rel_l2={d['rel_l2']:.6g}")
    for d in report["metadata"]:
        print(f"metadata:  {d['key']}: A {json.dumps(d['a'], default=str)} vs B {json.dumps(d['b'], default=str)}")
    print("checkpoints differ" if differ else f"identical ({len(ka)} tensors, metadata equal)")
    return 1 if differ else 0


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
    parser = argparse.ArgumentParser(
        prog="zarrckpt", description="Inspect zarrckpt checkpoints; export and import them."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", parents=[common], help="list tensors")
    p.add_argument("url")
    p.add_argument("pattern", nargs="?", help="fnmatch glob on keys, e.g. 'model.layers.*.mlp.*'")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("info", parents=[common], help="summary, topology and plain values")
    p.add_argument("url")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("show", parents=[common], help="print a tensor or a slice: 'key[5, :4, ...]'")
    p.add_argument("url")
    p.add_argument("target", metavar="KEY[INDEX]")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("verify", parents=[common], help="read every chunk and check checksums")
    p.add_argument("url")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints")
    p.add_argument("url_a")
    p.add_argument("url_b")
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
    p = sub.add_parser("export", parents=[common], help="write tensors as (sharded) Hugging Face safetensors")
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
        help="largest file, e.g. 500MB, 5GB, 2GiB (default 5GB)",
    )
    p.add_argument("--progress", action="store_true", help="progress bar on stderr (default: when it is a tty)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", parents=[common], help="convert a DCP, torch.save or safetensors checkpoint")
    p.add_argument("src", help="DCP directory, torch.save file, .safetensors file, or directory / index json")
    p.add_argument("url")
    p.add_argument("--from", dest="kind", choices=IMPORT_KINDS, help="source kind (default: detected)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at URL")
    p.set_defaults(func=cmd_import)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "ls" and args.pattern is None and len(extra) == 1 and not extra[0].startswith("-"):
        args.pattern = extra[0]  # `ls URL --json PATTERN`: argparse does not intermix positionals
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        rc: int = args.func(args, parse_storage_options(args.storage_option))
        return rc
    except (zarrckpt.ZarrckptError, CliError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
