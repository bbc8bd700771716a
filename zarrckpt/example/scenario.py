"""The measured scenario: train under T1, save at step K, resume under T1 / T2 / T3.

Run A trains ``2K`` steps under T1 without interruption and saves a checkpoint as it passes
step K (a save does not touch the training state, so run A's first K steps *are* run B's).
Each resumed run loads that checkpoint under its own topology, saves what it restored to a
second checkpoint (to check, tensor by tensor, that the restore was bit-exact), and trains
steps ``K+1 .. 2K``; its losses and the samples it reads are compared with run A's.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.example.config import ExpertDP, ModelConfig, Topology, TrainConfig
from zarrckpt.example.launch import spawn
from zarrckpt.example.trainer import Trainer

LOSS_TOLERANCE = 1e-5
"""Max |loss - run A's loss| after a resume under another topology.

Reduction order changes float32 rounding by ~1 ulp per step (measured <= 4.8e-7 over 10 steps);
a lost RNG state moves the loss by ~4e-4, lost Adam moments or a skipped batch by > 0.3.
"""


@dataclass(frozen=True)
class Layout:
    """A topology to run under, by name."""

    name: str
    world: int
    pp: int = 1
    ep: int = 0
    expert_dp: ExpertDP = ExpertDP.REPLICATED

    def topology(self) -> Topology:
        return Topology(self.world, self.pp, self.ep, self.expert_dp).resolved(ModelConfig())


DEFAULT_T1 = Layout("T1", 8, pp=2, ep=2, expert_dp=ExpertDP.SHARDED)
DEFAULT_RESUMES = (
    Layout("T1", 8, pp=2, ep=2, expert_dp=ExpertDP.SHARDED),
    Layout("T2", 4, pp=1, ep=4),
    Layout("T3", 1),
)


def _job(rank: int, world: int, spec: dict[str, Any]) -> None:
    layout, opts = Layout(**spec["layout"]), spec["storage_options"]
    trainer = Trainer(ModelConfig(), TrainConfig(), layout.topology())
    out: dict[str, Any] = {"losses": [], "ids": [], "save_s": None, "load_s": None}

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item())

    if spec.get("resume"):
        out["load_s"] = timed(lambda: trainer.load(spec["resume"], opts))
        zarrckpt.save(trainer.state_dict(), spec["resave"], storage_options=opts)
    pending: zarrckpt.AsyncSave | None = None
    while trainer.step < spec["until"]:
        # background staging: the copy overlaps this step's forward and backward, not its update
        loss, ids = trainer.train_step(before_update=pending.wait_staged if pending is not None else None)
        out["losses"].append(loss)
        out["ids"].append(ids)
        if trainer.step == spec.get("save_at"):
            started: list[zarrckpt.AsyncSave | None] = []
            out["save_s"] = timed(partial(_save, trainer.state_dict(), spec, started))  # what the loop waits for
            pending = started[0]
    if pending is not None:
        pending.result()  # committed (or raises)
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(out, f)


def _save(state: dict[str, Any], spec: dict[str, Any], started: list[zarrckpt.AsyncSave | None]) -> None:
    """The run's save: synchronous, or (``background_staging``) an async save staged in the background."""
    url, opts = spec["save_url"], spec["storage_options"]
    if spec.get("background_staging"):
        started.append(zarrckpt.async_save(state, url, storage_options=opts, staging="background"))
    else:
        zarrckpt.save(state, url, storage_options=opts)
        started.append(None)


