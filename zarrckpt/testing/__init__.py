"""Test harness: real servers and real processes on one machine (tests, benchmarks, the demo, the notebook).

- :mod:`zarrckpt.testing.s3`: moto's S3 server on a free loopback port, with a log of every
  request it answers (:class:`S3Server`, :class:`RequestLog`) and the one rule for "this request
  touches prefix P" (:func:`under`).
- :mod:`zarrckpt.testing.procs`: :func:`free_port` and :func:`spawn` (N local processes joined by
  a gloo process group).
- :mod:`zarrckpt.testing.gcs`: gcp-storage-emulator (import it before anything imports gcsfs).
- :mod:`zarrckpt.testing.rgw`: a throwaway Ceph RADOS Gateway, where Ceph is installed.

The library proper and the example job never import it (the example has its own launcher,
:mod:`zarrckpt.example.launch`; only the demo starts the S3 server from here).
moto, the GCS emulator and Ceph are only needed by the helpers that start them
(``pip install 'zarrckpt[test]'``).
"""

from __future__ import annotations

from zarrckpt.testing.procs import free_port, spawn
from zarrckpt.testing.s3 import (
    BUCKET,
    RequestLog,
    S3Request,
    S3Server,
    remove_tree,
    s3_server,
    s3_storage_options,
    under,
    unique_url,
)

__all__ = [
    "BUCKET",
    "RequestLog",
    "S3Request",
    "S3Server",
    "free_port",
    "remove_tree",
    "s3_server",
    "s3_storage_options",
    "spawn",
    "under",
    "unique_url",
]
