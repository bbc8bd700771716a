"""A throwaway Ceph RADOS Gateway (a real S3 server) on free loopback ports, where Ceph is installed.

It is started by ``shared/tools/rgw/start-rgw.sh`` next to the checkout (``$ZARRCKPT_RGW_TOOL``
overrides the directory); :func:`rgw_available` says why it cannot be started here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .procs import free_port
from .s3 import BUCKET, HOST

# zarrckpt/testing/rgw.py -> the checkout -> its parent, which holds shared/
RGW_TOOL = Path(os.environ.get("ZARRCKPT_RGW_TOOL") or Path(__file__).resolve().parents[3] / "shared" / "tools" / "rgw")


def rgw_available() -> str | None:
    """Why a RADOS Gateway cannot be started here (None when it can)."""
    if not (RGW_TOOL / "start-rgw.sh").exists():
        return f"no {RGW_TOOL}/start-rgw.sh"
    missing = [b for b in ("radosgw", "ceph-mon", "ceph-osd") if shutil.which(b) is None]
    return f"Ceph packages not installed ({', '.join(missing)})" if missing else None


def rgw_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage_options for the gateway (its region comes from AWS_DEFAULT_REGION, set by rgw_server)."""
    return {
        "endpoint_url": endpoint,
        "key": "testaccesskey0000000",
        "secret": "testsecretkey000000000000000000000000000",
        "skip_instance_cache": True,
    }


@contextmanager
def rgw_server(bucket: str = BUCKET) -> Iterator[str]:
    """Start a RADOS Gateway on free loopback ports; yield its endpoint; stop it."""
    work = Path(tempfile.mkdtemp(prefix="zarrckpt-rgw-"))
    while True:  # the mon binds MON_PORT and MON_PORT + 1
        mon = free_port()
        with socket.socket() as s:
            try:
                s.bind((HOST, mon + 1))
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
    endpoint = f"http://{HOST}:{rgw}"
    try:
        import fsspec

        fsspec.filesystem("s3", **rgw_storage_options(endpoint)).mkdir(bucket)
        yield endpoint
    finally:
        subprocess.run(["bash", str(RGW_TOOL / "stop-rgw.sh")], env=env, capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
