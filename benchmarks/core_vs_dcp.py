"""zarrckpt vs torch.distributed.checkpoint (DCP) on local disk: save, load, and 4 -> 3 resharding load.

Usage::

    python benchmarks/core_vs_dcp.py [--gib 1.0] [--reps 3] [--out benchmarks/results/core.md]

Every repetition spawns 4 gloo ranks (``init_device_mesh("cpu", (4,))``) holding a ~``--gib``
GiB FP32 state of ``Shard(0)`` DTensors (model weights plus Adam-style ``exp_avg`` /
``exp_avg_sq`` of the same shapes). They save it with both libraries, back to back, then load
it back into the same layout with both; a second spawn of 3 ranks (``Shard(0)`` over 3) loads
both checkpoints again (resharding). Every load is verified against the expected data, and
the checkpoint directories are deleted after each repetition.

Time of one operation = the max over ranks of the wall time between a barrier before and a
barrier after it. Throughput = total bytes of the state / time (GB = 1e9 bytes). Medians
over the repetitions are reported. The order of the two libraries alternates per repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from common import (
    LAYERS,
    build_state,
    disk_usage,
    evict_page_cache,
    generate_rows,
    hidden_size,
    sharded,
    state_nbytes,
    summarize_profiles,
    tensor_specs,
    timed,
    verify,
)

import zarrckpt
from zarrckpt.testing import free_port

SAVE_WORLD = 4
RESHARD_WORLD = 3
FORMATS = ("zarrckpt", "dcp")
OPS = ("save", "load", "reshard")
OP_TITLES = {
    "save": f"save ({SAVE_WORLD} ranks)",
    "load": f"load {SAVE_WORLD} -> {SAVE_WORLD} ranks",
    "reshard": f"load {SAVE_WORLD} -> {RESHARD_WORLD} ranks (resharding)",
}


# -- worker processes --------------------------------------------------------------------------


def save_fn(fmt: str, state: dict[str, Any], path: Path, dcp_sync: bool) -> Callable[[], None]:
    if fmt == "zarrckpt":
        return lambda: zarrckpt.save(state, str(path))
    if dcp_sync:  # the default, as users get it
        return lambda: dcp.save(state, storage_writer=FileSystemWriter(str(path)))
    return lambda: dcp.save(state, storage_writer=FileSystemWriter(str(path), sync_files=False))


def load_fn(fmt: str, state: dict[str, Any], path: Path) -> Callable[[], None]:
    if fmt == "zarrckpt":
        return lambda: zarrckpt.load(state, str(path))
    return lambda: dcp.load(state, storage_reader=FileSystemReader(str(path)))


def warm_up(mesh: Any, root: Path, dcp_sync: bool) -> None:
    """Save and load a tiny state with both libraries once, so first-call costs are not timed."""
    shape = (64, 8)
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
    local = generate_rows(0, shape, offset[0], offset[0] + local_shape[0])
    state = {"w": sharded(local, mesh, shape)}
    for fmt in FORMATS:
        save_fn(fmt, state, root / fmt, dcp_sync)()
        load_fn(fmt, state, root / fmt)()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)


def worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=1800)
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        dirs = {fmt: Path(cfg["root"]) / fmt for fmt in FORMATS}
        order = FORMATS if cfg["rep"] % 2 == 0 else FORMATS[::-1]
        profile = Path(cfg["profile"]) if cfg["profile"] and cfg["rep"] == 0 else None
        times: dict[str, float] = {}
        warm_up(mesh, Path(cfg["root"]) / f"warmup-{cfg['phase']}", cfg["dcp_sync"])

        def run(op: str, fmt: str, fn: Callable[[], None]) -> None:
            times[f"{op}/{fmt}"] = timed(fn, profile / f"{op}_{fmt}.pstats" if profile else None)

        if cfg["phase"] == "save":
            source, _ = build_state(cfg["gib"], mesh, fill=True)
            for fmt in order:
                run("save", fmt, save_fn(fmt, source, dirs[fmt], cfg["dcp_sync"]))
            del source
            target, checksums = build_state(cfg["gib"], mesh, fill=False)
            if cfg["evict"] and rank == 0:
                for fmt in FORMATS:
                    evict_page_cache(dirs[fmt])
            for fmt in order:
                run("load", fmt, load_fn(fmt, target, dirs[fmt]))
                verify(target, checksums, f"{fmt} load")
        else:
            target, checksums = build_state(cfg["gib"], mesh, fill=False)
            if cfg["evict"] and rank == 0:
                for fmt in FORMATS:
                    evict_page_cache(dirs[fmt])
            for fmt in order:
                run("reshard", fmt, load_fn(fmt, target, dirs[fmt]))
                verify(target, checksums, f"{fmt} resharding load")
        dist.barrier()
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def spawn(world: int, cfg: dict[str, Any]) -> dict[str, float]:
    mp.spawn(worker, args=(world, free_port(), cfg), nprocs=world, join=True)
    return json.loads(Path(cfg["result"]).read_text())


# -- driver and report -------------------------------------------------------------------------


def report(args: argparse.Namespace, runs: list[dict[str, float]], usage: dict[str, tuple[int, int, int]]) -> str:
    nbytes = state_nbytes(args.gib)
    specs = tensor_specs(args.gib)
    h = hidden_size(args.gib)
    lines = [
        f"# zarrckpt vs DCP on local disk ({nbytes / 2**30:.3f} GiB FP32 state)",
        "",
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/core_vs_dcp.py --gib {args.gib} "
        f"--reps {args.reps}{' --evict-cache' if args.evict_cache else ''}"
        f"{' --dcp-no-sync' if args.dcp_no_sync else ''}`",
        f"- state: {len(specs)} Shard(0) DTensors ({nbytes:,} bytes): hidden size {h}, {LAYERS} layers + embedding; "
        "weights, exp_avg, exp_avg_sq",
        f"- torch {torch.__version__}, zarrckpt {zarrckpt.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, gloo, 1 torch thread per rank; storage: {args.tmp or tempfile.gettempdir()}",
        "- DCP: `FileSystemWriter(path)` defaults (one file per rank, 1 thread, "
        + ("but `sync_files=False`); " if args.dcp_no_sync else "`sync_files=True`: fsyncs its files); ")
        + "zarrckpt: defaults (fsyncs its files; per rank 8 write threads, min(4, CPUs) read threads)",
        f"- medians of {len(runs)} repetition(s); time = max over ranks between barriers; GB/s = state bytes / time "
        "(1 GB = 1e9 B)",
        "- each spawn first saves and loads a tiny state with both libraries (warm-up, not timed)",
        "- page cache: "
        + (
            "files fsync'd and `POSIX_FADV_DONTNEED`-evicted before loads (best effort)"
            if args.evict_cache
            else "NOT dropped: loads likely read from the page cache"
        ),
        "",
        "| operation | zarrckpt GB/s | DCP GB/s | zarrckpt / DCP | zarrckpt s | DCP s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op in OPS:
        z = statistics.median(r[f"{op}/zarrckpt"] for r in runs)
        d = statistics.median(r[f"{op}/dcp"] for r in runs)
        lines.append(
            f"| {OP_TITLES[op]} | {nbytes / z / 1e9:.2f} | {nbytes / d / 1e9:.2f} | {d / z:.2f} | {z:.2f} | {d:.2f} |"
        )
    lines += [
        "",
        "| format | files | bytes (apparent) | bytes (allocated) | overhead vs state |",
        "|---|---:|---:|---:|---:|",
    ]
    for fmt in FORMATS:
        files, apparent, allocated = usage[fmt]
        lines.append(f"| {fmt} | {files} | {apparent:,} | {allocated:,} | {apparent / nbytes - 1:+.2%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the FP32 state in GiB (default 1.0)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/core.md"), help="markdown output")
    parser.add_argument("--tmp", default=None, help="parent directory of the checkpoints (default: system temp)")
    parser.add_argument(
        "--evict-cache",
        action="store_true",
        help="fsync + POSIX_FADV_DONTNEED the checkpoint files before each load phase",
    )
    parser.add_argument(
        "--dcp-no-sync",
        action="store_true",
        help="FileSystemWriter(path, sync_files=False): no fsync (default: DCP's default, fsync, as zarrckpt does)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile rank 0 (CPU time of all its threads, merged) in the first repetition; .pstats "
        "and .txt files go to this directory (inflates that repetition's times)",
    )
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    runs: list[dict[str, float]] = []
    usage: dict[str, tuple[int, int, int]] = {}
    for rep in range(args.reps):
        root = Path(tempfile.mkdtemp(prefix="zarrckpt-bench-", dir=args.tmp))
        try:
            cfg = {
                "gib": args.gib,
                "root": str(root),
                "rep": rep,
                "evict": args.evict_cache,
                "dcp_sync": not args.dcp_no_sync,
                "profile": str(args.profile) if args.profile else None,
                "result": str(root / "result.json"),
            }
            times = spawn(SAVE_WORLD, {**cfg, "phase": "save"})
            usage = {fmt: disk_usage(root / fmt) for fmt in FORMATS}
            times |= spawn(RESHARD_WORLD, {**cfg, "phase": "reshard"})
            runs.append(times)
            print(
                f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(times.items())),
                file=sys.stderr,
                flush=True,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)

    table = report(args, runs, usage)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)
    if args.profile:
        summarize_profiles(args.profile)


if __name__ == "__main__":
    main()
