"""A loopback HTTP proxy in front of a Ceph RADOS Gateway 16.2 that fills in the ETag its
CompleteMultipartUpload answer leaves out, so that s3torchconnector can write to it.

What is missing (seen through this proxy, s3torchconnector 1.5.0 against radosgw 16.2.x): every
object s3torchconnector writes is a multipart upload (POST ?uploads, PUT parts, POST ?uploadId),
and radosgw answers the completing POST with ``<ETag></ETag>`` in the body and no ``ETag`` header;
Mountpoint's S3 client then fails with ``Internal S3 client error: Header "ETag" not found``. The
parts' ETags (in their PUT answers) are there. The proxy computes the object's ETag the way S3 does
for a multipart upload, ``md5(md5(part 1) + ... + md5(part n))-n``, from the parts the client
lists in its completing request, and puts it in the answer's header and body. Every other request
and answer passes unchanged (headers included, so signatures still match); the gateway's ops log
still counts every request (the proxy sends none of its own).

Usage: ``with EtagProxy(upstream_endpoint) as proxy: ... proxy.endpoint ...``.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import re
import threading
from typing import Any
from urllib.parse import urlsplit

_PART_ETAG = re.compile(rb"<ETag>\s*(?:&quot;|\")?([0-9a-fA-F]{32})(?:&quot;|\")?\s*</ETag>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


def multipart_etag(complete_request: bytes) -> str | None:
    """The S3 ETag of a multipart object from the CompleteMultipartUpload request body that lists its
    parts' ETags: ``"<md5 of the parts' binary md5s>-<parts>"`` (quoted), or None if it lists none."""
    parts = _PART_ETAG.findall(complete_request)
    if not parts:
        return None
    digest = hashlib.md5(b"".join(bytes.fromhex(p.decode()) for p in parts)).hexdigest()  # S3's multipart ETag
    return f'"{digest}-{len(parts)}"'


class EtagProxy:
    """Forwards every request to ``upstream`` (``http://host:port``); fills in missing ETags."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        host, port = target.hostname or "127.0.0.1", target.port or 80
        self.filled = 0  # answers given an ETag
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream_conn: http.client.HTTPConnection | None = None

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                for attempt in (0, 1):  # a kept-alive upstream connection may have been closed: retry once
                    if self.upstream_conn is None:
                        self.upstream_conn = http.client.HTTPConnection(host, port, timeout=300)
                    try:
                        self.upstream_conn.request(self.command, self.path, body=body, headers=headers)
                        answer = self.upstream_conn.getresponse()
                        data = answer.read()
                        return answer.status, answer.getheaders(), data
                    except (ConnectionError, http.client.HTTPException):
                        self.upstream_conn.close()
                        self.upstream_conn = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, data = self._forward(body)
                completing = self.command == "POST" and "uploadId=" in self.path and status == 200
                if completing and not any(k.lower() == "etag" for k, _ in headers):
                    etag = multipart_etag(body)
                    if etag is not None:
                        headers.append(("ETag", etag))
                        data = re.sub(rb"<ETag>\s*</ETag>", f"<ETag>{etag}</ETag>".encode(), data)
                        with proxy._lock:
                            proxy.filled += 1
                self.send_response_only(status)
                head = self.command == "HEAD"  # keeps the object's Content-Length
                for k, v in headers:
                    if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="etag-proxy", daemon=True)

    def __enter__(self) -> EtagProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
