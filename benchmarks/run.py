"""The benchmark suite: zarrckpt side by side with DCP (and TensorStore, s3torchconnector, a raw write).

Usage::

    python benchmarks/run.py                 # full run (make bench): 2 GiB local, 256 MiB S3, 5 reps
    python benchmarks/run.py --quick         # smoke run: small sizes, 1 repetition
    python benchmarks/run.py --only lazy     # some scenarios only: local, s3, lazy, async, many
    python benchmarks/run.py --rgw off       # S3 on moto only (default: RGW too, where Ceph is installed)

Writes ``benchmarks/results/latest.md`` (targets with PASS / MISS, one section per scenario)
and PNG charts next to it. Scenarios (see benchmarks/README.md):

1. save, 4 gloo ranks, local disk: zarrckpt, ``dcp.save`` + ``FileSystemWriter``, TensorStore
   zarr3 with zarrckpt's layout, a raw fsync'd write of the same bytes;
2. resharding load 4 -> 3 ranks from local disk, with read amplification (TensorStore too);
3. the same two on ``s3://`` against moto (started here) and, where Ceph is installed, a Ceph
   RADOS Gateway (``benchmarks/rgw/start-rgw.sh``, started here); DCP through ``FsspecWriter/Reader``
   and through s3torchconnector (on RGW via ``etagproxy.py``); TensorStore's s3 kvstore (moto);
4. lazy read of one expert slice on S3 (both servers), requests and bytes counted at the server;
5. async save: time the caller is blocked vs the synchronous save, and DCP's ``async_save``;
6. peak RSS per rank of every save and load;
7. many small tensors (``scenarios_peers.py``): save and load on 1 and 4 ranks, zarrckpt vs DCP.

Each repetition spawns fresh rank processes (one spawn of 4 for the saves, one of 3 for the
loads); the order of the libraries rotates between repetitions; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import scenarios  # noqa: E402  (after the sys.path setup)
import scenarios_peers  # noqa: E402
import torch  # noqa: E402
from common import CpuSampler, generate_rows, state_nbytes, summarize_profiles  # noqa: E402
from report import render, targets  # noqa: E402
from servers import Store, stores  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt.testing import remove_tree, spawn  # noqa: E402

SAVE_WORLD, LOAD_WORLD = 4, 3
PARTS = ("local", "s3", "lazy", "async", "many")


SAMPLER = CpuSampler()


def run_spawn(world: int, fn: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``fn`` on ``world`` gloo ranks; annotate each measurement with the CPU use of the S3
    server (moto: this process; RGW: its daemons) and of the whole machine during it."""
    spawn(world, fn, cfg, timeout_s=1800.0, fresh=True)
    results = json.loads(Path(cfg["result"]).read_text())
    for key, value in results.items():
        if isinstance(value, dict) and "t0" in value:
            usage = SAMPLER.usage(value["t0"], value["t1"])
            if usage is not None:
                own, value["machine_busy"], watched = usage
                value["server_cores"] = watched if key.startswith("rgw_") else own
    return results


