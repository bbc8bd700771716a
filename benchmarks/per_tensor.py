"""The fixed CPU cost per tensor of a save (issue 39): one process, tmpfs, the time of each phase.

    python benchmarks/per_tensor.py --tensors 20000 --dir /dev/shm/x [--reps 3] [--profile FILE]

Builds a seeded state (``--tensors`` float32 tensors of 1-64 KiB, some 2-D, plus one 32 MiB
tensor), saves it with ``zarrckpt.save`` to a fresh directory under ``--dir`` ``--reps`` times and
prints, per phase, the best seconds and microseconds per tensor (wall, and CPU of the process): collect
(``plan.localstate.collect``), planning (``engine.saveplan.plan_save``), writing shards, the
``zarr.json`` documents (made and written), commit (manifest and chunk checksum table), other
(preparing, the storage, ...), total. Then the raw byte cost (the same bytes written as one file,
best of ``--reps``) and what is left of the total per tensor: the fixed cost. Then the floor of the
save's files: the very files and directories one save made, with their bytes, written again from
memory by a plain loop (``mkdir``, ``open``, ``write``, ``close``; best of ``--reps``), and what the
save costs beyond that (describing, planning, checksums, documents, the commit). ``--profile FILE``
adds one more save under cProfile and writes its top 25 functions by tottime to FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import zarrckpt
from zarrckpt import api
from zarrckpt.engine import writer
from zarrckpt.plan.save import ZarrSavePlan

PHASES = ("collect", "planning", "shards", "documents", "commit", "other", "total")


def build_state(n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` float32 tensors of 1-64 KiB (a third 2-D), nested as a model's layers, and one of 32 MiB."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i in range(n):
        numel = int(rng.integers(256, 16385))
        if i % 3 == 0 and numel >= 64:
            shape: tuple[int, ...] = (64, numel // 64)
        else:
            shape = (numel,)
        state[f"model.layers.{i // 8}.p{i % 8}"] = torch.randn(shape, generator=gen)
    state["model.embed.weight"] = torch.randn((8192, 1024), generator=gen)
    return state


class Phases:
    """Seconds per phase of one save (wall, and CPU of the whole process: steadier when other
    processes share the cores), from wrappers around the functions ``zarrckpt.save`` calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.cpu[phase] += time.process_time() - cpu

        return timed


@contextlib.contextmanager
def timing(phases: Phases) -> Iterator[None]:
    """Wrap the phases' functions where ``zarrckpt.api`` and ``engine.writer`` look them up."""
    patches = [
        (api, "collect", "collect"),
        (api, "plan_save", "planning"),
        (api, "write_local", "shards"),
        (api, "commit_save", "commit"),  # less the documents, below
        (writer, "write_metadata", "documents"),
        (ZarrSavePlan, "metadata_of", "documents"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, phase in patches:
            setattr(owner, name, phases.wrap(phase, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def one_save(state: dict[str, Any], url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(wall seconds, CPU seconds) per phase of one save."""
    shutil.rmtree(url, ignore_errors=True)
    phases = Phases()
    with timing(phases):
        start, cpu = time.perf_counter(), time.process_time()
        zarrckpt.save(state, url)
        total, cpu_total = time.perf_counter() - start, time.process_time() - cpu
    for s, whole in ((phases.seconds, total), (phases.cpu, cpu_total)):
        s["commit"] -= s["documents"]
        s["other"] = whole - sum(s[p] for p in PHASES[:5])
        s["total"] = whole
    return dict(phases.seconds), dict(phases.cpu)


def raw_write(state: dict[str, Any], path: str) -> float:
    """Seconds to write every tensor's bytes as one file (the byte cost a save cannot avoid)."""
    views = [t.numpy().data.cast("B") for t in state.values()]
    start = time.perf_counter()
    with open(path, "wb") as f:
        for v in views:
            f.write(v)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def saved_files(root: str) -> tuple[list[str], list[tuple[str, bytes]]]:
    """The directories (parents first) and files (path, bytes) under ``root``, relative to it."""
    dirs, files = [], []
    for here, subdirs, names in os.walk(root):
        rel = os.path.relpath(here, root)
        dirs += [os.path.normpath(os.path.join(rel, d)) for d in subdirs]
        for name in names:
            with open(os.path.join(here, name), "rb") as f:
                files.append((os.path.normpath(os.path.join(rel, name)), f.read()))
    return sorted(dirs), sorted(files)


def bare_files(dirs: list[str], files: list[tuple[str, bytes]], root: str) -> float:
    """Seconds to write ``files`` and make ``dirs`` under a fresh ``root`` in a plain loop: the cost
    of the save's own files and directories, without anything the save decides or checks."""
    shutil.rmtree(root, ignore_errors=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    start = time.perf_counter()
    os.mkdir(root)
    for d in dirs:
        os.mkdir(os.path.join(root, d))
    for rel, data in files:
        fd = os.open(os.path.join(root, rel), flags, 0o666)
        os.write(fd, data)
        os.close(fd)
    seconds = time.perf_counter() - start
    shutil.rmtree(root)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=20000)
    p.add_argument("--dir", default="/dev/shm/zarrckpt-per-tensor")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="FILE", help="one more save under cProfile: top 25 by tottime to FILE")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = build_state(args.tensors, args.seed)
    n = len(state)
    nbytes = sum(t.nbytes for t in state.values())
    url = os.path.join(args.dir, "ckpt")
    zarrckpt.save(state, url, overwrite=True)  # warm: imports, caches
    both = [one_save(state, url) for _ in range(args.reps)]
    runs, cpus = [r[0] for r in both], [r[1] for r in both]
    raw = min(raw_write(state, os.path.join(args.dir, "raw.bin")) for _ in range(args.reps))
    dirs, files = saved_files(url)
    bare = min(bare_files(dirs, files, os.path.join(args.dir, "bare")) for _ in range(args.reps))
    print(f"{n} tensors, {nbytes / 2**20:.1f} MiB, best of {args.reps} saves on {args.dir}")
    print(f"{'phase':<10} {'s':>8} {'us/tensor':>10} {'CPU us/t':>9}   (each run, s)")
    for phase in PHASES:
        best, cpu = min(r[phase] for r in runs), min(c[phase] for c in cpus)
        each = " ".join(f"{r[phase]:.3f}" for r in runs)
        print(f"{phase:<10} {best:8.3f} {best / n * 1e6:10.1f} {cpu / n * 1e6:9.1f}   ({each})")
    total = min(r["total"] for r in runs)
    print(f"{'raw bytes':<10} {raw:8.3f} {raw / n * 1e6:10.1f}   (one file of the same bytes)")
    print(f"{'fixed':<10} {total - raw:8.3f} {(total - raw) / n * 1e6:10.1f}   (total - raw bytes)")
    print(
        f"{'bare files':<10} {bare:8.3f} {bare / n * 1e6:10.1f}   "
        f"(the save's {len(files)} files and {len(dirs)} directories, written by a plain loop)"
    )
    print(f"{'beyond':<10} {total - bare:8.3f} {(total - bare) / n * 1e6:10.1f}   (total - bare files)")
    if args.profile:
        shutil.rmtree(url, ignore_errors=True)
        prof = cProfile.Profile()
        prof.runcall(zarrckpt.save, state, url)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())
        print(f"profile: {args.profile}")
    shutil.rmtree(url, ignore_errors=True)


if __name__ == "__main__":
    main()
