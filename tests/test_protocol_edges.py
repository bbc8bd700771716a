"""The commit protocol's edges that the outside review of issue 38 met, each on its own: errors that
say what happened (a commit whose last request failed is a success; a step the manager skipped is
named), a save whose location is taken away stops writing there, and restarts under another
hostname or in another PID namespace, on local disk and on a real S3 server (Ceph RGW)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import faulty  # noqa: F401  (registers faulty://)
import pytest
import torch

import zarrckpt
from zarrckpt.engine import markers, writerid
from zarrckpt.format.manifest import DELETING, PENDING
from zarrckpt.storage.store import Storage
from zarrckpt.testing import rgw, unique_url

RAMP = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": RAMP + value}, "step": int(value)}


def _loads(url: str, value: float, opts: dict[str, Any] | None = None) -> bool:
    got = _state(-1.0)
    zarrckpt.load(got, url, storage_options=opts)
    return torch.equal(got["model"]["w"], RAMP + value) and got["step"] == int(value)


def test_a_commit_whose_last_request_fails_is_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleting the pending marker after the manifest is created fails: the save returns (it is
    committed, and says so at WARNING), the checkpoint loads, and gc tidies the marker away."""
    url = str(tmp_path / "run" / "step_0000000001")
    real = Storage.delete

    def refuse(self: Storage, path: str, **kwargs: Any) -> None:
        if path == PENDING:
            raise zarrckpt.StorageError(f"deleting {path} refused (injected)")
        real(self, path, **kwargs)

    monkeypatch.setattr(Storage, "delete", refuse)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        zarrckpt.save(_state(1.0), url)
    monkeypatch.setattr(Storage, "delete", real)
    assert any("committed" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert (Path(url) / PENDING).exists() and zarrckpt.list_checkpoints(tmp_path / "run") == {url[-15:]: "committed"}
    assert _loads(url, 1.0)
    assert zarrckpt.collect_garbage(tmp_path / "run") == [], "nothing to remove; the marker is not tidied yet"
    assert (Path(url) / PENDING).exists(), "its save's lease has not passed: it may still be ending"
    then = time.time() - markers.lease_seconds() - 1
    for p in Path(url).glob(f"{PENDING}*"):
        os.utime(p, (then, then))
    zarrckpt.collect_garbage(tmp_path / "run")
    assert not (Path(url) / PENDING).exists() and _loads(url, 1.0)


def test_the_step_a_failed_async_save_made_the_manager_skip_is_named(tmp_path: Path) -> None:
    root = tmp_path / "run"
    opts = {"fail_paths": f"{root}/step_0000000003/model/*", "fail_with": "nospace", "rate": 0.0, "anchor": str(root)}
    manager = zarrckpt.CheckpointManager(f"faulty://{root}", interval=1, keep_last=5, storage_options=opts)
    manager.save(3, _state(3.0))
    with pytest.raises(zarrckpt.CheckpointSaveError, match=r"step 3 .* failed.*Step 4 was not saved") as err:
        manager.save(4, _state(4.0))
    assert err.value.skipped_step == 4 and isinstance(err.value.__cause__, zarrckpt.StorageError)
    manager.save(4, _state(4.0))  # the loop that caught it saves that step again
    manager.close()
    assert manager.steps() == [4]


def test_a_save_whose_location_is_taken_away_stops_writing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rm --force` deletes a save that is writing: the save fails loudly within a heartbeat (here
    0.2 s) instead of writing on into a location that no marker accounts for (its 40 shards take
    2 s), and what it wrote meanwhile lies under the deleting marker, which stays for the lease."""
    monkeypatch.setattr(markers, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setenv("ZARRCKPT_CONCURRENCY", "1")
    url = tmp_path / "ck"
    state = {f"w{i}": torch.full((64, 64), float(i)).add_(torch.arange(64.0)) for i in range(40)}
    real, written, deleted = Storage.create, [], threading.Event()

    def slow(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        if "/c." in path and sum("/c." in p for p in written) == 5:  # five shards are written
            threading.Thread(target=lambda: (zarrckpt.delete(url, force=True), deleted.set())).start()
            assert deleted.wait(30)
        real(self, path, parts, **kwargs)
        written.append(path)

    monkeypatch.setattr(Storage, "create", slow)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="took the location over"):
        zarrckpt.save(state, url)
    shards = [p for p in written if "/c." in p]
    assert 5 <= len(shards) < 20, f"it wrote on after its location was taken: {len(shards)} shards"
    assert zarrckpt.list_checkpoints(tmp_path) == {"ck": "deleting"}, "what it wrote lies under a deleting marker"


@pytest.fixture(params=["local", "rgw"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    if request.param == "local":
        return str(tmp_path / "run"), None
    return unique_url("s3"), rgw.rgw_storage_options(request.getfixturevalue("rgw_server"))


# the 3-second lease these tests set, counted from the dead save's marker: less the store's 1-second
# Last-Modified resolution (S3) and 0.1 s of slack. (Counted from after the steps between, it
# would shrink with the machine's load: those steps eat into the lease.)
LEASE_FLOOR = 3 - 1 - 0.1


def _died_saving(url: str, opts: dict[str, Any] | None, writer: dict[str, Any]) -> None:
    storage = Storage(url, opts)
    doc = {**markers.marker_doc("died", 2), "writer": writer}
    storage.write(PENDING, [json.dumps(doc).encode()])
    storage.write("model/w/c.0.0", [b"half of a shard"])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_a_restart_in_another_pid_namespace_never_takes_a_live_save(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods of one job share a hostname: a marker of this hostname and a pid not running here, from
    another PID namespace (or with no namespace to prove it), is a live save until its heartbeat
    stops; the restarted job waits for the lease, then takes it over."""
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", "3")
    root, opts = where
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=3, async_save=False, storage_options=opts)
    for writer in (
        {"host": socket.gethostname(), "pid": _dead_pid()},  # (a zarrckpt before namespaces were recorded)
        {**writerid.writer_identity(), "pid": _dead_pid(), "pidns": "pid:[4026532999]"},
    ):
        step = 2 if "pidns" not in writer else 3
        began = time.monotonic()
        _died_saving(manager.url(step), opts, writer)
        with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
            zarrckpt.save(_state(9.0), manager.url(step), storage_options=opts)
        manager.save(step, _state(float(step)))  # waits for the lease, then takes it over
        assert time.monotonic() - began >= LEASE_FLOOR, "it waited for the lease"
        assert _loads(manager.url(step), float(step), opts)
    manager.close()
    assert manager.steps() == [2, 3]


@pytest.mark.slow
def test_a_restart_on_another_host_takes_over_once_the_lease_has_passed(
    where: tuple[str, dict[str, Any] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", "3")
    root, opts = where
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=3, async_save=False, storage_options=opts)
    began = time.monotonic()
    _died_saving(manager.url(5), opts, {"host": "another-host", "pid": 1, "boot": "b", "pidns": "pid:[1]"})
    gone = zarrckpt.collect_garbage(root, grace_seconds=0, storage_options=opts)
    assert gone == [], "a fresh heartbeat on another host: running, whatever the grace"
    manager.save(5, _state(5.0))
    assert time.monotonic() - began >= LEASE_FLOOR and _loads(manager.url(5), 5.0, opts)
    manager.close()
    names = Storage(manager.url(5), opts).names()
    assert DELETING not in names and PENDING not in names
