"""overwrite=True must never let a reader see a mix of old and new data."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import zarrckpt

SAVES, MAX_SAVES = 29, 200


RAMP = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)  # so no tensor is a constant array (no shards)


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 64), value) + RAMP for i in range(8)}


def test_reader_never_sees_a_mix(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(0.0), url)
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()
    started = finished = 0  # saves begun / completed by the writer
    overlapped = 0  # successful loads during which a save was in progress

    def writer() -> None:
        nonlocal started, finished
        try:
            # at least SAVES saves; more (up to MAX_SAVES) until a successful load has overlapped one
            for i in range(1, MAX_SAVES + 1):
                with lock:
                    if i > SAVES and overlapped:
                        break
                    started += 1
                zarrckpt.save(_state(float(i)), url, overwrite=True, chunk_bytes=2048)
                with lock:
                    finished += 1
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    loads = refused = 0
    while not stop.is_set() or loads == 0:
        with lock:
            started_before, finished_before = started, finished
        target = _state(-1.0)
        try:
            zarrckpt.load(target, url)
            ok = True
        except (zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError, zarrckpt.CorruptChunkError):
            ok = False
        with lock:
            # a save was running when the load began, or one began before it ended
            if ok and (started_before > finished_before or started > started_before):
                overlapped += 1
        if not ok:
            refused += 1
            continue
        saved = [(t - RAMP).unique() for t in target.values()]  # the value each tensor was saved with
        values = {float(u.item()) for u in saved if u.numel() == 1}
        assert len(values) == 1 and all(u.numel() == 1 for u in saved), "a load mixed two saves"
        loads += 1
    thread.join()
    assert not errors, errors
    assert loads > 0
    assert overlapped > 0, f"no load overlapped a save ({loads} loads, {refused} refused, {finished} saves)"
    print(f"\n{finished} saves, {loads} loads ({overlapped} during a save), {refused} refused")
