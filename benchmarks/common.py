"""Shared pieces of the benchmarks: the deterministic DTensor state, timing, profiling, probes.

Used by ``run.py`` (the suite behind ``make bench``) and ``core_vs_dcp.py``. Imported by
name from the rank processes, so it must not import anything heavy besides torch.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import math
import os
import pstats
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

LAYERS = 2
BLOCK_ELEMS = 1 << 20  # deterministic generation unit: rows are generated in blocks of ~1M elements


# -- the state: shapes and deterministic contents ----------------------------------------------


def hidden_size(gib: float) -> int:
    """Hidden size h (a multiple of 64, not of 3) so the state totals about ``gib`` GiB.

    The model has ``LAYERS`` blocks of 12 h^2 parameters plus an (8h, h) embedding, i.e.
    about 32 h^2 parameters, each with an FP32 weight, exp_avg and exp_avg_sq (12 bytes).
    """
    params = gib * 2**30 / 12
    h = max(64, round(math.sqrt(params / (12 * LAYERS + 8)) / 64) * 64)
    return h + 64 if h % 3 == 0 else h  # uneven 3-way splits make resharding non-trivial


def model_shapes(h: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> global shape: a few big 2-D weights and some small 1-D tensors."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8 * h, h)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "attn.qkv.weight"] = (3 * h, h)
        shapes[p + "attn.qkv.bias"] = (3 * h,)
        shapes[p + "attn.out.weight"] = (h, h)
        shapes[p + "mlp_norm.weight"] = (h,)
        shapes[p + "mlp.up.weight"] = (4 * h, h)
        shapes[p + "mlp.up.bias"] = (4 * h,)
        shapes[p + "mlp.down.weight"] = (h, 4 * h)
    shapes["final_norm.weight"] = (h,)
    return shapes


def tensor_specs(gib: float) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(path in the nested state dict, global shape) for every tensor, in a fixed order."""
    specs: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
    shapes = model_shapes(hidden_size(gib))
    for name, shape in shapes.items():
        specs.append((("model", name), shape))
    for name, shape in shapes.items():
        specs.append((("optim", "state", name, "exp_avg"), shape))
        specs.append((("optim", "state", name, "exp_avg_sq"), shape))
    return specs


def state_nbytes(gib: float) -> int:
    return sum(math.prod(shape) * 4 for _, shape in tensor_specs(gib))


