"""A Lightning fit run under torchrun by tests/test_lightning.py (DDP with ZarrCheckpointIO, or
ZarrModelParallelStrategy with FSDP2 over the data-parallel mesh), on CPUs with gloo.

    python -m torch.distributed.run --nproc-per-node N tests/lightning_worker.py \
        STRATEGY ROOT STEPS OUT [CKPT_PATH]

Saves every 2 steps into ROOT/ckpts (every checkpoint kept, and last.ckpt); rank 0 writes OUT
(torch.save): the loss of every step it trained, and the full model and optimizer state at the end
(gathered from every rank's shards). ROOT may be an ``s3://`` or ``gs://`` URL: then
``$WORKER_STORAGE_OPTIONS`` (JSON) are the store's options, given to the strategy (or the plug-in) and to
``ZarrModelCheckpoint``, which keeps the newest ``$WORKER_TOP_K`` checkpoints (default: all) and last.ckpt.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from zarrckpt.integrations.lightning import ZarrCheckpointIO, ZarrModelCheckpoint, ZarrModelParallelStrategy


class Model(L.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 1)
        self.shard = shard
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.shard:  # FSDP2 over the data-parallel ranks: each holds a row block of every weight
            mesh = self.device_mesh["data_parallel"]
            for module in (self.a, self.b, self):
                fully_shard(module, mesh=mesh)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.b(torch.relu(self.a(x))) - y) ** 2).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        halving = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)  # the rate a resume must restore
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step"}}


def main() -> None:
    warnings.simplefilter("ignore")
    strategy_name, root, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ckpt_path = sys.argv[5] if len(sys.argv) > 5 else None
    L.seed_everything(0, verbose=False)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))  # 2 steps per epoch on 2 ranks
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    shard = strategy_name == "model_parallel"
    options = json.loads(os.environ.get("WORKER_STORAGE_OPTIONS", "null"))
    strategy: Any = ZarrModelParallelStrategy(storage_options=options) if shard else DDPStrategy()
    every = {"dirpath": f"{root}/ckpts", "save_last": True, "every_n_train_steps": 2}
    keep = int(os.environ.get("WORKER_TOP_K", -1))  # without a monitor, 1 keeps the newest alone
    checkpoints = ZarrModelCheckpoint(**every, save_top_k=keep, storage_options=options) if options else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),  # torchrun's
        strategy=strategy,
        plugins=[] if shard else [ZarrCheckpointIO(options)],
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints or ModelCheckpoint(**every, save_top_k=keep)],
    )
    model = Model(shard)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    net = trainer.strategy.model
    optimizer = trainer.optimizers[0]
    state = {
        "model": get_model_state_dict(net, options=full),
        "optim": get_optimizer_state_dict(net, optimizer, options=full),
    }
    if trainer.global_rank == 0:
        torch.save({"losses": model.losses, "state": state, "global_step": trainer.global_step}, out)


if __name__ == "__main__":
    main()
