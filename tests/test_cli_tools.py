"""The everyday tools: ``zarrckpt --version``, ``rm`` (the guarded delete), ``cp`` (a copy checked end to
end, between stores), ``ls -r`` (nested runs), ``show`` of plain values, and progress with an ETA."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt import display, lifecycle
from zarrckpt.cli import commands as cli
from zarrckpt.engine import markers
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING
from zarrckpt.storage.store import Storage

G = torch.Generator().manual_seed(5)
W = torch.randn(64, 48, generator=G)
E = torch.randn(4, 16, 8, generator=G).bfloat16()


def state(value: float = 0.0) -> dict[str, Any]:
    return {
        "model": {"w": W + value, "experts": E.clone(), "count": torch.arange(5)},
        "trainer": {"step": 7, "config": {"lr": 0.1, "name": "run"}},
    }


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def same_tensors(a: str, b: str, b_opts: dict[str, Any] | None = None) -> bool:
    x, y = zarrckpt.open(a), zarrckpt.open(b, storage_options=b_opts)
    return x.keys() == y.keys() and all(torch.equal(x[k][...], y[k][...]) for k in x)


def test_version_prints_the_package_version_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\nfrom zarrckpt.cli import commands\n"
        "try:\n    commands.main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('numpy', 'fsspec', 'torch') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"zarrckpt {zarrckpt.__version__}"


# --- rm ------------------------------------------------------------------------------------------


def test_rm_deletes_checkpoints_and_refuses_anything_else(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "run" / "step_1", tmp_path / "run" / "step_2"
    zarrckpt.save(state(1.0), str(a))
    zarrckpt.save(state(2.0), str(b))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    rc, out, _ = run(capsys, "rm", str(a), str(b))
    assert rc == 0 and out.splitlines() == [f"deleted {a}", f"deleted {b}"]
    assert not a.exists() and not b.exists()
    rc, _, err = run(capsys, "rm", str(tmp_path / "notes"))
    assert rc == 3 and "refusing to delete" in err and "no zarrckpt checkpoint" in err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    zarrckpt.save(state(1.0), str(a))
    rc, out, _ = run(capsys, "rm", str(a), "--json")
    assert rc == 0 and json.loads(out) == {"deleted": [str(a)]} and not a.exists()
    zarrckpt.save(state(3.0), str(tmp_path / "root" / "step_3"))
    rc, _, err = run(capsys, "rm", str(tmp_path / "root"))
    assert rc == 3 and "holds 1 checkpoints (step_3" in err and (tmp_path / "root" / "step_3" / MANIFEST).exists()


def _running_save(url: Path) -> None:
    """What a save running on another host looks like: a pending marker with a fresh heartbeat."""
    doc = markers.marker_doc("elsewhere")
    doc["writer"] = {"host": "another-host", "pid": 1}
    storage = Storage(url)
    storage.write(PENDING, [json.dumps(doc).encode()])
    storage.write("model/w/c.0.0", [b"half of a shard"])


def test_rm_refuses_a_save_that_may_still_run_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = tmp_path / "step_9"
    _running_save(url)
    rc, _, err = run(capsys, "rm", str(url))
    assert rc == 3 and "a save may still be writing it" in err and "--force" in err
    assert (url / "model/w/c.0.0").read_bytes() == b"half of a shard"
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="force=True"):
        zarrckpt.delete(str(url))
    rc, _, err = run(capsys, "rm", "--force", str(url))
    # the save's writers may still be writing: only its deleting marker stays, for the lease, and says so
    assert rc == 0 and sorted(p.name for p in url.iterdir()) == [DELETING] and "zarrckpt gc" in err


# --- cp ------------------------------------------------------------------------------------------


def test_cp_copies_between_stores_and_the_copy_reads_the_same(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(tmp_path / "src")
    zarrckpt.save(state(1.0), src)
    dst, opts = s3_url
    flags = [f"--to-storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    rc, out, _ = run(capsys, "cp", src, dst, *flags, "--json")
    summary = json.loads(out)
    assert rc == 0 and summary["tensors"] == 3 and summary["bytes_checked"] >= W.nbytes
    assert same_tensors(src, dst, opts)
    copy, orig = zarrckpt.open(dst, storage_options=opts), zarrckpt.open(src)
    assert copy.metadata == orig.metadata and copy.manifest.save_id != orig.manifest.save_id
    assert copy.verify()["problems"] == []
    back = str(tmp_path / "back")  # and back again, from S3 to local disk
    rc, out, _ = run(capsys, "cp", dst, back, *(f"--storage-option={f.split('=', 1)[1]}" for f in flags))
    assert rc == 0 and out.startswith(f"copied {dst} -> {back}:") and same_tensors(src, back)


def test_cp_refuses_an_existing_destination_unless_overwrite(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    zarrckpt.save(state(1.0), src)
    zarrckpt.save(state(2.0), dst)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="already exists"):
        zarrckpt.copy_checkpoint(src, dst)
    assert same_tensors(dst, dst) and torch.equal(zarrckpt.open(dst)["model.w"][...], W + 2.0)
    zarrckpt.copy_checkpoint(src, dst, overwrite=True)
    assert same_tensors(src, dst)
    with pytest.raises(zarrckpt.ZarrckptError, match="onto itself"):
        zarrckpt.copy_checkpoint(src, src)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.copy_checkpoint(str(tmp_path / "absent"), str(tmp_path / "c"))


def _shard(root: Path) -> Path:
    return sorted((root / "model" / "w").glob("c.*"))[0]


def test_cp_of_a_corrupt_source_fails_and_commits_nothing(tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "b"
    zarrckpt.save(state(1.0), str(src))
    shard = _shard(src)
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(zarrckpt.CorruptChunkError, match="does not verify, so it was not committed"):
        zarrckpt.copy_checkpoint(str(src), str(dst))
    assert not (dst / MANIFEST).exists() and zarrckpt.list_checkpoints(str(tmp_path))["b"] == "incomplete"
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.open(str(dst))


def test_cp_finds_bytes_damaged_on_the_way_and_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination is read back: bytes the store kept differently from what was sent fail the copy."""
    src, dst = tmp_path / "a", tmp_path / "b"
    zarrckpt.save(state(1.0), str(src))
    real = Storage.write

    def damaging(self: Storage, path: str, parts: Any, **kw: Any) -> None:
        if self.url == str(dst) and "/c." in path:
            data = bytearray(b"".join(bytes(p) for p in parts))
            data[len(data) // 3] ^= 0x01
            parts = [bytes(data)]
        real(self, path, parts, **kw)

    monkeypatch.setattr(Storage, "write", damaging)
    with pytest.raises(zarrckpt.CorruptChunkError, match="does not verify"):
        zarrckpt.copy_checkpoint(str(src), str(dst))
    assert not (dst / MANIFEST).exists()


def test_cp_of_a_checkpoint_changed_after_commit_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "a"
    zarrckpt.save(state(1.0), str(src))
    (src / "model" / "w" / "c.stray").write_bytes(b"written after commit")
    with pytest.raises(zarrckpt.CorruptChunkError, match="not committed"):
        zarrckpt.copy_checkpoint(str(src), str(tmp_path / "b"))
    assert not (tmp_path / "b" / MANIFEST).exists()


# --- ls -r ---------------------------------------------------------------------------------------


def test_ls_r_lists_checkpoints_of_nested_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zarrckpt.save(state(1.0), str(tmp_path / "exp" / "run_a" / "step_0000000010"))
    zarrckpt.save(state(2.0), str(tmp_path / "exp" / "group" / "run_b" / "step-20"))
    (tmp_path / "exp" / "readme.txt").write_text("not a checkpoint")
    rc, _, err = run(capsys, "ls", str(tmp_path / "exp"))
    assert rc == 3 and "ls -r" in err, err
    rc, out, _ = run(capsys, "ls", "-r", str(tmp_path / "exp"), "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["name"], r["state"], r["step"]) for r in rows] == [
        ("run_a/step_0000000010", "committed", 10),
        ("group/run_b/step-20", "committed", 20),
    ]
    assert [e.name for e in lifecycle.scan(str(tmp_path / "exp"), depth=2)] == ["run_a/step_0000000010"]


# --- show of plain values ------------------------------------------------------------------------


def test_show_prints_plain_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(state(), url)
    rc, out, _ = run(capsys, "show", url, "trainer.step")
    assert rc == 0 and out.strip() == "trainer.step = 7  (int)"
    rc, out, _ = run(capsys, "show", url, "trainer.config")
    assert rc == 0 and out.splitlines() == ["trainer.config.lr = 0.1", "trainer.config.name = 'run'"]
    rc, out, _ = run(capsys, "show", url, "trainer", "--json")
    assert rc == 0 and json.loads(out) == {
        "key": "trainer",
        "value": {"step": 7, "config": {"lr": 0.1, "name": "run"}},
    }
    rc, _, err = run(capsys, "show", url, "trainer.step[0]")
    assert rc == 3 and "plain value, not a tensor" in err
    rc, _, err = run(capsys, "show", url, "trainer.stp")
    assert rc == 3 and "no tensor or value 'trainer.stp'" in err and "did you mean 'trainer.step'" in err


# --- progress ------------------------------------------------------------------------------------


def test_progress_shows_rate_and_eta_and_counts_from_threads() -> None:
    stream = io.StringIO()
    bar = display.Progress("cp", 4, 4000, stream=stream, unit="objects")
    bar.start -= 2.0  # two seconds in, a quarter done: six seconds to go
    bar.interval = 0.0
    bar.update(1, 1000)
    line = stream.getvalue()
    assert "cp 1/4 objects [" in line and " 25% " in line and ", ETA 6s" in line
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: bar.advance(1, 1), range(3000)))
    assert (bar.items, bar.done_bytes) == (3001, 4000)
    assert [display._duration(s) for s in (5, 185, 7620)] == ["5s", "3m05s", "2h07m"]


