"""Save from CUDA tensors: how long training is blocked, and what the save costs in GPU memory.

Usage (on a machine with NVIDIA GPUs)::

    python benchmarks/gpu_save.py [--gib 2] [--ranks N] [--url DIR] [--out benchmarks/results/gpu.md]

Each rank (default: one per visible GPU; gloo for zarrckpt's small collectives) holds its rows
of a ~``--gib`` GiB FP32 state as ``zarrckpt.LocalShard`` blocks on ``cuda:<rank>`` and:

1. saves it with ``zarrckpt.save`` twice (a sync save from GPU stages through pinned host buffers
   within ``--staging-mib``, default the library's 512 MiB; the first call allocates them);
2. calls ``zarrckpt.async_save`` twice (the first call allocates the pinned host staging
   buffers, the second reuses them): the time the call blocks, then the time to completion;
3. loads it back into zeroed CUDA tensors with ``zarrckpt.load`` and checks every value.

Below the table: sync save time / (``async_save`` + waiting) time, first calls and repeats, and the
peak RSS growth during a sync save against the staging budget (a sync save holds no host copy of the
state: the growth stays near the budget, not the state's size).

Around each, GPU memory from PyTorch's caching allocator: ``memory_allocated`` and
``memory_reserved`` before, during (sampled every 5 ms by a thread while the save runs) and
after, and ``max_memory_allocated`` (reset before each call); pinned host memory from
``torch.cuda.host_memory_stats()`` where this torch has it, and the process's peak RSS.

Without a CUDA device it exits (status 1) with a message saying so; ``--cpu-dry-run`` runs the
same steps on CPU tensors (memory columns then read 0) to check the script itself; it adds two rows
where the sync save stages its CPU tensors as it would GPU ones (``staging.write_local``'s ``moves``),
to exercise that path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from common import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt import api, release_staging, staging  # noqa: E402
from zarrckpt.testing import spawn  # noqa: E402

MIB = 2**20


def shapes(gib: float) -> list[tuple[int, int]]:
    """A few large 2-D FP32 tensors (weights + Adam moments) totalling about ``gib`` GiB."""
    cols = 4096
    rows = max(8, int(gib * 2**30 / 4 / cols / 12))
    return [(rows, cols)] * 12


class GpuMemory:
    """Sample the caching allocator's allocated/reserved bytes every ``interval`` s in a thread."""

    def __init__(self, device: torch.device, interval: float = 0.005) -> None:
        self.device, self.interval = device, interval
        self.max_allocated = self.max_reserved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now(self) -> tuple[int, int]:
        if self.device.type != "cuda":
            return 0, 0
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            a, r = self.now()
            self.max_allocated, self.max_reserved = max(self.max_allocated, a), max(self.max_reserved, r)

    def __enter__(self) -> GpuMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def pinned_bytes() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except (RuntimeError, AttributeError):
        return None


def step(name: str, device: torch.device, fn: Any, blocking: Any = None) -> dict[str, Any]:
    """Run ``fn`` (and then ``blocking(result)``, e.g. waiting on a future) with memory probes;
    ``staged_s``: until an ``AsyncSave`` result's ``wait_staged()`` returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reset_peak_rss()
    rss_before = rss_bytes()
    probe = GpuMemory(device)
    before = probe.now()
    with probe:
        start = time.perf_counter()
        result = fn()
        call = time.perf_counter() - start
        during = probe.now()
        if hasattr(result, "wait_staged"):
            result.wait_staged()
        staged = time.perf_counter() - start
        if blocking is not None:
            blocking(result)
        total = time.perf_counter() - start
    after = probe.now()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "step": name,
        "call_s": call,
        "staged_s": staged,
        "total_s": total,
        "allocated_before": before[0],
        "reserved_before": before[1],
        "allocated_right_after_call": during[0],
        "allocated_sampled_max": probe.max_allocated,
        "reserved_sampled_max": probe.max_reserved,
        "allocated_after": after[0],
        "reserved_after": after[1],
        "max_memory_allocated": peak,
        "pinned_host_bytes": pinned_bytes(),
        "peak_rss": peak_rss_bytes(),
        "rss_growth": peak_rss_bytes() - rss_before,
    }


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    device = torch.device("cpu") if cfg["cpu"] else torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state: dict[str, Any] = {}
    for i, (rows, cols) in enumerate(shapes(cfg["gib"])):
        lo, hi = rows * rank // world, rows * (rank + 1) // world
        gen = torch.Generator(device=device).manual_seed(i)
        full_rows = torch.randn((hi - lo, cols), generator=gen, device=device) + lo  # rows differ per rank
        state[f"t{i}"] = zarrckpt.LocalShard(full_rows, (rows, cols), (lo, 0))
    root, budget = cfg["url"], cfg["budget"]
    release_staging()
    steps = [
        step(f"zarrckpt.save (sync) ({call} call)", device, lambda c=call: save(state, f"{root}/sync-{c}", budget))
        for call in ("first", "repeat")
    ]
    if cfg["cpu"]:  # the staged path on CPU tensors, as GPU tensors take it
        api.write_local = partial(staging.write_local, moves=lambda t: True)  # type: ignore[assignment]
        release_staging()
        for call in ("first", "repeat"):
            url = f"{root}/sync-staged-{call}"
            steps.append(
                step(
                    f"zarrckpt.save (sync, staged path forced) ({call} call)",
                    device,
                    lambda u=url: save(state, u, budget),
                )
            )
        api.write_local = staging.write_local  # type: ignore[assignment]
    for mode in ("caller", "background"):
        release_staging()  # each mode's first call allocates (and pins) its staging buffers
        for call in ("first", "repeat"):
            steps.append(
                step(
                    f"zarrckpt.async_save(staging={mode!r}) ({call} call)",
                    device,
                    lambda call=call, mode=mode: zarrckpt.async_save(
                        state, f"{root}/async-{mode}-{call}", staging=mode
                    ),
                    lambda fut: fut.result(),
                )
            )
    release_staging()
    target = {k: zarrckpt.LocalShard(torch.zeros_like(v.data), v.global_shape, v.offsets) for k, v in state.items()}
    steps.append(step("zarrckpt.load", device, lambda: zarrckpt.load(target, f"{root}/sync-first")))
    for k, v in state.items():
        if not torch.equal(target[k].data, v.data):
            raise AssertionError(f"rank {rank}: {k} loaded wrong values")
    Path(cfg["out_dir"], f"rank{rank}.json").write_text(json.dumps(steps))


def save(state: dict[str, Any], url: str, budget: int | None) -> None:
    zarrckpt.save(state, url, staging_budget_bytes=budget)


def summary(per_rank: list[list[dict[str, Any]]], nbytes: int, budget: int) -> list[str]:
    """Sync save against async_save + waiting, and a sync save's RSS growth against its budget."""
    names = [s["step"] for s in per_rank[0]]

    def mx(name: str, key: str) -> float:
        i = names.index(name)
        return max((r[i][key] or 0) for r in per_rank)

    lines = [
        "",
        f"Staging budget of a sync save: {budget / MIB:.0f} MiB per rank; state {nbytes / MIB:.0f} MiB in all.",
        "",
    ]
    for call in ("first", "repeat"):
        sync = mx(f"zarrckpt.save (sync) ({call} call)", "total_s")
        for mode in ("caller", "background"):
            other = mx(f"zarrckpt.async_save(staging={mode!r}) ({call} call)", "total_s")
            lines.append(
                f"- sync save / (async_save(staging={mode!r}) + wait), {call} calls: "
                f"{sync:.3f} s / {other:.3f} s = {sync / other:.2f}"
            )
    for name in names:
        if name.startswith("zarrckpt.save (sync"):
            lines.append(
                f"- peak RSS growth during `{name}`: {mx(name, 'rss_growth') / MIB:.0f} MiB "
                f"(budget {budget / MIB:.0f} MiB, state per rank {nbytes / len(per_rank) / MIB:.0f} MiB)"
            )
    return lines


