"""benchmarks/trust_trials.py, a few seconds each: a save loop against a ``gc --grace 0`` loop, and two
managers saving alternate steps, on one root, as real processes, on local disk and on a real S3
server (Ceph RGW, where installed). Every save that returned OK must stay committed and verify,
nothing may be left that ``ls`` cannot see, and after the lease gc must leave committed checkpoints
only. Before the fixes of issue 38 the gc deleted saves that had returned OK within seconds."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zarrckpt.testing import rgw, unique_url

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SECONDS = 6.0


@pytest.fixture(scope="module")
def trials() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import trust_trials

        yield trust_trials
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(params=["local", "rgw"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    if request.param == "local":
        return str(tmp_path / "run"), None
    endpoint = request.getfixturevalue("rgw_server")
    return unique_url("s3"), rgw.rgw_storage_options(endpoint)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_loop_against_a_gc_loop(trials: Any, root: tuple[str, dict[str, Any] | None]) -> None:
    result = trials.gc_race(*root, SECONDS)
    assert result["ok"] >= 3 and result["gc rounds"] >= 3, result
    assert result["failed on purpose"] >= 1 and not result["failed otherwise"], result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_managers_on_one_root(trials: Any, root: tuple[str, dict[str, Any] | None]) -> None:
    result = trials.two_managers(*root, SECONDS)
    assert result["ok"] >= 4 and result["committed"] >= result["ok"], result
