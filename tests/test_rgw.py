"""The RADOS Gateway harness (zarrckpt.testing.rgw): the project's own start/stop scripts bring up a real
S3 server, and its ops log counts exactly the requests a client made (as moto's request log does)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading

import fsspec
import pytest

from zarrckpt.testing import rgw


def test_ops_record_parses_a_gateway_record():
    r = rgw.ops_record(
        {
            "uri": "GET /b?list-type=2&prefix=ck%2F&delimiter=?list-type=2&prefix=ck%2F&delimiter= HTTP/1.1",
            "http_status": "200",
            "bytes_sent": 353,
            "bytes_received": 0,
            "total_time": 4,
        }
    )
    assert (r.method, r.kind, r.path, r.status, r.bytes_sent) == ("GET", "LIST", "/b", 200, 353)
    assert r.query == {"list-type": ["2"], "prefix": ["ck/"], "delimiter": [""]}
    assert r.touches("b/ck") and not r.touches("b/other")
    put = rgw.ops_record({"uri": "PUT /b/ck/a%20b HTTP/1.1", "http_status": "200", "bytes_received": 7})
    assert (put.method, put.path, put.bytes_received) == ("PUT", "/b/ck/a b", 7)


class _HeldBackLog:
    """A log socket that behaves as Ceph 16's does when its writer thread misses a wake-up: a
    request's record reaches the reader only once the next request's record is queued."""

    def __init__(self, tmp_path, held_back: int):
        self.path = str(tmp_path / "ops.sock")
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(self.path)
        self.server.listen(1)
        self.conn: socket.socket | None = None
        self.held_back, self.queue, self.marks = held_back, [], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.conn, _ = self.server.accept()
        self.conn.sendall(b"[")

    def request(self, key: str):
        self.marks += 1
        self.queue.append(json.dumps({"uri": f"HEAD /b/{key} HTTP/1.1", "http_status": "404"}).encode() + b",\n")
        if self.marks > self.held_back:  # the wake-up this time flushes everything queued
            while self.conn is None:
                threading.Event().wait(0.01)
            self.conn.sendall(b"".join(self.queue))
            self.queue.clear()


@pytest.mark.parametrize("held_back", [0, 1, 3])
def test_a_marker_held_back_by_the_gateway_is_pushed_out_by_the_next(tmp_path, held_back):
    gateway = _HeldBackLog(tmp_path, held_back)

    class Log(rgw.OpsLog):
        def _mark(self, mark: str) -> None:
            gateway.request(f".ops-log-mark/{mark}")

    log = Log(gateway.path, {}, "b")
    try:
        log.sync(timeout=10)
        assert gateway.marks == held_back + 1  # one more marker per one held back, none beyond
        assert log.requests() == []  # markers are not requests
        assert gateway.marks == held_back + 2
    finally:
        log.close()


def test_a_log_that_never_delivers_times_out(tmp_path):
    gateway = _HeldBackLog(tmp_path, held_back=10**6)

    class Log(rgw.OpsLog):
        def _mark(self, mark: str) -> None:
            gateway.request(f".ops-log-mark/{mark}")

    log = Log(gateway.path, {}, "b")
    try:
        with pytest.raises(TimeoutError, match=r"delivered none of [23] marker requests in 2\.5 s"):
            log.sync(timeout=2.5)
    finally:
        log.close()


def test_missing_ceph_says_how_to_install(monkeypatch):
    monkeypatch.setattr(rgw.shutil, "which", lambda name: None)
    why = rgw.rgw_available()
    assert why is not None and "apt-get install" in why and "radosgw ceph-mon ceph-osd" in why


@pytest.mark.skipif(rgw.rgw_available() is not None, reason=f"{rgw.rgw_available()}")
def test_gateway_counts_every_request_and_stops_cleanly():
    with rgw.RgwServer("zarrckpt-rgw-test") as server:
        assert server.log is not None and len(server.pids) == 3
        fs = fsspec.filesystem("s3", **server.storage_options)
        server.log.clear()
        fs.pipe_file("zarrckpt-rgw-test/run/a", b"x" * 1000)
        fs.pipe_file("zarrckpt-rgw-test/run/b", b"y" * 10)
        assert fs.cat_file("zarrckpt-rgw-test/run/a", start=100, end=150) == b"x" * 50
        fs.pipe_file("zarrckpt-rgw-test/elsewhere", b"z")
        got = server.log.summary("s3://zarrckpt-rgw-test/run", ("PUT", "GET", "HEAD"))
        assert got == {"requests": 3, "PUT": 2, "GET": 1, "HEAD": 0, "bytes_in": 1010, "bytes_out": 50}
        assert len(server.log.requests("s3://zarrckpt-rgw-test")) == 4
        pids = server.pids
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))], capture_output=True, text=True)
    assert alive.stdout.strip() == "", f"gateway processes left running: {alive.stdout}"


def test_s3fs_defaults_leave_the_callers_options_winning(s3_server, monkeypatch):
    """zarrckpt turns botocore's payload SHA-256 off for s3fs unless the caller's config_kwargs set it
    (obstore's side: tests/test_obstore.py::test_payload_signing_on_the_wire)."""
    from zarrckpt.storage.store import Storage

    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", "s3fs")
    from zarrckpt.testing import s3_storage_options

    opts = s3_storage_options(s3_server)
    plain = Storage("s3://zarrckpt-test/defaults", opts)
    assert plain.fs.config_kwargs["s3"] == {"payload_signing_enabled": False}
    assert plain.storage_options == opts and "config_kwargs" not in opts  # the caller's dict is left alone
    plain.write("x", [b"payload"])
    assert plain.read("x") == b"payload"
    mine = {**opts, "config_kwargs": {"s3": {"payload_signing_enabled": True}, "max_pool_connections": 3}}
    chosen = Storage("s3://zarrckpt-test/defaults", mine)
    assert chosen.fs.config_kwargs == {"s3": {"payload_signing_enabled": True}, "max_pool_connections": 3}
    assert Storage("memory://defaults", {}).storage_options == {}