def _launch(layout: Layout, **spec: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec |= {"layout": asdict(layout), "result": os.path.join(tmp, "result.json")}
        spawn(layout.world, _job, spec, timeout_s=600)
        with open(spec["result"]) as f:
            result: dict[str, Any] = json.load(f)
            return result


@dataclass
class Row:
    name: str
    saved_by: str
    loaded_by: str
    tensors: int
    nbytes: int
    save_s: float
    load_s: float
    max_restore_diff: float
    values_equal: bool
    max_loss_diff: float
    same_samples: bool


@dataclass
class Report:
    k: int
    run_a_losses: list[float]
    rows: list[Row] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What failed the scenario's checks (empty when everything held)."""
        out = []
        for r in self.rows:
            if r.max_restore_diff != 0.0 or not r.values_equal:
                out.append(f"{r.name}: restored state differs from the saved one (max |Δ| {r.max_restore_diff})")
            if not r.same_samples:
                out.append(f"{r.name}: the data loader did not continue with run A's samples")
            limit = 0.0 if r.loaded_by == r.saved_by else LOSS_TOLERANCE
            if not r.max_loss_diff <= limit:
                out.append(f"{r.name}: losses differ from run A's by {r.max_loss_diff:.3g} (allowed {limit:g})")
        return out

    def table(self) -> str:
        moves = [f"{r.saved_by} → {r.loaded_by}" for r in self.rows]
        width = max([len("saved → loaded"), *map(len, moves)]) + 2
        head = (
            f"{'resume':<8}{'saved → loaded':<{width}}{'tensors':>8}{'MB':>8}{'save s':>8}{'load s':>8}"
            f"{'max|Δ| restored':>17}{'max|Δloss| vs A':>17}{'samples':>9}"
        )
        lines = [head, "-" * len(head)]
        for r, move in zip(self.rows, moves, strict=True):
            lines.append(
                f"{r.name:<8}{move:<{width}}{r.tensors:>8}{r.nbytes / 1e6:>8.2f}"
                f"{r.save_s:>8.2f}{r.load_s:>8.2f}{r.max_restore_diff:>17.3g}{r.max_loss_diff:>17.3g}"
                f"{'same' if r.same_samples else 'DIFFER':>9}"
            )
        return "\n".join(lines)


def describe(layout: Layout) -> str:
    return f"{layout.world} rank{'s' if layout.world > 1 else ''} {layout.topology()}"


def compare(url_a: str, url_b: str, opts: dict[str, Any] | None) -> tuple[float, bool]:
    """(max |a - b| over every tensor, whether every plain value is equal) of two checkpoints."""
    a, b = zarrckpt.open(url_a, storage_options=opts), zarrckpt.open(url_b, storage_options=opts)
    if a.keys() != b.keys():
        return math.inf, False
    worst = 0.0
    for key in a:
        x, y = a[key].read(), b[key].read()
        if a[key].meta.per_rank and b[key].meta.per_rank:  # rows by rank: b's rank r restored a's row r % a's world
            x = x[[r % len(x) for r in range(len(y))]]
        if x.dtype == torch.uint8 or not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else math.inf)
        else:
            same_nan = torch.isnan(x) == torch.isnan(y)
            diff = (x - y).abs().nan_to_num(0.0).max().item() if x.numel() else 0.0
            worst = max(worst, diff if bool(same_nan.all()) else math.inf)
    return worst, a.metadata == b.metadata


def run(
    root: str,
    storage_options: dict[str, Any] | None = None,
    *,
    k: int = 10,
    t1: Layout = DEFAULT_T1,
    resumes: tuple[Layout, ...] = DEFAULT_RESUMES,
    progress: Any = print,
    background_staging: bool = False,
) -> Report:
    """Run the whole scenario under ``root`` (a directory or URL); returns the report.

    ``background_staging``: run A saves with ``async_save(..., staging="background")`` and trains
    on while the state is staged, waiting for it only before the next optimizer update.
    """
    ckpt = f"{root.rstrip('/')}/runA/step_{k:010d}"  # run A's checkpoint, which every run B resumes
    progress(f"run A: {describe(t1)}, {2 * k} steps, saving at step {k} -> {ckpt}")
    a = _launch(
        t1,
        storage_options=storage_options,
        until=2 * k,
        save_at=k,
        save_url=ckpt,
        background_staging=background_staging,
    )
    report = Report(k, a["losses"])
    view = zarrckpt.open(ckpt, storage_options=storage_options)
    nbytes = sum(t["bytes"] for t in view.tensors())
    for i, layout in enumerate(resumes):
        name = f"({'abcdefgh'[i]}) {layout.name}"
        progress(f"run B {name}: resume under {describe(layout)}, steps {k + 1}..{2 * k}")
        resaved = f"{root.rstrip('/')}/verify/{i}"
        b = _launch(layout, storage_options=storage_options, until=2 * k, resume=ckpt, resave=resaved)
        diff, values_equal = compare(ckpt, resaved, storage_options)
        loss_diff = max(abs(x - y) for x, y in zip(b["losses"], a["losses"][k:], strict=True))
        report.rows.append(
            Row(
                name,
                describe(t1),
                describe(layout),
                len(view),
                nbytes,
                a["save_s"],
                b["load_s"],
                diff,
                values_equal,
                loss_diff,
                b["ids"] == a["ids"][k:],
            )
        )
    return report
