"""``zarrckpt show`` and ``zarrckpt diff``: the commands that read tensor values (so import torch)."""

from __future__ import annotations

import argparse
import difflib
import json
import math
from typing import Any

import torch

import zarrckpt
from zarrckpt.cli.args import CliError, emit_json, parse_target

BLOCK_BYTES = 64 << 20  # tensors larger than this are compared in row blocks
_MISSING = object()


def to_jsonable(t: torch.Tensor) -> Any:
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.float()  # bfloat16 / float16 / float8
    return t.tolist()


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and (d or not prefix):  # a nested {} is a value; the top-level {} has none
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def cmd_show(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    key, text, index = parse_target(args.target)
    # values printed for people are checked: whole inner chunks, each against its CRC-32C (a lazy
    # partial read would check only that a chunk is the committed one, never the bytes it shows)
    ckpt = zarrckpt.open(args.url, storage_options=opts, partial_reads=False)
    if key not in ckpt:
        return show_value(ckpt, key, text, args.json)
    view = ckpt[key]
    try:
        t = view[index]
    except (zarrckpt.CorruptChunkError, zarrckpt.IncompleteCheckpointError, zarrckpt.StorageError):
        raise  # the stored data or the store failed, not the slice: said as it is
    except zarrckpt.ZarrckptError as e:
        raise CliError(f"bad slice {text!r} for {key!r} of shape {list(view.shape)}: {e}") from None
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


def show_value(ckpt: zarrckpt.Checkpoint, key: str, text: str | None, as_json: bool) -> int:
    """``show URL trainer.step``: a plain value (or every value under a prefix) instead of a tensor."""
    node: Any = ckpt.metadata
    for part in key.split("."):
        node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
    if node is _MISSING:
        close = difflib.get_close_matches(key, [*ckpt.keys(), *flatten(ckpt.metadata)], n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else " (`zarrckpt ls` and `info` list them)"
        raise CliError(f"no tensor or value {key!r} in {ckpt.storage.url!r}{hint}")
    if text is not None:
        raise CliError(f"{key!r} is a plain value, not a tensor: it cannot be sliced with {text!r}")
    if as_json:
        emit_json({"key": key, "value": node})
    elif isinstance(node, dict):
        for name, v in flatten(node).items():
            print(f"{key}.{name} = {v!r}")
    else:
        print(f"{key} = {node!r}  ({type(node).__name__})")
    return 0


def compare(a: zarrckpt.TensorView, b: zarrckpt.TensorView, atol: float = 0.0, rtol: float = 0.0) -> dict[str, Any]:
    """Max abs difference and relative L2 of two same-shape tensors, read in bounded row blocks, and
    whether every element is within tolerance: ``|a - b| <= atol + rtol * |b|`` (``torch.isclose``;
    NaN matches NaN, an infinity only itself)."""
    rows = a.shape[0] if a.shape else 1
    biggest = max(a.nbytes, b.nbytes)
    step = max(1, rows if biggest <= BLOCK_BYTES else BLOCK_BYTES // max(biggest // max(rows, 1), 1))
    max_abs, diff_sq, ref_sq, equal, within = 0.0, 0.0, 0.0, True, True
    for lo in range(0, rows, step):
        index: Any = slice(lo, lo + step) if a.shape else ()
        x, y = a[index], b[index]
        wide = torch.complex128 if x.is_complex() or y.is_complex() else torch.float64  # keep imaginary parts
        if x.dtype == y.dtype and torch.equal(x, y):
            ref_sq += float((x.to(wide).abs() ** 2).sum())
            continue
        x64, y64 = x.to(wide), y.to(wide)
        same = (x64 == y64) | (x64.isnan() & y64.isnan())
        d = (x64 - y64).abs()
        d[same] = 0.0
        finite = x64.isfinite() & y64.isfinite()
        d[~same & ~finite] = math.inf
        equal = equal and bool(same.all())
        within = within and bool((same | (finite & (d <= atol + rtol * y64.abs()))).all())
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
        diff_sq += float((d**2).sum())
        ref_sq += float((x64.abs() ** 2).nan_to_num(nan=0.0).sum())
    rel = 0.0 if diff_sq == 0 else (math.sqrt(diff_sq / ref_sq) if ref_sq else math.inf)
    return {"equal": equal, "max_abs_diff": max_abs, "rel_l2": rel, "within_tolerance": within}


MAX_VALUE_CHARS = 160  # `diff`: a metadata value printed longer is cut, with a count of the rest
MAX_SEGMENT_CHARS = 48  # and a key inside one (a Lightning callback's state key is its whole configuration)
MAX_CHANGES = 20  # differences shown inside one metadata value


def shorten(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many were left out."""
    return text if len(text) <= limit else f"{text[:limit]}... (+{len(text) - limit} characters)"


def changes(a: Any, b: Any, where: str) -> list[tuple[str, Any, Any]]:
    """Where two metadata values differ, as (path, A's part, B's part): inside dicts, and lists or
    tuples of one length (a Lightning checkpoint's whole state is one tuple), down to what differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(a.keys() | b.keys(), key=str):
            seg = shorten(str(k), MAX_SEGMENT_CHARS)
            if k not in a or k not in b or a[k] != b[k]:
                out += changes(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}.{seg}")
        return out
    if isinstance(a, list | tuple) and type(a) is type(b) and len(a) == len(b):
        return [c for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y for c in changes(x, y, f"{where}[{i}]")]
    return [(where, a, b)]


def cmd_diff(args: argparse.Namespace, opts: dict[str, Any] | None) -> int:
    atol, rtol = args.atol, args.rtol
    if not (atol >= 0 and rtol >= 0):  # also refuses NaN
        raise CliError(f"--atol and --rtol must be non-negative numbers, got atol={atol} rtol={rtol}")
    ca = zarrckpt.open(args.url_a, storage_options=opts, partial_reads=False)  # checked values, as show's
    cb = zarrckpt.open(args.url_b, storage_options=opts, partial_reads=False)
    ka, kb = set(ca.keys()), set(cb.keys())
    report: dict[str, Any] = {"only_in_a": sorted(ka - kb), "only_in_b": sorted(kb - ka), "layout": [], "values": []}
    compared = 0
    for key in sorted(ka & kb):
        va, vb = ca[key], cb[key]
        if va.shape != vb.shape or va.dtype != vb.dtype:
            report["layout"].append(
                {"key": key, "a": [list(va.shape), str(va.dtype)], "b": [list(vb.shape), str(vb.dtype)]}
            )
        if va.shape == vb.shape:
            compared += 1
            res = compare(va, vb, atol, rtol)
            if not res["equal"]:
                report["values"].append({"key": key, **res})
    ma, mb = flatten(ca.metadata), flatten(cb.metadata)
    report["metadata"] = [
        {"key": k, "a": ma.get(k, "<missing>"), "b": mb.get(k, "<missing>")}
        for k in sorted(ma.keys() | mb.keys())
        if k not in ma or k not in mb or ma[k] != mb[k]
    ]
    beyond = sum(not v["within_tolerance"] for v in report["values"])
    summary = {
        "compared": compared,
        "differing": len(report["values"]),
        "beyond_tolerance": beyond,
        "max_abs_diff": max((v["max_abs_diff"] for v in report["values"]), default=0.0),
        "atol": atol,
        "rtol": rtol,
    }
    structural = {k: len(report[k]) for k in ("only_in_a", "only_in_b", "layout", "metadata") if report[k]}
    identical = not structural and not report["values"]
    ok = not structural and not beyond
    if args.json:
        emit_json({"identical": identical, "within_tolerance": ok, "summary": summary, **report})
        return 0 if ok else 1
    tolerant = atol > 0 or rtol > 0
    for key in report["only_in_a"]:
        print(f"only in A: {key}")
    for key in report["only_in_b"]:
        print(f"only in B: {key}")
    for d in report["layout"]:
        print(f"layout:    {d['key']}: A {d['a'][0]} {d['a'][1]} vs B {d['b'][0]} {d['b'][1]}")
    for d in report["values"]:
        note = " (within tolerance)" if tolerant and d["within_tolerance"] else ""
        print(f"values:    {d['key']}: max_abs_diff={d['max_abs_diff']:.6g} rel_l2={d['rel_l2']:.6g}{note}")
    for d in report["metadata"]:
        found = changes(d["a"], d["b"], d["key"])
        for where, a, b in found[:MAX_CHANGES]:
            a_text, b_text = shorten(json.dumps(a, default=str)), shorten(json.dumps(b, default=str))
            print(f"metadata:  {where}: A {a_text} vs B {b_text}")
        if len(found) > MAX_CHANGES:
            more = len(found) - MAX_CHANGES
            print(f"metadata:  {d['key']}: ... and {more} more differences (--json: both values whole)")
    tol = f"atol={atol:g}, rtol={rtol:g}"
    counts = f"{compared} tensors compared, {summary['differing']} differ"
    if tolerant and report["values"]:
        counts += f" ({beyond} beyond {tol})"
    counts += f", max |a-b| {summary['max_abs_diff']:.6g}"
    if identical:
        print(f"identical: {counts}, metadata equal")
    elif ok:
        print(f"within tolerance ({tol}): {counts}, metadata equal")
    else:
        labels = {"only_in_a": "only in A", "only_in_b": "only in B", "layout": "layout", "metadata": "metadata"}
        extra = ", ".join(f"{n} {labels[k]}" for k, n in structural.items())
        print(f"checkpoints differ: {counts}" + (f"; {extra}" if extra else ""))
    return 0 if ok else 1
