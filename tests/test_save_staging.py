"""A sync save from GPU is the staged pipeline (:mod:`zarrckpt.staging`): device parts are copied to host
buffers within a budget and written as they land; CPU parts are written from their own memory.

There is no GPU here: ``write_local``'s ``moves`` (which parts to stage) is pointed at CPU tensors, so
they go the way GPU tensors do (``hostpool.to_host`` copies, the handoff, the writer thread).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from states import check_loaded, mixed_state

import zarrckpt
from zarrckpt import api, hostpool, staging
from zarrckpt.testing import spawn

ROWS, COLS = 64, 32
NBYTES = ROWS * COLS * 4  # one tensor of the state
RAMP = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)  # (no constant arrays: shards)


def _state(value: float, n: int = 6) -> dict[str, Any]:
    big = {f"w{i}": torch.full((ROWS, COLS), value + i) + RAMP for i in range(n)}
    return {"model": {**big, "bias": torch.arange(10.0) + value}, "step": int(value)}


def _loads(url: Path, value: float, n: int = 6) -> None:
    got = _state(-1.0, n)
    zarrckpt.load(got, url)
    want = _state(value, n)
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and got["step"] == want["step"]


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``staged(moves)``: the next saves stage the CPU parts ``moves`` picks (default: all)."""

    def switch(moves: Callable[[torch.Tensor], bool] = lambda t: True) -> None:
        monkeypatch.setattr(api, "write_local", partial(staging.write_local, moves=moves))

    yield switch
    zarrckpt.release_staging()


