"""Kill and restart through the framework adapters: a training job (tests/adapter_kill_worker.py, one
process, saving after every step) is killed with kill -9 at a random moment, then started again with
the same arguments. The restart must resume from the newest committed checkpoint the adapter keeps
(never from step 0 while a committed checkpoint exists) and go on saving; with ``--other-host`` the
killed job's pending markers are rewritten to name another host before the restart, which then has
only the lease (``ZARRCKPT_LEASE_SECONDS``, 8 s here) to tell that the save is dead.

    python benchmarks/adapter_kill_trials.py --adapter lightning --trials 20 [--url ROOT] [--other-host both]

``--adapter``: lightning (``ModelCheckpoint``, ``fit(ckpt_path=last_checkpoint(...))``),
lightning-last (``ZarrModelCheckpoint``, ``ckpt_path="last"``), accelerate, torchtitan, ray (a Ray Train
worker whose context is stood in for, Ray's registry a JSON file), or all. ``--url``: where the trials'
roots go (default: a temporary directory; ``s3://...`` with ``--storage-options``; ``rgw``: a throwaway
Ceph RADOS Gateway). Prints one line per trial and a summary; exits 1 when a trial broke the rule.

What "resumed from the right step" means per adapter: Lightning, the highest global step of the
committed ``last*.ckpt`` checkpoints in its directory, or of all its committed checkpoints when no
``last*.ckpt`` is committed (killed while re-saving it in place); Accelerate, the newest committed
``step_<iteration>`` (its progress step is the iteration plus one); torchtitan, the newest committed
``step-N``; Ray, Ray's latest registered checkpoint, or, when Ray has none, the newest committed one
(a commit Ray never registered is replaced otherwise, by design).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import zarrckpt

WORKER = Path(__file__).resolve().parents[1] / "tests" / "adapter_kill_worker.py"
ADAPTERS = ("lightning", "lightning-last", "accelerate", "torchtitan", "ray")
PENDING = ".zarrckpt-pending.json"  # docs/FORMAT.md section 6
LEASE = "8"  # longer than a restart takes to start: its first save to a dead save's place waits for it


def _start(
    adapter: str, root: str, steps: int, options: dict[str, Any] | None, extra: list[str]
) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(WORKER), adapter, root, str(steps), *extra]
    if options:
        cmd += ["--options", json.dumps(options)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ZARRCKPT_LEASE_SECONDS": LEASE}
    env["PYTHONPATH"] = str(WORKER.parents[1])
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _checkpoint_dir(adapter: str, root: str) -> str:
    return {"accelerate": f"{root}/checkpoints", "torchtitan": root, "ray": root}.get(adapter, f"{root}/ckpts")


def _expected(adapter: str, root: str, options: dict[str, Any] | None, registry: Path) -> tuple[int, int]:
    """(the newest committed step of the adapter's checkpoints, the step its restart must resume from)."""
    folder = _checkpoint_dir(adapter, root)
    committed = [n for n, s in zarrckpt.list_checkpoints(folder, storage_options=options).items() if s == "committed"]
    if adapter.startswith("lightning"):  # the newest committed last*.ckpt; none committed: the newest of all
        steps = {
            name: zarrckpt.open(f"{folder}/{name}", storage_options=options).metadata["lightning"][0]["global_step"]
            for name in committed
        }
        lasts = [step for name, step in steps.items() if name.startswith("last")]
        return max(steps.values(), default=0), max(lasts or steps.values(), default=0)
    if adapter == "accelerate":
        newest = max((int(n.removeprefix("step_")) + 1 for n in committed if n.startswith("step_")), default=0)
        return newest, newest
    if adapter == "torchtitan":
        newest = max((int(n.removeprefix("step-")) for n in committed if n.startswith("step-")), default=0)
        return newest, newest
    newest = max((int(n.removeprefix("step_")) for n in committed if n.startswith("step_")), default=0)
    known = json.loads(registry.read_text()) if registry.exists() else []
    return newest, (int(known[-1].rsplit("_", 1)[1]) if known else newest)


def _as_if_elsewhere(adapter: str, root: str, options: dict[str, Any] | None) -> int:
    """Rewrite the pending markers the killed job left to name a writer on another host; how many."""
    import fsspec

    folder = _checkpoint_dir(adapter, root)
    count = 0
    for name, state in zarrckpt.list_checkpoints(folder, storage_options=options).items():
        if state != "incomplete":
            continue
        fs, path = fsspec.core.url_to_fs(f"{folder}/{name}/{PENDING}", **(options or {}))
        try:
            doc = json.loads(fs.cat_file(path))
        except (FileNotFoundError, ValueError):
            continue
        doc["writer"] = {"host": "another-host", "pid": 1}
        fs.pipe_file(path, json.dumps(doc).encode())
        count += 1
    return count


def _lines_until(proc: subprocess.Popen[str], stop: Any, timeout: float) -> list[str]:
    """The worker's lines up to the first for which ``stop(line)`` holds (or its end)."""
    assert proc.stdout is not None
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip())
        if stop(line):
            break
    return seen


