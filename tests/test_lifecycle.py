"""Lifecycle safety: delete only checkpoints, marker-protected deletion, no silent save failures,
exclusive commit, leftovers with an age, and the replica check for every size."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import faulty  # noqa: F401  (registers faulty://)
import fsspec
import pytest
import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.cli import commands as cli
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.engine.markers import BEAT, stop_heartbeat
from zarrckpt.format.manifest import DELETING, PENDING, Manifest
from zarrckpt.storage.store import Storage
from zarrckpt.testing import spawn

RAMP = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)  # so no tensor is a constant array (no shards)


def _state(value: float, n: int = 4) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((32, 16), value + i) + RAMP for i in range(n)}, "step": int(value)}


def _loads(url: str, value: float, **kwargs: Any) -> bool:
    target = _state(-1.0)
    zarrckpt.load(target, url, **kwargs)
    return all(torch.equal(t, torch.full((32, 16), value + i) + RAMP) for i, t in enumerate(target["model"].values()))


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def _age(doc_path: Path, seconds: float) -> None:
    """Make a marker one a zarrckpt without heartbeats wrote ``seconds`` ago (only such markers age out by
    the grace period; a marker with heartbeats is dead only once they stop). Its save's heartbeat, if
    this process runs it, stops first and its heartbeat object goes: a beat landing after the marker was
    aged (a loaded machine) would make it a marker with heartbeats again."""
    doc = json.loads(doc_path.read_text())
    stop_heartbeat(Storage(str(doc_path.parent)), doc["save_id"])
    (doc_path.parent / BEAT).unlink(missing_ok=True)
    doc["started"] = (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="seconds")
    del doc["heartbeat"]
    doc_path.write_text(json.dumps(doc))


# --------------------------------------------------------------------------- delete


def test_delete_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('hi')\n")
    (project / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    before = _files(project)
    with pytest.raises(zarrckpt.ZarrckptError, match=r"refusing to delete .* no zarrckpt checkpoint"):
        zarrckpt.delete(str(project))
    assert _files(project) == before, "nothing may be touched"
    with pytest.raises(zarrckpt.ZarrckptError, match="holds nothing"):
        zarrckpt.delete(str(tmp_path / "absent"))


def test_delete_refuses_a_root_of_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(str(root), interval=1, keep_last=5, async_save=False)
    for step in (1, 2):
        manager.save(step, _state(float(step)))
    manager.close()
    before = _files(root)
    with pytest.raises(zarrckpt.ZarrckptError, match=r"it holds 2 checkpoints .*step_0000000001"):
        zarrckpt.delete(str(root))
    assert _files(root) == before
    zarrckpt.delete(manager.url(1))
    assert manager.steps() == [2] and not Path(manager.url(1)).exists()


def test_interrupted_delete_is_listed_and_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    url = str(root / "step_0000000001")
    zarrckpt.save(_state(1.0), url)
    real = Storage.delete_all

    def dies(self: Storage, keep: Any = (), **kwargs: Any) -> None:
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(Storage, "delete_all", dies)
    with pytest.raises(KeyboardInterrupt):
        zarrckpt.delete(url)
    monkeypatch.setattr(Storage, "delete_all", real)
    assert (Path(url) / DELETING).exists() and protocol.is_tombstone(Storage(url)), "marked, and no reader loads it"
    assert len(_files(Path(url))) > 1, "the shards are still there"
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000001": "deleting"}
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="being deleted"):
        zarrckpt.load(_state(0.0), url)
    dry = zarrckpt.collect_garbage(str(root), dry_run=True)
    assert [(e.name, e.state) for e in dry] == [("step_0000000001", "deleting")] and dry[0].nbytes > 0
    assert (Path(url) / DELETING).exists(), "a dry run removes nothing"
    manager = zarrckpt.CheckpointManager(str(root), interval=1, keep_last=1, async_save=False)
    assert manager.cleanup() == [1], "the manager finishes a deletion that died (here: failed in this process)"
    manager.wait()
    assert not Path(url).exists() and zarrckpt.list_checkpoints(str(root)) == {}
    manager.close()


def test_overwrite_killed_half_way_leaves_a_marked_leftover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(1.0), url)

    def dies(self: Storage, keep: Any = (), **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Storage, "delete_all", dies)
    with pytest.raises(KeyboardInterrupt):
        zarrckpt.save(_state(2.0), url, overwrite=True)
    assert zarrckpt.list_checkpoints(str(tmp_path)) == {"ck": "deleting"}, "the leftover says what it is"


# --------------------------------------------------------------------------- failed saves are never silent


def _full_disk(root: Path, step: int) -> dict[str, Any]:
    glob = f"{root}/step_{step:010d}/model/*"
    return {"fail_paths": glob, "fail_with": "nospace", "rate": 0.0, "anchor": str(root)}


@pytest.mark.parametrize("use_async", [True, False])
def test_manager_raises_a_failed_save(tmp_path: Path, use_async: bool, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    url = f"faulty://{root}"
    manager = zarrckpt.CheckpointManager(
        url, interval=1, keep_last=1, async_save=use_async, storage_options=_full_disk(root, 3)
    )
    manager.save(2, _state(2.0))
    manager.wait()
    caplog.set_level(logging.ERROR, logger="zarrckpt")
    if use_async:
        future = manager.save(3, _state(3.0))
        assert future is not None
        with pytest.raises(zarrckpt.StorageError, match="No space left"):
            future.result(timeout=60)
        with pytest.raises(zarrckpt.CheckpointSaveError, match=r"step 3 .* failed") as err:
            manager.save(4, _state(4.0))
        assert isinstance(err.value.__cause__, zarrckpt.StorageError) and "No space left" in str(err.value)
        for _ in range(200):  # the future's callbacks run right after its waiters wake
            errors = [r for r in caplog.records if r.levelno == logging.ERROR and "step 3" in r.getMessage()]
            if errors:
                break
            time.sleep(0.01)
        assert errors, "the failure is logged at ERROR when it happens"
    else:
        with pytest.raises(zarrckpt.CheckpointSaveError, match=r"step 3 .* failed"):
            manager.save(3, _state(3.0))
    manager.wait()
    assert manager.steps() == [2], "the newest committed checkpoint survives a failed save"
    assert _loads(str(root / "step_0000000002"), 2.0)
    manager.close()


def test_wait_and_close_raise_a_failed_async_save(tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"faulty://{root}"
    manager = zarrckpt.CheckpointManager(url, interval=1, keep_last=1, storage_options=_full_disk(root, 5))
    manager.save(4, _state(4.0))
    manager.save(5, _state(5.0))
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 5"):
        manager.wait()
    manager.wait()  # raised once
    manager.save(5, _state(5.0), force=True)
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 5"):
        manager.close()
    assert manager.steps() == [4]


@pytest.mark.parametrize("use_async", [True, False])
def test_a_save_that_failed_in_this_process_is_taken_over_at_once(tmp_path: Path, use_async: bool) -> None:
    """Its heartbeat stopped with the failure; the next save here need not wait out the lease."""
    from zarrckpt.lifecycle import await_dead_save

    root = tmp_path / "run"
    opts = _full_disk(root, 5)
    manager = zarrckpt.CheckpointManager(
        f"faulty://{root}", interval=1, keep_last=1, async_save=use_async, storage_options=opts
    )
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 5"):
        manager.save(5, _state(5.0))
        manager.wait()
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000005": "incomplete"}
    why = await_dead_save(manager.url(5), storage_options=opts, timeout=0)
    assert why == "it failed in this process, which abandoned it"
    manager.close()


def test_manager_never_overwrites(tmp_path: Path) -> None:
    manager = zarrckpt.CheckpointManager(str(tmp_path / "run"), interval=1, keep_last=3, async_save=False)
    manager.save(1, _state(1.0))
    with pytest.raises(zarrckpt.CheckpointSaveError) as err:
        manager.save(1, _state(9.0))
    assert isinstance(err.value.__cause__, zarrckpt.CheckpointExistsError)
    assert _loads(manager.url(1), 1.0)
    manager.close()


# --------------------------------------------------------------------------- leftovers have an age


def test_cleanup_removes_old_leftovers_even_newer_than_the_latest_commit(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(str(root), interval=1, keep_last=5, async_save=False)
    manager.save(2, _state(2.0))
    for step in (3, 4, 5, 6):  # a failed series of saves, newer than the latest commit
        s = Storage(str(root / f"step_{step:010d}"))
        protocol.prepare(s, overwrite=False)
        s.write("model/w0/c.0.0", [b"partial"])
        if step < 6:
            _age(root / f"step_{step:010d}" / PENDING, 2 * 3600)
    assert sorted(manager.cleanup()) == [3, 4, 5], "older than the grace period: removed"
    manager.wait()
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000002": "committed", "step_0000000006": "incomplete"}
    assert zarrckpt.collect_garbage(str(root), grace_seconds=0) == [], "a save with heartbeats: never by the grace"
    markers.abandon(Storage(str(root / "step_0000000006")), protocol.pending_id(Storage(str(root / "step_0000000006"))))
    removed = zarrckpt.collect_garbage(str(root), grace_seconds=7200)
    assert [e.name for e in removed] == ["step_0000000006"] and removed[0].objects in (2, 3), "(3: it beat once)"
    assert manager.steps() == [2] and _loads(manager.url(2), 2.0)
    manager.close()


def test_a_save_killed_while_creating_its_marker_is_listed_and_collected(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "step_0000000007").mkdir(parents=True)
    stray = root / "step_0000000007" / f"{PENDING}.0123456789ab.tmp"  # the marker's temporary file, never linked
    stray.write_text("{}")
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000007": "incomplete"}
    assert zarrckpt.collect_garbage(str(root)) == [], "its age (the file's) is under the grace period"
    os.utime(stray, (stray.stat().st_atime - 7200, stray.stat().st_mtime - 7200))
    assert [e.name for e in zarrckpt.collect_garbage(str(root))] == ["step_0000000007"]
    assert not (root / "step_0000000007").exists()


_KILLED_PLACING_ITS_MARKER = """
import os, signal, stat, sys, torch, zarrckpt
from zarrckpt.storage import local
local._UNNAMED["works"] = sys.argv[2] == "unnamed"
def die(fd):  # the first file flushed is the pending marker, before it has its name
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.kill(os.getpid(), signal.SIGKILL)
os.fsync = die
zarrckpt.save({"w": torch.ones(3)}, sys.argv[1])
"""


@pytest.mark.parametrize("files", ["unnamed", "named"])
def test_a_save_killed_placing_its_marker_leaves_nothing_gc_cannot_take_at_once(tmp_path: Path, files: str) -> None:
    """Killed with SIGKILL while its pending marker is written: with unnamed files (O_TMPFILE) nothing
    is left; under a temporary name, the name says its save is incomplete and the marker inside says
    whose, so gc with no grace removes it at once (it waited the lease, the CI soak's failure)."""
    root, url = tmp_path / "run", tmp_path / "run" / "step_0000000010"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_PLACING_ITS_MARKER, str(url), files], stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    left = sorted(p.name for p in url.iterdir())
    if files == "unnamed":
        assert left == [] and zarrckpt.list_checkpoints(str(root)) == {}
    else:
        assert len(left) == 1 and left[0].startswith(f"{PENDING}.") and left[0].endswith(".tmp")
        assert json.loads((url / left[0]).read_text())["writer"]["pid"] == proc.pid
        assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000010": "incomplete"}
        (removed,) = zarrckpt.collect_garbage(str(root), grace_seconds=0)
        assert removed.died is not None and "is gone" in removed.died
    assert zarrckpt.list_checkpoints(str(root)) == {}
    zarrckpt.save({"w": torch.ones(3)}, str(url))  # and the step saves at once
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000010": "committed"}


