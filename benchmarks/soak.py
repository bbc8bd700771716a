"""Kill -9 and two-writer trials of the checkpoint lifecycle, with the invariants checked after each.

    python benchmarks/soak.py                      # 100 kill trials (20 per scenario) and 20 races
    python benchmarks/soak.py --trials 10 --races 3 --out benchmarks/results/soak.md

Scenarios, each run in a fresh process that is killed with SIGKILL at a random point of its work:
fresh save, overwrite of a committed checkpoint, async save, manager save + retention delete, and
``zarrckpt gc`` of leftovers. After every trial:

- every committed checkpoint loads bit-exactly to one of the states that may be there (no mixed data);
- every entry under the root that holds anything is listed by ``list_checkpoints`` (no orphan);
- ``collect_garbage(grace_seconds=0)`` removes every leftover, and only committed checkpoints remain.

Races: two processes save to one URL at the same instant; exactly one commits, the other is refused,
and the checkpoint holds the winner's values.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import zarrckpt

SCENARIOS = ("fresh", "overwrite", "async", "retention", "gc")
TENSORS, ROWS, COLS = 16, 256, 512  # 8 MiB of float32 in 16 tensors
CHUNK_BYTES = 64 * 1024  # many objects, so kills land between them


def state(variant: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(variant)
    return {"model": {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(TENSORS)}, "variant": variant}


def target() -> dict[str, Any]:
    return {"model": {f"w{i}": torch.zeros(ROWS, COLS) for i in range(TENSORS)}, "variant": -1}


def name(step: int) -> str:
    return f"step_{step:010d}"


# --------------------------------------------------------------------------- the worker (killed)


def worker(scenario: str, root: str, step: int, variant: int) -> None:
    url = f"{root}/{name(step)}"
    print("READY", flush=True)
    sys.stdin.readline()  # the driver says go once every worker of the trial is ready
    print("GO", time.monotonic(), flush=True)
    if scenario == "fresh":
        zarrckpt.save(state(variant), url, chunk_bytes=CHUNK_BYTES)
    elif scenario == "overwrite":
        zarrckpt.save(state(variant), url, chunk_bytes=CHUNK_BYTES, overwrite=True)
    elif scenario == "async":
        zarrckpt.async_save(state(variant), url, chunk_bytes=CHUNK_BYTES).result()
    elif scenario == "retention":
        manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=1, async_save=False)
        manager.save(step, state(variant))
        manager.close()
    elif scenario == "gc":
        from zarrckpt.cli import commands as cli

        cli.main(["gc", root, "--grace", "0"])
    elif scenario == "race":
        try:
            zarrckpt.save(state(variant), url, chunk_bytes=CHUNK_BYTES)
        except (zarrckpt.CheckpointExistsError, zarrckpt.IncompleteCheckpointError) as e:
            print("REFUSED", type(e).__name__, flush=True)
            os._exit(3)
    print("DONE", time.monotonic(), flush=True)
    os._exit(0)  # skip interpreter teardown (no threads of ours may outlive it)


# --------------------------------------------------------------------------- the driver


def _spawn(scenario: str, root: Path, step: int, variant: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--worker", scenario, str(root), str(step), str(variant)]
    return subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _expect(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"worker said {line!r}, not {word}: {proc.stderr.read() if proc.stderr else ''}")
    return line


def _go(*procs: subprocess.Popen[str]) -> list[float]:
    """Wait until every worker is ready, tell them all to go; returns when each began."""
    for p in procs:
        _expect(p, "READY")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return [float(_expect(p, "GO").split()[1]) for p in procs]


def _setup(scenario: str, root: Path, step: int) -> dict[str, set[int]]:
    """Bring ``root`` to the scenario's starting point; returns name -> the variants each may hold."""
    allowed: dict[str, set[int]] = {}
    if scenario in ("overwrite", "retention", "gc"):
        zarrckpt.save(state(step - 1), str(root / name(step - 1)), chunk_bytes=CHUNK_BYTES)
        allowed[name(step - 1)] = {step - 1}
    if scenario == "overwrite":
        zarrckpt.save(state(step), str(root / name(step)), chunk_bytes=CHUNK_BYTES)
    if scenario == "gc":  # leftovers to collect: a save that died, and a deletion that died
        from zarrckpt.storage.store import Storage

        for leftover, deleting in ((step, False), (step + 1, True)):
            s = Storage(str(root / name(leftover)))
            zarrckpt.save(state(leftover), s.url, chunk_bytes=CHUNK_BYTES)
            if deleting:
                committed = zarrckpt.open(s.url).manifest.save_id  # (the deletion of that save died)
                s.write(".zarrckpt-deleting.json", [json.dumps(_died(committed, deletes="committed")).encode()])
            else:
                s.delete("zarr.json")
                s.write(".zarrckpt-pending.json", [json.dumps(_died("died", world_size=1)).encode()])
    allowed.setdefault(name(step), set()).update({step + 100} if scenario != "overwrite" else {step, step + 100})
    return allowed


def _died(save_id: str, **fields: Any) -> dict[str, Any]:
    """A marker whose writer, a process on this host (this kernel and PID namespace), is gone."""
    from zarrckpt.engine import markers

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    doc = markers.marker_doc(save_id)
    doc["writer"] = {**{k: v for k, v in doc["writer"].items() if k != "start"}, "pid": int(gone.stdout)}
    return {**doc, **fields}


