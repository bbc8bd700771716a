"""In-process object-store servers for tests: moto (S3) and gcp-storage-emulator (GCS).

Plain helpers, no pytest dependency. Each server runs in a background thread of the
calling process, listens on a free 127.0.0.1 port and is reached over real HTTP, so
child processes (multiprocessing / torch.multiprocessing, any start method) can use it
given only the URL and the storage_options dict.

Environment: importing this module sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``.
gcsfs reads it once, at *its* import time; if unset (default "true") gcsfs swaps in
``ExtendedGcsFileSystem``, which probes the endpoint over gRPC and stalls for minutes
against the emulator. So this module must be imported before anything imports gcsfs;
spawned children inherit the variable through ``os.environ``. No other env var is
needed: the endpoints travel in storage_options (``STORAGE_EMULATOR_HOST`` is
deliberately *not* set, so code that drops storage_options fails instead of silently
working).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

BUCKET = "zarrckpt-test"
_HOST = "127.0.0.1"


def unique_url(scheme: str, bucket: str = BUCKET) -> str:
    """A fresh, unused prefix such as ``s3://zarrckpt-test/<uuid hex>``."""
    return f"{scheme}://{bucket}/{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- S3 (moto)


def s3_storage_options(endpoint: str) -> dict:
    """s3fs storage_options for the moto server at ``endpoint`` (picklable, plain)."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        # Pin the region so AWS_DEFAULT_REGION / ~/.aws/config cannot interfere.
        # Not us-east-1: s3fs.mkdir(bucket) always sends LocationConstraint=<region>,
        # and S3 (moto too) rejects LocationConstraint=us-east-1 as invalid.
        "client_kwargs": {"region_name": "us-west-2"},
        # fsspec caches filesystem instances (and their listing caches) per
        # kwargs+pid+thread; a fresh instance per call avoids stale listings.
        "skip_instance_cache": True,
    }


@contextmanager
def s3_server(bucket: str | None = BUCKET) -> Iterator[str]:
    """Run moto's S3 server in a thread; yield its endpoint URL; stop on exit.

    ``bucket`` (if not None) is created before yielding.
    """
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request to stderr unless its logger already has a level.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=_HOST, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()  # real port after binding port 0
        endpoint = f"http://{host}:{port}"
        log = _LOGS[endpoint] = RequestLog()
        server._server.app = _CountingApp(server._server.app, log)  # type: ignore[union-attr]
        if bucket:
            import fsspec

            fsspec.filesystem("s3", **s3_storage_options(endpoint)).mkdir(bucket)
        yield endpoint
    finally:
        server.stop()  # shutdown() + join() of the server thread
        _LOGS.pop(endpoint, None)


@dataclass(frozen=True)
class S3Request:
    """One HTTP request the moto server answered (path-style addressing: ``/bucket/key``)."""

    method: str
    path: str  # unquoted, e.g. "/zarrckpt-test/<prefix>/zarr.json"
    query: dict[str, list[str]]
    range: str | None  # the Range header, e.g. "bytes=0-19"
    status: int
    bytes_sent: int  # response body bytes
    bytes_received: int  # request body bytes

    @property
    def kind(self) -> str:
        """GET, LIST (a GET on a bucket: ListObjects), HEAD, PUT, POST or DELETE."""
        if self.method == "GET" and self.path.strip("/").count("/") == 0:
            return "LIST"
        return self.method

    def touches(self, prefix: str) -> bool:
        """Whether the request names ``prefix`` (``bucket/some/prefix``) in its path or list prefix."""
        bucket, _, rest = prefix.strip("/").partition("/")
        if self.kind == "LIST":
            return self.path.strip("/") == bucket and self.query.get("prefix", [""])[0].startswith(rest)
        return self.path.lstrip("/").startswith(prefix.strip("/"))


class RequestLog:
    """Every request a moto server answers, in order (thread-safe; child processes' requests too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[S3Request] = []

    def add(self, request: S3Request) -> None:
        with self._lock:
            self._requests.append(request)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def requests(self, url: str | None = None) -> list[S3Request]:
        """The requests so far; with ``url`` (``s3://bucket/prefix``), only those touching it."""
        with self._lock:
            got = list(self._requests)
        if url is None:
            return got
        prefix = url.split("://", 1)[-1]
        return [r for r in got if r.touches(prefix)]


_LOGS: dict[str, RequestLog] = {}


def request_log(endpoint: str) -> RequestLog:
    """The request log of the moto server at ``endpoint`` (started by :func:`s3_server`)."""
    return _LOGS[endpoint]


class _CountingApp:
    """WSGI middleware: records each request, with the body bytes it sends back.

    The response body is collected (moto holds objects in memory anyway) and the request is
    logged *before* anything is sent, so a client that got its answer always finds it logged.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], log: RequestLog) -> None:
        self.app, self.log = app, log

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        status: list[int] = []

        def respond(line: str, headers: Any, exc_info: Any = None) -> Any:
            status.append(int(line.split()[0]))
            return start_response(line, headers, exc_info)

        body = self.app(environ, respond)
        try:
            data = b"".join(body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        method = environ["REQUEST_METHOD"]
        self.log.add(
            S3Request(
                method=method,
                path=environ.get("PATH_INFO", ""),  # WSGI gives it percent-decoded
                query=parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
                range=environ.get("HTTP_RANGE"),
                status=status[-1] if status else 0,
                bytes_sent=0 if method == "HEAD" else len(data),
                bytes_received=int(environ.get("CONTENT_LENGTH") or 0),
            )
        )
        return [data]


# ------------------------------------------------------------ GCS (gcp-storage-emulator)


def gcs_storage_options(endpoint: str) -> dict:
    """gcsfs storage_options for the emulator at ``endpoint`` (picklable, plain)."""
    return {
        "endpoint_url": endpoint,  # overrides STORAGE_EMULATOR_HOST / googleapis.com
        "token": "anon",  # no google.auth lookup (metadata-server probing)
        "project": "test",  # only used for bucket creation / listing
        "skip_instance_cache": True,
    }


_SUFFIX_RANGE = re.compile(r"\s*bytes=-(\d+)\s*")
_patch_lock = threading.Lock()


def _patch_emulator_suffix_ranges() -> None:
    """Teach the emulator suffix ranges (``Range: bytes=-N``).

    gcsfs sends them for ``cat_file(path, start=-N)`` (zarr uses this for shard
    indexes). The emulator only parses ``bytes=a-b`` and silently answers anything
    else with the *whole object* (200). Rewrite the header to ``bytes=(size-N)-``.
    """
    from gcp_storage_emulator import server as gserver
    from gcp_storage_emulator.handlers import objects

    with _patch_lock:
        original = objects.download
        if getattr(original, "_zarrckpt_patched", False):
            return

        def download(request, response, storage, *args, **kwargs):
            rng = request.get_header("range")
            match = _SUFFIX_RANGE.fullmatch(rng) if rng else None
            if match:
                params = request.params
                try:
                    obj = storage.get_file_obj(params["bucket_name"], params["object_id"])
                except Exception:  # NotFound: let the original answer 404
                    pass
                else:
                    start = max(0, int(obj["size"]) - int(match[1]))
                    request._request_handler.headers.replace_header("Range", f"bytes={start}-")
            return original(request, response, storage, *args, **kwargs)

        download._zarrckpt_patched = True
        objects.download = download  # used by objects.get(alt=media)
        for _, handlers in gserver.HANDLERS:
            for method, fn in handlers.items():
                if fn is original:
                    handlers[method] = download


def _check_gcsfs_not_extended() -> None:
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        raise RuntimeError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set; "
            "import tests/servers.py before gcsfs (it would stall probing gRPC)."
        )


@contextmanager
def gcs_server(bucket: str | None = BUCKET) -> Iterator[str]:
    """Run gcp-storage-emulator (in memory) in a thread; yield its endpoint URL.

    ``bucket`` (if not None) is created before yielding. Note the emulator's HTTP
    server is single-threaded: requests are served one at a time.
    """
    from gcp_storage_emulator.server import create_server

    _check_gcsfs_not_extended()
    _patch_emulator_suffix_ranges()
    # The emulator logs "Resource not found" at ERROR for every 404 (normal in tests).
    logging.getLogger("gcp_storage_emulator.storage").setLevel(logging.CRITICAL)
    server = create_server(_HOST, 0, in_memory=True, default_bucket=bucket)
    server.start()  # returns once the socket is bound
    try:
        port = server._api._httpd.server_address[1]  # real port after binding port 0
        yield f"http://{_HOST}:{port}"
    finally:
        server.stop()  # shutdown() + server_close(); the thread then exits
        threading.Thread.join(server._api, timeout=5)  # APIThread.join is overridden


# --------------------------------------------------------------------------- S3 (Ceph RADOS Gateway)

RGW_TOOL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "rgw"


def rgw_available() -> str | None:
    """Why a RADOS Gateway cannot be started here (None when it can)."""
    if not (RGW_TOOL / "start-rgw.sh").exists():
        return f"no {RGW_TOOL}/start-rgw.sh"
    missing = [b for b in ("radosgw", "ceph-mon", "ceph-osd") if shutil.which(b) is None]
    return f"Ceph packages not installed ({', '.join(missing)})" if missing else None


def rgw_storage_options(endpoint: str) -> dict:
    """s3fs storage_options for the gateway (its region comes from AWS_DEFAULT_REGION, set by rgw_server)."""
    return {
        "endpoint_url": endpoint,
        "key": "testaccesskey0000000",
        "secret": "testsecretkey000000000000000000000000000",
        "skip_instance_cache": True,
    }


@contextmanager
def rgw_server(bucket: str = BUCKET) -> Iterator[str]:
    """Start a throwaway Ceph RADOS Gateway (real S3) on free loopback ports; yield its endpoint; stop it."""
    from zarrckpt.launch import free_port

    work = Path(tempfile.mkdtemp(prefix="zarrckpt-rgw-"))
    while True:  # the mon binds MON_PORT and MON_PORT + 1
        mon = free_port()
        with socket.socket() as s:
            try:
                s.bind((_HOST, mon + 1))
                break
            except OSError:
                continue
    rgw = free_port()
    env = {**os.environ, "CEPH_DIR": str(work / "cluster"), "RGW_PORT": str(rgw), "MON_PORT": str(mon)}
    start = subprocess.run(
        ["bash", str(RGW_TOOL / "start-rgw.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    if start.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"start-rgw.sh failed:\n{start.stderr[-2000:]}")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = f"http://{_HOST}:{rgw}"
    try:
        import fsspec

        fsspec.filesystem("s3", **rgw_storage_options(endpoint)).mkdir(bucket)
        yield endpoint
    finally:
        subprocess.run(["bash", str(RGW_TOOL / "stop-rgw.sh")], env=env, capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
