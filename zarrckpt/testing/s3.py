"""moto's S3 server on a free loopback port, recording every request it answers.

The server runs in a background thread of the calling process and is reached over real HTTP,
so child processes (any start method) can use it given only the URL and the storage_options.
A WSGI middleware in front of moto logs each request (method, path, query, Range, status, body
bytes in and out, timing) *before* the response is sent, so a client that got its answer always
finds it logged, and the counts include every rank process's requests.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from zarrckpt.errors import ZarrckptError

BUCKET = "zarrckpt-test"
HOST = "127.0.0.1"


def unique_url(scheme: str, bucket: str = BUCKET) -> str:
    """A fresh, unused prefix such as ``s3://zarrckpt-test/<uuid hex>``."""
    return f"{scheme}://{bucket}/{uuid.uuid4().hex}"


def under(key: str, prefix: str) -> bool:
    """Whether object key (or listing prefix) ``key`` lies under ``prefix``: equal to it, or below it.

    Both are ``bucket/some/path`` (leading and trailing slashes ignored); ``run-1`` is not under
    ``run``, ``run/x`` is. An empty ``prefix`` holds everything.
    """
    key, prefix = key.strip("/"), prefix.strip("/")
    return not prefix or key == prefix or key.startswith(prefix + "/")


def remove_tree(url: str, options: dict[str, Any] | None = None) -> None:
    """Delete everything under ``url`` (any fsspec URL), if anything is there."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage_options for the moto server at ``endpoint`` (plain and picklable)."""
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


@dataclass(frozen=True)
class S3Request:
    """One HTTP request the server answered (path-style addressing: ``/bucket/key``)."""

    method: str
    path: str  # percent-decoded, e.g. "/zarrckpt-test/<prefix>/zarr.json"
    query: dict[str, list[str]]
    range: str | None  # the Range header, e.g. "bytes=0-19"
    status: int
    bytes_sent: int  # response body bytes (0 for HEAD)
    bytes_received: int  # request body bytes
    start: float = 0.0  # time.time() when the server got the request
    seconds: float = 0.0  # how long the server took to answer it

    @property
    def kind(self) -> str:
        """GET, LIST (a GET on a bucket: ListObjects), HEAD, PUT, POST or DELETE."""
        if self.method == "GET" and self.path.strip("/").count("/") == 0:
            return "LIST"
        return self.method

    @property
    def target(self) -> str:
        """The request target as sent: the percent-encoded path and the query string."""
        query = urlencode(self.query, doseq=True)
        return quote(self.path) + (f"?{query}" if query else "")

    def touches(self, prefix: str) -> bool:
        """Whether the request is about objects under ``prefix`` (``bucket/some/prefix``, see :func:`under`).

        An object request: its key is. A bucket-level request (a listing, a multi-object delete):
        its ``prefix`` query parameter is.
        """
        bucket = prefix.strip("/").partition("/")[0]
        path = self.path.strip("/")
        if path == bucket:
            return under(f"{bucket}/{self.query.get('prefix', [''])[0]}", prefix)
        return under(path, prefix)


class RequestLog:
    """Every request a server answered, in order (thread-safe; child processes' requests too)."""

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

    def summary(self, url: str, methods: tuple[str, ...]) -> dict[str, int]:
        """Requests (in all and by method) and body bytes about objects under ``url``, for ``methods`` only."""
        hits = [r for r in self.requests(url) if r.method in methods]
        out = {"requests": len(hits), "bytes_out": sum(r.bytes_sent for r in hits)}
        out["bytes_in"] = sum(r.bytes_received for r in hits)
        for m in methods:
            out[m] = sum(r.method == m for r in hits)
        return out


class _LoggingApp:
    """WSGI middleware: collects the response body (moto holds objects in memory anyway), logs, answers."""

    def __init__(self, app: Callable[..., Iterable[bytes]], log: RequestLog) -> None:
        self.app, self.log = app, log

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start = time.time()
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
                start=start,
                seconds=time.time() - start,
            )
        )
        return [data]


class S3Server:
    """moto's S3 server on a free 127.0.0.1 port, in a background thread, with ``bucket`` created.

    Use it as a context manager (``with S3Server() as s3:``) or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, bucket: str | None = BUCKET) -> None:
        self.bucket = bucket
        self.log = RequestLog()
        self.endpoint = ""
        self._server: Any = None

    @property
    def url(self) -> str:
        """``s3://<bucket>``."""
        return f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return s3_storage_options(self.endpoint)

    def start(self) -> S3Server:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise ZarrckptError("the local S3 server needs moto: pip install 'moto[server]'") from e

        # werkzeug logs every request to stderr unless its logger already has a level.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        server.start()
        self._server = server
        try:
            host, port = server.get_host_and_port()  # the real port after binding port 0
            self.endpoint = f"http://{host}:{port}"
            server._server.app = _LoggingApp(server._server.app, self.log)  # type: ignore[union-attr]
            if self.bucket:
                import fsspec

                fsspec.filesystem("s3", **self.storage_options).mkdir(self.bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # shutdown() + join() of the server thread
            self._server = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3_server(bucket: str | None = BUCKET) -> S3Server:
    """``with s3_server() as s3:`` — an :class:`S3Server` (``s3.endpoint``, ``s3.url``, ``s3.log``)."""
    return S3Server(bucket)
