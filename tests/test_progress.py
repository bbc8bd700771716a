"""Progress of save, async_save, load, the manager and import: a line with rate and ETA on stderr
(``progress=True``) or a callback ``fn(done_bytes, total_bytes)`` for notebooks and frameworks."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.testing.procs import spawn

MIB = 1024 * 1024


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(300, generator=g), "step": 7}


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


class Calls:
    """A progress callback that records what it was told, and from which threads."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.calls.append((done, total))
            self.threads.add(threading.current_thread().name)

    def check(self, total: int) -> None:
        """Several calls, all against ``total``, never past it, ending with ``(total, total)``."""
        assert len(self.calls) >= 3, self.calls
        assert {t for _, t in self.calls} == {total}
        assert all(0 <= d <= total for d, _ in self.calls)
        assert self.calls[-1] == (total, total)
        assert any(d < total for d, _ in self.calls)  # it was told along the way, not only at the end


def test_save_and_load_call_back_with_their_bytes(tmp_path: Path) -> None:
    # three tensors: a load reads each small shard in one read (its index with it), so three reads
    state, url = _state() | {"c": torch.arange(100.0)}, str(tmp_path / "ck")
    saved = Calls()
    zarrckpt.save(state, url, chunk_bytes=256 * 1024, small_tensor_bytes=0, progress=saved)
    saved.check(_tensor_bytes(state))
    target = {"w": torch.zeros(1024, 512), "b": torch.zeros(300), "c": torch.zeros(100), "step": 0}
    loaded = Calls()
    zarrckpt.load(target, url, progress=loaded)
    loaded.check(_tensor_bytes(state))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 7


def test_progress_line_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zarrckpt.save(_state(), str(tmp_path / "ck"), progress=True)
    err = capsys.readouterr().err
    assert f"save {tmp_path / 'ck'}" in err and "100%" in err and "[" + "#" * 30 + "]" in err, err
    target = {"w": torch.zeros(1024, 512), "b": torch.zeros(300), "step": 0}
    zarrckpt.load(target, str(tmp_path / "ck"), progress=True)
    err = capsys.readouterr().err
    assert f"load {tmp_path / 'ck'}" in err and "100%" in err and "2.0 MiB" in err, err


def test_no_progress_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zarrckpt.save(_state(), str(tmp_path / "ck"))
    assert capsys.readouterr().err == ""


def test_a_bad_progress_value_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="progress must be True, False or a callable"):
        zarrckpt.save(_state(), str(tmp_path / "ck"), progress="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "ck").exists()


def test_async_save_calls_back_from_its_writer(tmp_path: Path) -> None:
    state, calls = _state(), Calls()
    future = zarrckpt.async_save(state, str(tmp_path / "ck"), chunk_bytes=256 * 1024, progress=calls)
    future.result()
    calls.check(_tensor_bytes(state))
    assert threading.current_thread().name not in calls.threads


def test_manager_saves_report_progress(tmp_path: Path) -> None:
    calls = Calls()
    manager = zarrckpt.CheckpointManager(str(tmp_path), interval=1, keep_last=2, progress=calls)
    try:
        for step in (1, 2):
            manager.save(step, _state())
        manager.wait()
    finally:
        manager.close()
    ends = [c for c in calls.calls if c[0] == c[1]]
    assert len(ends) == 2 and ends[0] == (_tensor_bytes(_state()),) * 2


def test_a_failed_save_ends_its_progress_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(), url)
    with pytest.raises(zarrckpt.CheckpointExistsError):
        zarrckpt.save(_state(), url, progress=True)
    assert "100%" not in capsys.readouterr().err  # no success drawn for a save that failed


def test_import_cli_progress(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from zarrckpt.cli import main

    torch.save(_state(), tmp_path / "model.pt")
    assert main(["import", str(tmp_path / "model.pt"), str(tmp_path / "ck"), "--progress", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["tensors"] == 2
    assert f"save {tmp_path / 'ck'}" in err and "100%" in err, err


def _read_fanned(rank: int, world: int, url: str, out: str) -> None:
    import numpy as np

    from zarrckpt.engine.dist import Group
    from zarrckpt.engine.fanread import read_shared
    from zarrckpt.engine.loader import open_manifest
    from zarrckpt.format.layout import Box
    from zarrckpt.plan.fetch import Request
    from zarrckpt.storage.store import Storage

    group, storage = Group(None), Storage(url, None)
    manifest = open_manifest(group, storage, allow_modified=False)
    meta = manifest.arrays["w"]
    dest = np.empty(meta.shape, dtype=np.float32)
    received: list[int] = []
    read_shared(group, storage, manifest, [Request(meta, Box.full(meta.shape), dest)], on_received=received.append)
    assert np.array_equal(dest, _state()["w"].numpy())
    Path(out, str(rank)).write_text(json.dumps([storage.traffic.snapshot()["bytes_read"], received]))


@pytest.mark.slow
def test_fanned_out_reads_report_what_other_ranks_send(tmp_path: Path) -> None:
    """Both ranks need all of ``w``: one reads it and sends it; the receiver's progress counts
    what arrived (else a fanned-out load would sit at its few own bytes until the end)."""
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(), url)
    out = tmp_path / "calls"
    out.mkdir()
    spawn(2, _read_fanned, url, str(out))
    nbytes = 1024 * 512 * 4
    seen = [json.loads((out / str(rank)).read_text()) for rank in (0, 1)]
    assert sorted(sum(received) for _, received in seen) == [0, nbytes]  # one rank read it, one received it
    for bytes_read, received in seen:
        assert bytes_read + sum(received) >= nbytes


def _save_halves(rank: int, world: int, url: str, out: str, use_async: bool) -> None:
    import io
    import sys

    rows = 1024 // world
    full = _state()["w"]
    state = {"w": zarrckpt.LocalShard(full[rank * rows : (rank + 1) * rows], tuple(full.shape), (rank * rows, 0))}
    sys.stderr = io.StringIO()  # the line is drawn on the stream stderr is when the save starts
    if use_async:
        zarrckpt.async_save(state, url, progress=True, small_tensor_bytes=0).result()
    else:
        zarrckpt.save(state, url, progress=True, small_tensor_bytes=0)  # each rank writes its half
    Path(out, str(rank)).write_text(sys.stderr.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True])
def test_a_save_on_several_ranks_shows_the_whole_saves_bytes(tmp_path: Path, use_async: bool) -> None:
    """The line is rank 0's: it counts rank 0's writes, and says so, with the bytes of the whole save (issue 41)."""
    out = tmp_path / "err"
    out.mkdir()
    spawn(2, _save_halves, str(tmp_path / "ck"), str(out), use_async)
    line = (out / "0").read_text().strip().splitlines()[-1]
    assert "100% " in line and " of rank 0's 1.0 MiB (2.0 MiB in all, 2 ranks)" in line, line
    assert (out / "1").read_text() == ""  # one line, rank 0's


def test_a_single_process_line_says_what_its_bytes_are_of(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zarrckpt.save(_state(), str(tmp_path / "ck"), progress=True)
    assert " of 2.0 MiB" in capsys.readouterr().err.strip().splitlines()[-1]
