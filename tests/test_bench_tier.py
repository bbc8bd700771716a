"""The local-tier benchmark (benchmarks/tier.py) must keep running: its smallest run end to end
(3 simulated nodes of one rank, a few MiB), its report with every row and target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TITLES = [
    "## Targets",
    "## Machine",
    "## 1. Restore after one node loss",
    "## 2. What a save blocks the caller",
    "## 3. Steps lost per failure",
]


@pytest.mark.slow
@pytest.mark.timeout(180)  # about 40 s on an idle 2-core machine; each spawn's start-up grows with its load
def test_quick_tier_benchmark_runs(tmp_path):
    out = tmp_path / "tier.md"
    cmd = [sys.executable, str(BENCH / "tier.py"), "--quick", "--nodes", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for title in TITLES:
        assert title in text, f"{title!r} missing from the report"
    lines = text.splitlines()
    targets = [line for line in lines if line.startswith(("| restore ", "| local-tier save blocks"))]
    assert len(targets) == 3, targets
    for line in targets:
        assert line.rstrip(" |").endswith(("PASS", "MISS")), line
    # the restores: on 3 ranks (every node) and 2 (the survivors), each from the local tier, from S3
    # and the floor (the bytes alone), which bounds the speed-up any local restore could show
    restores = [line for line in lines if line.startswith(("| 3 ranks (3 nodes", "| 2 ranks (2 nodes"))]
    assert len(restores) == 6, restores
    assert len([line for line in restores if "| floor: the bytes alone" in line]) == 2, restores
    assert next(line for line in lines if line.startswith("| (the most any local restore could show here"))
    for line in restores:
        assert line.rstrip(" |").endswith("yes"), line  # bit-exact
    local = [line for line in restores if "local tier: `load_latest`" in line]
    assert len(local) == 2 and all("| 0 (all requests:" in line for line in local), local  # no object read from S3
    assert next(line for line in lines if line.startswith("| local tier (`manager.save`) |"))
    assert next(line for line in lines if line.startswith("| `async_save` to S3 |"))
    steps = [line for line in lines if line.startswith(("| 1 s |", "| 5 s |", "| 10 s |"))]
    assert len(steps) == 9, steps
    assert "Docs-ready:" in text
