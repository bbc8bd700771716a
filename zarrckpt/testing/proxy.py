"""A real HTTP proxy on a free loopback port, in front of an S3 or GCS server, that injects faults.

- ``faults``: (method, path suffix, status) answered by the proxy itself instead of the server,
  each used once (status 0 drops the connection);
- ``flips``: request bodies to damage on their way to the server, one byte each, as a flaky network
  or NIC would (for the next ``flips`` requests that ``flip_if`` accepts);
- ``refuse_deletes``: bulk deletes (``POST ?delete``) answer 200 with every key refused.

Everything else is forwarded unchanged (headers included, so signatures still match) and answered
as the server answered. ``answered`` logs (method, path, status); ``flipped`` the damaged requests.
"""

from __future__ import annotations

import http.client
import http.server
import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

_CODES = {403: "AccessDenied", 412: "PreconditionFailed", 500: "InternalError", 503: "SlowDown"}


def big_upload(method: str, path: str, body: bytes) -> bool:
    """The default ``flip_if``: a PUT (S3) or a POST upload (GCS) of at least 1 KiB."""
    return len(body) >= 1024 and (method == "PUT" or (method == "POST" and "uploadType=" in path))


class FaultProxy:
    """Forwards every request to ``upstream`` (``http://host:port``), but for the faults it is told to make."""

    def __init__(self, upstream: str) -> None:
        self.faults: list[tuple[str, str, int]] = []
        self.answered: list[tuple[str, str, int]] = []
        self.signed: list[str] = []  # each PUT's x-amz-content-sha256
        self.refuse_deletes = False
        self.flips = 0
        self.flip_if: Callable[[str, str, bytes], bool] = big_upload
        self.flipped: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        target = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
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
                    code = _CODES[fault[2]]
                    self._answer(fault[2], f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode())
                    return
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = conn.getresponse()
                data = answer.read()
                proxy.answered.append((self.command, self.path, answer.status))
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
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

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
