"""The floor under a save to S3 (issue 39, point 5): what each request costs, and how fast a bare
client writes zarrckpt's objects, against zarrckpt's save and s3torchconnector's, in one run.

Usage::

    python benchmarks/s3_floor.py            # 4 ranks, 256 MiB, 5 repetitions, on a RADOS Gateway
    python benchmarks/s3_floor.py --quick    # smoke run: 2 ranks, 8 MiB, 1 repetition

Writes ``benchmarks/results/s3_floor.md``. Needs Ceph's gateway (``benchmarks/rgw/``); s3torchconnector
where installed (``make bench`` installs it).

Four writers of the same state (``common.py``'s DTensors, Shard(0) over the ranks) to the gateway,
in an order that rotates each repetition, timed barrier to barrier (max over ranks):

- ``zarrckpt``: ``zarrckpt.save``;
- ``zarrckpt, no MD5``: the same with its end-to-end check of each PUT off (a patch of this benchmark's:
  no MD5 of each body, no ETag compared, ``verify_after_save=False``): what that check costs here;
- ``s3torchconnector``: DCP's layout (one object per rank plus metadata) through AWS's Rust client
  (behind ``etagproxy.py``, which radosgw 16.2 needs for it);
- ``bare: zarrckpt's objects``: the objects of zarrckpt's checkpoint (the same keys and sizes: shards,
  ``zarr.json`` documents, manifest, checksum table, markers) PUT by the same obstore client with the
  same requests in flight per rank (16), and nothing else: no planning, no checksums, no commit
  protocol. The objects go to the ranks by size, each to the least loaded. The fastest zarrckpt's
  layout can be written by this client;
- ``bare: one object per rank``: each rank PUTs its bytes as one object: the fastest any layout can be
  written by this client.

Then, from this process: the gateway's cost per request (400 PUTs of 700 bytes, 16 in flight) and
per byte (4 PUTs of 64 MiB), in wall time and the gateway's CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import CpuSampler, build_state, measure, requests_in, state_nbytes  # noqa: E402
from scenarios_peers import S3TC, peer_status, s3tc_saver  # noqa: E402
from servers import stores  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt.storage import remote  # noqa: E402
from zarrckpt.storage.caps import REMOTE_CONCURRENCY  # noqa: E402
from zarrckpt.storage.clients import open_filesystem  # noqa: E402
from zarrckpt.storage.store import Storage  # noqa: E402
from zarrckpt.testing import remove_tree, spawn  # noqa: E402

TARGET = 1.2  # zarrckpt's save speed / s3torchconnector's (issue 39)
WRITERS = ("zarrckpt", "zarrckpt_no_md5", S3TC, "bare_objects", "bare_rank")
TITLES = {
    "zarrckpt": "zarrckpt (`zarrckpt.save`)",
    "zarrckpt_no_md5": "zarrckpt, its end-to-end MD5 check off (a benchmark patch)",
    S3TC: "s3torchconnector (DCP's layout)",
    "bare_objects": "bare: zarrckpt's objects",
    "bare_rank": "bare: one object per rank",
}
GAP_S = 0.3  # between two writers (> 2 x the request window's slack)


def _deal(sizes: dict[str, int], world: int) -> list[list[tuple[str, int]]]:
    """The objects to the ranks, largest first, each to the least loaded rank."""
    loads = [0] * world
    out: list[list[tuple[str, int]]] = [[] for _ in range(world)]
    for path, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = loads.index(min(loads))
        loads[r] += n
        out[r].append((path, n))
    return out


def _leaves(node: Any) -> Any:
    for value in node.values():
        yield from _leaves(value) if isinstance(value, dict) else (value,)


def floor_phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    store = cfg["store"]
    opts = store["opts"]
    state, _ = build_state(cfg["gib"], init_device_mesh("cpu", (world,)), fill=True)
    mine = b"".join(t.to_local().contiguous().numpy().tobytes() for t in _leaves(state))
    base = f"{store['url']}/floor-{cfg['run']}"
    fs, _, _ = open_filesystem(base, opts)
    pool = concurrent.futures.ThreadPoolExecutor(REMOTE_CONCURRENCY)

    # zarrckpt's objects, from a save (untimed: it also warms every client up)
    layout_url = f"{base}/layout"
    zarrckpt.save(state, layout_url, storage_options=opts)
    if cfg["s3tc"]:
        s3tc_saver(state, f"{base}/warm-s3tc", store)()
    listing = [Storage(layout_url, opts).sizes() if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    sizes: dict[str, int] = listing[0] or {}
    objects = _deal(sizes, world)[rank]
    payload = memoryview(bytes(max(sizes.values())))  # the bare writers' bodies: zeros (the gateway keeps them)

    def put(path: str, body: Any) -> None:
        fs.pipe_file(path, body)

    def bare_objects(url: str) -> None:
        root = url.split("://", 1)[1]
        list(pool.map(lambda item: put(f"{root}/{item[0]}", payload[: item[1]]), objects))

    def bare_rank(url: str) -> None:
        put(f"{url.split('://', 1)[1]}/rank{rank}", mine)

    def without_md5(url: str) -> None:
        kept = remote._MD5_CLIENTS
        remote._MD5_CLIENTS = ()  # no MD5 of each body, so no ETag compared (and no read-back: below)
        try:
            zarrckpt.save(state, url, storage_options=opts, verify_after_save=False)
        finally:
            remote._MD5_CLIENTS = kept

    def writer(name: str, url: str) -> Any:
        if name == "zarrckpt":
            return lambda: zarrckpt.save(state, url, storage_options=opts)
        if name == "zarrckpt_no_md5":
            return lambda: without_md5(url)
        if name == S3TC:
            return s3tc_saver(state, url, store)
        return (lambda: bare_objects(url)) if name == "bare_objects" else (lambda: bare_rank(url))

    names = [w for w in WRITERS if w != S3TC or cfg["s3tc"]]
    out: dict[str, Any] = {"objects": len(sizes), "object_bytes": sum(sizes.values()), "runs": []}
    out["largest"] = max(sizes.values())
    for rep in range(cfg["reps"]):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        runs: dict[str, Any] = {"order": order}
        for name in order:
            url = f"{base}/{rep}-{name}"
            runs[name] = measure(writer(name, url)) | {"url": url}
            time.sleep(GAP_S)
            dist.barrier()
        out["runs"].append(runs)
        if rank == 0:  # (untimed) each repetition writes ~4x the state: the gateway's memstore holds 8 GiB
            for name in order:
                remove_tree(f"{base}/{rep}-{name}", opts)
        dist.barrier()
    dist.barrier()
    if rank == 0:
        remove_tree(base, opts)
        Path(cfg["result"]).write_text(json.dumps(out))
    pool.shutdown()
    dist.barrier()


# -- the driver ---------------------------------------------------------------------------------


def request_costs(store: Any, sampler: CpuSampler, small: int, large_mib: int) -> dict[str, Any]:
    """Wall time and gateway CPU of ``small`` PUTs of 700 B (16 in flight) and of 4 PUTs of
    ``large_mib`` MiB (4 in flight), from this process."""
    base = f"{store.url}/floor-costs-{os.getpid()}"
    fs, _, _ = open_filesystem(base, store.opts)
    root = base.split("://", 1)[1]
    out = {}
    with concurrent.futures.ThreadPoolExecutor(REMOTE_CONCURRENCY) as pool:
        for name, count, body in (("small", small, bytes(700)), ("large", 4, bytes(large_mib << 20))):
            fs.pipe_file(f"{root}/warm-{name}", body)
            time.sleep(0.2)
            t0 = time.time()
            list(pool.map(lambda i, b=body, n=name: fs.pipe_file(f"{root}/{n}/{i}", b), range(count)))
            t1 = time.time()
            time.sleep(0.2)
            usage = sampler.usage(t0, t1)
            gateway_cpu = usage[2] * (t1 - t0) if usage else float("nan")
            out[name] = {"count": count, "bytes": len(body), "s": t1 - t0, "gateway_cpu_s": gateway_cpu}
    remove_tree(base, store.opts)
    return out


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    peers = peer_status()
    info: dict[str, Any] = {"load": [os.getloadavg()], "s3tc": peers.get(S3TC)}
    scratch = Path(tempfile.mkdtemp(prefix="zarrckpt-floor-"))
    started = time.perf_counter()
    with stores(True, "only") as (found, _), CpuSampler() as sampler:
        store = found[0]
        sampler.watched = store.pids
        info["server"] = "Ceph RADOS Gateway on loopback (`benchmarks/rgw/start-rgw.sh`: 1 mon, 1 memstore OSD)"
        cfg = {
            "store": store.cfg(),
            "gib": args.gib,
            "reps": args.reps,
            "run": os.getpid(),
            "s3tc": peers.get(S3TC) is None,
            "result": str(scratch / "floor.json"),
        }
        spawn(args.ranks, floor_phase, cfg, timeout_s=1800.0, fresh=True)
        got = json.loads(Path(cfg["result"]).read_text())
        for runs in got["runs"]:
            for name in runs["order"]:
                m = runs[name]
                m["s3"] = requests_in(store.log, m["t0"], m["t1"], m["url"].split("://", 1)[1])
                usage = sampler.usage(m["t0"], m["t1"])
                m["gateway_cpu_s"] = usage[2] * (m["t1"] - m["t0"]) if usage else float("nan")
                m["machine_busy"] = usage[1] if usage else float("nan")
        info |= got
        info["costs"] = request_costs(store, sampler, args.small_puts, args.large_mib)
    info["wall_s"] = time.perf_counter() - started
    info["load"].append(os.getloadavg())
    return info


# -- the report ---------------------------------------------------------------------------------


def med(info: dict[str, Any], name: str, key: str = "s") -> float:
    return statistics.median(r[name][key] for r in info["runs"] if name in r)


def render(args: argparse.Namespace, info: dict[str, Any], argv: list[str]) -> str:
    names = [w for w in WRITERS if any(w in r for r in info["runs"])]
    state = state_nbytes(args.gib)
    last = info["runs"][-1]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# The floor under a save to S3 (Ceph RADOS Gateway)",
        "",
        f"_{when}; `python benchmarks/s3_floor.py {' '.join(argv)}`; {info['wall_s']:.0f} s._",
        "",
    ]
    speed = {n: med(info, n) for n in names}
    rows = [
        "| target or floor | measured | |",
        "|---|---|---|",
    ]
    if S3TC in speed:
        ratio = speed[S3TC] / speed["zarrckpt"]
        best = speed[S3TC] / speed["bare_objects"]
        verdict = "PASS" if ratio >= TARGET else "MISS"
        rows += [
            f"| save, zarrckpt speed / s3torchconnector (target >= {TARGET}x) | {ratio:.2f}x | {verdict} |",
            f"| the floor: a bare client writing zarrckpt's objects, speed / s3torchconnector | {best:.2f}x | "
            f"{'the target is above the floor' if best < TARGET else 'the floor allows the target'} |",
            f"| a bare client writing one object per rank, speed / s3torchconnector | "
            f"{speed[S3TC] / speed['bare_rank']:.2f}x | |",
        ]
        if "zarrckpt_no_md5" in speed:
            rows.insert(
                -2,
                f"| the save with its end-to-end MD5 check off, speed / s3torchconnector | "
                f"{speed[S3TC] / speed['zarrckpt_no_md5']:.2f}x | what checking every PUT costs (a benchmark patch) |",
            )
    else:
        rows.append(f"| s3torchconnector | not run: {info['s3tc']} | |")
    rows += [
        f"| zarrckpt's time / the bare client's on the same objects | {speed['zarrckpt'] / speed['bare_objects']:.2f}x"
        " | zarrckpt's own work above its requests |",
        f"| the bare client: zarrckpt's objects / one object per rank, time | "
        f"{speed['bare_objects'] / speed['bare_rank']:.2f}x | what the object count costs |",
    ]
    lines += ["## Targets and floors", "", *rows, ""]
    load = ", ".join("/".join(f"{x:.1f}" for x in la) for la in info["load"])
    lines += [
        "## Set-up",
        "",
        f"- {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
        f"{torch.__version__}; load averages (1/5/15 min) at the start and end: {load}.",
        f"- {info['server']}.",
        f"- {args.ranks} rank processes (gloo), `common.py`'s state: {state / 2**20:.1f} MiB of FP32 DTensors, "
        f"Shard(0). zarrckpt's checkpoint of it: {info['objects']} objects, {info['object_bytes'] / 2**20:.1f} MiB "
        f"(the largest {info['largest'] / 2**20:.1f} MiB).",
        f"- {args.reps} repetitions, the writers' order rotating; time = max over ranks, barrier to barrier; "
        "requests: the gateway's ops log over each write's window, under its prefix; gateway CPU: its "
        "processes' (radosgw, ceph-osd, ceph-mon) CPU seconds over the window.",
        "",
        "## Writers",
        "",
        "| writer | median s | MiB/s | every run, s | requests (last run) | by method | gateway CPU s (median) |"
        " machine busy |",
        "|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for n in names:
        hits = last[n]["s3"]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(hits.items()) if k.isupper())
        every = ", ".join(f"{r[n]['s']:.3f}" for r in info["runs"] if n in r)
        lines.append(
            f"| {TITLES[n]} | {speed[n]:.3f} | {state / 2**20 / speed[n]:.0f} | {every} | {hits['requests']} | "
            f"{kinds} | {med(info, n, 'gateway_cpu_s'):.2f} | {med(info, n, 'machine_busy'):.0%} |"
        )
    costs = info["costs"]
    small, large = costs["small"], costs["large"]
    lines += [
        "",
        "## What a request costs (from one process, 16 in flight)",
        "",
        "| PUTs | each | wall s | per request, ms of wall | gateway CPU s | gateway CPU per request, ms |"
        " per MiB, ms of gateway CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in (small, large):
        per_mib = f"{row['gateway_cpu_s'] * 1e3 / (row['count'] * row['bytes'] / 2**20):.2f}" if row is large else ""
        lines.append(
            f"| {row['count']} | {row['bytes']:,} B | {row['s']:.3f} | {row['s'] * 1e3 / row['count']:.2f} | "
            f"{row['gateway_cpu_s']:.2f} | {row['gateway_cpu_s'] * 1e3 / row['count']:.2f} | {per_mib} |"
        )
    lines += [
        "",
        "What it means: a save's time on this machine is about its requests times the first row plus its bytes "
        "times the second, all on the same 2 cores as the ranks. The bare writers above say how fast this "
        "client can write each layout with no other work; zarrckpt's own work is the ratio of its time to "
        "the bare client's on the same objects.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=None, help="state size, GiB (default 0.25; --quick 0.008)")
    p.add_argument("--ranks", type=int, default=None, help="rank processes (default 4; --quick 2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; --quick 1)")
    p.add_argument("--small-puts", type=int, default=400, help="small PUTs timed for the per-request cost")
    p.add_argument("--large-mib", type=int, default=64, help="size of the 4 large PUTs, MiB")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition (a smoke run)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "s3_floor.md", help="the report")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this JSON file")
    args = p.parse_args(argv)
    args.gib = args.gib or (0.008 if args.quick else 0.25)
    args.ranks = args.ranks or (2 if args.quick else 4)
    args.reps = args.reps or (1 if args.quick else 5)
    if args.quick:
        args.small_puts, args.large_mib = min(args.small_puts, 32), min(args.large_mib, 4)
    info = measure_all(args)
    if args.json:
        args.json.write_text(json.dumps(info))
    args.out.write_text(render(args, info, argv))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
