"""The commit protocol, checked as a model (tests/protocol_model.py): zarrckpt's own save, load, delete,
gc and manager code as concurrent actors on a scheduled in-memory store with a virtual clock, every
interleaving of their requests a seed away, checked against the invariants of docs/FORMAT.md §6.

Three families of schedules: (a) saves, restarted jobs, ``gc --grace 0``, manager cleanup and
retention that keeps everything, loads, on one root, nothing asked to be deleted: every save that
returned OK must be committed and verify at the end; (b) the same with deletions asked for
(``rm``, ``rm --force``, ``overwrite=True``, retention of one); (c) one save stalled against a gc
loop and a restarted job, where leases run out. Odd seeds schedule by priorities (PCT: long stalls),
even ones by coin flips; processes are killed at random. ``ZARRCKPT_MODEL_SCHEDULES`` sets how many
schedules per family (default 150, about 5 s each family here); a failure names its seed, replayed
with ``python tests/protocol_model.py FAMILY SEED``.
"""

from __future__ import annotations

import os

import pytest
from protocol_model import FAMILIES, explore

SCHEDULES = int(os.environ.get("ZARRCKPT_MODEL_SCHEDULES", "150"))


@pytest.fixture(autouse=True)
def _one_request_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZARRCKPT_CONCURRENCY", "1")  # (every request on the actor's own thread)
    monkeypatch.delenv("ZARRCKPT_LEASE_SECONDS", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_schedule_keeps_the_invariants(family: str) -> None:
    failed = []
    for seed in range(SCHEDULES):
        world = explore(seed, FAMILIES[family])
        if world.violations:
            failed.append(f"seed {seed}: " + "; ".join(world.violations[:3]) + "\n" + world.tail(40))
    assert not failed, f"{len(failed)} of {SCHEDULES} schedules of family {family} broke an invariant:\n" + failed[0]


def test_the_model_finds_a_planted_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deletion that skips its re-check after its marker (decides on what it saw before) loses saves
    that returned OK: the model finds it within a few dozen schedules of family (c)."""
    from zarrckpt.engine import removal

    original = removal._require

    def first_look_only(*args: object, after: bool = False, **kwargs: object) -> None:
        if not after:
            original(*args, after=after, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(removal, "_require", first_look_only)
    broken = next((seed for seed in range(400) if explore(seed, FAMILIES["c"]).violations), None)
    assert broken is not None, "no schedule found the planted race"
