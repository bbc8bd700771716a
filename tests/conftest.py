"""Storage fixtures: real S3 (moto) and GCS (emulator) servers, plus local/memory."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import servers  # sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before gcsfs is imported


@pytest.fixture(scope="session")
def s3_server():
    with servers.s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def rgw_server():
    """A real S3 server (Ceph RADOS Gateway) where its packages are installed; the test skips elsewhere."""
    why = servers.rgw_available()
    if why:
        pytest.skip(f"RADOS Gateway unavailable: {why}")
    with servers.rgw_server() as endpoint:
        yield endpoint


@pytest.fixture
def rgw_url(rgw_server):
    yield from _remote(servers.unique_url("s3"), servers.rgw_storage_options(rgw_server))


@pytest.fixture(scope="session")
def gcs_server():
    with servers.gcs_server() as endpoint:
        yield endpoint


def _remote(url, options):
    yield url, options
    fs, path = fsspec.core.url_to_fs(url, **options)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def s3_url(s3_server):
    yield from _remote(servers.unique_url("s3"), servers.s3_storage_options(s3_server))


@pytest.fixture
def gcs_url(gcs_server):
    yield from _remote(servers.unique_url("gs"), servers.gcs_storage_options(gcs_server))


@pytest.fixture(params=["local", "memory", "s3", "gcs"])
def storage(request, tmp_path):
    """``(url, storage_options)`` for a fresh, empty location on each backend."""
    if request.param == "local":
        yield str(tmp_path / "store"), {}
    elif request.param == "memory":
        yield from _remote(f"memory://{uuid.uuid4().hex}", {})
    else:
        yield request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def s3_requests(s3_server):
    """The moto server's request log, emptied: ``s3_requests.requests(url)`` lists what reached it."""
    log = servers.request_log(s3_server)
    log.clear()
    return log
