"""A reduced run of benchmarks/soak.py: kill -9 at random points of each lifecycle operation, and
two writers racing to one URL; after every trial the committed checkpoints load bit-exactly, no
leftover is unlisted, and collect_garbage removes every leftover. The full run (100 kills, 20 races)
is ``python benchmarks/soak.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(BENCH))
    try:
        import soak

        yield soak
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_trials_keep_every_invariant(soak, tmp_path: Path) -> None:
    outcomes = soak.kill_trials(tmp_path, trials=15, seed=1)
    assert set(outcomes) == set(soak.SCENARIOS)
    assert sum(sum(c.values()) for c in outcomes.values()) == 15
    seen = {k.split(",")[0].split(" (")[0] for c in outcomes.values() for k in c}
    assert "incomplete" in seen, f"no kill landed mid-save: {outcomes}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_racing_one_url(soak, tmp_path: Path) -> None:
    assert soak.races(tmp_path, 3) == {"one committed, one refused": 3}