@pytest.fixture
def handoffs(monkeypatch: pytest.MonkeyPatch) -> list[staging.Handoff]:
    """Every handoff a save makes (to read its ``peak`` afterwards)."""
    made: list[staging.Handoff] = []

    class Recorded(staging.Handoff):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(staging, "Handoff", Recorded)
    return made


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every copy to host memory (``hostpool.to_host``), in order."""
    seen: list[int] = []
    real = hostpool.to_host

    def counted(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.nbytes)
        return real(t)

    monkeypatch.setattr(hostpool, "to_host", counted)
    return seen


def _files(root: Path) -> dict[str, bytes]:
    """Every object of a checkpoint; the root document without what differs between two saves."""
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    doc = json.loads(files.pop("zarr.json"))
    for key in ("save_id", "created", "attributes_crc32c"):
        doc["attributes"]["zarrckpt"].pop(key)
    files["zarr.json"] = json.dumps(doc, sort_keys=True).encode()
    return files


@pytest.mark.parametrize("budget", [2 * NBYTES, 10**9], ids=["two-tensors", "everything"])
def test_staged_save_is_bit_identical_to_the_direct_one(
    tmp_path: Path, staged: Callable[..., None], handoffs: list[staging.Handoff], copies: list[int], budget: int
) -> None:
    zarrckpt.save(_state(1.0), tmp_path / "direct")
    assert copies == [] and handoffs == []
    staged()
    zarrckpt.save(_state(1.0), tmp_path / "staged", staging_budget_bytes=budget)
    assert len(copies) == 7 and len(handoffs) == 1, (copies, handoffs)  # six tensors and the bias
    assert _files(tmp_path / "staged") == _files(tmp_path / "direct")
    _loads(tmp_path / "staged", 1.0)


def test_some_parts_staged_and_the_rest_written_from_their_memory(
    tmp_path: Path, staged: Callable[..., None], copies: list[int]
) -> None:
    zarrckpt.save(_state(2.0), tmp_path / "direct")
    staged(lambda t: t.numel() > 100)  # the weights "on the GPU", the bias on the CPU
    zarrckpt.save(_state(2.0), tmp_path / "mixed", staging_budget_bytes=NBYTES)
    assert copies == [NBYTES] * 6, copies
    assert _files(tmp_path / "mixed") == _files(tmp_path / "direct")
    _loads(tmp_path / "mixed", 2.0)


@pytest.mark.parametrize("tensors", [1, 2, 3])
def test_staged_bytes_never_exceed_the_budget(
    tmp_path: Path, staged: Callable[..., None], handoffs: list[staging.Handoff], tensors: int
) -> None:
    staged()
    budget = tensors * NBYTES
    zarrckpt.save(_state(3.0, n=8), tmp_path / "ck", staging_budget_bytes=budget)
    (handoff,) = handoffs
    assert 0 < handoff.peak <= budget and handoff.in_flight == 0, (handoff.peak, budget)
    _loads(tmp_path / "ck", 3.0, n=8)


def test_a_part_larger_than_the_budget_is_staged_alone(
    tmp_path: Path, staged: Callable[..., None], handoffs: list[staging.Handoff]
) -> None:
    staged()
    zarrckpt.save(_state(4.0), tmp_path / "ck", staging_budget_bytes=1000)  # each weight is 8 KiB
    assert handoffs[0].peak == NBYTES  # one at a time, never two
    _loads(tmp_path / "ck", 4.0)


def test_a_writer_failure_stops_the_copies_and_the_save_raises(
    tmp_path: Path, staged: Callable[..., None], copies: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    staged()
    real = staging.write_rank
    calls = {"n": 0}

    def failing(*args: Any, **kw: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk on fire")
        return real(*args, **kw)

    monkeypatch.setattr(staging, "write_rank", failing)
    threads = threading.active_count()
    with pytest.raises(OSError, match="disk on fire"):
        zarrckpt.save(_state(5.0, n=12), tmp_path / "ck", staging_budget_bytes=NBYTES)
    assert len(copies) <= 3, copies  # the copies stopped: not all 13 parts were staged
    assert threading.active_count() == threads  # the writer thread is gone
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state(0.0, n=12), tmp_path / "ck")


def test_a_copy_failure_stops_the_writer_and_the_save_raises(
    tmp_path: Path, staged: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    staged()
    real = hostpool.to_host
    calls = {"n": 0}

    def flaky(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device copy failed")
        return real(t)

    monkeypatch.setattr(hostpool, "to_host", flaky)
    with pytest.raises(RuntimeError, match="device copy failed"):
        zarrckpt.save(_state(6.0), tmp_path / "ck", staging_budget_bytes=NBYTES)
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state(0.0), tmp_path / "ck")
    monkeypatch.setattr(hostpool, "to_host", real)
    zarrckpt.save(_state(6.0), tmp_path / "ck", overwrite=True, staging_budget_bytes=NBYTES)
    _loads(tmp_path / "ck", 6.0)


def test_an_all_cpu_save_copies_nothing(
    tmp_path: Path, copies: list[int], handoffs: list[staging.Handoff], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    real = staging.write_rank

    def once(storage: Any, plan: Any, local: Any, *args: Any, **kw: Any) -> int:
        writes.append(len(list(local.parts())))
        return real(storage, plan, local, *args, **kw)

    monkeypatch.setattr(staging, "write_rank", once)
    zarrckpt.save(_state(7.0), tmp_path / "ck", staging_budget_bytes=1)
    assert copies == [] and handoffs == [] and writes == [7], (copies, writes)  # one write_rank, as before
    _loads(tmp_path / "ck", 7.0)


def test_pooled_buffers_stay_within_the_budget(tmp_path: Path, staged: Callable[..., None]) -> None:
    zarrckpt.release_staging()
    staged()
    state = {"model": {f"w{i}": torch.rand(ROWS + i, COLS) for i in range(6)}}  # six shapes: no reuse
    zarrckpt.save(state, tmp_path / "ck", staging_budget_bytes=2 * NBYTES + 1000)
    assert 0 < hostpool.pool.nbytes <= 2 * NBYTES + 1000, hostpool.pool.nbytes


def test_the_budget_comes_from_the_argument_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(staging.SAVE_STAGING_ENV, raising=False)
    assert staging.save_budget(None) == staging.DEFAULT_SAVE_STAGING_BYTES == 512 * 2**20
    monkeypatch.setenv(staging.SAVE_STAGING_ENV, "1048576")
    assert staging.save_budget(None) == 2**20 and staging.save_budget(7) == 7
    monkeypatch.setenv(staging.SAVE_STAGING_ENV, "lots")
    with pytest.raises(zarrckpt.ZarrckptError, match="ZARRCKPT_SAVE_STAGING_BYTES='lots'"):
        staging.save_budget(None)
    with pytest.raises(zarrckpt.ZarrckptError, match="positive"):
        staging.save_budget(0)


def _staged_ranks(rank: int, world: int, url: str) -> None:
    api.write_local = partial(staging.write_local, moves=lambda t: True)  # type: ignore[assignment]
    zarrckpt.save(mixed_state(rank, world, fill=True, save_world=world), url, staging_budget_bytes=4096)


def _load_ranks(rank: int, world: int, url: str) -> None:
    state = mixed_state(rank, world, fill=False, save_world=4)
    zarrckpt.load(state, url)
    check_loaded(state, rank, world, 4)


@pytest.mark.slow
def test_staged_save_multi_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    spawn(4, _staged_ranks, url)
    spawn(3, _load_ranks, url)