def report(args: argparse.Namespace, per_rank: list[list[dict[str, Any]]], nbytes: int) -> str:
    device = "CPU (dry run)" if args.cpu_dry_run else torch.cuda.get_device_name(0)
    lines = [
        f"# zarrckpt: save from {'CPU' if args.cpu_dry_run else 'CUDA'} tensors ({nbytes / 2**30:.2f} GiB FP32)",
        "",
        f"- {len(per_rank)} rank(s), {device}, torch {torch.__version__}; checkpoint at {args.url or 'a temp dir'}",
        "- times: max over ranks; memory: max over ranks, MiB; `during` = sampled every 5 ms while the save ran",
        "",
        "| step | blocked s | staged s | total s | GB/s | alloc before | alloc during (max) | alloc after | "
        "max_memory_allocated | reserved before / max / after | pinned host | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, first in enumerate(per_rank[0]):

        def mx(key: str, i: int = i) -> float:
            return max((r[i][key] or 0) for r in per_rank)

        lines.append(
            f"| {first['step']} | {mx('call_s'):.3f} | {mx('staged_s'):.3f} | {mx('total_s'):.3f} | "
            f"{nbytes / mx('total_s') / 1e9:.2f} | "
            f"{mx('allocated_before') / MIB:.0f} | {mx('allocated_sampled_max') / MIB:.0f} | "
            f"{mx('allocated_after') / MIB:.0f} | {mx('max_memory_allocated') / MIB:.0f} | "
            f"{mx('reserved_before') / MIB:.0f} / {mx('reserved_sampled_max') / MIB:.0f} / "
            f"{mx('reserved_after') / MIB:.0f} | {mx('pinned_host_bytes') / MIB:.0f} | {mx('peak_rss') / MIB:.0f} |"
        )
    budget = staging.save_budget(None if args.staging_mib is None else int(args.staging_mib * MIB))
    return "\n".join(lines + summary(per_rank, nbytes, budget)) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size in GiB over all ranks (default 2)")
    p.add_argument("--ranks", type=int, default=0, help="ranks (default: one per visible GPU)")
    p.add_argument("--url", default=None, help="where to save (default: a temp dir, deleted after)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "gpu.md", help="markdown report")
    p.add_argument("--staging-mib", type=float, default=None, help="sync save's staging budget (default: 512)")
    p.add_argument("--cpu-dry-run", action="store_true", help="run the same steps on CPU tensors (no GPU needed)")
    args = p.parse_args()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_save.py: no CUDA device here (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}); nothing was measured. Run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch, or pass --cpu-dry-run to check the script on CPU tensors.",
            file=sys.stderr,
        )
        return 1
    world = args.ranks or (1 if args.cpu_dry_run else torch.cuda.device_count())
    tmp = tempfile.mkdtemp(prefix="zarrckpt-gpu-")
    url = args.url or f"{tmp}/ckpt"
    try:
        budget = None if args.staging_mib is None else int(args.staging_mib * MIB)
        cfg = {"gib": args.gib, "url": url, "out_dir": tmp, "cpu": args.cpu_dry_run, "budget": budget}
        spawn(world, rank_main, cfg, timeout_s=1800.0, fresh=True)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    nbytes = sum(math.prod(s) * 4 for s in shapes(args.gib))
    text = report(args, per_rank, nbytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
