"""Kill -9 trials of the local tier (issue 42): the example training job under torchrun, 4 ranks as 2
simulated nodes of 2 (``--ranks-per-node 2``), a local step every step with a copy on the other node,
a remote step every 10, is killed with kill -9 (torchrun and every rank) at a random moment and
started again, many times. Before some restarts one node's tier directory is wiped (a node lost), or
both (the job lost), or the restart runs on 2 ranks (1 node, no replica); some restarts are killed
again while they restore. Every restart must resume from a step whose state is a state the job had
at that step (the digest the job printed then: equal to an uninterrupted reference run's, unless a
2-rank run lies between, whose sums add up in another order), never a torn, stale or mixed one, and
from the newest step that should have survived: the newest local step committed on the surviving
nodes when it is at least as new as the newest remote step, else the remote one; and it must carry on.

    python benchmarks/tier_kill_trials.py [--trials 32] [--seed 0] [--out FILE]

What the harness knows of each run comes from its output alone: ``digest step S X`` (printed
before step S's save starts), ``step S loss`` (printed after step S's save started, which waits for
step S-1's local save to be committed on every node): so steps up to S-1 are surely committed, and
S and S+1 may be. Writes a Markdown report (default ``benchmarks/results/tier_kills.md``); exits
non-zero when a trial broke the rule. ``tests/test_tier_kills.py`` runs 3 trials in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from restart_trials import _kill_tree  # (the script's neighbour: torchrun and its ranks at once)

import zarrckpt

WORLD, PER_NODE = 4, 2
NODES = ("node0", "node1")
REMOTE_EVERY = 10
STEPS = 10_000  # more than any run reaches before its kill
KINDS = ("kill", "node lost", "kill", "fewer ranks", "restore kill", "job lost")
START = 11.0  # seconds from the start to the resumed line, at first (then the median of the trials' last 5)
WINDOW = (0.3, 7.0)  # a kill this long after that moment
RESUMED = ("resumed from step", "starting from scratch")  # the job's lines at that moment


def _job(remote: str, tier: str, world: int, steps: int, port: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port)]
    args += ["-m", "zarrckpt.example.train", "--ckpt", remote, "--steps", str(steps), "--digest", "--log-every", "1"]
    args += ["--save-every", str(REMOTE_EVERY), "--keep-last", "2", "--ranks-per-node", str(PER_NODE)]
    if tier:
        replicas = 1 if world > PER_NODE else 0
        args += ["--local-every", "1", "--local-path", f"{tier}/{{node}}", "--local-replicas", str(replicas)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _free_port() -> int:
    from zarrckpt.testing import free_port

    return free_port()


@dataclass
class Run:
    """What one run printed."""

    world: int
    lines: list[tuple[float, str]]
    exited: int | None

    def grep(self, pattern: str) -> list[re.Match[str]]:
        return [m for _, ln in self.lines if (m := re.match(pattern, ln))]

    @property
    def scratch(self) -> bool:
        return bool(self.grep(r"starting from scratch"))

    @property
    def resumed(self) -> tuple[int, str] | None:
        found = self.grep(r"resumed from step (\d+) of the (local|remote) tier")
        return (int(found[0][1]), found[0][2]) if found else None

    @property
    def restored_digest(self) -> str | None:
        found = self.grep(r"digest restored \d+ (\w+)")
        return found[0][1] if found else None

    @property
    def digests(self) -> dict[int, str]:
        return {int(m[1]): m[2] for m in self.grep(r"digest step (\d+) (\w+)")}

    @property
    def last_step(self) -> int | None:
        return max((int(m[1]) for m in self.grep(r"step (\d+) loss")), default=None)

    def when(self, pattern: str) -> float | None:
        return next((t for t, ln in self.lines if re.match(pattern, ln)), None)

    def tail(self) -> list[str]:
        errors = [ln for _, ln in self.lines if "Error" in ln and not ln.startswith("[rank")][:3]
        return errors or [ln for _, ln in self.lines[-5:]]


def run_job(
    remote: str,
    tier: str,
    world: int,
    kill_after: float | None,
    steps: int = STEPS,
    at_save: float | None = None,
    at_restore: float | None = None,
    after: tuple[str, ...] = (),
) -> tuple[Run, str]:
    """Start the job; kill -9 it after ``kill_after`` seconds (None: let it finish; with ``after``,
    seconds from the first line starting with one of those, else from the start), or, with
    ``at_save``, that long after the first step's save that starts after ``kill_after`` (the job
    prints the step's digest, then starts its save), or, with ``at_restore``, that long after it
    says it restores; returns what it printed and what the tier showed at the kill."""
    proc = _job(remote, tier, world, steps, _free_port())
    started, wall = time.monotonic(), time.time()
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    out = proc.stdout

    def read() -> None:
        for ln in out:
            lines.append((time.monotonic() - started, ln.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    moment = ""
    if kill_after is None:
        proc.wait(timeout=600)
    else:
        base = started
        if after:  # (the job's own pace, whatever the machine's load: a loaded CI run took >16 s to resume)
            deadline = started + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if any(ln.startswith(after) for _, ln in lines):
                    base = time.monotonic()
                    break
                time.sleep(0.01)
        while time.monotonic() - base < kill_after and proc.poll() is None:
            if at_restore is not None and any(ln.startswith("restoring the newest") for _, ln in lines):
                time.sleep(at_restore)
                break
            time.sleep(0.01)
        if at_save is not None:
            seen, deadline = len(lines), time.monotonic() + 5
            while proc.poll() is None and time.monotonic() < deadline:
                if any(ln.startswith("digest step") for _, ln in lines[seen:]):
                    time.sleep(at_save)
                    break
                time.sleep(0.01)
        if proc.poll() is None:
            moment = _moment(tier, wall, lines, world)
            _kill_tree(proc.pid)
            proc.wait()
    reader.join(timeout=30)
    return Run(world, lines, None if moment else proc.returncode), moment


def _moment(tier: str, since: float, lines: list[tuple[float, str]], world: int) -> str:
    """What the job was doing at the kill, from its output (it said it restores) and what this run
    made (since ``since``) in its nodes' tier directories: the step whose digest it printed last (it
    starts that step's save next) not yet committed on every node."""
    begun = any(re.match(r"(resumed from|starting from scratch)", ln) for _, ln in lines)
    printed = [int(m[1]) for _, ln in lines if (m := re.match(r"digest step (\d+)", ln))]
    committed = []
    for node in NODES[: world // PER_NODE]:
        root, done = os.path.join(tier, node), False
        with suppress(FileNotFoundError):
            for name in os.listdir(root):
                path = os.path.join(root, name)
                with suppress(FileNotFoundError):
                    if os.stat(path).st_mtime < since - 1:
                        continue
                if printed and name.startswith(f"step_{printed[-1]:010d}."):
                    done |= os.path.exists(os.path.join(path, ".zarrckpt-tier", "committed.json"))
        committed.append(done)
    if not begun:
        said = any(ln.startswith("restoring the newest") for _, ln in lines)
        return "restoring" if said else "starting (before any restore)"
    return "saving" if printed and not all(committed) else "training (no save in flight)"


@dataclass
class Entry:
    """A local step a node's directory may hold complete (every rank's objects, as a 2-node job with a
    replica and a 1-node job leave it): ``sure`` when it was surely committed there."""

    step: int
    digest: str
    sure: bool
    seq: int


@dataclass
class Model:
    """What each node's tier directory holds, as far as the runs' output tells."""

    nodes: dict[str, list[Entry]] = field(default_factory=lambda: {n: [] for n in NODES})
    logged: dict[int, set[str]] = field(default_factory=dict)  # every digest any run printed, by step
    # (step, digest) -> whether a 2-rank run lies between that state and the start (its sums differ)
    diverged: dict[tuple[int, str], bool] = field(default_factory=dict)
    world: dict[tuple[int, str], int] = field(default_factory=dict)  # (step, digest) -> the ranks of the run at it
    seq: int = 0
    # the runs that began (resumed or started from scratch): (the step it began at, the index of the
    # run whose state it restored, what it printed: (step, digest)); the last one is the head
    runs: list[tuple[int, int | None, set[tuple[int, str]]]] = field(default_factory=list)

    def on_branch(self, step: int, digest: str) -> bool:
        """Whether (step, digest) is a state of the head run's own history: printed by it, or by one
        of the runs it descends from, at or before the step where the next of them began."""
        at, cutoff = len(self.runs) - 1, None
        while at >= 0:
            base, parent, printed = self.runs[at]
            if (step, digest) in printed and (cutoff is None or step <= cutoff):
                return True
            if parent is None:
                return False
            at, cutoff = parent, base if cutoff is None else min(cutoff, base)
        return True  # no run began yet

    def expected(self, nodes: list[str], remote: int | None) -> tuple[int | None, int | None]:
        """The range the restored step must lie in (None, None: from scratch)."""
        entries = [e for n in nodes for e in self.nodes[n]]
        lo = max((e.step for e in entries if e.sure), default=None)
        hi = max((e.step for e in entries), default=None)
        if remote is not None:
            lo, hi = max(lo if lo is not None else -1, remote), max(hi if hi is not None else -1, remote)
        return lo, hi

    def acceptable(self, nodes: list[str], step: int) -> set[str]:
        """The digests a restore of local ``step`` may have: the newest save of it on the nodes, back to
        the newest one surely committed (a later save of a step wins over an earlier one)."""
        entries = sorted((e for n in nodes for e in self.nodes[n] if e.step == step), key=lambda e: e.seq)
        out = set()
        for e in reversed(entries):
            out.add(e.digest)
            if e.sure:
                break
        return out

    def ran(self, nodes: list[str], run: Run) -> None:
        """Take in what a run saved to its nodes' directories."""
        base = run.resumed[0] if run.resumed else 0 if run.scratch else None
        if base is not None:
            mine = {(int(st), d) for st, d in run.digests.items()}
            restored = (base, run.restored_digest or "")
            parent = next((i for i in reversed(range(len(self.runs))) if restored in self.runs[i][2]), None)
            self.runs.append((base, parent if run.resumed else None, mine | ({restored} if run.resumed else set())))
        diverged = run.world != WORLD or (
            run.resumed is not None and self.diverged.get((run.resumed[0], run.restored_digest or ""), False)
        )
        for step, d in run.digests.items():
            self.logged.setdefault(step, set()).add(d)
            self.diverged[(step, d)] = self.diverged.get((step, d), False) or diverged
            self.world[(step, d)] = run.world
        if base is None:
            return  # killed before it resumed: it saved nothing
        last = run.last_step
        sure = last - 1 if last is not None else None
        for step, d in sorted(run.digests.items()):
            if step <= base:
                continue
            self.seq += 1
            for n in nodes:
                self.nodes[n].append(Entry(step, d, sure is not None and step <= sure, self.seq))
        for n in nodes:  # what is older than the newest surely committed step no longer matters
            top = max((e.step for e in self.nodes[n] if e.sure), default=-1)
            self.nodes[n] = [e for e in self.nodes[n] if e.step >= top]

    def wipe(self, node: str) -> None:
        self.nodes[node] = []


def _remote(remote: str) -> int | None:
    states = zarrckpt.list_checkpoints(remote) if os.path.exists(remote) else {}
    return max((int(k.split("_")[1]) for k, s in states.items() if s == "committed"), default=None)


def reference(workdir: str, steps: int) -> tuple[dict[int, str], float]:
    """An uninterrupted run's digest at every step (4 ranks, no local tier: it does not change the state)."""
    started = time.perf_counter()
    run, _ = run_job(os.path.join(workdir, "reference"), "", WORLD, None, steps)
    if run.exited != 0:
        raise RuntimeError(f"the reference run failed ({run.exited}): {run.tail()}")
    return run.digests, time.perf_counter() - started


def _within(step: int, lo: int | None, hi: int | None) -> bool:
    """Whether a restore of ``step`` fits :meth:`Model.expected` (lo None: no step surely survived)."""
    return hi is not None and (lo is None or lo <= step) and step <= hi


def run(
    workdir: str,
    trials: int,
    seed: int = 0,
    final: bool = True,
    kinds: list[str] | None = None,
    window: tuple[float, float] = WINDOW,
    anchored: bool = False,
) -> dict[str, Any]:
    """``trials`` kills (of ``kinds`` in this order; default: :data:`KINDS` over and over, shuffled;
    ``window``: seconds after the moment the job resumes, as the trials so far took to get there, or,
    ``anchored``, from the moment this trial's job says it resumed), then a run to the end
    (``final``), then the reference run to compare the restored states with."""
    rng = random.Random(seed)
    remote, tier = os.path.join(workdir, "remote"), os.path.join(workdir, "tier")
    model = Model()
    counts: Counter[str] = Counter()
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    resumed_at: list[float] = []  # when the job said it resumed, in the trials so far
    restoring: list[float] = []  # how long it took from saying it restores to saying it resumed
    restored: list[tuple[int, int, str, bool]] = []  # (trial, step, digest, after a 2-rank run) of every restore
    if kinds is None:  # the 2-rank restarts in the second half: the first half's states equal the reference run's
        kinds = [KINDS[n % len(KINDS)] for n in range(trials)]
        fewer = [k for k in kinds if k == "fewer ranks"]
        kinds = [k for k in kinds if k != "fewer ranks"]
        rng.shuffle(kinds)
        for k in fewer:
            kinds.insert(rng.randint(trials // 2, len(kinds)), k)
    for n, kind in enumerate(kinds):
        world, wiped = WORLD, []
        if kind == "node lost":
            wiped = [rng.choice(NODES)]
        elif kind == "job lost":
            wiped = list(NODES)
        elif kind == "fewer ranks":
            world = PER_NODE
        for node in wiped:
            shutil.rmtree(os.path.join(tier, node), ignore_errors=True)
            model.wipe(node)
        nodes = list(NODES[: world // PER_NODE])
        remote_step = _remote(remote)
        lo, hi = model.expected(nodes, remote_step)
        at = statistics.median(resumed_at[-5:]) if resumed_at else START
        took = statistics.median(restoring[-5:]) if restoring else 1.0
        at_save = at_restore = None
        if kind == "restore kill":  # within the time the last restores took, after the job says it restores
            kill_after, at_restore = at + 10, rng.uniform(0.0, took)
        else:
            kill_after = (0.0 if anchored else at) + rng.uniform(*window)
            at_save = rng.uniform(0.0, 0.4) if rng.random() < 0.5 else None
        after = RESUMED if anchored and at_restore is None else ()
        trial, moment = run_job(remote, tier, world, kill_after, at_save=at_save, at_restore=at_restore, after=after)
        row: dict[str, Any] = {"trial": n, "kind": kind, "world": world, "wiped": wiped, "kill": round(kill_after, 1)}
        row |= {"at save": None if at_save is None else round(at_save, 2)}
        row |= {"at restore": None if at_restore is None else round(at_restore, 2)}
        row |= {"moment": moment, "expected": [lo, hi], "remote": remote_step}
        rows.append(row)
        counts["trials"] += 1
        counts[f"kind: {kind}"] += 1
        if trial.exited is not None:
            problems.append(f"trial {n} ({kind}): the job exited with {trial.exited} before the kill: {trial.tail()}")
            model.ran(nodes, trial)
            continue
        counts[f"killed: {moment}"] += 1
        got = trial.resumed
        row["resumed"], row["last"] = got, trial.last_step
        if got is None and not trial.scratch:
            counts["killed before resuming"] += 1
        elif got is None:
            resumed_at.append(trial.when(r"starting from scratch") or START)
            if lo is not None:
                problems.append(f"trial {n} ({kind}): started from scratch, but step {lo} at least survived")
            counts["started from scratch"] += 1
        else:
            step, where = got
            resumed_at.append(trial.when(r"resumed from step") or 0.0)
            restoring.append(resumed_at[-1] - (trial.when(r"restoring the newest") or 0.0))
            counts[f"restored {where}"] += 1
            digest = trial.restored_digest
            if where == "local" and wiped:
                counts[f"restored local after {kind}"] += 1
            saver = model.world.get((step, digest or ""), WORLD)
            if where == "local" and saver != world:
                counts[f"restored local: saved on {saver} ranks, restored on {world}"] += 1
            if not _within(step, lo, hi):
                problems.append(f"trial {n} ({kind}): resumed from {where} step {step}, expected {lo}..{hi}")
            newest_remote = remote_step if remote_step is not None else -1  # (a step in both tiers: local)
            if (where == "local" and step < newest_remote) or (where == "remote" and step > newest_remote):
                problems.append(f"trial {n} ({kind}): step {step} from the {where} tier, the remote has {remote_step}")
            ok = model.acceptable(nodes, step) if where == "local" else model.logged.get(step, set())
            if digest not in ok:
                problems.append(
                    f"trial {n} ({kind}): restored {where} step {step} with digest {digest}, "
                    f"not the state the job had then ({sorted(ok)}): torn, stale or mixed"
                )
            restored.append((n, step, digest or "", model.diverged.get((step, digest or ""), False)))
            if not model.on_branch(step, digest or ""):
                counts["restored a step of a branch an earlier restart left"] += 1
                row["left branch"] = True
            if (trial.last_step or step) > step:
                counts["carried on"] += 1
        model.ran(nodes, trial)
        print(json.dumps(row), flush=True)
    if final:  # the last run: a few steps more, to the end, on 4 ranks
        remote_step = _remote(remote)
        lo, hi = model.expected(list(NODES), remote_step)
        done = max([e.step for es in model.nodes.values() for e in es] + [remote_step or 0]) + 4
        last, _ = run_job(remote, tier, WORLD, None, done)
        if last.exited != 0 or not last.grep(rf"done: step {done}"):
            problems.append(f"the final run did not finish: exit {last.exited}: {last.tail()}")
        got = last.resumed
        if (got is None and lo is not None) or (got is not None and not _within(got[0], lo, hi)):
            problems.append(f"the final run resumed from {got}, expected {lo}..{hi}")
        counts["final run finished"] = int(last.exited == 0 and bool(last.grep(rf"done: step {done}")))
    ref, ref_seconds = reference(workdir, max([s for _, s, _, _ in restored], default=1))
    for n, step, digest, diverged in restored:
        if digest == ref.get(step):
            counts["digest = the reference run's"] += 1
        elif diverged:
            counts["digest = a 2-rank run's descendant's"] += 1
        else:
            problems.append(
                f"trial {n}: restored step {step} with digest {digest}, the reference run had {ref.get(step)}"
            )
    return {"trials": trials, "counts": dict(counts), "problems": problems, "rows": rows, "reference": ref_seconds}


def report(result: dict[str, Any], seconds: float) -> str:
    c = result["counts"]
    kinds = [k for k in dict.fromkeys(KINDS)]
    lines = ["# Kill -9 trials of the local tier (`benchmarks/tier_kill_trials.py`)", ""]
    lines += [
        f"The example job (`zarrckpt.example.train`) under torchrun: {WORLD} ranks as 2 simulated nodes of "
        f"{PER_NODE} (`--ranks-per-node {PER_NODE}`), a local step every step with 1 replica on the other node, "
        f"a remote step every {REMOTE_EVERY}, background staging. Each trial kills it with kill -9 (torchrun "
        f"and every rank) {WINDOW[0]:g}-{WINDOW[1]:g} s after the moment earlier restarts had resumed "
        "(start-up ~10 s, then ~1 step/s on 2 shared cores), after, in some trials, wiping one node's tier "
        "directory (node lost) or both (job lost), or restarting on 2 ranks (1 node, no replica); the "
        "restore-kill trials are killed within the time earlier restores took, after the job says it "
        "restores. A restore must give a state "
        "the job had at that step (its digest: crc32 of every tensor in key order and the step; the reference "
        "run's, an uninterrupted run on 4 ranks, unless a 2-rank run lies between), from the newest step that "
        "should have survived, from the right tier, and carry on.",
        "",
        f"Trials: {result['trials']}, in {seconds:.0f} s (the reference run: {result['reference']:.0f} s).",
        "",
        "| outcome | count |",
        "|---|---:|",
    ]
    order = [
        "trials",
        *[f"kind: {k}" for k in kinds],
        "killed: starting (before any restore)",
        "killed: restoring",
        "killed: saving",
        "killed: training (no save in flight)",
        "killed before resuming",
        "started from scratch",
        "restored local",
        "restored remote",
        *[f"restored local after {k}" for k in ("node lost", "job lost")],
        f"restored local: saved on {WORLD} ranks, restored on {PER_NODE}",
        f"restored local: saved on {PER_NODE} ranks, restored on {WORLD}",
        "digest = the reference run's",
        "digest = a 2-rank run's descendant's",
        "carried on",
        "restored a step of a branch an earlier restart left",
        "final run finished",
    ]
    for key in order + sorted(set(c) - set(order)):
        if key in c:
            lines.append(f"| {key} | {c[key]} |")
    lines.append(f"| problems | {len(result['problems'])} |")
    lines += ["", *([f"- {p}" for p in result["problems"]] or ["No restore was torn, stale or mixed."])]
    left = (
        " *restored a step of a branch an earlier restart left*: a node absent from a restart (a 2-rank "
        "restart, after the other node's directory was lost) kept the steps the job had reached before; the "
        "restart resumed from an older (remote) step and went on; once the node is back, a restart prefers its "
        "steps when their step number is higher: a state the job had (its digest is that run's), the newest "
        "step committed on the surviving nodes, as the rule says, though the steps between are dropped."
    )
    lines += [
        "",
        "*killed*: what the job was doing at the kill, from its output and what it had made in the tier "
        "(*restoring*: it had said it restores, not yet that it resumed; *saving*: it printed the digest "
        "of a step, then starts its save, and the step was not yet committed on every node); half the "
        "kills of the other kinds wait "
        "for a step's digest and come 0-0.4 s after it."
        + (left if "restored a step of a branch an earlier restart left" in c else ""),
    ]
    lines += ["", "<details><summary>The trials</summary>", "", "```"]
    lines += [json.dumps(r) for r in result["rows"]]
    lines += ["```", "", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tier_kills.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="zarrckpt-tierkills-")
    try:
        result = run(workdir, args.trials, args.seed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1), flush=True)
    args.out.write_text(report(result, time.perf_counter() - started))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
