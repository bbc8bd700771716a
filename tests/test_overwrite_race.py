"""overwrite=True must never let a reader see a mix of old and new data."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import zarrckpt


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 64), value) for i in range(8)}


def test_reader_never_sees_a_mix(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(0.0), url)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(1, 30):
                zarrckpt.save(_state(float(i)), url, overwrite=True, chunk_bytes=2048)
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    loads = refused = 0
    while not stop.is_set() or loads == 0:
        target = _state(-1.0)
        try:
            zarrckpt.load(target, url)
        except (zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError, zarrckpt.CorruptChunkError):
            refused += 1
            continue
        values = {float(t.unique().item()) for t in target.values() if t.unique().numel() == 1}
        assert len(values) == 1 and all(t.unique().numel() == 1 for t in target.values()), "a load mixed two saves"
        loads += 1
    thread.join()
    assert not errors, errors
    assert loads > 0