def test_a_marker_under_its_temporary_name_whose_writer_lives_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "step_0000000007").mkdir(parents=True)
    doc = markers.marker_doc("0123", world_size=1)  # this process's: about to place it
    (root / "step_0000000007" / f"{PENDING}.0123456789ab.tmp").write_text(json.dumps(doc))
    assert zarrckpt.collect_garbage(str(root), grace_seconds=0) == []
    assert zarrckpt.list_checkpoints(str(root)) == {"step_0000000007": "incomplete"}


def test_markers_carry_time_and_writer(tmp_path: Path) -> None:
    s = Storage(str(tmp_path / "ck"))
    save_id = protocol.prepare(s, overwrite=False)
    doc = json.loads((tmp_path / "ck" / PENDING).read_text())
    assert doc["save_id"] == save_id and doc["writer"]["pid"] == os.getpid() and doc["writer"]["host"]
    assert 0 <= markers.age_seconds(doc) < 60  # type: ignore[operator]


def test_gc_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    zarrckpt.save(_state(1.0), str(root / "a"))
    protocol.prepare(Storage(str(root / "b")), overwrite=False)
    _age(root / "b" / PENDING, 7200)
    (root / "notes").mkdir()
    (root / "notes" / "x.txt").write_text("keep me")
    assert cli.main(["gc", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and "b" in out and "incomplete" in out
    assert (root / "b").exists()
    assert cli.main(["gc", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in doc["removed"]] == ["b"] and doc["dry_run"] is False
    assert not (root / "b").exists() and (root / "notes" / "x.txt").exists() and _loads(str(root / "a"), 1.0)


# --------------------------------------------------------------------------- exclusive commit


def _racer(
    value: float, url: str, opts: dict[str, Any], go: threading.Barrier, results: dict[float, BaseException | None]
) -> None:
    go.wait()
    try:
        zarrckpt.save(_state(value, n=8), url, chunk_bytes=512, storage_options=opts)
        results[value] = None
    except zarrckpt.ZarrckptError as e:
        results[value] = e


def _races(urls: list[str], opts: dict[str, Any]) -> int:
    """Two saves racing to each URL: exactly one commits, the other is refused, nothing mixes."""
    for url in urls:
        results: dict[float, BaseException | None] = {}
        go = threading.Barrier(2)
        threads = [threading.Thread(target=_racer, args=(v, url, opts, go, results)) for v in (1.0, 2.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [v for v, e in results.items() if e is None]
        assert len(winners) == 1, results
        loser = next(e for e in results.values() if e is not None)
        assert isinstance(loser, zarrckpt.CheckpointExistsError | zarrckpt.IncompleteCheckpointError), loser
        target = _state(-1.0, n=8)
        zarrckpt.load(target, url, storage_options=opts)
        want = _state(winners[0], n=8)["model"]
        assert all(torch.equal(t, want[k]) for k, t in target["model"].items())
    return len(urls)


def test_two_writers_racing_one_url(tmp_path: Path) -> None:
    assert _races([str(tmp_path / f"ck{trial}") for trial in range(20)], {}) == 20


def test_two_writers_racing_on_a_real_s3_server(rgw_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = rgw_url
    assert _races([f"{url}/ck{trial}" for trial in range(20)], opts) == 20


def test_create_only_on_a_real_s3_server(rgw_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = rgw_url
    s = Storage(url, opts)
    s.create("m", [b"first"])
    s.create("m", [b"first"])
    with pytest.raises(FileExistsError):  # RGW's 412 reaches s3fs as OSError(EINVAL)
        s.create("m", [b"second"])
    assert s.read("m") == b"first"


def test_a_zombie_writer_cannot_commit_or_mix(tmp_path: Path) -> None:
    s = Storage(str(tmp_path / "ck"))
    zombie = protocol.prepare(s, overwrite=False)
    markers.abandon(s, zombie)  # it counts as dead (as once its lease ran out), yet it runs on: a zombie
    restart = protocol.prepare(Storage(str(tmp_path / "ck")), overwrite=False)  # the restart takes over
    s.write("model/w/c.0", [b"restart's shard"], create_only=True)
    with pytest.raises(FileExistsError):
        s.write("model/w/c.0", [b"zombie's shard"], create_only=True)
    s.write("model/w/c.0", [b"restart's shard"], create_only=True)  # a retry of a landed write is fine
    with pytest.raises(zarrckpt.CheckpointExistsError, match="took this location over"):
        protocol.commit(s, Manifest(zombie, {}, {"v": 1}, 1))
    protocol.commit(s, Manifest(restart, {}, {"v": 2}, 1))
    with pytest.raises(zarrckpt.CheckpointExistsError, match=r"committed there first|took this location over"):
        protocol.commit(s, Manifest(zombie, {}, {"v": 1}, 1))
    assert protocol.read_manifest(s).save_id == restart


def test_create_only_on_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_url
    s = Storage(url, opts)
    assert s.atomic_create
    s.create("m", [b"first"])
    s.create("m", [b"first"])  # the same bytes: a retry of a create that landed
    with pytest.raises(FileExistsError):
        s.create("m", [b"second"])
    assert s.read("m") == b"first"


def test_gcs_emulator_ignores_create_only(gcs_url: tuple[str, dict[str, Any]]) -> None:
    """A fact docs/FORMAT.md and docs/lifecycle.md state: real GCS honours ``ifGenerationMatch=0``; the emulator does
    not, so on it two racing commits can both succeed. If this starts failing, the emulator learnt it: update them."""
    url, opts = gcs_url
    fs, path = fsspec.core.url_to_fs(url, **opts)
    fs.pipe_file(f"{path}/m", b"first")
    fs.pipe_file(f"{path}/m", b"second", mode="create")
    assert fs.cat_file(f"{path}/m") == b"second"


# --------------------------------------------------------------------------- replicas of every size


def _replicas(rank: int, world: int, url: str) -> None:
    same = torch.arange(200 * 200, dtype=torch.float32).reshape(200, 200)
    differs = same.clone()
    if rank == 1:
        differs[123, 45] += 1e-3
    with pytest.raises(zarrckpt.SaveLayoutError, match=r"big: replicas with different contents \(ranks \[0\]"):
        zarrckpt.save({"big": differs, "ok": same}, url)
    with pytest.raises(zarrckpt.SaveLayoutError, match="big: replicas with different contents"):
        zarrckpt.async_save({"big": differs}, url + "-async")
    dist.barrier()
    assert not os.path.exists(url) and not os.path.exists(url + "-async"), "nothing may be written"
    block = zarrckpt.LocalShard(differs[rank * 100 : (rank + 1) * 100].clone(), (200, 200), (rank * 100, 0))
    both = {"sharded": block, "replica": zarrckpt.LocalShard(differs[100:].clone(), (100, 200), (0, 0))}
    with pytest.raises(zarrckpt.SaveLayoutError, match="replica: replicas with different contents"):
        zarrckpt.save(both, url)
    zarrckpt.save({"big": differs, "ok": same}, url, check_replicas=False)  # the opt-out: rank 0's copy
    got = {"big": torch.zeros(200, 200), "ok": torch.zeros(200, 200)}
    zarrckpt.load(got, url)
    assert torch.equal(got["ok"], same)


@pytest.mark.slow
def test_replicas_of_any_size_are_compared(tmp_path: Path) -> None:
    spawn(2, _replicas, str(tmp_path / "ck"))


def test_array_metadata_is_written_after_every_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generic Zarr reader of a half-written save must not find an array whose chunks are missing
    (it would read Zarr's fill value, zeros): every zarr.json document comes after every shard."""
    order: list[str] = []
    real = Storage.create

    def recording(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:  # every object a save writes is created
        real(self, path, parts, **kwargs)
        order.append(path)  # in the order they became visible

    monkeypatch.setattr(Storage, "create", recording)
    state = {f"w{i}": torch.randn(256, 256) for i in range(24)}  # more shards than write threads
    zarrckpt.save(state, str(tmp_path / "ck"), chunk_bytes=4096)
    docs = [i for i, p in enumerate(order) if p.endswith("zarr.json") and p != "zarr.json"]
    shards = [i for i, p in enumerate(order) if "/c." in p]
    assert docs and shards and max(shards) < min(docs) and order[-1] == "zarr.json", order
