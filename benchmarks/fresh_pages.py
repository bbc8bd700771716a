"""A local save's time on fresh memory pages and on recycled ones: zarrckpt and DCP side by side.

    python benchmarks/fresh_pages.py [--gib 2] [--ranks 4] [--idle 40] [--dir /tmp/fresh-pages]

Why: in ``run.py``'s section 1 each library's save is the first of a fresh process, writing into
page-cache pages the kernel must find. On a virtual machine whose guest hands free memory back to
the host (free page reporting, a balloon), a page that has been free for a while is no longer
backed by host memory, and the first write into it faults on the host. The bench's ratio to DCP
then depends on how warm the pages were. This script measures it: per library, in one spawn of
``--ranks`` processes and the bench state (``common.build_state``), four saves each followed by
removing what it wrote: the first of the process, one right after (pages just freed: recycled),
one after ``--idle`` seconds without I/O (pages handed back, fresh again), and one right after that.
Libraries alternate spawns; ``os.sync()`` (untimed) before every save; time = max over ranks,
barrier to barrier. Prints one row per library and the ratio per save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SAVES = ("first in process", "recycled pages", "after idle", "recycled again")


def phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from common import build_state
    from torch.distributed.device_mesh import init_device_mesh

    import zarrckpt

    mesh = init_device_mesh("cpu", (world,))
    state, _ = build_state(cfg["gib"], mesh, fill=True)
    root = Path(cfg["dir"])

    def save(path: Path) -> None:
        if cfg["lib"] == "dcp":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        else:
            zarrckpt.save(state, str(path))

    times = []
    for i, _ in enumerate(SAVES):
        if rank == 0:
            os.sync()
            if i == 2:
                time.sleep(cfg["idle"])
        dist.barrier()
        start = time.perf_counter()
        save(root / f"s{i}")
        dist.barrier()
        times.append(time.perf_counter() - start)
        if rank == 0:
            shutil.rmtree(root / f"s{i}")
        dist.barrier()
    if rank == 0:
        Path(cfg["result"]).write_text(" ".join(f"{t:.3f}" for t in times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--idle", type=float, default=40.0, help="seconds without I/O before the third save")
    p.add_argument("--dir", default="/tmp/zarrckpt-fresh-pages")
    p.add_argument("--rounds", type=int, default=1, help="spawns per library (alternating)")
    args = p.parse_args()
    from zarrckpt.testing.procs import spawn

    results: dict[str, list[list[float]]] = {"zarrckpt": [], "dcp": []}
    for _ in range(args.rounds):
        for lib in results:
            root = Path(args.dir) / lib
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            out = Path(args.dir) / f"{lib}.txt"
            cfg = {"lib": lib, "gib": args.gib, "dir": str(root), "idle": args.idle, "result": str(out)}
            spawn(args.ranks, phase, cfg, timeout_s=600.0, fresh=True)
            results[lib].append([float(x) for x in out.read_text().split()])
            shutil.rmtree(root, ignore_errors=True)
    print(f"{args.gib} GiB, {args.ranks} ranks, {args.dir}; seconds (each round)")
    print(f"| save | {' | '.join(SAVES)} |")
    print(f"|---|{'---:|' * len(SAVES)}")
    for lib, rounds in results.items():
        cells = [", ".join(f"{r[i]:.2f}" for r in rounds) for i in range(len(SAVES))]
        print(f"| {lib} | {' | '.join(cells)} |")
    ratio = [min(r[i] for r in results["dcp"]) / min(r[i] for r in results["zarrckpt"]) for i in range(len(SAVES))]
    print(f"| DCP time / zarrckpt's (best of rounds) | {' | '.join(f'{x:.2f}x' for x in ratio)} |")


if __name__ == "__main__":
    main()