def _step(line: str) -> int | None:
    words = line.split()
    return int(words[1]) if len(words) == 2 and words[0] in ("saved", "trained") and words[1].isdigit() else None


def one_trial(
    adapter: str, root: str, options: dict[str, Any] | None, elsewhere: bool, rng: random.Random
) -> dict[str, Any]:
    steps = 14
    registry = Path(tempfile.mkdtemp(prefix="ray-registry-")) / "registry.json"
    extra = ["--registry", str(registry)] if adapter == "ray" else []
    proc = _start(adapter, root, steps, options, extra)
    at = rng.randint(1, steps - 2)  # after the line of this step, a random part of the next step's time
    lines = _lines_until(proc, lambda line: _step(line) == at, 240)
    began = time.monotonic()
    lines += _lines_until(proc, lambda line: _step(line) == at + 1, 60)
    step_time = time.monotonic() - began
    delay = rng.uniform(0, step_time)
    time.sleep(delay)
    finished = proc.poll() is not None
    if not finished:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    newest, expected = _expected(adapter, root, options, registry)
    folder = _checkpoint_dir(adapter, root)
    at_kill = zarrckpt.list_checkpoints(folder, storage_options=options)
    dead = [name for name, state in at_kill.items() if state == "incomplete"]
    torn = [name for name, state in at_kill.items() if state != "committed" and name.startswith("last")]
    moved = _as_if_elsewhere(adapter, root, options) if elsewhere else 0
    began = time.monotonic()
    again = _start(adapter, root, expected + 2, options, extra)
    out, _ = again.communicate(timeout=300)
    after = zarrckpt.list_checkpoints(folder, storage_options=options)
    resumed = [
        int(line.split()[1]) for line in out.splitlines() if line.startswith("resumed ") and line.split()[1].isdigit()
    ]
    got = resumed[0] if resumed else None
    if again.returncode != 0 or got is None:
        outcome = "RESTART FAILED"
    elif newest > 0 and got == 0:
        outcome = "FROM STEP 0"
    elif got != expected:
        outcome = "WRONG STEP"
    else:
        outcome = "ok" if newest else "ok (nothing committed)"
    return {
        "adapter": adapter,
        "killed": f"{delay:.3f} s after step {at + 1}" if not finished else "finished first",
        "newest_committed": newest,
        "expected": expected,
        "resumed": got,
        "elsewhere": elsewhere,
        "markers_moved": moved,
        "dead_saves": sorted(dead),
        "last_torn": sorted(torn),  # Lightning: a last*.ckpt killed while re-saved (incomplete or deleting)
        "taken_over": sum(after.get(name) == "committed" for name in dead),
        "restart_s": round(time.monotonic() - began, 1),
        "outcome": outcome,
        "tail": "" if outcome.startswith("ok") else out[-1500:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", choices=[*ADAPTERS, "all"], default="all")
    parser.add_argument("--trials", type=int, default=20, help="per adapter")
    parser.add_argument("--url", help="root of the trials: a path, s3://..., or rgw (default: a temporary directory)")
    parser.add_argument("--storage-options", type=json.loads, default=None)
    parser.add_argument("--other-host", choices=["no", "yes", "both"], default="both", help="both: every other trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every trial's record here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    adapters = ADAPTERS if args.adapter == "all" else (args.adapter,)
    records = []
    with ExitStack() as stack:
        options = args.storage_options
        base = args.url
        if base == "rgw":
            from zarrckpt.testing import rgw

            endpoint = stack.enter_context(rgw.rgw_server())
            options, base = rgw.rgw_storage_options(endpoint), f"s3://zarrckpt-test/{uuid.uuid4().hex}"
        elif base is None:
            base = stack.enter_context(tempfile.TemporaryDirectory(prefix="adapter-kill-"))
        for adapter in adapters:
            for trial in range(args.trials):
                elsewhere = args.other_host == "yes" or (args.other_host == "both" and trial % 2 == 1)
                record = one_trial(adapter, f"{base}/{adapter}-{trial}", options, elsewhere, rng)
                records.append(record)
                shown = {k: v for k, v in record.items() if k != "tail"}
                print(json.dumps(shown), flush=True)
                if record["tail"]:
                    print(record["tail"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print("\nsummary:")
    for adapter in adapters:
        mine = [r for r in records if r["adapter"] == adapter]
        outcomes = Counter(r["outcome"] for r in mine)
        dead, taken = sum(len(r["dead_saves"]) for r in mine), sum(r["taken_over"] for r in mine)
        elsewhere = sum(r["markers_moved"] for r in mine)
        torn = sum(bool(r["last_torn"]) for r in mine)
        print(
            f"  {adapter}: {len(mine)} trials, {dict(outcomes)}; saves killed part way: {dead} ({elsewhere} of them "
            f"moved to another host), taken over by the restart: {taken}"
            + (f"; killed while re-saving last.ckpt: {torn}" if adapter.startswith("lightning") else "")
        )
    bad = [r for r in records if not r["outcome"].startswith("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
