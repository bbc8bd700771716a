"""A throwaway Ceph RADOS Gateway (a real S3 server) on free loopback ports, where Ceph is installed.

It is started by ``benchmarks/rgw/start-rgw.sh`` of this checkout (``$ZARRCKPT_RGW_TOOL`` names
another directory holding ``start-rgw.sh`` and ``stop-rgw.sh``); :func:`rgw_available` says why
it cannot be started here. :class:`RgwServer` also counts requests at the server: the gateway
writes one ops-log record per request to a unix socket, and :class:`OpsLog` reads them into the
same :class:`~zarrckpt.testing.s3.RequestLog` that moto's server fills.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from zarrckpt.testing.procs import free_port
from zarrckpt.testing.s3 import BUCKET, HOST, RequestLog, S3Request

# zarrckpt/testing/rgw.py -> the checkout
RGW_TOOL = Path(os.environ.get("ZARRCKPT_RGW_TOOL") or Path(__file__).resolve().parents[2] / "benchmarks" / "rgw")
INSTALL = "apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd"
ACCESS_KEY = "testaccesskey0000000"
SECRET_KEY = "testsecretkey000000000000000000000000000"


def rgw_available() -> str | None:
    """Why a RADOS Gateway cannot be started here (None when it can); says how to install Ceph."""
    if not (RGW_TOOL / "start-rgw.sh").exists():
        return f"no {RGW_TOOL}/start-rgw.sh"
    missing = [b for b in ("radosgw", "ceph-mon", "ceph-osd") if shutil.which(b) is None]
    return f"Ceph packages not installed ({', '.join(missing)}); as root: {INSTALL}" if missing else None


def rgw_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage_options for the gateway (its region comes from AWS_DEFAULT_REGION, set by rgw_server)."""
    return {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY, "skip_instance_cache": True}


