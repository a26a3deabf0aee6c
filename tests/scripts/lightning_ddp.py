"""A Lightning DDP run on CPU ranks (gloo) saving through ckptfmt, one rank slow to fetch some batches.

    torchrun --nproc_per_node 2 lightning_ddp.py REPO STEPS SLOW_RANK FIRST_SLOW LAST_SLOW

Rank SLOW_RANK sleeps 0.25 s while fetching batches FIRST_SLOW..LAST_SLOW (0-based, as the
StepTimingCallback numbers steps); a checkpoint every 8 steps goes to REPO.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, StepTimingCallback

SLEEP_S = 0.25


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowFetches:
    """A collate function that sleeps on one rank while fetching chosen batches."""

    def __init__(self, slow: bool, first: int, last: int):
        self.slow, self.first, self.last, self.fetched = slow, first, last, 0

    def __call__(self, samples):
        if self.slow and self.first <= self.fetched <= self.last:
            time.sleep(SLEEP_S)
        self.fetched += 1
        return torch.utils.data.default_collate(samples)


def main() -> None:
    repo, steps, slow_rank, first, last = sys.argv[1], *map(int, sys.argv[2:6])
    rank = int(os.environ["RANK"])
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(8 * steps * 2, 16), torch.randn(8 * steps * 2, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=SlowFetches(rank == slow_rank, first, last))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[CkptfmtCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=repo, every_n_train_steps=8, save_top_k=-1),
                                   StepTimingCallback(progress_interval=0.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()  # the imports' objects are the oldest generation's now: no full collection pauses a step
        gc.freeze()
        trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
