"""Column slices of a row-sharded matrix (issue 41, point 9): what a lazy read and a reshard load
cost with row-band inner chunks (the rule before) and with column tiles (FORMAT.md §4).

    PYTHONPATH=. .venv/bin/python benchmarks/column_slices.py [--rows 4096] [--cols 4096] [--world 4]
        [--reps 3] [--storage local,s3] [--rules rows,tiles]

A ``[rows, cols]`` float32 matrix is saved by ``--world`` gloo ranks, ``Shard(0)`` (each rank a
``LocalShard`` of its rows), on local disk (a temporary folder, page cache warm), on moto S3 and
(``--storage rgw``, where Ceph's packages are installed) on a real S3 server, Ceph's RADOS Gateway.
moto copies a whole object for every ranged GET, so its times for ranged reads of large shards
say little; RGW's do.
Then, for each rule, ``--reps`` times:

- lazy reads in this process (``zarrckpt.open(url)[key][...]``, a fresh ``open`` each): ``[:, :16]``,
  ``[:16, :]`` and the rows a load rank of ``world - 1`` would hold (one row block);
- a reshard load into ``world - 1`` ranks (``zarrckpt.load`` of a ``LocalShard`` of rows per rank),
  timed between barriers on the slowest rank.

Bytes are what zarrckpt read (``stats()``: shard bytes and the manifest; summed over ranks for
the load); times are medians with the range over repetitions. The rules are ``save``'s
``chunk_policy``: "rows" (the default: row bands as wide as the shard) and "tiles" (column tiles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.testing import S3Server, rgw, spawn

KEY = "w"


def matrix(rows: int, cols: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the benchmark matrix (element i is float(i % 65521): exact, cheap)."""
    start = lo * cols
    return (torch.arange(start, hi * cols, dtype=torch.int64) % 65521).to(torch.float32).reshape(hi - lo, cols)


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """DTensor's Shard(0) split: ceil(n / world) rows per rank."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def _save(rank: int, world: int, url: str, opts: dict[str, Any] | None, rows: int, cols: int, rule: str) -> None:
    lo, hi = split(rows, world, rank)
    shard = zarrckpt.LocalShard(matrix(rows, cols, lo, hi), (rows, cols), (lo, 0))
    zarrckpt.save({KEY: shard}, url, storage_options=opts, chunk_policy=rule)


def _load(rank: int, world: int, url: str, opts: dict[str, Any] | None, rows: int, cols: int, out: str) -> None:
    lo, hi = split(rows, world, rank)
    target = {KEY: zarrckpt.LocalShard(torch.empty(hi - lo, cols), (rows, cols), (lo, 0))}
    zarrckpt.load(
        {KEY: zarrckpt.LocalShard(torch.empty(hi - lo, cols), (rows, cols), (lo, 0))}, url, storage_options=opts
    )
    dist.barrier()
    start = time.perf_counter()
    stats = zarrckpt.load(target, url, storage_options=opts)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    got = torch.tensor([stats["bytes_read"], stats["requests"]], dtype=torch.int64)
    dist.all_reduce(got)
    if not torch.equal(target[KEY].data, matrix(rows, cols, lo, hi)):
        raise AssertionError(f"rank {rank}: the loaded rows differ")
    if rank == 0:
        Path(out).write_text(json.dumps({"s": float(took), "bytes": int(got[0]), "requests": int(got[1])}))


def lazy(url: str, opts: dict[str, Any] | None, rows: int, cols: int, world: int) -> dict[str, dict[str, float]]:
    lo, hi = split(rows, world - 1, 1)
    reads = {
        "[:, :16]": (slice(None), slice(0, 16)),
        "[:16, :]": (slice(0, 16), slice(None)),
        "row block": slice(lo, hi),
    }
    out = {}
    for name, index in reads.items():
        ckpt = zarrckpt.open(url, storage_options=opts, partial_reads=True)
        view = ckpt[KEY]
        before = ckpt.stats()
        start = time.perf_counter()
        got = view[index]
        took = time.perf_counter() - start
        after = ckpt.stats()
        want = matrix(rows, cols, 0, rows)[index]
        if not torch.equal(torch.as_tensor(got), want):
            raise AssertionError(f"{name}: wrong values")
        out[name] = {
            "s": took,
            "bytes": after["bytes_read"] - before["bytes_read"],
            "requests": after["requests"] - before["requests"],
            "needed": want.numel() * 4,
        }
    return out


Results = dict[str, list[dict[str, float]]]  # read -> one measurement per repetition


def run(
    storage: str, rules: list[str], args: argparse.Namespace, remote: tuple[str, dict[str, Any]] | None, tmp: Path
) -> dict[str, Results]:
    """Save once per rule, then repeat every read of every rule, the rules' order alternating (so
    that a slower phase of a busy machine falls on both)."""
    opts = remote[1] if remote else None
    urls = {rule: f"{remote[0]}/{uuid.uuid4().hex}" if remote else str(tmp / f"{storage}-{rule}") for rule in rules}
    for rule, url in urls.items():
        spawn(args.world, _save, url, opts, args.rows, args.cols, rule, fresh=True)
    results: dict[str, Results] = {rule: {} for rule in rules}
    for rep in range(args.reps):
        for rule in rules if rep % 2 == 0 else rules[::-1]:
            for name, m in lazy(urls[rule], opts, args.rows, args.cols, args.world).items():
                results[rule].setdefault(name, []).append(m)
            out = tmp / "load.json"
            spawn(args.world - 1, _load, urls[rule], opts, args.rows, args.cols, str(out), fresh=True)
            results[rule].setdefault(f"reshard {args.world} -> {args.world - 1}", []).append(
                json.loads(out.read_text())
            )
    return results


def table(all_results: dict[tuple[str, str], Results]) -> str:
    lines = [
        "| storage | rule | read | MiB read (needed) | requests | seconds, median (range) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (storage, rule), results in all_results.items():
        for name, ms in results.items():
            secs = [m["s"] for m in ms]
            mib = statistics.median(m["bytes"] for m in ms) / 2**20
            need = f" ({ms[0]['needed'] / 2**20:.2f})" if "needed" in ms[0] else ""
            reqs = statistics.median(m["requests"] for m in ms)
            lines.append(
                f"| {storage} | {rule} | {name} | {mib:.2f}{need} | {reqs:.0f} | "
                f"{statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f}) |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--storage", default="local,s3")
    parser.add_argument("--rules", default="rows,tiles")
    args = parser.parse_args()
    all_results: dict[tuple[str, str], Results] = {}
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        for storage in args.storage.split(","):
            remote = None
            if storage == "s3":
                s3 = stack.enter_context(S3Server())
                remote = (s3.url, s3.storage_options)
            elif storage == "rgw":
                endpoint = stack.enter_context(rgw.rgw_server())
                remote = (f"s3://{rgw.BUCKET}", rgw.rgw_storage_options(endpoint))
            for rule, results in run(storage, args.rules.split(","), args, remote, Path(d)).items():
                all_results[(storage, rule)] = results
                print(table({(storage, rule): results}), file=sys.stderr, flush=True)
    print(f"[{args.rows}, {args.cols}] float32, saved by {args.world} ranks (Shard(0)), {args.reps} repetitions\n")
    print(table(all_results))


if __name__ == "__main__":
    main()