def check(root: Path, allowed: dict[str, set[int]], entry_of_trial: str) -> tuple[str, int]:
    """The invariants after a trial; returns (what the trial's checkpoint was, leftovers collected)."""
    listed = zarrckpt.list_checkpoints(str(root))
    if orphans := sorted(_holding(root) - listed.keys()):
        raise AssertionError(f"entries not listed by list_checkpoints (orphans): {orphans}")
    variants = {}
    for entry, status in listed.items():
        if status == "committed":
            variants[entry] = _check_loads(root / entry, allowed.get(entry, set()))
    collected = zarrckpt.collect_garbage(str(root), grace_seconds=0)
    after = zarrckpt.list_checkpoints(str(root))
    if any(s != "committed" for s in after.values()):
        raise AssertionError(f"leftovers survived collect_garbage: {after}")
    if leftover := sorted(_holding(root) - after.keys()):  # (a deletion killed at its very end leaves an empty dir)
        raise AssertionError(f"collect_garbage left entries behind: {leftover}")
    status = listed.get(entry_of_trial, "absent")
    if entry_of_trial in variants:
        status += f" (variant {variants[entry_of_trial]})"
    return status, len(collected)


def _holding(root: Path) -> set[str]:
    """Entries under ``root`` that hold at least one file."""
    return {p.name for p in root.iterdir() if any(f.is_file() for f in p.rglob("*"))} if root.exists() else set()


def _check_loads(url: Path, variants: set[int]) -> int:
    got = target()
    zarrckpt.load(got, str(url))
    if got["variant"] not in variants:
        raise AssertionError(f"{url} holds variant {got['variant']}, expected one of {sorted(variants)}")
    want = state(got["variant"])
    if not all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]):
        raise AssertionError(f"{url}: tensors differ from variant {got['variant']} (mixed data)")
    return int(got["variant"])


def kill_trials(base: Path, trials: int, seed: int = 0) -> dict[str, Counter[str]]:
    """``trials`` kill -9 trials, spread evenly over the scenarios (plus one unkilled timing run each)."""
    rng = random.Random(seed)
    durations: dict[str, float] = {}
    outcomes: dict[str, Counter[str]] = {s: Counter() for s in SCENARIOS}
    for i in range(trials + len(SCENARIOS)):
        scenario = SCENARIOS[i % len(SCENARIOS)]
        root, step = base / f"t{i:04d}", 10
        allowed = _setup(scenario, root, step)
        proc = _spawn(scenario, root, step, step + 100)
        (began,) = _go(proc)
        timing = scenario not in durations  # the first run of each scenario measures it, unkilled
        if timing:
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{scenario} worker failed: {err[-2000:]}")
            durations[scenario] = float(out.split()[-1]) - began
        else:  # kill points spread from the start to past the usual end (durations vary)
            time.sleep(max(0.0, began + rng.uniform(0.0, 1.3) * durations[scenario] - time.monotonic()))
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
        try:
            status, collected = check(root, allowed, name(step))
        except Exception as e:
            raise AssertionError(f"trial {i} ({scenario}): {e}") from e
        if not timing:
            outcomes[scenario][f"{status}, {collected} collected"] += 1
    return outcomes


def races(base: Path, count: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    for i in range(count):
        root = base / f"race{i:03d}"
        procs = [_spawn("race", root, 1, 200 + w) for w in range(2)]
        _go(*procs)
        results = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode not in (0, 3):
                raise RuntimeError(f"race writer failed: {err[-2000:]}")
            results.append(p.returncode)
        if sorted(results) != [0, 3]:
            raise AssertionError(f"race {i}: exit codes {results}; exactly one writer must commit")
        winner = 200 + results.index(0)
        _check_loads(root / name(1), {winner})
        check(root, {name(1): {winner}}, name(1))
        outcomes["one committed, one refused"] += 1
    return outcomes


def report(outcomes: dict[str, Counter[str]], race_outcomes: Counter[str], seconds: float) -> str:
    lines = ["# Lifecycle soak: kill -9 and two-writer trials", ""]
    killed = sum(sum(c.values()) for c in outcomes.values())
    lines += [
        f"{killed} trials killed with SIGKILL at random points, {sum(race_outcomes.values())} races, "
        f"{seconds:.0f} s. Every trial passed the invariants (committed checkpoints bit-exact, no orphan, "
        "every leftover collected).",
        "",
        "| scenario | trials | the trial's checkpoint after the kill, leftovers collected: count |",
        "|---|---|---|",
    ]
    for scenario, counts in outcomes.items():
        seen = "; ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
        lines.append(f"| {scenario} | {sum(counts.values())} | {seen} |")
    lines += ["", "| races | outcome |", "|---|---|"]
    lines += [f"| {n} | {k} |" for k, n in race_outcomes.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--races", type=int, default=20)
    parser.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one)")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--worker", nargs=4, metavar=("SCENARIO", "ROOT", "STEP", "VARIANT"))
    args = parser.parse_args(argv)
    if args.worker:
        scenario, root, step, variant = args.worker
        worker(scenario, root, int(step), int(variant))
        return 0
    import tempfile

    base = Path(args.dir or tempfile.mkdtemp(prefix="zarrckpt-soak-"))
    began = time.monotonic()
    try:
        outcomes = kill_trials(base, args.trials)
        race_outcomes = races(base, args.races)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    text = report(outcomes, race_outcomes, time.monotonic() - began)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
