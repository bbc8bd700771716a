"""benchmarks/tier_kill_trials.py, 3 trials: the example job on 4 ranks as 2 simulated nodes, a
local step every step with a replica on the other node, killed with kill -9 at a random moment;
restarted after one node's tier directory is wiped, then on 2 ranks (1 node). Every restart must
resume from the newest step that survived, with the state the job had at that step (no torn, stale
or mixed step). The benchmark runs 30 and more of them (benchmarks/results/tier_kills.md)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def trials() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import tier_kill_trials

        yield tier_kill_trials
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_trials_of_the_local_tier(trials: Any, tmp_path: Path) -> None:
    # each kill 2-5 s after the job said it resumed (after its restore: counted from that line, so that
    # a loaded machine's slow start-up kills no job before its first step); seed 0: node1 is lost,
    # node0 restores alone
    kinds = ["kill", "node lost", "fewer ranks"]
    result = trials.run(str(tmp_path), 3, seed=0, final=False, kinds=kinds, window=(2.0, 5.0), anchored=True)
    counts = result["counts"]
    assert not result["problems"], result
    assert counts["trials"] == 3 and counts.get("restored local", 0) >= 1, result
