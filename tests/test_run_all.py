"""``Storage.run_all`` with items run on the calling thread (small local reads), what a load of
many small local shards costs: one read per shard object, on the loading thread, and where small
local writes go: the saving thread while the filesystem answers fast, the threads while it does not."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.storage.concurrency import LOCAL_BATCH, SMALL_LOCAL_WRITE, Pace
from zarrckpt.storage.store import Storage


def test_inline_items_keep_their_turn_and_thread(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "ck"), concurrency=4)
    caller = threading.current_thread()

    def work(i: int) -> tuple[int, bool]:
        if i % 3 == 0:
            time.sleep(0.01)  # pooled items finish late: the results must still come in order
        return i, threading.current_thread() is caller

    got = store.run_all(work, range(40), inline=lambda i: i % 3 != 0)
    assert [i for i, _ in got] == list(range(40))
    assert [on_caller for _, on_caller in got] == [i % 3 != 0 for i in range(40)]


def test_the_first_failure_in_order_wins_and_nothing_more_starts(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "ck"), concurrency=2)
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i == 3:  # pooled, fails late
            time.sleep(0.2)
            raise ValueError("item 3")
        if i == 5:  # inline, fails at once
            raise KeyError("item 5")
        return i

    with pytest.raises(ValueError, match="item 3"):
        store.run_all(work, range(100), inline=lambda i: i != 3)
    assert 5 in started and max(started) == 5


def test_a_failing_inline_item_alone_raises(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "ck"), concurrency=2)

    def work(i: int) -> int:
        if i == 4:
            raise KeyError("item 4")
        return i

    with pytest.raises(KeyError, match="item 4"):
        store.run_all(work, range(10), inline=lambda i: True)


def test_small_local_shards_are_read_once_each_on_the_loading_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"p{i}": torch.arange(i + 2, dtype=torch.float32) * (i + 1) for i in range(50)}  # none constant
    state["big"] = torch.randn(512, 1024)  # 2 MiB: over the inline size, read by the pool
    url = str(tmp_path / "ck")
    zarrckpt.save(state, url)
    reads: list[tuple[str, int, bool]] = []
    caller = threading.current_thread()
    plain_read_into, plain_reading = Storage.read_into, Storage.reading

    def read_into(self: Storage, path: str, offset: int, buffers: Any) -> int:
        reads.append((path, offset, threading.current_thread() is caller))
        return plain_read_into(self, path, offset, buffers)

    def reading(self: Storage, path: str, start: int | None = None, end: int | None = None) -> Any:
        if "/c" in path:
            reads.append((path, start or 0, threading.current_thread() is caller))
        return plain_reading(self, path, start, end)

    monkeypatch.setattr(Storage, "read_into", read_into)
    monkeypatch.setattr(Storage, "reading", reading)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    zarrckpt.load(target, url)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    small = [r for r in reads if not r[0].startswith("big/")]
    assert sorted(p for p, _, _ in small) == sorted(f"p{i}/c.0" for i in range(50))  # one read per shard
    assert all(offset == 0 and on_caller for _, offset, on_caller in small)  # its index in the same read
    assert any(not on_caller for p, _, on_caller in reads if p.startswith("big/"))


def _write_all(store: Storage, sizes: list[int], seconds: float = 0.0) -> tuple[int, list[bool], int]:
    """``store.write_all`` over objects of ``sizes`` (each write sleeping ``seconds``): the total it
    returned, whether each write ran on the calling thread, and the most writes that ran at once."""
    caller = threading.current_thread()
    lock = threading.Lock()
    where: list[bool] = [False] * len(sizes)
    running = [0, 0]  # now, most

    def write(i: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running)
        where[i] = threading.current_thread() is caller
        time.sleep(seconds)
        with lock:
            running[0] -= 1
        return sizes[i]

    return store.write_all(write, range(len(sizes)), size=lambda i: sizes[i]), where, running[1]


def test_small_local_writes_run_on_the_saving_thread_while_the_filesystem_is_fast(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "ck"), concurrency=8)
    sizes = [700] * (10 * LOCAL_BATCH) + [SMALL_LOCAL_WRITE] + [700] * LOCAL_BATCH
    total, where, _ = _write_all(store, sizes)
    assert total == sum(sizes)
    assert all(where[i] for i, n in enumerate(sizes) if n < SMALL_LOCAL_WRITE)
    assert not where[10 * LOCAL_BATCH]  # a large write: to a thread, always


def test_small_local_writes_go_to_the_threads_while_the_filesystem_is_slow(tmp_path: Path) -> None:
    # 2 ms a write, as a network filesystem answers (a local one: 26-75 us): after three slow runs
    # on the saving thread, the runs go to the threads, and every 8 runs one more is tried here
    store = Storage(str(tmp_path / "ck"), concurrency=8)
    sizes = [700] * (40 * LOCAL_BATCH)
    total, where, most = _write_all(store, sizes, seconds=0.002)
    assert total == sum(sizes)
    runs = [where[i * LOCAL_BATCH] for i in range(40)]
    assert all(where[i] == runs[i // LOCAL_BATCH] for i in range(len(sizes)))  # a run stays on one thread
    assert runs[:3] == [True] * 3 and not any(runs[3:11])  # three slow runs here, then 8 to the threads
    assert runs.count(True) in range(5, 8)  # then one try here in every 9 runs: 3 + 3 or 4 of 40
    assert most > 2


def test_a_journal_stall_now_and_then_keeps_small_writes_on_the_saving_thread() -> None:
    pace = Pace(limit=8)
    for i in range(40):  # one run in four stalls (a journal commit)
        assert pace.inline(small=True)
        pace.recent.append(2e-3 if i % 4 == 3 else 40e-6)
    for _ in range(3):  # three slow runs in a row: the threads
        pace.recent.append(2e-3)
    assert [pace.inline(small=True) for _ in range(18)] == ([False] * 8 + [True]) * 2
    assert not pace.inline(small=False)