# --- Checkpoint.stats(): the store's own request log is the oracle --------------------------------


def test_stats_count_what_the_server_saw(s3_url: tuple[str, dict[str, Any]], s3_requests: Any) -> None:
    url, opts = s3_url
    zarrckpt.save(state(1.0), url, storage_options=opts)
    s3_requests.clear()

    def server() -> tuple[int, int]:  # requests, and bytes of object bodies (not of listings)
        seen = s3_requests.requests(url)
        return len(seen), sum(r.bytes_sent for r in seen if r.kind == "GET")

    ckpt = zarrckpt.open(url, storage_options=opts)
    assert ckpt.stats() == {"requests": 1, "retries": 0, "bytes_read": server()[1], "bytes_written": 0}
    assert server()[0] == 1
    ckpt["model.w"][3, :5]
    ckpt["model.experts"][1]
    got = ckpt.stats()
    assert (got["requests"], got["bytes_read"]) == server() and got["requests"] > 1
    ckpt.verify()
    got = ckpt.stats()
    assert (got["requests"], got["bytes_read"]) == server() and got["bytes_read"] >= W.nbytes


def test_save_and_load_return_what_the_server_saw(s3_url: tuple[str, dict[str, Any]], s3_requests: Any) -> None:
    """zarrckpt.save and zarrckpt.load return their requests and bytes, as Checkpoint.stats() (issue 41)."""
    url, opts = s3_url
    saved = zarrckpt.save(state(1.0), url, storage_options=opts)
    seen = s3_requests.requests(url)  # (not the multi-object deletes of the markers, on the bucket: at most those)
    assert len(seen) <= saved["requests"] <= len(s3_requests.requests()) and saved["retries"] == 0
    assert saved["bytes_written"] == sum(r.bytes_received for r in seen if r.kind == "PUT") >= W.nbytes
    assert saved["bytes_read"] == sum(r.bytes_sent for r in seen if r.kind == "GET")
    s3_requests.clear()
    loaded = zarrckpt.load(state(), url, storage_options=opts)
    seen = s3_requests.requests(url)
    assert loaded == {
        "requests": len(seen),
        "retries": 0,
        "bytes_read": sum(r.bytes_sent for r in seen if r.kind == "GET"),
        "bytes_written": 0,
    }
    assert loaded["bytes_read"] >= W.nbytes
    s3_requests.clear()
    future = zarrckpt.async_save(state(2.0), url + "_async", storage_options=opts)
    future.result()
    seen = s3_requests.requests(url + "_async")
    assert len(seen) <= future.stats()["requests"] <= len(s3_requests.requests())
    assert future.stats()["bytes_written"] == sum(r.bytes_received for r in seen if r.kind == "PUT") >= W.nbytes
