"""A real HTTP proxy on a free loopback port, in front of an S3 or GCS server, that injects faults.

- ``faults``: (method, path suffix, status) answered by the proxy itself instead of the server,
  each used once (status 0 drops the connection); a fourth item names the S3 error code of the
  answer's XML body (else one that fits the status);
- ``flips``: request bodies to damage on their way to the server, one byte each, as a flaky network
  or NIC would (for the next ``flips`` requests that ``flip_if`` accepts);
- ``response_flips``: response bodies to damage on their way back, one byte each (XORed with
  ``response_mask``: 0xFF, every bit of it, by default; 1 flips its lowest bit), at the place
  ``response_flip_at`` picks in the body (by default one drawn from a seeded generator), for the
  next ``response_flips`` answers that ``response_flip_if`` accepts (by default GETs answered 200
  or 206 with a body);
- ``refuse_deletes``: bulk deletes (``POST ?delete``) answer 200 with every key refused;
- ``delay``: seconds every forwarded request waits before it goes on (a far server's latency);
  ``timeline`` logs (method, path, arrived, answered) on the proxy's monotonic clock, so a test
  tells requests in flight together from requests in turn.

Everything else is forwarded unchanged (headers included, so signatures still match) and answered
as the server answered. ``answered`` logs (method, path, status); ``flipped`` the damaged requests,
``response_flipped`` the damaged answers (method, path, the place of the byte flipped).
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

_CODES = {403: "AccessDenied", 412: "PreconditionFailed", 500: "InternalError", 503: "SlowDown"}


def big_upload(method: str, path: str, body: bytes) -> bool:
    """The default ``flip_if``: a PUT (S3) or a POST upload (GCS) of at least 1 KiB."""
    return len(body) >= 1024 and (method == "PUT" or (method == "POST" and "uploadType=" in path))


def object_read(method: str, path: str, status: int, body: bytes) -> bool:
    """The default ``response_flip_if``: an object's bytes (a GET answered 200 or 206 with a body)."""
    return method == "GET" and status in (200, 206) and len(body) > 0


class FaultProxy:
    """Forwards every request to ``upstream`` (``http://host:port``), but for the faults it is told to make."""

    def __init__(self, upstream: str) -> None:
        self.faults: list[tuple[str, str, int] | tuple[str, str, int, str]] = []
        self.answered: list[tuple[str, str, int]] = []
        self.signed: list[str] = []  # each PUT's x-amz-content-sha256
        self.refuse_deletes = False
        self.delay = 0.0
        self.timeline: list[tuple[str, str, float, float]] = []
        self.flips = 0
        self.flip_if: Callable[[str, str, bytes], bool] = big_upload
        self.flipped: list[tuple[str, str]] = []
        self.response_flips = 0
        self.response_flip_if: Callable[[str, str, int, bytes], bool] = object_read
        self.response_mask = 0xFF
        self.response_flip_at: Callable[[bytes], int] | None = None
        self.response_flipped: list[tuple[str, str, int]] = []
        self.random = random.Random(0)  # where in a response the byte flips
        self._lock = threading.Lock()
        target = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out in two writes: with Nagle's algorithm a small body waits for
            # the client's delayed ACK of the headers (40 ms on Linux), which servers do not add
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                arrived = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT":
                    proxy.signed.append(self.headers.get("x-amz-content-sha256", ""))
                body = proxy._maybe_flip(self.command, self.path, body)
                fault = next(
                    (f for f in proxy.faults if f[0] == self.command and self.path.split("?")[0].endswith(f[1])), None
                )
                if proxy.refuse_deletes and self.command == "POST" and "delete" in self.path:  # 200, every key refused
                    keys = re.findall(rb"<Key>(.*?)</Key>", body)
                    error = b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>denied</Message></Error>"
                    payload = b"<DeleteResult>%s</DeleteResult>" % b"".join(error % k for k in keys)
                    self._answer(200, payload)
                    return
                if fault is not None:
                    proxy.faults.remove(fault)
                    proxy.answered.append((self.command, self.path, fault[2]))
                    if fault[2] == 0:
                        self.close_connection = True
                        self.connection.close()
                        return
                    code = fault[3] if len(fault) > 3 else _CODES[fault[2]]
                    xml = '<?xml version="1.0" encoding="UTF-8"?>' if len(fault) > 3 else ""
                    self._answer(
                        fault[2], f"{xml}<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    )
                    return
                if proxy.delay:
                    time.sleep(proxy.delay)
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = conn.getresponse()
                data = proxy._maybe_damage(self.command, self.path, answer.status, answer.read())
                proxy.answered.append((self.command, self.path, answer.status))
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                proxy.timeline.append(
                    (self.command, self.path, arrived, time.monotonic())
                )  # (before the client has it)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _maybe_flip(self, method: str, path: str, body: bytes) -> bytes:
        """``body``, one byte of it inverted (three quarters in) when a flip is due for this request."""
        with self._lock:
            if self.flips <= 0 or not self.flip_if(method, path, body):
                return body
            self.flips -= 1
            self.flipped.append((method, path))
        at = len(body) * 3 // 4
        return body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]

    def _maybe_damage(self, method: str, path: str, status: int, body: bytes) -> bytes:
        """``body``, one byte of it XORed with ``response_mask`` when a flip is due for this answer."""
        with self._lock:
            if self.response_flips <= 0 or not self.response_flip_if(method, path, status, body):
                return body
            self.response_flips -= 1
            at = self.random.randrange(len(body)) if self.response_flip_at is None else self.response_flip_at(body)
            self.response_flipped.append((method, path, at))
        return body[:at] + bytes([body[at] ^ self.response_mask]) + body[at + 1 :]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
