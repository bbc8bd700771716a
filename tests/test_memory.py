"""Host memory stays bounded: async and sync-from-GPU staging within the budget, loads within concurrency x chunk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES
from zarrckpt.storage.caps import LOCAL_WRITE_CONCURRENCY

MiB = 1 << 20
SLACK = 48 * MiB  # allocator and interpreter noise, measured well below this


@pytest.mark.slow
def test_extra_rss_is_bounded(tmp_path: Path) -> None:
    budget = 64 * MiB  # a quarter of the 256 MiB state
    probe = Path(__file__).with_name("memory_probe.py")
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path), str(budget)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    extra = json.loads(out.stdout.strip().splitlines()[-1])
    print({k: f"{v / MiB:.1f} MiB" for k, v in extra.items()})
    per_worker = LOCAL_WRITE_CONCURRENCY * (DEFAULT_CHUNK_BYTES + 4)
    assert extra["async_save"] <= budget + per_worker + SLACK, extra
    assert extra["save"] <= per_worker + SLACK, extra
    assert extra["save_staged"] <= budget + per_worker + SLACK, extra  # not the 256 MiB state
    assert extra["load"] <= per_worker + SLACK, extra
