"""The MoE transformer as pure functions of a parameter dict (global keys, global shapes).

``specs(cfg)`` lists every parameter with its global shape and whether it is an expert tensor
(stacked ``[experts, ...]``); ``stage_forward`` runs one pipeline stage given full dense
weights and this rank's experts, with expert parallelism supplied by the caller.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zarrckpt.example.config import ModelConfig, Topology

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    shape: Shape
    expert: bool
    layer: int
    """The block it belongs to: -1 for the embedding, ``layers`` for the final norm and head."""

    def stage(self, topo: Topology, layers: int) -> int:
        """The pipeline stage that holds it."""
        return min(max(self.layer, 0), layers - 1) * topo.pp // layers


def specs(cfg: ModelConfig) -> dict[str, Spec]:
    """Every parameter, keyed by its global (topology-independent) name."""
    d, e, ff = cfg.d_model, cfg.experts, cfg.d_ff
    out: dict[str, Spec] = {"embed.weight": Spec((cfg.vocab, d), False, -1)}
    for i in range(cfg.layers):
        out |= {
            f"layers.{i}.attn_norm.weight": Spec((d,), False, i),
            f"layers.{i}.attn.wqkv.weight": Spec((3 * d, d), False, i),
            f"layers.{i}.attn.wo.weight": Spec((d, d), False, i),
            f"layers.{i}.moe_norm.weight": Spec((d,), False, i),
            f"layers.{i}.moe.router.weight": Spec((e, d), False, i),
            f"layers.{i}.moe.experts.w1": Spec((e, d, ff), True, i),
            f"layers.{i}.moe.experts.w2": Spec((e, ff, d), True, i),
        }
    out |= {"norm.weight": Spec((d,), False, cfg.layers), "head.weight": Spec((cfg.vocab, d), False, cfg.layers)}
    return out


def init(key: str, shape: Shape, seed: int) -> torch.Tensor:
    """The initial value of a parameter: a function of its name and the seed only."""
    if key.endswith("norm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    fan_in = shape[-2] if key.endswith(("experts.w1", "experts.w2")) else shape[-1]
    return torch.randn(shape, generator=g) * (0.5 / fan_in**0.5 if "embed" not in key else 1.0)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def attention(x: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (x @ wqkv.T).split(d, dim=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, d) @ wo.T


class ExpertComm:
    """How a stage reaches the experts it does not hold (identity on one rank)."""

    first_expert = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens → the tokens of every rank in the EP group."""
        return x

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Partial outputs for all the group's tokens → the summed output for this rank's tokens."""
        return x


def moe(
    x: torch.Tensor,
    jitter: torch.Tensor,
    router: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    comm: ExpertComm,
) -> torch.Tensor:
    """Top-k routed experts; ``w1``/``w2`` hold this rank's experts only."""
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    logits = (flat * jitter.reshape(-1, 1)) @ router.T
    both = comm.gather(torch.cat([flat, logits], dim=-1))
    tokens, probs = both[:, :d], both[:, d:].softmax(-1)
    top, idx = probs.topk(top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for j in range(w1.shape[0]):
        hit = idx == comm.first_expert + j
        rows = hit.any(-1).nonzero().squeeze(-1)
        if rows.numel():
            gate = (top * hit).sum(-1)[rows]
            out = out.index_add(0, rows, (F.silu(tokens[rows] @ w1[j]) @ w2[j]) * gate[:, None])
    return comm.reduce(out).reshape(b, t, d)


def stage_forward(
    p: dict[str, torch.Tensor],
    x: torch.Tensor,
    layers: range,
    cfg: ModelConfig,
    jitter: torch.Tensor,
    comm: ExpertComm,
    first: bool,
) -> torch.Tensor:
    """Token ids (first stage) or activations → activations after this stage's layers."""
    if first:
        x = F.embedding(x, p["embed.weight"])
    for i in layers:
        pre = f"layers.{i}."
        x = x + attention(
            rms_norm(x, p[pre + "attn_norm.weight"]), p[pre + "attn.wqkv.weight"], p[pre + "attn.wo.weight"], cfg.heads
        )
        h = rms_norm(x, p[pre + "moe_norm.weight"])
        x = x + moe(
            h,
            jitter[i],
            p[pre + "moe.router.weight"],
            p[pre + "moe.experts.w1"],
            p[pre + "moe.experts.w2"],
            cfg.top_k,
            comm,
        )
    return x


def loss_sum(p: dict[str, torch.Tensor], x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of the final stage's activations."""
    logits = rms_norm(x, p["norm.weight"]) @ p["head.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
