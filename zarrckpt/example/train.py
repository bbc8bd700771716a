"""The example MoE training job, resumable under any topology.

    python -m zarrckpt.example.train --ckpt URL [--steps N] [--save-every K] [--keep-last 3]
           [--pp P] [--ep E] [--expert-dp sharded|replicated] [--storage-options JSON]
           [--seed S] [--log-every N] [--digest]
           [--local-every N --local-path PATH [--local-keep K] [--local-replicas R] [--ranks-per-node K]]

Under ``torchrun`` it joins the env:// rendezvous; run alone it is a single process. It resumes
from the latest committed checkpoint under ``--ckpt`` (saved by any number of ranks in any
layout: loading reshards), trains until step N, and saves every K steps with a
``CheckpointManager`` (asynchronous saves, keeping the last ``--keep-last``). On SIGTERM or SIGUSR1
(a scheduler's preemption warning) it saves the step it is at, synchronously, and exits with 128 +
the signal's number, so that the scheduler restarts it (and the restart resumes from that step).
With ``--local-every N`` the manager also saves every N steps to a node-local tier
(``zarrckpt.LocalTier``: ``--local-path`` with ``{node}``, copies on ``--local-replicas`` other
nodes; ``--ranks-per-node K`` names rank r's node ``node{r // K}``, simulated nodes on one host) and
resumes from the newest step of either tier, saying which. ``--digest`` prints a crc32 of the
state after resuming and at each step (before its save), so that runs can be compared.
``--ckpt`` defaults to ``$ZARRCKPT_CKPT_URL``, ``--storage-options`` to ``$ZARRCKPT_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zarrckpt
from zarrckpt.example.config import ExpertDP, ModelConfig, Topology, TrainConfig
from zarrckpt.example.launch import init_alone
from zarrckpt.example.trainer import Trainer, digest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=os.environ.get("ZARRCKPT_CKPT_URL"), help="checkpoint root (dir or URL)")
    p.add_argument("--steps", type=int, default=100, help="train until this step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (divides 4 and the world size)")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel groups (default gcd(8, world/pp))")
    p.add_argument("--expert-dp", choices=[e.value for e in ExpertDP], default=ExpertDP.REPLICATED.value)
    p.add_argument("--storage-options", default=os.environ.get("ZARRCKPT_STORAGE_OPTIONS"), help="JSON object")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--backend", choices=["gloo"], default="gloo", help="the example computes on the CPU")
    p.add_argument("--log-every", type=int, default=10)
    tier = p.add_argument_group("local tier (off unless --local-every is given; docs/tiers.md)")
    tier.add_argument("--local-every", type=int, default=0, help="also save every N steps to node-local storage")
    tier.add_argument("--local-path", default=None, help="each node's tier directory ({node}: the node's name)")
    tier.add_argument("--local-keep", type=int, default=2, help="local steps a node keeps")
    tier.add_argument("--local-replicas", type=int, default=1, help="other nodes holding a copy of each node's shards")
    tier.add_argument(
        "--ranks-per-node", type=int, default=0, help="name rank r's node node{r // K} (simulated nodes on one host)"
    )
    p.add_argument(
        "--digest", action="store_true", help="print the state's digest after resuming and before each step's save"
    )
    args = p.parse_args(argv)
    if not args.ckpt:
        p.error("give --ckpt URL or set ZARRCKPT_CKPT_URL")
    try:
        args.options = json.loads(args.storage_options) if args.storage_options else None
    except ValueError as e:
        p.error(f"--storage-options / ZARRCKPT_STORAGE_OPTIONS is not JSON: {e}")
    if args.options is not None and not isinstance(args.options, dict):
        p.error("--storage-options must be a JSON object")
    if args.local_every and not args.local_path:
        p.error("--local-every needs --local-path")
    return args


def _local_tier(args: argparse.Namespace, rank: int) -> zarrckpt.LocalTier | None:
    if not args.local_every:
        return None
    node = f"node{rank // args.ranks_per_node}" if args.ranks_per_node else None
    return zarrckpt.LocalTier(
        args.local_path, every=args.local_every, keep=args.local_keep, replicas=args.local_replicas, node=node
    )


def _init(backend: str) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(minutes=10))
    else:
        init_alone(backend)


def _latest(manager: zarrckpt.CheckpointManager) -> int | None:
    step = torch.tensor([(manager.latest() or -1) if dist.get_rank() == 0 else 0])
    dist.broadcast(step, src=0)  # every rank resumes from the step rank 0 saw
    return None if step.item() < 0 else int(step.item())


def _print_digest(trainer: Trainer, what: str) -> None:
    value = digest(trainer.state_dict(), trainer.step)  # (every rank: whole DTensors are a collective)
    if dist.get_rank() == 0:
        print(f"digest {what} {trainer.step} {value}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _init(args.backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            topo = Topology(world, args.pp, args.ep, args.expert_dp).resolved(ModelConfig())
            trainer = Trainer(ModelConfig(), TrainConfig(seed=args.seed), topo)
        except ValueError as e:
            print(f"zarrckpt.example.train: bad topology for {world} ranks: {e}", file=sys.stderr)
            return 2
        manager = zarrckpt.CheckpointManager(
            args.ckpt,
            interval=args.save_every,
            keep_last=args.keep_last,
            storage_options=args.options,
            staging="background",  # save() returns after planning; the copy overlaps the next forward/backward
            save_on=(signal.SIGTERM, signal.SIGUSR1),  # preemption: save the step we are at, then exit
            local=_local_tier(args, rank),
        )
        if args.local_every:  # the newest of the local tier's steps and the remote ones
            if rank == 0:
                print("restoring the newest step of the local tier and the remote one", flush=True)
            step = trainer.resume(manager)
            where = f"the {manager.restored_from} tier"
        else:
            step, where = _latest(manager), args.ckpt
            if step is not None:
                trainer.load(manager.url(step), args.options)
        if args.digest:
            _print_digest(trainer, "restored" if step is not None else "initial")
        if step is not None:
            if rank == 0:
                print(f"resumed from step {step} of {where} on {world} ranks ({topo})", flush=True)
        elif rank == 0:
            print(f"starting from scratch on {world} ranks ({topo}), checkpoints to {args.ckpt}", flush=True)
        loss, start, first = float(trainer.losses[-1]), time.perf_counter(), trainer.step
        while trainer.step < args.steps:
            loss, _ = trainer.train_step(before_update=manager.wait_staged)
            if args.digest:
                _print_digest(trainer, "step")
            manager.save(trainer.step, trainer.state_dict(), force=trainer.step == args.steps)
            if rank == 0 and (trainer.step % args.log_every == 0 or trainer.step == args.steps):
                rate = (trainer.step - first) / max(time.perf_counter() - start, 1e-9)
                print(f"step {trainer.step} loss {loss:.4f} ({rate:.1f} steps/s)", flush=True)
            if manager.preempted:
                manager.close()
                if rank == 0:
                    print(f"preempted ({manager.preempted.name}): saved step {trainer.step}, exiting", flush=True)
                return 128 + int(manager.preempted)
        manager.close()
        if rank == 0:
            print(f"done: step {trainer.step} loss {loss:.4f}", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
