"""A checkpoint being deleted (or overwritten) is invisible to readers before anything of it is
deleted: once the deletion holds its marker, its manifest is replaced by a tombstone, so ``load`` and
``open`` refuse it ("being deleted") with no request of their own beyond the manifest GET they always make.
A deletion killed after any of its requests leaves a prefix that every reader refuses, that
``list_checkpoints`` names "deleting", and that ``collect_garbage`` finishes; on local disk, moto's
S3 server and a real S3 server (Ceph RGW).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.format.manifest import DELETING, MANIFEST
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog

RAMP = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": RAMP + value, "b": RAMP[0] - value}, "step": int(value)}


@pytest.fixture(params=["local", "s3", "rgw"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if request.param == "local":
        yield str(tmp_path / "run"), {}
    else:
        yield request.getfixturevalue(f"{request.param}_url")


class Killed(BaseException):
    """Stands in for kill -9 (a BaseException, so nothing on the way catches it)."""


def _kill_after(monkeypatch: pytest.MonkeyPatch, url: str, requests: int, hook: Any = None) -> list[str]:
    """Make the ``requests``-th mutating storage request of a deletion at ``url`` the last: each later one
    raises Killed before reaching the store. ``hook(done)`` runs after every request that went through.
    Requests to other locations (a heartbeat an earlier test in this process left running) pass."""
    done: list[str] = []
    for name in ("write", "create", "delete", "delete_all"):
        real = getattr(Storage, name)

        def wrapped(self: Storage, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if self.url.rstrip("/") != url.rstrip("/"):
                return _real(self, *args, **kwargs)
            if len(done) >= requests:
                raise Killed(_name)
            out = _real(self, *args, **kwargs)
            done.append(f"{_name} {args[0] if args and isinstance(args[0], str) else ''}".strip())
            if hook is not None:
                hook(done)
            return out

        monkeypatch.setattr(Storage, name, wrapped)
    return done


def _refused(url: str, opts: dict[str, Any], why: str = "being deleted") -> None:
    with pytest.raises((zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError)) as err:
        zarrckpt.load(_state(-1.0), url, storage_options=opts)
    assert isinstance(err.value, zarrckpt.CheckpointNotFoundError) or why in str(err.value), str(err.value)
    with pytest.raises((zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError)):
        zarrckpt.open(url, storage_options=opts)


def _loads(url: str, opts: dict[str, Any], value: float) -> bool:
    got = _state(-1.0)
    zarrckpt.load(got, url, storage_options=opts)
    return torch.equal(got["model"]["w"], RAMP + value) and got["step"] == int(value)


@pytest.mark.parametrize("overwrite", [False, True], ids=["delete", "overwrite"])
def test_a_deletion_killed_after_any_request_is_refused_listed_and_collected(
    root: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    base, opts = root
    steps = 0
    while True:  # kill after 0, 1, 2, ... requests, until one deletion runs to its end
        url = f"{base}/step_{steps:04d}"
        zarrckpt.save(_state(1.0), url, storage_options=opts)
        done = _kill_after(monkeypatch, url, steps)
        try:
            if overwrite:
                zarrckpt.save(_state(2.0), url, storage_options=opts, overwrite=True)
            else:
                zarrckpt.delete(url, storage_options=opts)
            finished = True
        except Killed:
            finished = False
        monkeypatch.undo()
        if steps == 0:
            assert _loads(url, opts, 1.0), "before its first request, the checkpoint is untouched"
        elif overwrite and finished:
            assert _loads(url, opts, 2.0)
        else:
            assert done[0] == f"create {DELETING}", f"the first step is the deletion's marker, create-only: {done}"
            assert done[1:2] in ([], [f"write {MANIFEST}"]), f"the second replaces the manifest: {done}"
            listed = zarrckpt.list_checkpoints(base, storage_options=opts).get(f"step_{steps:04d}")
            if listed == "committed":  # overwrite: killed after the new save's commit (its marker left over)
                assert overwrite and _loads(url, opts, 2.0), done
                steps += 1
                continue
            assert listed in ("deleting", "incomplete", None), (done, listed)
            if len(done) == 1:  # only the marker: listed as being deleted, and intact until its tombstone
                assert listed == "deleting" and _loads(url, opts, 1.0), (done, listed)
            else:
                _refused(url, opts, "never committed" if listed == "incomplete" else "being deleted")
            assert listed != "incomplete" or overwrite, "only overwrite's own new save is incomplete"
            if listed == "deleting":
                assert any(e.name == f"step_{steps:04d}" for e in zarrckpt.collect_garbage(base, storage_options=opts))
                assert f"step_{steps:04d}" not in zarrckpt.list_checkpoints(base, storage_options=opts)
        if finished:
            break
        steps += 1
    assert steps >= 3, "the deletion was cut after each of its requests"


def test_readers_refuse_from_the_tombstone_on(
    root: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load and an open that start right after the deletion's tombstone, its second request (the
    first creates its marker), while it still runs."""
    base, opts = root
    url = f"{base}/ck"
    zarrckpt.save(_state(1.0), url, storage_options=opts)
    seen: list[str] = []

    def read_now(done: list[str]) -> None:
        if len(done) == 2:
            monkeypatch.undo()  # the readers' own requests go through
            try:
                _refused(url, opts)
                seen.append("refused")
            finally:
                _kill_after(monkeypatch, url, 99)

    _kill_after(monkeypatch, url, 99, read_now)
    zarrckpt.delete(url, storage_options=opts)
    monkeypatch.undo()
    assert seen == ["refused"]
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.open(url, storage_options=opts)


def test_the_happy_path_costs_no_request(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """Opening a committed checkpoint is still one GET: the tombstone rides on the manifest GET."""
    url, opts = s3_url
    zarrckpt.save(_state(1.0), url, storage_options=opts)
    s3_requests.clear()
    zarrckpt.open(url, storage_options=opts)
    assert [r.kind for r in s3_requests.requests()] == ["GET"]


def test_a_tombstone_is_told_by_its_size_and_content(tmp_path: Path) -> None:
    """Listings probe only a manifest of exactly TOMBSTONE_BYTES (one GET), and a real manifest of that
    size stays committed; a tombstone parses as JSON (a Zarr group) and carries the marker."""
    import json

    from zarrckpt.engine import markers
    from zarrckpt.format.manifest import TOMBSTONE_BYTES, tombstone, tombstone_marker

    marker = markers.marker_doc("abc")
    raw = tombstone(marker)
    assert len(raw) == TOMBSTONE_BYTES and json.loads(raw)["node_type"] == "group"
    assert tombstone_marker(raw) == marker and tombstone_marker(raw.strip()) is None
    assert len(tombstone({"writer": {"host": "h" * 5000}})) == TOMBSTONE_BYTES
    url, pad = tmp_path / "run" / "ck", 0
    for _ in range(10):  # (the manifest's digest and save id vary a little in length: aim again)
        zarrckpt.save({"step": 1, "note": "x" * pad}, url, overwrite=True)
        pad += TOMBSTONE_BYTES - (url / MANIFEST).stat().st_size
        if (url / MANIFEST).stat().st_size == TOMBSTONE_BYTES:
            break
    assert (url / MANIFEST).stat().st_size == TOMBSTONE_BYTES
    assert zarrckpt.list_checkpoints(tmp_path / "run")[url.name] == "committed"
