"""Process groups, sharded parameters and expert parallelism for the example (gloo, CPU).

Dense parameters are DTensors sharded ``[Shard(0), Shard(0)]`` over the stage's (ep, ep_dp)
sub-mesh, i.e. ``Shard(0)`` over all DP ranks of the stage (FSDP-style). Expert tensors are
``[Shard(0), Shard(1)]`` (EP-DP sharded) or ``[Shard(0), Replicate()]`` (EP-DP replicated).
Each step gathers the full weights it computes with, and reduces gradients back to the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zarrckpt.example.config import ExpertDP, Topology
from zarrckpt.example.model import ExpertComm

# DTensor warns on every gather of a [Shard(0), Shard(0)] weight that it takes two all_gathers
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@dataclass
class Groups:
    """This rank's place in the topology and the process groups it talks over."""

    topo: Topology
    rank: int
    mesh: DeviceMesh  # the stage's (ep, epdp) sub-mesh
    stage: int
    ep_rank: int
    epdp_rank: int
    stage_group: Any
    ep_group: Any
    epdp_group: Any

    @property
    def dp_rank(self) -> int:
        return self.rank % self.topo.dp

    def placements(self, expert: bool) -> list[Placement]:
        if not expert:
            return [Shard(0), Shard(0)]
        return [Shard(0), Shard(1) if self.topo.expert_dp == ExpertDP.SHARDED else Replicate()]

    def owns_gradient(self, expert: bool) -> bool:
        """Whether this rank's shard is the one counted in the global grad norm (not a replica)."""
        return not expert or self.topo.expert_dp == ExpertDP.SHARDED or self.epdp_rank == 0


def make_groups(topo: Topology) -> Groups:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (topo.pp, topo.ep, topo.ep_dp), mesh_dim_names=("pp", "ep", "epdp"))
    stage, ep_rank, epdp_rank = topo.coords(rank)
    mine: dict[str, Any] = {}
    for s in range(topo.pp):  # every rank creates every group, in the same order
        ranks = topo.stage_ranks(s)
        group = dist.new_group(ranks)
        if s == stage:
            mine["stage"] = group
    return Groups(
        topo,
        rank,
        mesh["ep", "epdp"],
        stage,
        ep_rank,
        epdp_rank,
        mine["stage"],
        mesh.get_group("ep"),
        mesh.get_group("epdp"),
    )


def local_box(shape: tuple[int, ...], g: Groups, expert: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a parameter."""
    local, offset = compute_local_shape_and_global_offset(shape, g.mesh, g.placements(expert))
    return tuple(local), tuple(offset)


def shard_of(full: torch.Tensor, g: Groups, expert: bool) -> DTensor:
    """This rank's shard of a full tensor, as a DTensor on the stage mesh."""
    local, offset = local_box(tuple(full.shape), g, expert)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))].clone()
    return DTensor.from_local(
        piece, g.mesh, g.placements(expert), run_check=False, shape=full.shape, stride=full.stride()
    )


def compute_weight(param: DTensor, g: Groups, expert: bool) -> torch.Tensor:
    """The weight a step computes with: full for dense, this EP rank's experts (all columns) for experts."""
    if not expert:
        return param.full_tensor()
    if g.topo.expert_dp == ExpertDP.SHARDED and g.topo.ep_dp > 1:
        return param.redistribute(g.mesh, [Shard(0), Replicate()]).to_local()
    return param.to_local()


def reduce_gradient(grad: torch.Tensor, param: DTensor, g: Groups, expert: bool) -> torch.Tensor:
    """Sum a compute-weight gradient over the ranks that share the weight; keep this rank's shard."""
    group, size = (g.epdp_group, g.topo.ep_dp) if expert else (g.stage_group, g.topo.dp)
    if size > 1:
        dist.all_reduce(grad, group=group)
    local, offset = local_box(tuple(param.shape), g, expert)
    if expert:  # grad covers this EP rank's experts: offsets along dim 0 are relative to them
        offset = (0, *offset[1:])
    return grad[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, index: int, size: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.index, ctx.n = group, index, x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.index * ctx.n : (ctx.index + 1) * ctx.n], None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, index: int, size: int) -> torch.Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        ctx.group, ctx.size = group, size
        n = x.shape[0] // size
        return total[index * n : (index + 1) * n]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None, None, None


class EPComm(ExpertComm):
    """Expert parallelism inside an EP group: every rank sees the group's tokens, runs its experts."""

    def __init__(self, g: Groups, experts: int) -> None:
        self.g = g
        self.first_expert = g.ep_rank * (experts // g.topo.ep)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.g.topo.ep == 1:
            return x
        out: torch.Tensor = _Gather.apply(x, self.g.ep_group, self.g.ep_rank, self.g.topo.ep)  # type: ignore[no-untyped-call]
        return out

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.g.topo.ep == 1:
            return x
        out: torch.Tensor = _Reduce.apply(x, self.g.ep_group, self.g.ep_rank, self.g.topo.ep)  # type: ignore[no-untyped-call]
        return out
