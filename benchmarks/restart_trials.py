"""Kill and restart: the example training job under torchrun, saving every step, is killed with
kill -9 (torchrun and every rank at once) at a random moment and started again, many times; then
it runs to the end. Every restart must resume from a committed step and carry on saving, and the
last run must finish with every save committed, with no manual step in between.

    python benchmarks/restart_trials.py [--trials 30] [--backend local|rgw|both] [--out FILE]

Writes a Markdown report (default ``benchmarks/results/restarts.md``); exits non-zero when a
trial broke the rule. ``tests/test_restart.py`` covers the same rule in ``make test`` (a killed writer's
save taken over by the next one, on local disk and S3); this script is the many-trials proof.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import zarrckpt

STEPS = 400  # more than any run reaches before its kill
WORLD = 2


def _job(root: str, options: dict[str, Any] | None, steps: int, port: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port", str(port)]
    args += ["-m", "zarrckpt.example.train", "--ckpt", root, "--steps", str(steps), "--save-every", "1"]
    args += ["--keep-last", "2", "--log-every", "1"]
    if options:
        args += ["--storage-options", json.dumps(options)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # lines reach us before the kill
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _free_port() -> int:
    from zarrckpt.testing import free_port

    return free_port()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: torchrun starts each rank in a session of its own, so killing
    torchrun's process group would leave the ranks running (and saving) as orphans."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill_tree(pid: int) -> None:
    """kill -9 torchrun and all its ranks at the same moment, as a node failure would."""
    for victim in [pid, *_descendants(pid)]:
        with suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def one_trial(
    root: str, options: dict[str, Any] | None, rng: random.Random, window: tuple[float, float]
) -> dict[str, Any]:
    """Start the job, kill -9 it (torchrun and its ranks) after a random time, and read what it said."""
    proc = _job(root, options, STEPS, _free_port())
    kill_at = time.monotonic() + rng.uniform(*window)  # torch's import takes ~3 s: then it trains, saving each step
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in proc.stdout), daemon=True)
    reader.start()
    while time.monotonic() < kill_at and proc.poll() is None:
        time.sleep(0.05)
    exited = proc.poll()
    if exited is None:
        _kill_tree(proc.pid)
        proc.wait()
    reader.join(timeout=30)
    resumed = next((int(m[1]) for ln in lines if (m := re.match(r"resumed from step (\d+)", ln))), None)
    steps = [int(m[1]) for ln in lines if (m := re.match(r"step (\d+) loss", ln))]
    errors = [ln for ln in lines if "Error" in ln and not ln.startswith("[rank")][:3]
    return {"exited": exited, "resumed": resumed, "last_step": max(steps, default=None), "tail": errors or lines[-5:]}


def run(
    root: str, options: dict[str, Any] | None, trials: int, window: tuple[float, float], seed: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    committed_before = None
    for n in range(trials):
        trial = one_trial(root, options, rng, window)
        if trial["exited"] is not None:  # it stopped by itself before the kill: a failure (saves raise)
            problems.append(f"trial {n}: the job exited with {trial['exited']} before the kill: {trial['tail']}")
            continue
        if trial["resumed"] is None and trial["last_step"] is None:  # killed while starting (torch's import)
            outcomes["killed before resuming"] += 1
        elif trial["resumed"] != committed_before:  # everything stopped at the kill: the latest is what it resumes
            problems.append(f"trial {n}: resumed from {trial['resumed']}, the latest committed: {committed_before}")
        states = zarrckpt.list_checkpoints(root, storage_options=options)
        outcomes.update(s for s in states.values())
        committed = [int(k.split("_")[1]) for k, s in states.items() if s == "committed"]
        committed_before = max(committed, default=None)
        outcomes["trials"] += 1
    # the last run: to the end, without a kill
    final_steps = (committed_before or 0) + 5
    proc = _job(root, options, final_steps, _free_port())
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0 or f"done: step {final_steps}" not in out:
        errors = [ln for ln in out.splitlines() if "Error" in ln and not ln.startswith("[rank")][:3]
        problems.append(f"the final run did not finish: exit {proc.returncode}: {errors or out.splitlines()[-5:]}")
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=2, storage_options=options)
    if manager.latest() != final_steps:
        problems.append(f"after the final run the latest step is {manager.latest()}, not {final_steps}")
    leftovers = {k: s for k, s in zarrckpt.list_checkpoints(root, storage_options=options).items() if s != "committed"}
    return {"trials": trials, "outcomes": dict(outcomes), "problems": problems, "leftovers": leftovers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--backend", choices=["local", "rgw", "both"], default="both")
    parser.add_argument(
        "--kill-after",
        type=float,
        nargs=2,
        default=(4.0, 9.0),
        metavar=("MIN", "MAX"),
        help="kill each run after MIN..MAX seconds (uniform; default 4 9: after start-up, during saves)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "restarts.md")
    args = parser.parse_args(argv)
    reports = {}
    with ExitStack() as stack:
        for backend in ("local", "rgw") if args.backend == "both" else (args.backend,):
            started = time.perf_counter()
            if backend == "local":
                root, options = tempfile.mkdtemp(prefix="zarrckpt-restarts-") + "/run", None
            else:
                from zarrckpt.testing import unique_url
                from zarrckpt.testing.rgw import rgw_available, rgw_server, rgw_storage_options

                if why := rgw_available():
                    print(f"RGW skipped: {why}")
                    continue
                endpoint = stack.enter_context(rgw_server())
                root, options = unique_url("s3"), rgw_storage_options(endpoint)
            report = run(root, options, args.trials, tuple(args.kill_after))
            report["seconds"], report["window"] = time.perf_counter() - started, args.kill_after
            reports[backend] = report
            print(backend, json.dumps(report, indent=1), flush=True)
    lines = ["# Kill -9 and restart trials (`benchmarks/restart_trials.py`)", ""]
    lines += [
        f"The example job (`zarrckpt.example.train`, {WORLD} ranks under torchrun, a save every step, async with "
        "background staging) is killed with kill -9 (torchrun and its ranks) at a random moment, then started "
        "again with no step in between; then it runs to the end.",
        "",
        "| backend | kill after (s) | restarts | killed before resuming | problems | prefixes seen after the kills "
        "(committed / incomplete / deleting) | leftovers at the end | seconds |",
        "|---|---|---:|---:|---:|---|---|---:|",
    ]
    for backend, r in reports.items():
        o = r["outcomes"]
        seen = f"{o.get('committed', 0)} / {o.get('incomplete', 0)} / {o.get('deleting', 0)}"
        early, (lo, hi) = o.get("killed before resuming", 0), r["window"]
        lines.append(
            f"| {backend} | {lo:g}-{hi:g} | {o.get('trials', 0)} | {early} | {len(r['problems'])} | {seen} "
            f"| {r['leftovers'] or 'none'} | {r['seconds']:.0f} |"
        )
    problems = [f"- {b}: {p}" for b, r in reports.items() for p in r["problems"]]
    lines += ["", *(problems or ["Every restart resumed from the latest committed step, and the final run finished."])]
    args.out.write_text("\n".join(lines) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
