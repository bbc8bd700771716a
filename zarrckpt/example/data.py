"""Seeded synthetic token data and a resumable loader (position, epoch, shuffle order).

Every sequence follows a noisy affine rule ``x[t+1] = (a * x[t] + b) mod vocab`` with a
per-sequence ``a, b``, so the model has something to learn. Randomness is drawn identically on
every rank (the loader hands out the *global* batch; each DP rank takes its slice), so the
stream of samples does not depend on the topology and a resumed run under any other layout
continues with the right sample.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from zarrckpt.example.config import ModelConfig, TrainConfig

MAX_CROP = 4
"""Each step starts its sequences at a random offset in [0, MAX_CROP] (python ``random``)."""


def sample(index: int, model: ModelConfig, seed: int) -> np.ndarray:
    """Sequence ``index`` of the dataset: ``seq_len + 1 + MAX_CROP`` tokens."""
    rng = np.random.default_rng([seed, index])
    a, b = int(rng.integers(1, 4)), int(rng.integers(0, model.vocab))
    out = np.empty(model.seq_len + 1 + MAX_CROP, dtype=np.int64)
    out[0] = rng.integers(0, model.vocab)
    noise = rng.random(len(out)) < 0.05
    for t in range(1, len(out)):
        out[t] = (a * out[t - 1] + b + int(noise[t])) % model.vocab
    return out


def manifest(model: ModelConfig, train: TrainConfig) -> dict[str, Any]:
    """What a resumed run needs to know it reads the same data."""
    first = sample(0, model, train.seed)
    return {
        "name": "synthetic-affine-mod-vocab",
        "num_samples": train.dataset_size,
        "tokens_per_sample": len(first),
        "seed": train.seed,
        "sample0_head": first[:8].tolist(),
    }


class Loader:
    """Hands out global batches in a shuffled order; shuffles draw from the numpy generator."""

    def __init__(self, model: ModelConfig, train: TrainConfig, np_rng: np.random.Generator) -> None:
        self.model, self.train, self.np_rng = model, train, np_rng
        self.epoch, self.position = 0, 0
        self.order = self._shuffle()

    def _shuffle(self) -> list[int]:
        return [int(i) for i in self.np_rng.permutation(self.train.dataset_size)]

    def next_batch(self) -> tuple[list[int], torch.Tensor]:
        """(sample ids, tokens ``[batch, seq_len + 1]``) of the next global batch."""
        ids = []
        for _ in range(self.train.batch):
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._shuffle()
            ids.append(self.order[self.position])
            self.position += 1
        crop = random.randrange(MAX_CROP + 1)
        rows = [sample(i, self.model, self.train.seed)[crop : crop + self.model.seq_len + 1] for i in ids]
        return ids, torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.order = int(state["epoch"]), int(state["position"]), list(state["order"])
