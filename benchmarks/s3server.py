"""moto's S3 server on loopback for the benchmarks, counting every request it answers.

Same idea as ``tests/servers.py``: a WSGI middleware in front of moto records each request
(method, path, body bytes in and out) before answering it, so request and byte counts are
exact and include what every rank process sent (they reach the server over HTTP).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

BUCKET = "zarrckpt-bench"


@dataclass(frozen=True)
class Hit:
    method: str
    path: str  # "/bucket/key", percent-decoded
    prefix: str  # the ``prefix`` query parameter of a listing, else ""
    bytes_out: int  # response body bytes (what a GET transferred)
    bytes_in: int  # request body bytes (what a PUT / POST uploaded)
    start: float = 0.0  # time.time() when the server got the request
    seconds: float = 0.0  # how long the server took to answer it

    def under(self, url: str) -> bool:
        """Whether the request is about objects under ``s3://bucket/prefix``."""
        bucket, _, rest = url.split("://", 1)[-1].strip("/").partition("/")
        path = self.path.strip("/")
        if path == bucket:  # a bucket-level request: a listing (or a multi-object delete)
            return self.prefix == rest or self.prefix.startswith(f"{rest}/")
        return path == f"{bucket}/{rest}" or path.startswith(f"{bucket}/{rest}/")


class RequestLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits: list[Hit] = []

    def add(self, hit: Hit) -> None:
        with self._lock:
            self._hits.append(hit)

    def clear(self) -> None:
        with self._lock:
            self._hits.clear()

    def under(self, url: str) -> list[Hit]:
        with self._lock:
            return [h for h in self._hits if h.under(url)]

    def summary(self, url: str, methods: tuple[str, ...]) -> dict[str, int]:
        """Requests (by method) and body bytes about objects under ``url``, for ``methods`` only."""
        hits = [h for h in self.under(url) if h.method in methods]
        out = {"requests": len(hits), "bytes_out": sum(h.bytes_out for h in hits)}
        out["bytes_in"] = sum(h.bytes_in for h in hits)
        for m in methods:
            out[m] = sum(h.method == m for h in hits)
        return out


class _Counting:
    """WSGI middleware: collects the response body (moto holds objects in memory anyway), logs, answers."""

    def __init__(self, app: Callable[..., Iterable[bytes]], log: RequestLog) -> None:
        self.app, self.log = app, log

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start = time.time()
        body = self.app(environ, start_response)
        try:
            data = b"".join(body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        method = environ["REQUEST_METHOD"]
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        self.log.add(
            Hit(
                method=method,
                path=environ.get("PATH_INFO", ""),
                prefix=query.get("prefix", [""])[0],
                bytes_out=0 if method == "HEAD" else len(data),
                bytes_in=int(environ.get("CONTENT_LENGTH") or 0),
                start=start,
                seconds=time.time() - start,
            )
        )
        return [data]


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the server (plain and picklable: the rank processes get them too)."""
    return {
        "endpoint_url": endpoint,
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": "us-west-2"},
        "skip_instance_cache": True,
    }


@contextmanager
def s3_server() -> Iterator[tuple[str, dict[str, Any], RequestLog]]:
    """Start moto on 127.0.0.1 with bucket ``BUCKET``; yield (``s3://BUCKET``, storage_options, log)."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        log = RequestLog()
        server._server.app = _Counting(server._server.app, log)  # type: ignore[union-attr]
        options = storage_options(f"http://{host}:{port}")
        fsspec.filesystem("s3", **options).mkdir(BUCKET)
        yield f"s3://{BUCKET}", options, log
    finally:
        server.stop()


def remove(url: str, options: dict[str, Any]) -> None:
    """Delete everything under ``url`` (frees the server's memory between repetitions)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    if fs.exists(path):
        fs.rm(path, recursive=True)