def generate_rows(index: int, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of global tensor number ``index`` (deterministic, any rank).

    Rows are generated in fixed blocks, each from a ``torch.Generator`` seeded by (tensor
    index, block), so a rank only generates the blocks its slice touches.
    """
    row = math.prod(shape[1:])
    per_block = max(1, BLOCK_ELEMS // max(row, 1))
    out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
    gen = torch.Generator()
    for block in range(start // per_block, -(-stop // per_block) if stop > start else 0):
        lo, hi = block * per_block, min((block + 1) * per_block, shape[0])
        gen.manual_seed(index * 1_000_003 + block)
        data = torch.randn((hi - lo, *shape[1:]), generator=gen)
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = data[a - lo : b - lo]
    return out


def sharded(local: torch.Tensor, mesh: Any, shape: tuple[int, ...]) -> DTensor:
    """A Shard(0) DTensor of global ``shape`` whose local part is ``local``."""
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def build_specs_state(
    specs: list[tuple[tuple[str, ...], tuple[int, ...]]], mesh: Any, fill: bool
) -> tuple[dict[str, Any], list[int]]:
    """This rank's nested state of Shard(0) DTensors for ``specs``, and the crc32c of each local shard.

    ``fill=True``: the generated data (what is saved). ``fill=False``: zeros (a load target);
    the checksums are always those of the expected data.
    """
    state: dict[str, Any] = {}
    checksums: list[int] = []
    for index, (path, shape) in enumerate(specs):
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        expected = generate_rows(index, shape, offset[0], offset[0] + local_shape[0])
        checksums.append(crc32c.crc32c(expected.numpy()))
        local = expected if fill else torch.zeros_like(expected)
        del expected
        node = state
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = sharded(local, mesh, shape)
    return state, checksums


def build_state(gib: float, mesh: Any, fill: bool) -> tuple[dict[str, Any], list[int]]:
    """The ~``gib`` GiB model + Adam state (see :func:`build_specs_state`)."""
    return build_specs_state(tensor_specs(gib), mesh, fill)


def leaves(state: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in state.values():
        out += leaves(value) if isinstance(value, dict) else [value.to_local()]
    return out


def verify(state: dict[str, Any], checksums: list[int], what: str) -> None:
    """Raise unless every local shard matches the expected data; then zero it for the next load."""
    got = [crc32c.crc32c(t.numpy()) for t in leaves(state)]
    bad = [i for i, (a, b) in enumerate(zip(got, checksums, strict=True)) if a != b]
    if bad:
        raise AssertionError(f"rank {dist.get_rank()}: {what} loaded wrong data into tensors {bad}")
    for t in leaves(state):
        t.zero_()


# -- profiling and timing ----------------------------------------------------------------------


class ThreadsProfile:
    """cProfile of the calling thread and of every thread started while it is enabled, merged.

    cProfile alone sees only the calling thread, and zarrckpt does its I/O in a thread pool.
    Times are CPU seconds per thread (``time.thread_time``), summed: waits (barriers, I/O
    queues, the GIL) do not show, so the numbers say where the CPU goes.
    """

    def __init__(self) -> None:
        self.profiles = [cProfile.Profile(time.thread_time)]

    def _start_in_thread(self, *_: Any) -> None:
        prof = cProfile.Profile(time.thread_time)
        self.profiles.append(prof)  # list.append is atomic under the GIL
        prof.enable()  # replaces this hook in the new thread

    def __enter__(self) -> ThreadsProfile:
        threading.setprofile(self._start_in_thread)
        self.profiles[0].enable()
        return self

    def __exit__(self, *_: Any) -> None:
        self.profiles[0].disable()
        threading.setprofile(None)  # type: ignore[arg-type]

    def dump(self, path: Path) -> None:
        stats = pstats.Stats(self.profiles[0])
        for prof in self.profiles[1:]:
            stats.add(prof)
        stats.dump_stats(path)


def summarize_profiles(directory: Path) -> None:
    """Write a ``.txt`` summary (top self time, top cumulative) next to every ``.pstats`` file."""
    for name in sorted(directory.glob("*.pstats")):
        buf = io.StringIO()
        stats = pstats.Stats(str(name), stream=buf)
        stats.sort_stats("tottime").print_stats(15)
        stats.sort_stats("cumulative").print_stats(25)
        (directory / f"{name.stem}.txt").write_text(buf.getvalue())


def top_functions(pstats_file: Path, n: int = 6) -> list[tuple[str, float]]:
    """The ``n`` functions with the most self CPU time in a profile: (``file:line(name)``, seconds)."""
    stats = pstats.Stats(str(pstats_file))
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]  # type: ignore[attr-defined]
    out = []
    for (file, line, func), (_, _, tottime, _, _) in rows:
        short = "/".join(Path(file).parts[-2:]) if file != "~" else ""
        out.append((f"{short}:{line}({func})" if short else func, float(tottime)))
    return out


def timed(fn: Callable[[], Any], profile_to: Path | None = None) -> float:
    """Max over ranks of the wall time of ``fn`` between a barrier before and one after."""
    prof = ThreadsProfile() if profile_to is not None and dist.get_rank() == 0 else None
    dist.barrier()
    start = time.perf_counter()
    with prof or contextlib.nullcontext():
        fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if prof is not None and profile_to is not None:
        prof.dump(profile_to)
    return float(elapsed.item())


# -- per-process probes: peak RSS and bytes read -----------------------------------------------


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (peak RSS) to its current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def io_counters() -> dict[str, int]:
    """``/proc/self/io`` (all threads of this process): rchar/wchar = bytes passed to read/write
    system calls (page cache hits included; sockets too), read_bytes/write_bytes = block I/O."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def measure(fn: Callable[[], Any], profile_to: Path | None = None) -> dict[str, float]:
    """Run ``fn`` on every rank between barriers; return what all ranks agree on.

    ``s``: max over ranks of the wall time from a barrier before to a barrier after;
    ``call_s``: max over ranks of the time ``fn`` itself took (no barrier after: what a
    training loop would be blocked for); ``rss_peak``: max over ranks of VmHWM after ``fn``
    (reset to the current RSS right before); ``rss_extra``: max over ranks of that peak minus
    the RSS before ``fn``; ``rchar``, ``read_bytes``, ``wchar``, ``write_bytes``: sums over ranks
    of the ``/proc/self/io`` deltas.
    """
    prof = ThreadsProfile() if profile_to is not None and dist.get_rank() == 0 else None
    dist.barrier()
    reset_peak_rss()
    rss0, io0 = rss_bytes(), io_counters()
    wall0 = time.time()
    start = time.perf_counter()
    with prof or contextlib.nullcontext():
        fn()
    call = time.perf_counter() - start
    dist.barrier()
    elapsed = time.perf_counter() - start
    wall1 = time.time()
    io1, peak = io_counters(), peak_rss_bytes()
    maxes = torch.tensor([elapsed, call, peak, peak - rss0], dtype=torch.float64)
    keys = ("rchar", "read_bytes", "wchar", "write_bytes")
    sums = torch.tensor([io1.get(k, 0) - io0.get(k, 0) for k in keys], dtype=torch.float64)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    if prof is not None and profile_to is not None:
        prof.dump(profile_to)
    out = dict(zip(("s", "call_s", "rss_peak", "rss_extra"), maxes.tolist(), strict=True))
    return out | dict(zip(keys, sums.tolist(), strict=True)) | {"t0": wall0, "t1": wall1}


class CpuSampler:
    """A thread sampling, every ``interval`` s, this process's CPU time, that of the processes in
    ``watched`` (a server's, e.g. the RADOS Gateway's daemons) and the machine's busy time.

    ``usage(t0, t1)`` then says, for a wall-clock window (``time.time``) measured in any process
    of the machine: (CPU cores this process used, fraction of all the machine's CPU time busy,
    CPU cores the watched processes used).
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.watched: list[int] = []
        # (wall, own CPU s, busy jiffies, all jiffies, watched CPU s)
        self.samples: list[tuple[float, float, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _machine() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def _watched_cpu(self) -> float:
        total = 0
        for pid in self.watched:
            try:  # utime and stime: fields 14 and 15, counted after the ")" closing the name
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / self._tick

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            t = os.times()
            self.samples.append((time.time(), t.user + t.system, *self._machine(), self._watched_cpu()))

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def usage(self, t0: float, t1: float) -> tuple[float, float, float] | None:
        """Over the samples bracketing [t0, t1]: (own cores, machine busy fraction, watched cores)."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return None
        (w0, c0, b0, a0, x0), (w1, c1, b1, a1, x1) = before[-1], after[0]
        wall = max(w1 - w0, 1e-9)
        return (c1 - c0) / wall, (b1 - b0) / max(a1 - a0, 1), (x1 - x0) / wall


WINDOW_SLACK_S = 0.05  # requests counted in a time window, widened by this much each side


def requests_in(log: Any, t0: float, t1: float, prefix: str | None = None) -> dict[str, Any]:
    """S3 requests the server got in ``[t0, t1]`` (wall clock), by kind, and body bytes sent: any key
    of the bucket, or with ``prefix`` (``bucket/some/prefix``) those about objects under it."""
    out: dict[str, Any] = {"requests": 0, "bytes": 0, "detail": []}
    for r in log.requests():
        if t0 - WINDOW_SLACK_S <= r.start <= t1 + WINDOW_SLACK_S and (prefix is None or r.touches(prefix)):
            out["requests"] += 1
            out["bytes"] += r.bytes_sent
            out[r.kind] = out.get(r.kind, 0) + 1
            if len(out["detail"]) < 10:
                out["detail"].append(f"{r.kind} {r.target} {r.start - t0:+.3f}s {r.bytes_sent} B")
    return out


# -- files -------------------------------------------------------------------------------------


def evict_page_cache(root: Path) -> None:
    """Best effort: fsync each file and ask the kernel to drop its cached pages."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_usage(root: Path) -> tuple[int, int, int]:
    """(files, apparent bytes, allocated bytes) under ``root``."""
    files = apparent = allocated = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            files += 1
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return files, apparent, allocated
