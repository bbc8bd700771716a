"""Model / training configuration and the parallel topology (pure math, no process groups)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The MoE transformer's shape. Changing any field is a model conversion, not a reshard."""

    layers: int = 4
    """Transformer blocks; each one has attention and a mixture-of-experts MLP."""
    d_model: int = 64
    """Residual stream width."""
    heads: int = 4
    """Attention heads (``d_model`` must be a multiple)."""
    experts: int = 8
    """Experts per MoE layer, stacked as ``[experts, ...]`` tensors."""
    d_ff: int = 128
    """Hidden width of one expert."""
    top_k: int = 2
    """Experts each token is routed to."""
    vocab: int = 64
    """Vocabulary size."""
    seq_len: int = 32
    """Tokens per training sequence."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and data settings (part of the saved config)."""

    batch: int = 8
    """Sequences per global batch; the DP ranks of a stage split it evenly."""
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0
    """Global gradient-norm clip."""
    router_jitter: float = 0.01
    """Multiplicative noise on router inputs (draws from the torch RNG every step)."""
    window: int = 16
    """Length of the rolling loss / grad-norm windows kept as bookkeeping."""
    seed: int = 1234
    dataset_size: int = 96
    """Synthetic sequences per epoch (an epoch is 12 steps at batch 8)."""

    def to_json(self, model: ModelConfig) -> dict[str, Any]:
        return {"model": asdict(model), "train": {**asdict(self), "betas": list(self.betas)}}


class ExpertDP(StrEnum):
    """What the ``ep_dp`` ranks of an expert group do with its expert tensors (``--expert-dp``)."""

    SHARDED = "sharded"
    """They split them along the second dimension."""
    REPLICATED = "replicated"
    """Each holds all of them (a replica)."""


@dataclass(frozen=True)
class Topology:
    """How ``world`` ranks split the model: ``pp`` stages x ``ep`` expert groups x ``ep_dp`` replicas.

    Rank ``r`` is stage ``r // dp``; inside a stage, ``dp_rank = r % dp`` splits into
    ``ep_rank = dp_rank // ep_dp`` (which experts) and ``epdp_rank = dp_rank % ep_dp``.
    Dense parameters are sharded over the ``dp`` ranks of their stage; expert tensors over
    ``ep`` along the expert dimension and, when ``expert_dp`` is :attr:`ExpertDP.SHARDED`, over
    ``ep_dp`` along their second dimension (otherwise replicated there).
    """

    world: int
    pp: int = 1
    ep: int = 0
    """0 picks gcd(experts, dp)."""
    expert_dp: ExpertDP = ExpertDP.REPLICATED
    """An :class:`ExpertDP` or its name (``"sharded"``): :meth:`resolved` makes it the member."""

    @property
    def dp(self) -> int:
        return self.world // self.pp

    @property
    def ep_dp(self) -> int:
        return self.dp // self.ep

    def resolved(self, model: ModelConfig) -> Topology:
        """This topology with ``ep`` filled in, after checking it fits the model."""
        if self.world < 1 or self.pp < 1 or self.world % self.pp:
            raise ValueError(f"pp={self.pp} must divide the world size {self.world}")
        if model.layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide the number of layers ({model.layers})")
        ep = self.ep or math.gcd(model.experts, self.dp)
        if model.experts % ep or self.dp % ep:
            raise ValueError(f"ep={ep} must divide the experts ({model.experts}) and the ranks per stage ({self.dp})")
        if self.expert_dp not in tuple(ExpertDP):
            raise ValueError(f"expert_dp must be 'sharded' or 'replicated', not {self.expert_dp!r}")
        return Topology(self.world, self.pp, ep, ExpertDP(self.expert_dp))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, ep_rank, epdp_rank) of a global rank."""
        stage, dp_rank = divmod(rank, self.dp)
        ep_rank, epdp_rank = divmod(dp_rank, self.ep_dp)
        return stage, ep_rank, epdp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.dp, (stage + 1) * self.dp))

    def layers_of(self, stage: int, layers: int) -> range:
        per = layers // self.pp
        return range(stage * per, (stage + 1) * per)

    def __str__(self) -> str:
        sharded = " (sharded)" if self.expert_dp == ExpertDP.SHARDED else ""
        return f"PP{self.pp}xEP{self.ep}xEP-DP{self.ep_dp}{sharded}"
