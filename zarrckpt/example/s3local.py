"""An S3 endpoint on loopback for the demo: moto's server in a background thread."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ZarrckptError


@contextmanager
def embedded_s3(bucket: str = "zarrckpt-demo") -> Iterator[tuple[str, dict[str, Any]]]:
    """Start moto's S3 server on 127.0.0.1; yield (``s3://bucket``, storage_options)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise ZarrckptError("the embedded S3 endpoint needs moto: pip install 'moto[server]' (or pass a --url)") from e
    import fsspec

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options: dict[str, Any] = {
            "endpoint_url": f"http://{host}:{port}",
            "key": "demo",
            "secret": "demo",
            "client_kwargs": {"region_name": "us-west-2"},
        }
        fsspec.filesystem("s3", **options).mkdir(bucket)
        yield f"s3://{bucket}", options
    finally:
        server.stop()
