"""The S3 servers the benchmarks run against: moto (always) and a Ceph RADOS Gateway (where Ceph is
installed), each with a log of the requests it answered."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from etagproxy import EtagProxy

from zarrckpt.testing import RequestLog, s3_server
from zarrckpt.testing.rgw import INSTALL, RgwServer, rgw_available

BUCKET = "zarrckpt-bench"
# peers that cannot run on the gateway, and why (measured with benchmarks/etagproxy.py in front of it)
RGW_SKIP = {
    "tensorstore": (
        "radosgw 16.2 answers 412 to TensorStore's conditional rewrites of a shard (`If-Match` with the quoted "
        "ETag; it matches only the unquoted one), so ranks writing parts of one shard retry forever (4 writers "
        "of one [64, 8] array: still retrying after 20 s); a proxy cannot unquote the header, it is signed (403)"
    )
}


@dataclass
class Store:
    """One S3 server as the benchmarks see it."""

    name: str  # prefix of its result keys: "s3" (moto) or "rgw"
    title: str  # for the report
    url: str  # s3://bucket
    opts: dict[str, Any]  # fsspec storage_options (picklable: they go to the rank processes)
    log: RequestLog | None  # requests answered, counted at the server
    pids: list[int] = field(default_factory=list)  # its processes (empty: moto, inside this process)
    counted: str = ""  # how requests are counted, for the report
    peer_endpoint: str = ""  # where s3torchconnector goes (on the gateway: an ETag-filling proxy in front)
    skip: dict[str, str] = field(default_factory=dict)  # peer library -> why it cannot run on this server

    def cfg(self) -> dict[str, Any]:
        endpoint = self.peer_endpoint or self.opts["endpoint_url"]
        return {"name": self.name, "url": self.url, "opts": self.opts, "peer_endpoint": endpoint, "skip": self.skip}


def _merge(opts: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(opts)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def stores(want: bool, rgw: str, extra_opts: str = "") -> Iterator[tuple[list[Store], str]]:
    """Start the servers: moto (unless ``rgw`` is "only"), and the gateway unless ``rgw`` is "off"
    (with "auto", only where Ceph is installed). Yields the stores and a line for the report saying what ran.
    ``extra_opts``: JSON storage_options merged into every store's (to measure client settings)."""
    if not want:
        yield [], ""
        return
    extra = json.loads(extra_opts) if extra_opts else {}
    with contextlib.ExitStack() as stack:
        moto = stack.enter_context(s3_server(BUCKET))
        out = (
            []
            if rgw == "only"
            else [
                Store(
                    "s3",
                    "moto",
                    moto.url,
                    _merge(moto.storage_options, extra),
                    moto.log,
                    counted="at moto's server, in the driver process (a WSGI middleware logs every request)",
                )
            ]
        )
        why = rgw_available() if rgw != "off" else "`--rgw off`"
        if why and rgw in ("on", "only"):
            raise SystemExit(f"--rgw {rgw}: cannot start the RADOS Gateway: {why}")
        if why:
            note = f"S3 on RGW NOT RUN: {why}. Only moto was measured."
            if "not installed" in why:
                note += f" To run it: `{INSTALL}` (as root), then `make bench`."
        else:
            server = stack.enter_context(RgwServer(BUCKET))
            proxy = stack.enter_context(EtagProxy(server.endpoint))  # for s3torchconnector (etagproxy.py)
            out.append(
                Store(
                    "rgw",
                    "Ceph RADOS Gateway",
                    server.url,
                    _merge(server.storage_options, extra),
                    server.log,
                    server.pids,
                    "at the gateway: its ops log (one record per request, read from its unix socket)",
                    proxy.endpoint,
                    RGW_SKIP,
                )
            )
            note = (
                "S3 on both moto and a Ceph RADOS Gateway (single-node Ceph on loopback started by "
                "`benchmarks/rgw/start-rgw.sh`: 1 mon, 1 memstore OSD, radosgw with beast)"
            )
        if extra:
            note += f"; extra storage_options on every S3 store: `{json.dumps(extra)}`"
        print(note, file=sys.stderr, flush=True)
        yield out, note
