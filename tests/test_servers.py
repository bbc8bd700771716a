"""Smoke tests of the storage fixtures, using fsspec only."""

from __future__ import annotations

import os
import time

import fsspec
import pytest
import torch.multiprocessing as mp

MB = 2**20


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(256)) * (n // 256)


def test_roundtrip(storage):
    url, options = storage
    fs, root = fsspec.core.url_to_fs(url, **options)
    data = _payload(3 * MB)
    big, small = f"{root}/a/b/blob.bin", f"{root}/a/small.json"

    # Local directories must exist before writing (fsspec's local fs has
    # auto_mkdir=False); on object stores this is a no-op.
    fs.makedirs(f"{root}/a/b", exist_ok=True)
    fs.pipe_file(big, data)
    fs.pipe_file(small, b"{}")
    assert fs.exists(big) and fs.exists(small)
    assert fs.info(big)["size"] == len(data)
    assert fs.cat_file(big) == data

    # Ranged reads: [start, end), open-ended, and suffix (zarr shard indexes use it).
    assert fs.cat_file(big, start=1000, end=MB + 1000) == data[1000 : MB + 1000]
    assert fs.cat_file(big, start=len(data) - 10) == data[-10:]
    assert fs.cat_file(big, start=-4096) == data[-4096:]
    # NB: no empty range (start == end): s3fs sends "bytes=5-4", which S3 (and moto)
    # ignore as invalid and return the whole object.

    assert sorted(fs.find(root)) == sorted([big, small])
    assert sorted(p.rstrip("/") for p in fs.ls(f"{root}/a", detail=False)) == sorted([f"{root}/a/b", small])

    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{root}/a/missing.bin")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{root}/a/missing.bin", start=0, end=10)

    fs.rm(root, recursive=True)
    assert not fs.exists(big)
    assert fs.find(root) == []
    # A brand-new instance (as another process would have) agrees.
    fs2, _ = fsspec.core.url_to_fs(url, **options)
    assert not fs2.exists(big)


def _child_write(rank: int, targets: list[tuple[str, dict]]) -> None:
    # Only url + storage_options (+ inherited env) reach the child.
    assert "STORAGE_EMULATOR_HOST" not in os.environ
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    for url, options in targets:
        fs, root = fsspec.core.url_to_fs(url, **options)
        fs.pipe_file(f"{root}/rank{rank}.bin", _payload(MB, seed=rank))
        assert fs.cat_file(f"{root}/rank{rank}.bin", start=-3) == _payload(MB, rank)[-3:]


@pytest.mark.slow
def test_spawned_children_write(s3_url, gcs_url):
    targets = [s3_url, gcs_url]
    ctx = mp.spawn(_child_write, args=(targets,), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "child processes timed out"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()

    for url, options in targets:
        fs, root = fsspec.core.url_to_fs(url, **options)
        assert sorted(fs.find(root)) == [f"{root}/rank0.bin", f"{root}/rank1.bin"]
        for rank in range(2):
            assert fs.cat_file(f"{root}/rank{rank}.bin") == _payload(MB, seed=rank)


@pytest.mark.parametrize("tail", [b"\r", b"\r\n", b"\n", b"\n--==0==--", b"\x00"])
def test_objects_come_back_byte_exact_whatever_their_last_bytes(storage, tail: bytes) -> None:
    """Without the harness's fix, the GCS emulator stored b"...\\r" as b"..." (its multipart parser
    took the final CR for part of the line break before gcsfs's closing delimiter)."""
    url, options = storage
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.makedirs(root, exist_ok=True)
    data = _payload(512) + tail
    fs.pipe_file(f"{root}/obj", data)
    assert fs.cat_file(f"{root}/obj") == data


def _env_seen(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    assert dist.get_world_size() == world
    seen = {k: os.environ.get(k) for k in ("ZARRCKPT_SPAWN_PROBE", "ZARRCKPT_SPAWN_GONE")}
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(seen))


def test_spawned_ranks_see_the_callers_environment_at_each_call(tmp_path, monkeypatch) -> None:
    """``zarrckpt.testing.spawn`` forks ranks from a forkserver that imported torch once; the server's
    environment is the one from when it started, yet every rank gets the caller's as it is at each
    call: a variable set, changed or removed between two calls reaches the ranks of the second."""
    from zarrckpt.testing import spawn

    monkeypatch.setenv("ZARRCKPT_SPAWN_PROBE", "first")
    monkeypatch.setenv("ZARRCKPT_SPAWN_GONE", "here")
    spawn(2, _env_seen, str(tmp_path / "a"))
    monkeypatch.setenv("ZARRCKPT_SPAWN_PROBE", "second")
    monkeypatch.delenv("ZARRCKPT_SPAWN_GONE")
    spawn(2, _env_seen, str(tmp_path / "b"))
    for rank in range(2):
        first = (tmp_path / f"a.{rank}").read_text()
        assert first == repr({"ZARRCKPT_SPAWN_PROBE": "first", "ZARRCKPT_SPAWN_GONE": "here"})
        second = (tmp_path / f"b.{rank}").read_text()
        assert second == repr({"ZARRCKPT_SPAWN_PROBE": "second", "ZARRCKPT_SPAWN_GONE": None})
