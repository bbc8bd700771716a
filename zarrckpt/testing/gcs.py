"""gcp-storage-emulator (GCS) in a background thread, on a free loopback port.

Importing this module sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``. gcsfs reads it once, at
*its* import time; if unset (default "true") gcsfs swaps in ``ExtendedGcsFileSystem``, which
probes the endpoint over gRPC and stalls for minutes against the emulator. So import this module
before anything imports gcsfs; spawned children inherit the variable through ``os.environ``.
No other variable is set: the endpoint travels in storage_options (``STORAGE_EMULATOR_HOST`` is
deliberately *not* set, so code that drops storage_options fails instead of silently working).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zarrckpt.testing.s3 import BUCKET, HOST

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    """gcsfs storage_options for the emulator at ``endpoint`` (plain and picklable)."""
    return {
        "endpoint_url": endpoint,  # overrides STORAGE_EMULATOR_HOST / googleapis.com
        "token": "anon",  # no google.auth lookup (metadata-server probing)
        "project": "test",  # only used for bucket creation / listing
        "skip_instance_cache": True,
    }


_SUFFIX_RANGE = re.compile(r"\s*bytes=-(\d+)\s*")
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?')
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

        def download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
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

        download._zarrckpt_patched = True  # type: ignore[attr-defined]
        objects.download = download  # used by objects.get(alt=media)
        for _, handlers in gserver.HANDLERS:
            for method, fn in handlers.items():
                if fn is original:
                    handlers[method] = download


def _patch_emulator_multipart_bodies() -> None:
    """Keep multipart upload bodies byte-exact.

    The emulator parses ``multipart/related`` uploads with Python's email parser, which drops a
    final ``\\r`` of the content: gcsfs ends the content with a bare ``\\n`` before the closing
    delimiter, and the parser takes ``\\r\\n`` for that line break. Measured: ``b"abc\\r"`` was
    stored as ``b"abc"``, so about one object in 256 (whose last byte, a crc32c byte, is 13) lost
    its last byte. Split the body on its delimiter instead, removing exactly the line break the
    client put before it (CRLF or LF, as its first delimiter line ends).
    """
    import json

    from gcp_storage_emulator import server as gserver

    with _patch_lock:
        original = gserver._read_data
        if getattr(original, "_zarrckpt_patched", False):
            return

        def read_data(request_handler: Any, query: Any) -> Any:
            ctype = request_handler.headers.get("Content-Type") or ""
            match = _BOUNDARY.search(ctype)
            if not ctype.startswith("multipart/related") or match is None:
                return original(request_handler, query)
            raw = gserver._decode_raw_data(gserver._read_raw_data(request_handler), request_handler)
            delim = b"--" + match[1].encode()
            eol = b"\r\n" if raw.startswith(delim + b"\r\n") else b"\n"
            meta_part, content_part = raw[len(delim) :].split(eol + delim + eol, 1)
            content_head, content = content_part.split(eol + eol, 1)
            end = content.rindex(eol + delim + b"--")
            content_type = "application/octet-stream"
            for line in content_head.decode().splitlines():
                if line.lower().startswith("content-type:"):
                    content_type = line.split(":", 1)[1].strip()
            return {
                "meta": json.loads(meta_part.split(eol + eol, 1)[1]),
                "content": content[:end],
                "content-type": content_type,
            }

        read_data._zarrckpt_patched = True  # type: ignore[attr-defined]
        gserver._read_data = read_data


class _Backlogged:
    """The emulator's HTTP server with a listen backlog for many clients: its default (5) drops the
    connections of 16 concurrent requests per rank, each then retried by TCP after a second (a 10 MiB
    save took 1.4-2.2 s, 1 s of it in one such stall)."""

    @staticmethod
    def run(api: Any) -> None:
        from functools import partial
        from http import server

        from gcp_storage_emulator.server import RequestHandler

        class HTTPServer(server.HTTPServer):
            request_queue_size = 1024

        api._httpd = HTTPServer((api._host, api._port), partial(RequestHandler, api._storage))
        api.is_running.set()
        api._httpd.serve_forever()


def _emulator_costs_removed(server: Any) -> None:
    """Take out two costs of the in-memory emulator that are the emulator's, not a store's: after
    every write it serialized the metadata of every object in it to a file no one reads in memory
    (each write slower than the last: 100 writes took 0.19 s into an empty bucket, 0.52 s after 300),
    and its listen backlog (:class:`_Backlogged`)."""
    storage, api = server._storage, server._api
    storage._write_config_to_file = lambda: None  # (read only when a data directory is reopened)
    api.run = lambda: _Backlogged.run(api)


def _check_gcsfs_not_extended() -> None:
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        raise RuntimeError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set; "
            "import zarrckpt.testing.gcs before gcsfs (it would stall probing gRPC)."
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
    _patch_emulator_multipart_bodies()
    # The emulator logs "Resource not found" at ERROR for every 404 (normal in tests).
    logging.getLogger("gcp_storage_emulator.storage").setLevel(logging.CRITICAL)
    server = create_server(HOST, 0, in_memory=True, default_bucket=bucket)
    _emulator_costs_removed(server)
    server.start()  # returns once the socket is bound
    try:
        port = server._api._httpd.server_address[1]  # the real port after binding port 0
        yield f"http://{HOST}:{port}"
    finally:
        server.stop()  # shutdown() + server_close(); the thread then exits
        threading.Thread.join(server._api, timeout=5)  # APIThread.join is overridden


def main(argv: list[str] | None = None) -> None:
    """``python -m zarrckpt.testing.gcs``: run the emulator in the foreground (Ctrl-C stops it) and
    print how to point zarrckpt (and the demo) at it. ``--help`` says so, and starts nothing."""
    import argparse
    import time

    argparse.ArgumentParser(
        prog="python -m zarrckpt.testing.gcs",
        description=f"Run a GCS emulator (gcp-storage-emulator, in memory, bucket {BUCKET!r}) on a free loopback "
        "port in the foreground until Ctrl-C, and print how to point zarrckpt and its demo at it.",
    ).parse_args(argv)
    with gcs_server() as endpoint:
        print(f"GCS emulator at {endpoint}, bucket {BUCKET!r}, in memory; Ctrl-C stops it", flush=True)
        print(
            f"  python -m zarrckpt.demo --url gs://{BUCKET}/demo --storage-option endpoint_url={endpoint} "
            "--storage-option token=anon --storage-option project=test",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
