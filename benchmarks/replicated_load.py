"""Replicated load, fan-out on vs off: 4 gloo ranks load a checkpoint whose every tensor each rank
holds whole (DDP-style), from the moto S3 server; the server's request log counts GETs and bytes.

    .venv/bin/python benchmarks/replicated_load.py [--mib 48] [--world 4] [--repeat 2]

Prints a markdown table: shard bytes fetched over one copy's bytes, shard GETs, and the load time
(slowest rank, after a barrier and a warm-up load of a 1 MiB checkpoint that pays for imports and
connections; best of ``--repeat``), for ``load(..., fan_out=True)`` and
``fan_out=False``. Each rank checks that what it loaded is bit-exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.testing import S3Server, spawn, unique_url

COLS = 1024


def state(mib: int) -> dict[str, Any]:
    """A model of 8 float32 weights of about ``mib / 8`` MiB each, a bfloat16 embedding, biases, a step."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, mib * 2**20 // 10 // (COLS * 4))
    model = {f"w{i}": torch.randn(rows, COLS, generator=g) for i in range(8)}
    model["embed"] = torch.randn(4 * rows, COLS, generator=g).to(torch.bfloat16)
    model |= {f"b{i}": torch.randn(COLS, generator=g) for i in range(8)}
    model["step"] = torch.tensor(100)
    return {"model": model}


def _load(
    rank: int, world: int, url: str, warm_url: str, opts: dict[str, Any], mib: int, fan_out: bool, out: str
) -> None:
    small = {"model": {k: torch.zeros_like(v) for k, v in state(1)["model"].items()}}
    zarrckpt.load(small, warm_url, storage_options=opts, fan_out=fan_out)  # imports, connections: not timed
    want = state(mib)
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    dist.barrier()
    start = time.perf_counter()
    zarrckpt.load(target, url, storage_options=opts, fan_out=fan_out)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    for k, v in want["model"].items():
        if not torch.equal(target["model"][k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {k} differs from what was saved")
    if rank == 0:
        Path(out).write_text(json.dumps(float(seconds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=48, help="checkpoint size (MiB)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    one_copy = sum(t.numel() * t.element_size() for t in state(args.mib)["model"].values())
    rows = []
    with S3Server() as s3, tempfile.TemporaryDirectory() as tmp:
        url, warm_url, opts = unique_url("s3"), unique_url("s3"), s3.storage_options
        zarrckpt.save(state(args.mib), url, storage_options=opts)
        zarrckpt.save(state(1), warm_url, storage_options=opts)
        for fan_out in (True, False):
            times, counts = [], []
            for n in range(args.repeat):
                s3.log.clear()
                out = str(Path(tmp, f"{fan_out}-{n}"))
                spawn(args.world, _load, url, warm_url, opts, args.mib, fan_out, out, fresh=True)
                times.append(json.loads(Path(out).read_text()))
                gets = [r for r in s3.log.requests(url) if r.method == "GET" and "/c." in r.path]
                counts.append((len(gets), sum(r.bytes_sent for r in gets)))
            gets, nbytes = counts[0]
            rows.append((fan_out, nbytes / one_copy, gets, min(times)))
    print(f"Replicated load: {args.world} ranks each load all of a {one_copy / 2**20:.1f} MiB checkpoint from moto S3")
    print()
    print("| fan_out | shard bytes fetched / one copy | shard GETs | load time (s) |")
    print("|---|---|---|---|")
    for fan_out, ratio, gets, seconds in rows:
        print(f"| {fan_out} | {ratio:.3f} | {gets} | {seconds:.2f} |")
    (on, off) = rows
    print()
    print(f"fan-out: {off[1] / on[1]:.2f}x fewer bytes, {off[3] / on[3]:.2f}x the speed")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
