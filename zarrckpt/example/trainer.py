"""One rank of the example training job: state, a pipeline-parallel step, Adam, and checkpoints.

``Trainer.state_dict()`` is exactly what goes into a checkpoint; ``load(url)`` fills the same
structure from any checkpoint of the same model, whatever topology saved it.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zarrckpt
from zarrckpt.example import data, model
from zarrckpt.example.config import ModelConfig, Topology, TrainConfig
from zarrckpt.example.parallel import EPComm, Groups, compute_weight, make_groups, reduce_gradient, shard_of


class Trainer:
    def __init__(self, cfg: ModelConfig, train: TrainConfig, topo: Topology) -> None:
        self.cfg, self.train, self.topo = cfg, train, topo.resolved(cfg)
        if train.batch % self.topo.dp:
            raise ValueError(f"the batch ({train.batch}) must split evenly over the {self.topo.dp} DP ranks of a stage")
        self.g: Groups = make_groups(self.topo)
        self.specs = {k: s for k, s in model.specs(cfg).items() if s.stage(self.topo, cfg.layers) == self.g.stage}
        self.params = {k: shard_of(model.init(k, s.shape, train.seed), self.g, s.expert) for k, s in self.specs.items()}
        self.moments = {
            k: {
                "exp_avg": shard_of(torch.zeros(s.shape), self.g, s.expert),
                "exp_avg_sq": shard_of(torch.zeros(s.shape), self.g, s.expert),
                "step": torch.tensor(0.0),
            }
            for k, s in self.specs.items()
        }
        # every rank draws the same random numbers, so RNG state is the same everywhere and a
        # run resumed under another topology continues the same random stream
        torch.manual_seed(train.seed)
        random.seed(train.seed)
        self.np_rng = np.random.default_rng(train.seed)
        self.loader = data.Loader(cfg, train, self.np_rng)
        self.step, self.tokens = 0, 0
        self.losses = torch.full((train.window,), float("nan"), dtype=torch.float64)
        self.grad_norms = torch.full((train.window,), float("nan"), dtype=torch.float64)
        self.comm = EPComm(self.g, cfg.experts)
        self.first, self.last = self.g.stage == 0, self.g.stage == self.topo.pp - 1

    # -- one training step -------------------------------------------------------------------

    def train_step(self, before_update: Callable[[], object] | None = None) -> tuple[float, list[int]]:
        """Run one step on the next global batch; returns (loss, sample ids of the batch).

        ``before_update`` runs after the backward pass, right before the optimizer changes the
        parameters and moments: where a loop waits for a background-staged save
        (``CheckpointManager.wait_staged``)."""
        cfg, topo, g = self.cfg, self.topo, self.g
        ids, tokens = self.loader.next_batch()
        jitter = 1 + self.train.router_jitter * (2 * torch.rand(cfg.layers, self.train.batch, cfg.seq_len) - 1)
        per = self.train.batch // topo.dp
        rows = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
        weights = {
            k: compute_weight(self.params[k], g, s.expert).detach().requires_grad_() for k, s in self.specs.items()
        }
        layers = topo.layers_of(g.stage, cfg.layers)
        if self.first:
            inp = tokens[rows, :-1]
        else:
            inp = torch.empty(per, cfg.seq_len, cfg.d_model)
            dist.recv(inp, g.rank - topo.dp)
            inp.requires_grad_()
        out = model.stage_forward(weights, inp, layers, cfg, jitter[:, rows], self.comm, self.first)
        if self.last:
            loss = model.loss_sum(weights, out, tokens[rows, 1:]) / (self.train.batch * cfg.seq_len)
            loss.backward()
            local_loss = loss.detach()
        else:
            dist.send(out.detach().contiguous(), g.rank + topo.dp)
            grad = torch.empty_like(out)
            dist.recv(grad, g.rank + topo.dp)
            out.backward(grad)
            local_loss = torch.zeros(())
        if not self.first:
            dist.send(inp.grad.contiguous(), g.rank - topo.dp)  # type: ignore[union-attr]
        grads = {
            k: reduce_gradient(weights[k].grad, self.params[k], g, s.expert)  # type: ignore[arg-type]
            for k, s in self.specs.items()
        }
        sq = torch.zeros((), dtype=torch.float64)
        for k, s in self.specs.items():
            if g.owns_gradient(s.expert):
                sq += grads[k].double().pow(2).sum()
        total = torch.stack([sq, local_loss.double()])
        dist.all_reduce(total)
        norm, loss_value = math.sqrt(total[0].item()), total[1].item()
        if before_update is not None:
            before_update()
        self._adam(grads, min(1.0, self.train.clip / (norm + 1e-6)))
        self.step += 1
        self.tokens += self.train.batch * cfg.seq_len
        self.losses = torch.cat([self.losses[1:], torch.tensor([loss_value], dtype=torch.float64)])
        self.grad_norms = torch.cat([self.grad_norms[1:], torch.tensor([norm], dtype=torch.float64)])
        return loss_value, ids

    def _adam(self, grads: dict[str, torch.Tensor], scale: float) -> None:
        (b1, b2), lr, eps = self.train.betas, self.train.lr, self.train.eps
        for k, grad in grads.items():
            st = self.moments[k]
            st["step"] += 1
            n = st["step"].item()
            m, v, p = (_local(st["exp_avg"]), _local(st["exp_avg_sq"]), _local(self.params[k]))
            grad = grad * scale
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v / (1 - b2**n)).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**n))

    # -- checkpoint state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full training state, keyed by global names (what a checkpoint holds)."""
        return {
            "model": dict(self.params),
            "optim": {
                "state": self.moments,
                "param_groups": [{"lr": self.train.lr, "betas": list(self.train.betas), "eps": self.train.eps}],
            },
            "trainer": {
                "step": self.step,
                "tokens": self.tokens,
                "epoch": self.loader.epoch,
                # per-rank state: one array [world, ...] per key, each rank its row (zarrckpt.PerRank)
                "loader": zarrckpt.PerRank(self.loader.state_dict()),
                "rng": {
                    "torch": zarrckpt.PerRank(torch.get_rng_state()),
                    "numpy": zarrckpt.PerRank(self.np_rng.bit_generator.state),
                    "python": zarrckpt.PerRank(random.getstate()),
                },
                "bookkeeping": {"losses": self.losses, "grad_norms": self.grad_norms},
                "config": self.train.to_json(self.cfg),
                "data": data.manifest(self.cfg, self.train),
            },
        }

    def load(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Restore everything from a checkpoint of the same model saved under any topology.

        A checkpoint of a different model (other expert count, widths, layers) raises
        ``LayoutMismatchError`` before any tensor data is read.
        """
        ckpt = zarrckpt.open(url, storage_options=storage_options)
        differences = conversion_differences(ckpt, self.cfg)
        if differences:
            raise zarrckpt.LayoutMismatchError(
                f"{url} holds a different model (saved vs expected):\n  "
                + "\n  ".join(differences)
                + "\nChanging experts, widths or layers is a model conversion, not a topology change; "
                "nothing was loaded. To take part of a model deliberately, read it with zarrckpt.open(url)[key][...]",
                differences,
            )
        saved = ckpt.metadata.get("trainer", {})
        if saved.get("data") != data.manifest(self.cfg, self.train):
            raise zarrckpt.ZarrckptError(
                f"{url} was trained on other data ({saved.get('data')}); "
                f"this run reads {data.manifest(self.cfg, self.train)}"
            )
        state = self.state_dict()
        # every rank of this job draws the same samples, so the saved rows are equal: on another number
        # of ranks, rank r takes saved rank r % saved world's (a job whose ranks differ might reseed: "skip")
        zarrckpt.load(state, url, storage_options=storage_options, per_rank="modulo")
        self.loaded(state)

    def resume(self, manager: zarrckpt.CheckpointManager) -> int | None:
        """Restore the newest step ``manager`` has (its local tier's or its remote one's, as
        ``manager.load_latest`` picks; ``manager.restored_from`` says which); returns the step (None:
        nothing saved yet, the state is left as it is)."""
        state = self.state_dict()
        step = manager.load_latest(state, per_rank="modulo")  # (per_rank: as load() says)
        if step is not None:
            self.loaded(state)
        return step

    def loaded(self, state: dict[str, Any]) -> None:
        """Take up a ``state_dict()`` a checkpoint was loaded into (the tensors are loaded in place)."""
        t = state["trainer"]
        self.step, self.tokens = int(t["step"]), int(t["tokens"])
        self.loader.load_state_dict(t["loader"].value)
        torch.set_rng_state(t["rng"]["torch"].value)
        self.np_rng.bit_generator.state = t["rng"]["numpy"].value
        version, internal, gauss = t["rng"]["python"].value
        random.setstate((version, tuple(internal), gauss))
        self.losses, self.grad_norms = t["bookkeeping"]["losses"], t["bookkeeping"]["grad_norms"]


def digest(state: dict[str, Any], step: int) -> str:
    """A crc32 of ``state``'s tensors in key order (DTensors whole: a collective of their mesh;
    PerRank tensors: this rank's row) and ``step``: alike wherever the state is alike, under any
    topology, so that runs can compare the state they restored or reached."""
    crc = zlib.crc32(str(step).encode())

    def walk(prefix: str, value: Any) -> None:
        nonlocal crc
        if isinstance(value, zarrckpt.PerRank):
            value = value.value
        if isinstance(value, dict):
            for k in sorted(value):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            crc = zlib.crc32(prefix.encode(), crc)
            crc = zlib.crc32(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)

    walk("", state)
    return f"{crc:08x}"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of every model and optimizer tensor of a model with this config."""
    out: dict[str, tuple[int, ...]] = {}
    for key, spec in model.specs(cfg).items():
        out[f"model.{key}"] = spec.shape
        out[f"optim.state.{key}.exp_avg"] = out[f"optim.state.{key}.exp_avg_sq"] = spec.shape
        out[f"optim.state.{key}.step"] = ()
    return out


def conversion_differences(ckpt: zarrckpt.Checkpoint, cfg: ModelConfig) -> list[str]:
    """How the checkpoint's model differs from ``cfg``'s, from metadata alone (empty if it is the same)."""
    want = expected_shapes(cfg)
    have = {t["key"]: tuple(t["shape"]) for t in ckpt.tensors() if t["key"].startswith(("model.", "optim.state."))}
    out = [
        f"{k}: shape {list(have[k])} saved vs {list(want[k])} expected"
        for k in sorted(want)
        if k in have and have[k] != want[k]
    ]
    out += [f"{k}: expected, not in the checkpoint" for k in sorted(want.keys() - have.keys())]
    out += [f"{k}: in the checkpoint, not expected" for k in sorted(have.keys() - want.keys())]
    saved = ckpt.metadata.get("trainer", {}).get("config", {}).get("model")
    if not out and saved is not None and saved != asdict(cfg):
        out.append(f"trainer.config.model: {saved} saved vs {asdict(cfg)} expected")
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