def ops_record(record: dict[str, Any]) -> S3Request:
    """One ops-log record of the gateway as an :class:`S3Request` (no Range: the log has none)."""
    method, _, rest = str(record.get("uri", "")).partition(" ")
    target = urlsplit(rest.rsplit(" ", 1)[0])  # "PUT /bucket/key?x=y HTTP/1.1"
    query = target.query.split("?", 1)[0]  # Ceph 16 repeats the query string: "?a=1?a=1"
    took = float(record.get("total_time", 0)) / 1000  # ms
    try:  # when the gateway got the request, e.g. "2026-12-01T13:37:13.012079Z"
        start = datetime.fromisoformat(str(record["time"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        start = time.time() - took
    return S3Request(
        method=method,
        path=unquote(target.path),
        query=parse_qs(query, keep_blank_values=True),
        range=None,
        status=int(record.get("http_status") or 0),
        bytes_sent=int(record.get("bytes_sent", 0)),
        bytes_received=int(record.get("bytes_received", 0)),
        start=start,
        seconds=took,
    )


class OpsLog(RequestLog):
    """The gateway's requests, read from its ops-log socket by a background thread.

    A record reaches the socket just after its response, so reading the log first sends a marker
    request (a HEAD of a key that does not exist) and waits for its record: every request answered
    before is then in the log. The markers are left out; so are requests the gateway does not log
    (those naming no bucket, such as ListBuckets).
    """

    def __init__(self, sock_path: str, storage_options: dict[str, Any], bucket: str) -> None:
        super().__init__()
        self._options, self._bucket = storage_options, bucket
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(sock_path)
        self._seen: set[str] = set()
        self._failed: BaseException | None = None
        self._fs: Any = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, name="rgw-ops-log", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._parse()
        except BaseException as e:  # sync() reports it
            self._failed = e
            raise

    def _parse(self) -> None:
        decoder, text = json.JSONDecoder(), ""
        mark = f"{self._bucket}/.ops-log-mark"
        while data := self._recv():
            text += data.decode("utf-8", "replace")
            while True:  # a JSON array streamed without its end: "[{...},\n{...},\n"
                text = text.lstrip("[,\n\r ")
                try:
                    record, end = decoder.raw_decode(text)
                except ValueError:
                    break
                text = text[end:]
                request = ops_record(record)
                if not request.touches(mark):
                    self.add(request)
                elif request.path.startswith(f"/{mark}/"):
                    with self._cond:
                        self._seen.add(request.path.rsplit("/", 1)[-1])
                        self._cond.notify_all()

    def _recv(self) -> bytes:
        try:
            return self._sock.recv(1 << 16)
        except OSError:  # closed
            return b""

    def sync(self, timeout: float = 60.0) -> None:
        """Wait until every request answered so far is in the log.

        Ceph 16's log socket can hold a record back until the next request's record: its writer
        thread waits on a condition without a predicate, so a record queued while it was writing
        the previous batch waits for the next wake-up. A marker not seen within a second is
        therefore followed by another one, which pushes the first out; seeing any of them is enough.
        """
        sent: set[str] = set()
        deadline = time.monotonic() + timeout
        while True:
            mark = uuid.uuid4().hex
            sent.add(mark)
            self._mark(mark)
            left = deadline - time.monotonic()
            with self._cond:
                if self._cond.wait_for(lambda: not sent.isdisjoint(self._seen), max(0.0, min(1.0, left))):
                    self._seen -= sent
                    return
            if not self._thread.is_alive():
                raise RuntimeError(f"the gateway's ops-log reader stopped: {self._failed!r}")
            if left <= 1.0:
                raise TimeoutError(
                    f"the gateway's ops log delivered none of {len(sent)} marker requests in {timeout:g} s"
                )

    def _mark(self, mark: str) -> None:
        """Send the marker request: one HEAD, answered 404 (s3fs's info() would also list)."""
        from fsspec.asyn import sync
        from s3fs import S3FileSystem  # whatever s3:// is registered to in this process

        if self._fs is None:
            self._fs = S3FileSystem(**self._options)
        with contextlib.suppress(FileNotFoundError):
            sync(self._fs.loop, self._fs._call_s3, "head_object", Bucket=self._bucket, Key=f".ops-log-mark/{mark}")

    def clear(self) -> None:
        self.sync()
        super().clear()

    def requests(self, url: str | None = None) -> list[S3Request]:
        self.sync()
        return super().requests(url)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._sock.close()


class RgwServer:
    """A gateway with ``bucket`` created: ``endpoint``, ``url``, ``storage_options``, ``log``, ``pids``."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self.pids: list[int] = []
        self.log: OpsLog | None = None
        self._work: Path | None = None
        self._env: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return rgw_storage_options(self.endpoint)

    def start(self) -> RgwServer:
        why = rgw_available()
        if why:
            raise RuntimeError(f"cannot start a RADOS Gateway: {why}")
        self._work = Path(tempfile.mkdtemp(prefix="zarrckpt-rgw-"))
        while True:  # the monitor binds MON_PORT and MON_PORT + 1
            mon = free_port()
            with socket.socket() as s:
                try:
                    s.bind((HOST, mon + 1))
                    break
                except OSError:
                    continue
        port = free_port()
        cluster = self._work / "cluster"
        self._env = {**os.environ, "CEPH_DIR": str(cluster), "RGW_PORT": str(port), "MON_PORT": str(mon)}
        started = subprocess.run(
            ["bash", str(RGW_TOOL / "start-rgw.sh")], env=self._env, capture_output=True, text=True, timeout=120
        )
        if started.returncode != 0:
            shutil.rmtree(self._work, ignore_errors=True)
            raise RuntimeError(f"start-rgw.sh failed:\n{started.stderr[-2000:]}")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.endpoint = f"http://{HOST}:{port}"
        try:
            self.pids = [int(line.split()[1]) for line in (cluster / "pids").read_text().splitlines()]
            import fsspec

            fsspec.filesystem("s3", **self.storage_options).mkdir(self.bucket)
            sock = cluster / "run" / "ops-log.sock"
            if sock.exists():
                self.log = OpsLog(str(sock), self.storage_options, self.bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
        if self._work is not None:
            subprocess.run(["bash", str(RGW_TOOL / "stop-rgw.sh")], env=self._env, capture_output=True, timeout=120)
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def __enter__(self) -> RgwServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def rgw_server(bucket: str = BUCKET) -> Iterator[str]:
    """Start a RADOS Gateway on free loopback ports; yield its endpoint; stop it."""
    with RgwServer(bucket) as server:
        yield server.endpoint
