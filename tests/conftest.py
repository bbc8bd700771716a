"""Storage fixtures: real S3 (moto) and GCS (emulator) servers, plus local/memory (see zarrckpt.testing)."""

from __future__ import annotations

import re
import uuid

import pytest

from zarrckpt import testing
from zarrckpt.testing import RequestLog, S3Server, gcs, remove_tree, rgw, s3_storage_options, unique_url


@pytest.fixture(scope="session")
def s3() -> S3Server:
    with testing.s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(s3: S3Server) -> str:
    """The moto server's endpoint URL."""
    return s3.endpoint


@pytest.fixture(scope="session")
def rgw_server():
    """A real S3 server (Ceph RADOS Gateway) where its packages are installed; the test skips elsewhere."""
    why = rgw.rgw_available()
    if why:
        pytest.skip(f"RADOS Gateway unavailable: {why}")
    with rgw.rgw_server() as endpoint:
        yield endpoint


@pytest.fixture
def rgw_url(rgw_server):
    yield from _remote(unique_url("s3"), rgw.rgw_storage_options(rgw_server))


@pytest.fixture(scope="session")
def gcs_server():
    with gcs.gcs_server() as endpoint:
        yield endpoint


def _remote(url, options):
    yield url, options
    remove_tree(url, options)


@pytest.fixture
def s3_url(s3_server):
    yield from _remote(unique_url("s3"), s3_storage_options(s3_server))


@pytest.fixture
def gcs_url(gcs_server):
    yield from _remote(unique_url("gs"), gcs.gcs_storage_options(gcs_server))


@pytest.fixture
def store_elsewhere_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment names a store where nothing listens, with wrong keys: what only reaches the test's
    server through ``storage_options`` (never through ``AWS_*`` / ``STORAGE_EMULATOR_HOST``) still works."""
    dead = f"http://127.0.0.1:{testing.free_port()}"
    for name, value in (("AWS_ENDPOINT_URL", dead), ("STORAGE_EMULATOR_HOST", dead)):
        monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "wrong")


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
def s3_requests(s3: S3Server) -> RequestLog:
    """The moto server's request log, emptied: ``s3_requests.requests(url)`` lists what reached it."""
    s3.log.clear()
    return s3.log


SERVERS = {"s3", "s3_server", "gcs_server", "rgw_server"}
SERVER_IDS = {"s3", "gcs", "rgw", "moto"}  # parameter ids of tests that start a server themselves


@pytest.fixture(autouse=True)
def _no_heartbeat_outlives_its_test():
    """Stop the heartbeats a test started and left beating (a save prepared by hand to stand for one
    that died, a save that failed on purpose): they would write markers for the rest of the worker
    process and show up in later tests' request logs and heartbeat checks."""
    from zarrckpt.engine import markers

    before = set(markers._Heartbeat._running)
    yield
    for url, name, save_id in set(markers._Heartbeat._running) - before:
        markers._Heartbeat.stop(url, save_id, name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on a server (moto, the GCS emulator, Ceph RGW) is ``slow``, like the multi-process
    ones (marked where they are defined): ``make test-fast`` leaves them out, ``make test`` runs all."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = getattr(callspec, "params", {})
        ids = set(re.split(r"[-\[\]]", getattr(callspec, "id", "")))  # [s3-s3fs], [rgw-delete], [gcs], ...
        on_server = (
            SERVERS & set(getattr(item, "fixturenames", ()))
            or params.get("storage") in ("s3", "gcs")
            or ids & SERVER_IDS
            or item.path.name == "test_rgw.py"
        )
        if on_server:
            item.add_marker(pytest.mark.slow)
