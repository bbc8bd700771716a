"""Which S3 client under zarrckpt's Storage: s3fs (aiobotocore) against obstore (Rust ``object_store``,
zarrckpt/obstorefs.py), on a Ceph RADOS Gateway (issue 15, point 7).

Usage::

    python benchmarks/clients.py                 # 256 MiB, 3 repetitions -> benchmarks/results/clients.md
    python benchmarks/clients.py --quick         # 16 MiB, 1 repetition (a smoke run)

The same scenarios as ``run.py``'s S3 part, with zarrckpt only: save from 4 gloo ranks, resharding
load into 3. Each repetition runs both clients (order alternating), each in fresh rank processes
with ``$ZARRCKPT_S3_CLIENT`` set to that client, and the same URL and storage_options. Requests are
counted at the gateway (its ops log). Needs Ceph (``apt-get install -y radosgw ceph-mon ceph-osd``).
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
from zarrckpt.testing import S3Request, remove_tree, spawn  # noqa: E402
from zarrckpt.testing.rgw import RgwServer, rgw_available, rgw_storage_options  # noqa: E402

CLIENTS = ("s3fs", "obstore")
ADOPT = 1.3  # obstore serves s3:// by default if this much faster on both save and load, at equal requests


def _use(client: str) -> None:
    """Make zarrckpt's Storage serve ``s3://`` through ``client`` in this process (same URL, same options)."""
    os.environ["ZARRCKPT_S3_CLIENT"] = client


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


def _window(requests: list[S3Request], measured: dict[str, float]) -> dict[str, int]:
    """Requests the gateway got between the timed operation's barriers (bucket-level ones, such as
    a multi-object delete, included), by method, with their body bytes."""
    hits = [r for r in requests if measured["t0"] - 0.01 <= r.start <= measured["t1"]]
    out = {"requests": len(hits), "bytes_in": sum(r.bytes_received for r in hits)}
    out["bytes_out"] = sum(r.bytes_sent for r in hits)
    return out | {m: sum(r.method == m for r in hits) for m in ("PUT", "POST", "GET", "HEAD", "DELETE")}


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
                cfg = {"client": client, "url": url, "opts": rgw_storage_options(server.endpoint), "gib": args.gib}
                for op, world in (("save", 4), ("load", 3)):
                    cfg |= {"op": op, "result": f"{tmp}/{client}-{op}.json"}
                    server.log.clear()
                    spawn(world, _phase, cfg, timeout_s=900.0, fresh=True)
                    measured = json.loads(Path(cfg["result"]).read_text())
                    row[f"{op}/{client}"] = {"s": measured["s"], **_window(server.log.requests(), measured)}
                remove_tree(url, rgw_storage_options(server.endpoint))
            runs.append(row)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v['s']:.2f} s" for k, v in row.items()), flush=True)
        about.append(f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return runs, about


def render(runs: list[dict[str, Any]], about: list[str], nbytes: int) -> str:
    def med(key: str) -> float | None:
        values = [r[key]["s"] for r in runs if key in r]
        return statistics.median(values) if values else None

    rows, speedups, counts = [], {}, []
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
        counts.append((runs[-1][f"{op}/s3fs"]["requests"], runs[-1][f"{op}/obstore"]["requests"]))
    # "at equal requests": obstore may not make more requests than s3fs (1% slack); it makes fewer
    # where s3fs asks an object's size (HEAD) before reading it whole
    no_more = all(b <= a + max(1, a // 100) for a, b in counts)
    faster = all(v is not None and v >= ADOPT for v in speedups.values())
    pairs = zip(("save", "load"), counts, strict=True)
    said = "; ".join(f"{op}: s3fs {a} vs obstore {b} requests" for op, (a, b) in pairs)
    speeds = f"save {fmt(speedups['save'])}x, load {fmt(speedups['load'])}x"
    if faster and no_more:
        verdict = (
            f"obstore is >= {ADOPT}x faster on both ({speeds}) with no more requests ({said}): "
            "**obstore serves s3:// by default** (zarrckpt/obstorefs.py; s3fs where the storage_options need it)."
        )
    else:
        why = f"not >= {ADOPT}x faster on both" if not faster else "faster only with more requests"
        verdict = f"obstore is {why} ({speeds}; {said}): **s3fs should serve s3:// by default**."
    header = ["scenario", "client", "median s", "GB/s", "speed / s3fs", "requests", "by method", "body bytes"]
    out = [
        "# S3 client under zarrckpt's Storage: s3fs vs obstore, on a Ceph RADOS Gateway",
        "",
        *[f"- {line}" for line in about],
        f"- state {nbytes:,} bytes ({nbytes / 2**20:.0f} MiB); medians of {len(runs)} repetition(s), each with "
        "both clients in alternating order, fresh rank processes per operation (gloo); time = max over ranks "
        "between a barrier before and after; requests and body bytes: all those the gateway got in that window "
        "(its ops log; bucket-level ones such as a multi-object delete included), last repetition",
        "- both clients get the same URL and storage_options (zarrckpt.testing.rgw); "
        "`$ZARRCKPT_S3_CLIENT` picks the client (zarrckpt/filesystems.py)",
        "",
        *table([*header, "every repetition (s)"], rows, 2),
        "",
        f"**Decision:** {verdict}",
    ]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=256, help="state size, MiB (default 256)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--quick", action="store_true", help="16 MiB, 1 repetition")
    p.add_argument("--out", type=Path, default=HERE / "results" / "clients.md")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this JSON file")
    p.add_argument("--from-json", type=Path, default=None, help="only re-render the report of a --json file")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        args.out.write_text(render(saved["runs"], saved["about"], saved["nbytes"]))
        return 0
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
    nbytes = state_nbytes(args.gib)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "about": about, "nbytes": nbytes}, indent=1))
    text = render(runs, about, nbytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
