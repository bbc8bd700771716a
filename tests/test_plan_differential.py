"""The save planner against its own output before issue 39 (``plan.save._plan`` split into a grid
pass and a writers pass, the layout-based planner's collectives moved to ``engine.saveplan``).

``EXPECTED`` (tests/plan_expected.json) was written by ``python tests/plan_cases.py`` (with ``tests``
and the repository root on ``PYTHONPATH``) at the commit before the split, and again when writers
came to be chosen by bytes (plan_cases.py says what was compared): every case's plan, to the last
field and dict order, or the error it raised, must stay what it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plan_cases
import pytest

from zarrckpt.plan.save import ZarrSavePlan

EXPECTED: dict[str, str] = json.loads((Path(__file__).parent / "plan_expected.json").read_text())


@pytest.fixture(scope="module")
def cases() -> dict[str, Callable[[], ZarrSavePlan]]:
    return plan_cases.cases()


def test_the_cases_are_the_expected_ones(cases: dict[str, Any]) -> None:
    assert sorted(cases) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_plan_is_unchanged(cases: dict[str, Callable[[], ZarrSavePlan]], name: str) -> None:
    assert plan_cases.outcome(cases[name]) == EXPECTED[name]