def one_rep(
    args: argparse.Namespace,
    rep: int,
    s3: list[Store],
    profile: str | None,
    layout: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Both spawns of one repetition; returns the merged results (with S3 request counts)."""
    only = set(args.only)
    root = Path(tempfile.mkdtemp(prefix="zarrckpt-bench-", dir=args.tmp))
    url = {store.name: f"{store.url}/rep{rep}-{os.getpid()}" for store in s3}
    cfg = {
        "root": str(root),
        "rep": rep,
        "gib": args.gib,
        "s3_gib": args.s3_mib / 1024,
        "stores": [store.cfg() | {"url": url[store.name]} for store in s3],
        "profile": profile,
        "evict": args.evict_cache,
        "tensorstore": not args.no_tensorstore,
        "result": str(root / "result.json"),
        "layout": layout,
        "s3_libs": args.s3_libs,
        "many_tensors": args.many_tensors,
        "many_big_mib": args.many_big_mib,
    }
    results: dict[str, Any] = {}
    try:
        save_parts = sorted(only & {"local", "async", "s3"})
        if save_parts:
            clear_logs(s3)
            results |= run_spawn(SAVE_WORLD, scenarios.save_phase, {**cfg, "parts": save_parts})
            if "s3" in only:
                count(results, s3, url, "save", ("PUT", "POST", "GET", "HEAD", "DELETE"))
        load_parts = sorted(only & {"local", "s3"})
        if load_parts:
            clear_logs(s3)
            results |= run_spawn(LOAD_WORLD, scenarios.load_phase, {**cfg, "parts": load_parts})
            if "s3" in only:
                count(results, s3, url, "reshard", ("GET", "HEAD"))
        for world in args.many_ranks if "many" in only else []:  # scenario 7
            results |= run_spawn(world, scenarios_peers.many_phase, cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for store in s3:
            remove_tree(url[store.name], store.opts)
    return results


def clear_logs(s3: list[Store]) -> None:
    for store in s3:
        if store.log is not None:
            store.log.clear()


def count(results: dict[str, Any], s3: list[Store], url: dict[str, str], op: str, methods: tuple[str, ...]) -> None:
    """Requests and body bytes each server answered about each library's checkpoint, as
    ``results["<server>_<op>/<library>/s3"]``."""
    for store in s3:
        if store.log is not None:
            for lib in scenarios.S3_LIBS:
                if f"{store.name}_{op}/{lib}" not in results:  # not run on this server
                    continue
                results[f"{store.name}_{op}/{lib}/s3"] = store.log.summary(f"{url[store.name]}/{lib}", methods)


def round_trips(hits: list[Any]) -> int:
    """Requests in sequence: a request that starts after every earlier one has ended begins a new
    round trip (the server's clock: each request's start and duration)."""
    trips, end = 0, -1.0
    for h in sorted(hits, key=lambda h: h.start):
        if h.start >= end:
            trips += 1
        end = max(end, h.start + h.seconds)
    return trips


LATENCY_S = 0.1  # the delay a proxy adds to every request in round_trips_behind_latency


def round_trips_behind_latency(url: str, opts: dict[str, Any], key: str, i: int, j: int) -> dict[str, float]:
    """Round trips of a tensor's first read (``[i]``) and a later one (``[j]``), as a far server sees
    them: through a proxy that holds every request :data:`LATENCY_S`, a read's time over that delay
    (about 1: its requests were in flight together; 2: one waited for another). On loopback the
    server's own log cannot tell, a request being over before the next is even sent."""
    from zarrckpt.testing.proxy import FaultProxy

    proxy = FaultProxy(opts["endpoint_url"])
    try:
        proxy.delay = LATENCY_S
        ckpt = zarrckpt.open(url, storage_options={**opts, "endpoint_url": proxy.endpoint})
        out = {}
        for name, index in (("zarrckpt_index", i), ("zarrckpt_later", j)):
            start = time.perf_counter()
            ckpt[key][index]
            out[name] = round((time.perf_counter() - start) / LATENCY_S, 1)
        return out
    finally:
        proxy.close()


def lazy_scenario(args: argparse.Namespace, store: Store) -> dict[str, Any]:
    """Save the expert tensors with ``--lazy-ranks`` ranks, then read one slice here, counting requests."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    opts, log = store.opts, store.log
    assert log is not None, "the lazy scenario counts requests at the server"
    url = f"{store.url}/lazy-{os.getpid()}"
    shape = tuple(args.lazy_shape)
    root = Path(tempfile.mkdtemp(prefix="zarrckpt-bench-lazy-", dir=args.tmp))
    cfg = {"root": str(root), "rep": 0, "url": url, "opts": opts, "lazy_shape": shape, "result": str(root / "r.json")}
    try:
        saved = run_spawn(args.lazy_ranks, scenarios.lazy_phase, cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path, _ = scenarios.lazy_specs(shape)[0]
    key, i = ".".join(path), args.lazy_index
    expected = generate_rows(0, shape, i, i + 1)[0]
    zurl, durl = f"{url}/zarrckpt", f"{url}/dcp"

    def counted(where: str, fn: Any) -> tuple[Any, dict[str, Any]]:
        log.clear()
        start = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - start
        hits = log.requests(where)
        kinds: dict[str, int] = {}
        for h in hits:
            kinds[h.method] = kinds.get(h.method, 0) + 1
        count = {"requests": len(hits), "bytes": sum(h.bytes_sent for h in hits), "kinds": kinds, "s": seconds}
        return value, count | {"round_trips": round_trips(hits)}

    def dcp_read() -> torch.Tensor:
        target = {path[0]: {path[1]: torch.empty(shape)}}
        dcp.load(target, storage_reader=FsspecReader(durl, **opts))
        return target[path[0]][path[1]][i]

    runs: dict[str, list[dict[str, Any]]] = {"zarrckpt_open": [], "zarrckpt_index": [], "zarrckpt": [], "dcp": []}
    runs["zarrckpt_later"] = []  # another expert of the same tensor, after the first
    counted(zurl, lambda: zarrckpt.open(zurl, storage_options=opts)[key][i])  # warm-up (imports, clients)
    j = (i + 1) % shape[0]
    for _ in range(max(args.reps, 3)):
        ckpt, opened = counted(zurl, lambda: zarrckpt.open(zurl, storage_options=opts))
        got, indexed = counted(zurl, lambda ckpt=ckpt: ckpt[key][i])
        assert torch.equal(got, expected), "zarrckpt lazy read returned wrong data"
        again, later = counted(zurl, lambda ckpt=ckpt: ckpt[key][j])
        assert torch.equal(again, generate_rows(0, shape, j, j + 1)[0]), "zarrckpt's later read returned wrong data"
        runs["zarrckpt_open"].append(opened)
        runs["zarrckpt_index"].append(indexed)
        runs["zarrckpt_later"].append(later)
        runs["zarrckpt"].append(
            {k: opened[k] + indexed[k] for k in ("requests", "bytes", "s")}
            | {
                "kinds": {
                    m: opened["kinds"].get(m, 0) + indexed["kinds"].get(m, 0)
                    for m in opened["kinds"].keys() | indexed["kinds"].keys()
                }
            }
        )
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore")
            got, read = counted(durl, dcp_read)
        assert torch.equal(got, expected), "DCP read returned wrong data"
        runs["dcp"].append(read)
    trips = round_trips_behind_latency(zurl, opts, key, i, j)
    for name in ("zarrckpt_index", "zarrckpt_later"):  # (the server's log cannot tell them on loopback)
        for run in runs[name]:
            run["round_trips"] = trips[name]
    layout = next(t for t in zarrckpt.open(zurl, storage_options=opts).tensors() if t["key"] == key)
    remove_tree(url, opts)
    out: dict[str, Any] = {
        "key": key,
        "shape": list(shape),
        "index": i,
        "ranks": args.lazy_ranks,
        "tensors": len(scenarios.lazy_specs(shape)),
        "slice_bytes": int(expected.numel() * 4),
        "layout": layout,
        "reps": len(runs["dcp"]),
        "saved": saved,
    }
    for name, rows in runs.items():
        last = rows[-1]
        out[name] = {**last, "s": sorted(r["s"] for r in rows)[len(rows) // 2]}
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def environment(args: argparse.Namespace, argv: list[str]) -> list[str]:
    from importlib.metadata import version

    def load() -> str:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())

    storage = args.tmp or tempfile.gettempdir()
    fstype = subprocess.run(["df", "-T", storage], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    return [
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/run.py {' '.join(argv)}`".rstrip(),
        f"torch {torch.__version__}, zarrckpt {zarrckpt.__version__}, tensorstore {version('tensorstore')}, "
        f"moto {version('moto')}, s3torchconnector {_version('s3torchconnector')}, "
        f"Python {platform.python_version()}; {os.cpu_count()} CPUs; "
        f"gloo, 1 torch thread per rank; local storage: {storage} ({fstype})",
        f"load average (1/5/15 min) at the start: {load()}",
        f"medians of {args.reps} repetition(s); time = max over ranks between a barrier before and after; "
        "GB/s = state bytes / time (1 GB = 1e9 B); the order of the local savers rotates by one per "
        "repetition (of zarrckpt and DCP elsewhere: alternates), "
        "with an untimed `os.sync()` before each local save; each spawn "
        "first runs every library on a tiny state (untimed)",
        "everything fsyncs on local disk (zarrckpt, DCP's default `sync_files=True`, TensorStore's default "
        "`file_io_sync`, the raw write); on S3 DCP gets `sync_files=False` (its fsync becomes `os.sync()` "
        "there); page cache "
        + ("evicted (best effort) before the local loads" if args.evict_cache else "NOT dropped before the loads"),
    ]


GPU_NOTE = (
    "No GPU on this machine{}. `python benchmarks/gpu_save.py` measures a save from CUDA tensors where "
    "one exists: blocked time of `zarrckpt.async_save`, `torch.cuda.memory_allocated` / `memory_reserved` "
    "before, during and after the save, `max_memory_allocated`, and the pinned host staging."
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="local state size, GiB (default 2)")
    p.add_argument("--s3-mib", type=float, default=256, help="S3 state size, MiB (default 256; moto is slow)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported (default 5)")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repetition (a smoke run, < ~2 min)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument(
        "--rgw", choices=("auto", "on", "off", "only"), default="auto", help="S3 scenarios on a RADOS Gateway too"
    )
    p.add_argument("--s3-options", default="", help="JSON storage_options merged into every S3 store's")
    p.add_argument("--lazy-shape", default="64,256,256", help="expert tensor shape (default 64,256,256)")
    p.add_argument("--lazy-ranks", type=int, default=8, help="ranks that save the expert tensors (default 8)")
    p.add_argument("--lazy-index", type=int, default=5, help="expert index read lazily (default 5)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "latest.md", help="report (charts go next to it)")
    p.add_argument("--tmp", default=None, help="parent directory of the local checkpoints (default: system temp)")
    p.add_argument("--evict-cache", action="store_true", help="fsync + POSIX_FADV_DONTNEED before local loads")
    p.add_argument("--no-tensorstore", action="store_true", help="leave TensorStore out (local and S3)")
    p.add_argument("--no-s3tc", action="store_true", help="leave s3torchconnector out of the S3 scenarios")
    p.add_argument("--many-tensors", type=int, default=20_000, help="small tensors in scenario 7 (default 20000)")
    p.add_argument("--many-big-mib", type=float, default=64, help="its one large tensor, MiB (default 64)")
    p.add_argument("--many-ranks", default="1,4", help="world sizes of scenario 7 (default 1,4)")
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument("--charts-dir", type=Path, default=None, help="where the charts go (default: next to --out)")
    p.add_argument("--json", type=Path, default=None, help="also write every measurement to this JSON file")
    p.add_argument("--profile", type=Path, default=None, help="profile rank 0 in an extra, untimed repetition")
    p.add_argument("--from-json", type=Path, default=None, help="only re-render the report of a --json file")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        write_report(args, saved["runs"], saved["lazy"], saved["info"])
        return 0
    args.only = [x for x in args.only.split(",") if x]
    if unknown := set(args.only) - set(PARTS):
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    args.lazy_shape = [int(x) for x in args.lazy_shape.split(",")]
    if args.quick:
        args.gib = min(args.gib, 0.05)
        args.s3_mib = min(args.s3_mib, 16)
        args.many_tensors = min(args.many_tensors, 2_000)
        args.reps = 1
    args.many_ranks = [int(x) for x in args.many_ranks.split(",") if x]
    peers = scenarios_peers.peer_status()
    if args.no_s3tc:
        peers[scenarios_peers.S3TC] = "left out (`--no-s3tc`)"
    if args.no_tensorstore:
        peers["tensorstore"] = "left out (`--no-tensorstore`)"
    args.s3_libs = [*scenarios.LIBS, *(lib for lib in scenarios.S3_LIBS[2:] if peers.get(lib) is None)]
    info: dict[str, Any] = {
        "about": environment(args, argv),
        "only": args.only,
        "state_bytes": state_nbytes(args.gib),
        "s3_state_bytes": state_nbytes(args.s3_mib / 1024),
        "profile": str(args.profile) if args.profile else None,
        "peers": {lib: why for lib, why in peers.items() if why},  # why a peer library did not run
        "many": {"tensors": args.many_tensors, "big_mib": args.many_big_mib, "ranks": args.many_ranks},
        "gpu": GPU_NOTE.format("" if not torch.cuda.is_available() else " used by this run (CPU only)"),
    }
    start = time.perf_counter()
    needs_s3 = bool({"s3", "lazy"} & set(args.only))
    runs: list[dict[str, Any]] = []
    lazy = None
    with SAMPLER, stores(needs_s3, args.rgw, args.s3_options) as (s3, note):
        SAMPLER.watched = [pid for store in s3 for pid in store.pids]
        info["s3_note"] = note
        info["stores"] = {
            store.name: {"title": store.title, "counted": store.counted, "skip": store.skip} for store in s3
        }
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            one_rep(args, 0, s3, str(args.profile))
            summarize_profiles(args.profile)
            print(f"profiles in {args.profile}", file=sys.stderr, flush=True)
        for rep in range(args.reps):
            layout = next((r["layout"] for r in runs if "layout" in r), None)  # for TensorStore
            runs.append(one_rep(args, rep, s3, None, layout))
            times = {k: round(v["s"], 2) for k, v in runs[-1].items() if isinstance(v, dict) and "s" in v}
            print(f"rep {rep + 1}/{args.reps}: {times}", file=sys.stderr, flush=True)
        if "lazy" in args.only and s3:
            lazy = {}
            for store in s3:  # moto's at the top level, the gateway's under "rgw"
                got = lazy_scenario(args, store)
                lazy |= {"rgw": got} if store.name == "rgw" else got
    info["about"].append(
        f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"suite wall time {time.perf_counter() - start:.0f} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "lazy": lazy, "info": info}, indent=1))
    write_report(args, runs, lazy, info)
    return 0


def write_report(args: argparse.Namespace, runs: list[dict[str, Any]], lazy: Any, info: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_charts:
        from charts import draw_all

        where = args.charts_dir or args.out.parent
        where.mkdir(parents=True, exist_ok=True)
        drawn = draw_all(runs, targets(runs, lazy, info), info, where)
        info["charts"] = [os.path.relpath(where / name, args.out.parent) for name in drawn]  # (links from the report)
    text = render(runs, lazy, info)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
