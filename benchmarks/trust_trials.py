"""Writers and cleaners on one root, as real processes: does every save that returned OK stay saved?

    python benchmarks/trust_trials.py                       # 60 s each, local disk
    python benchmarks/trust_trials.py --rgw                 # on a throwaway Ceph RGW server
    python benchmarks/trust_trials.py --url s3://bucket/t --storage-option endpoint_url=... --seconds 60

Two trials, each for ``--seconds``:

- **gc race**: one process saves step after step (every fifth save fails on purpose after writing
  its shards, leaving a leftover the gc must collect), while another runs ``collect_garbage(root,
  grace_seconds=0)`` in a loop (what ``zarrckpt gc ROOT --grace 0s`` does).
- **two managers**: two processes, each a ``CheckpointManager`` (async saves, retention that keeps
  every step, ``cleanup()`` after each save), save alternate steps to one root.

Afterwards: every save that returned OK is committed, loads its own values and verifies (I1); every
prefix under the root that holds objects is listed by ``list_checkpoints`` (I3); and once the lease
has passed, ``collect_garbage`` leaves committed checkpoints only (I5). The lease is 3 s here
(``ZARRCKPT_LEASE_SECONDS``), so that leftovers die within the trial. ``tests/test_trust_trials.py``
runs each for a few seconds, on local disk and on Ceph RGW.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

LEASE = "3"
ROWS = 64


def _state(value: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((ROWS, 32), float(value)), "b": torch.arange(ROWS) + value}, "step": value}


def _target() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(ROWS, 32), "b": torch.zeros(ROWS, dtype=torch.int64)}, "step": -1}


def _url(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step_{step:010d}"


def _saver(root: str, opts: dict[str, Any] | None, seconds: float, out: Any) -> None:
    """Save step after step until the deadline; every fifth save fails after its shards are written."""
    os.environ["ZARRCKPT_LEASE_SECONDS"] = LEASE
    import zarrckpt
    from zarrckpt.engine import commit

    real_commit = commit.commit
    ok, failed = [], []
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        doomed = step % 5 == 0

        def dies(storage: Any, manifest: Any, _doomed: bool = doomed) -> None:
            if _doomed:
                raise RuntimeError("this save fails on purpose before its commit")
            real_commit(storage, manifest)

        commit.commit = dies  # type: ignore[assignment]
        try:
            zarrckpt.save(_state(step), _url(root, step), storage_options=opts)
            ok.append(step)
        except Exception as e:  # (a failure is fine if it is loud: recorded)
            failed.append((step, type(e).__name__, str(e)[:200]))
    out.put({"ok": ok, "failed": failed})


def _collector(root: str, opts: dict[str, Any] | None, seconds: float, out: Any) -> None:
    """``collect_garbage(grace_seconds=0)`` in a loop until the deadline."""
    os.environ["ZARRCKPT_LEASE_SECONDS"] = LEASE
    import zarrckpt

    removed, errors, rounds = 0, [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            removed += len(zarrckpt.collect_garbage(root, grace_seconds=0, storage_options=opts))
        except Exception as e:  # (a gc that fails is retried: recorded)
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
        rounds += 1
    out.put({"removed": removed, "rounds": rounds, "errors": errors})


def _manager(root: str, opts: dict[str, Any] | None, seconds: float, parity: int, out: Any) -> None:
    """A CheckpointManager saving the steps of one parity, asynchronously, with cleanup after each."""
    os.environ["ZARRCKPT_LEASE_SECONDS"] = LEASE
    import zarrckpt

    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=100_000, storage_options=opts)
    futures: dict[int, Any] = {}
    failed = []
    deadline = time.monotonic() + seconds
    step = parity
    while time.monotonic() < deadline:
        step += 2
        try:
            future = manager.save(step, _state(step))
            if future is not None:
                futures[step] = future
            manager.wait()
        except zarrckpt.CheckpointSaveError as e:
            failed.append((step, str(e)[:200]))
    try:
        manager.close()
    except zarrckpt.CheckpointSaveError as e:
        failed.append((step, str(e)[:200]))
    ok = [s for s, f in futures.items() if f.done() and f.exception() is None]
    out.put({"ok": ok, "failed": failed})


def _run(targets: list[tuple[Any, tuple[Any, ...]]]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out)) for fn, args in targets]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return results


def check(root: str, opts: dict[str, Any] | None, ok: list[int]) -> dict[str, Any]:
    """The invariants after a trial: returns counts; raises AssertionError naming what broke."""
    os.environ["ZARRCKPT_LEASE_SECONDS"] = LEASE
    import zarrckpt
    from zarrckpt.storage.store import Storage

    lost, unlisted = [], []
    for step in ok:  # I1: every save that returned OK is there, loads its own values, and verifies
        url = _url(root, step)
        try:
            got = _target()
            zarrckpt.load(got, url, storage_options=opts)
            problems = zarrckpt.open(url, storage_options=opts).verify()["problems"]
            if got["step"] != step or not torch.equal(got["model"]["w"], _state(step)["model"]["w"]) or problems:
                lost.append((step, f"loaded step {got['step']}, problems {problems}"))
        except zarrckpt.ZarrckptError as e:
            lost.append((step, f"{type(e).__name__}: {e}"))
    listed = zarrckpt.list_checkpoints(root, storage_options=opts)
    stored = Storage(root, opts).entries()
    for name in stored:  # I3: every prefix holding objects is listed
        if name not in listed and Storage(root, opts).child(name).sizes():
            unlisted.append(name)
    time.sleep(float(LEASE) + 1)  # I5: once the leases have passed, gc leaves committed checkpoints only
    zarrckpt.collect_garbage(root, grace_seconds=0, storage_options=opts)
    zarrckpt.collect_garbage(root, grace_seconds=0, storage_options=opts)
    left = {n: s for n, s in zarrckpt.list_checkpoints(root, storage_options=opts).items() if s != "committed"}
    assert not lost, f"{len(lost)} saves that returned OK are gone or damaged: {lost[:5]}"
    assert not unlisted, f"prefixes that ls cannot see: {unlisted[:5]}"
    assert not left, f"left after gc: {left}"
    return {"ok": len(ok), "committed": sum(s == "committed" for s in listed.values()), "listed": len(listed)}


def gc_race(root: str, opts: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """A save loop against a ``gc --grace 0`` loop on one root; the invariants after it."""
    saved, collected = sorted(
        _run([(_saver, (root, opts, seconds)), (_collector, (root, opts, seconds))]), key=lambda r: "ok" not in r
    )
    report = check(root, opts, saved["ok"])
    return {
        **report,
        "failed on purpose": sum("on purpose" in f[2] for f in saved["failed"]),
        "failed otherwise": [f for f in saved["failed"] if "on purpose" not in f[2]],
        "gc rounds": collected["rounds"],
        "gc removed": collected["removed"],
        "gc errors": collected["errors"][:3],
    }


def two_managers(root: str, opts: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """Two managers saving alternate steps to one root; the invariants after them."""
    first, second = _run([(_manager, (root, opts, seconds, 0)), (_manager, (root, opts, seconds, 1))])
    report = check(root, opts, first["ok"] + second["ok"])
    return {**report, "failed": first["failed"] + second["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="trust-trials", help="a root to run in (emptied first when local)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--trial", choices=["gc", "managers", "both"], default="both")
    parser.add_argument("--rgw", action="store_true", help="on a throwaway Ceph RGW server started here")
    args = parser.parse_args()
    opts = dict(kv.split("=", 1) for kv in args.storage_option) or None
    if args.rgw:
        from zarrckpt.testing import rgw, unique_url

        with rgw.rgw_server() as endpoint:
            _trials(unique_url("s3"), rgw.rgw_storage_options(endpoint), args)
    else:
        _trials(args.url, opts, args)


def _trials(url: str, opts: dict[str, Any] | None, args: argparse.Namespace) -> None:
    for trial, fn in (("gc", gc_race), ("managers", two_managers)):
        if args.trial in (trial, "both"):
            root = f"{url.rstrip('/')}/{trial}-{int(time.time())}"
            if "://" not in root:
                Path(root).mkdir(parents=True, exist_ok=True)
            began = time.monotonic()
            result = fn(root, opts, args.seconds)
            print(json.dumps({"trial": trial, "url": root, "seconds": round(time.monotonic() - began, 1), **result}))


if __name__ == "__main__":
    main()
