"""Which S3 client under zarrckpt's Storage: s3fs (aiobotocore) against obstore (Rust ``object_store``,
through its fsspec filesystem ``obstore.fsspec``), on a Ceph RADOS Gateway (issue 15, point 7).

Usage::

    python benchmarks/clients.py                 # 256 MiB, 3 repetitions -> benchmarks/results/clients.md
    python benchmarks/clients.py --quick         # 16 MiB, 1 repetition (a smoke run)

The same scenarios as ``run.py``'s S3 part, with zarrckpt only: save from 4 gloo ranks, resharding
load into 3. Each repetition runs both clients (order alternating), each in fresh rank processes
that make ``s3://`` resolve to that client (``obstore.fsspec.register("s3")`` for obstore). Requests
are counted at the gateway (its ops log). Needs Ceph (``apt-get install -y radosgw ceph-mon ceph-osd``)
and ``pip install obstore``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import build_specs_state, build_state, measure, state_nbytes, verify  # noqa: E402
from tables import fmt, ratio, table  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt.testing import remove_tree, spawn  # noqa: E402
from zarrckpt.testing.rgw import ACCESS_KEY, SECRET_KEY, RgwServer, rgw_available, rgw_storage_options  # noqa: E402

CLIENTS = ("s3fs", "obstore")
ADOPT = 1.3  # obstore is adopted only if this much faster on both save and load, at equal requests


def client_options(client: str, endpoint: str) -> dict[str, Any]:
    """storage_options reaching the same gateway with the same keys through ``client``."""
    if client == "s3fs":
        return rgw_storage_options(endpoint)
    return {
        "endpoint": endpoint,
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        "region": "us-east-1",
        "client_options": {"allow_http": True},
        "skip_instance_cache": True,
    }


def _use(client: str) -> None:
    if client == "obstore":
        import obstore.fsspec

        obstore.fsspec.register("s3")


def _phase(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One spawn: warm up on a tiny state, then the timed save (``cfg["op"] == "save"``) or load."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _use(cfg["client"])
    mesh = init_device_mesh("cpu", (world,))
    tiny, _ = build_specs_state([(("w",), (64, 8))], mesh, fill=True)
    warm = f"{cfg['url']}-warmup-{cfg['op']}"
    zarrckpt.save(tiny, warm, storage_options=cfg["opts"])
    zarrckpt.load(tiny, warm, storage_options=cfg["opts"])
    state, checksums = build_state(cfg["gib"], mesh, fill=cfg["op"] == "save")
    if cfg["op"] == "save":
        out = measure(lambda: zarrckpt.save(state, cfg["url"], storage_options=cfg["opts"]))
    else:
        out = measure(lambda: zarrckpt.load(state, cfg["url"], storage_options=cfg["opts"]))
        verify(state, checksums, f"load through {cfg['client']}")
    dist.barrier()
    if rank == 0:
        remove_tree(warm, cfg["opts"])
        Path(cfg["result"]).write_text(json.dumps(out))


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    runs: list[dict[str, Any]] = []
    with RgwServer("zarrckpt-clients") as server, tempfile.TemporaryDirectory() as tmp:
        assert server.log is not None
        about = [
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/clients.py {' '.join(sys.argv[1:])}`",
            f"s3fs {version('s3fs')} (aiobotocore {version('aiobotocore')}), obstore {version('obstore')}, "
            f"zarrckpt {zarrckpt.__version__}, Python {platform.python_version()}; {os.cpu_count()} CPUs",
            f"load average (1/5/15 min) at the start: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}",
        ]
        for rep in range(args.reps):
            row: dict[str, Any] = {}
            for client in CLIENTS if rep % 2 == 0 else CLIENTS[::-1]:
                url = f"{server.url}/rep{rep}-{client}"
                cfg = {"client": client, "url": url, "opts": client_options(client, server.endpoint), "gib": args.gib}
                for op, world in (("save", 4), ("load", 3)):
                    cfg |= {"op": op, "result": f"{tmp}/{client}-{op}.json"}
                    server.log.clear()
                    spawn(world, _phase, cfg, timeout_s=900.0)
                    measured = json.loads(Path(cfg["result"]).read_text())
                    hits = server.log.summary(url, ("PUT", "POST", "GET", "HEAD", "DELETE"))
                    row[f"{op}/{client}"] = {"s": measured["s"], **hits}
                remove_tree(url, client_options("s3fs", server.endpoint))
            runs.append(row)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v['s']:.2f} s" for k, v in row.items()), flush=True)
        about.append(f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return runs, about


def render(runs: list[dict[str, Any]], about: list[str], nbytes: int) -> str:
    def med(key: str) -> float | None:
        values = [r[key]["s"] for r in runs if key in r]
        return statistics.median(values) if values else None

    rows, speedups, equal = [], {}, True
    for op, what in (("save", "save, 4 ranks"), ("load", "resharding load, 4 -> 3 ranks")):
        ref = med(f"{op}/s3fs")
        for client in CLIENTS:
            key = f"{op}/{client}"
            s, last = med(key), runs[-1][key]
            kinds = ", ".join(f"{m} {last[m]}" for m in ("PUT", "POST", "GET", "HEAD", "DELETE") if last.get(m))
            moved = last["bytes_in"] if op == "save" else last["bytes_out"]
            every = ", ".join(f"{r[key]['s']:.2f}" for r in runs)
            gbs = fmt(nbytes / s / 1e9 if s else None)
            rows.append(
                [what, client, fmt(s), gbs, fmt(ratio(ref, s)), str(last["requests"]), kinds, f"{moved:,}", every]
            )
        speedups[op] = ratio(med(f"{op}/s3fs"), med(f"{op}/obstore"))
        equal = equal and runs[-1][f"{op}/s3fs"]["requests"] == runs[-1][f"{op}/obstore"]["requests"]
    faster = all(v is not None and v >= ADOPT for v in speedups.values())
    verdict = (
        f"obstore is >= {ADOPT}x faster on both{' at equal requests' if equal else ' (requests differ)'}: "
        "the lead decides whether to adopt it (it would need create-only writes, retries and request counting)."
        if faster
        else f"obstore is not >= {ADOPT}x faster on both (save {fmt(speedups['save'])}x, load "
        f"{fmt(speedups['load'])}x): **keep s3fs**."
    )
    header = ["scenario", "client", "median s", "GB/s", "speed / s3fs", "requests", "by method", "body bytes"]
    out = [
        "# S3 client under zarrckpt's Storage: s3fs vs obstore, on a Ceph RADOS Gateway",
        "",
        *[f"- {line}" for line in about],
        f"- state {nbytes:,} bytes ({nbytes / 2**20:.0f} MiB); medians of {len(runs)} repetition(s), each with "
        "both clients in alternating order, fresh rank processes per operation (gloo); time = max over ranks "
        "between a barrier before and after; requests and body bytes counted at the gateway (ops log), last "
        "repetition",
        "- s3fs with zarrckpt's default storage_options for s3 (see zarrckpt/storage.py); obstore through "
        "`obstore.fsspec.register('s3')` with endpoint, keys, region and `allow_http`, its defaults otherwise",
        "",
        *table([*header, "every repetition (s)"], rows, 2),
        "",
        f"**Decision:** {verdict}",
        "",
        "What obstore's fsspec filesystem (0.12.1) lacks for zarrckpt, whatever the speed: `pipe_file(mode="
        "'create')` ignores the mode (no `If-None-Match: *`), so zarrckpt's Storage falls back to a check "
        "then a write for its commit objects (one more HEAD each, and not atomic: two racing saves can both "
        "win); its errors are obstore's own exception types, which zarrckpt's retry policy does not classify "
        "as transient; the moto request-counting tests run on s3fs.",
    ]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=256, help="state size, MiB (default 256)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--quick", action="store_true", help="16 MiB, 1 repetition")
    p.add_argument("--out", type=Path, default=HERE / "results" / "clients.md")
    args = p.parse_args()
    if args.quick:
        args.mib, args.reps = min(args.mib, 16), 1
    args.gib = args.mib / 1024
    why = rgw_available()
    if why:
        print(f"clients.py needs a RADOS Gateway: {why}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    runs, about = run(args)
    about.append(f"wall time {time.perf_counter() - started:.0f} s")
    text = render(runs, about, state_nbytes(args.gib))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
