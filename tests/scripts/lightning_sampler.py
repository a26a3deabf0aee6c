"""A Lightning DDP run on CPU ranks (gloo) whose loader draws from a ResumableSampler.

    torchrun --nproc_per_node WORLD lightning_sampler.py REPO STEPS OUT [RESUME_PATH]

A dataset of 96 samples, each carrying its index; a global batch of 8 (8 // WORLD a rank), shuffled
by the sampler's seed; a checkpoint every 3 steps (mid-epoch: 12 steps an epoch). Each rank writes the
sample indices of each of its steps to OUT.RANK.json as [[step, [indices]], ...]; RESUME_PATH resumes
from that checkpoint path, at whatever world size this launch has.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, StepTimingCallback
from ckptfmt.integrations.sampler import ResumableSampler

SAMPLES, GLOBAL_BATCH = 96, 8


class Regression(L.LightningModule):
    def __init__(self, seen: list):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.seen = seen

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.append([self.trainer.global_step, index.tolist()])
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    repo, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 4, generator=generator),
                                          torch.randn(SAMPLES, 1, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_sampler=ResumableSampler(data, GLOBAL_BATCH // world, seed=5))
    seen: list = []
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[CkptfmtCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=repo, every_n_train_steps=3, save_top_k=-1),
                                   StepTimingCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regression(seen), loader, ckpt_path=resume)
    with open(f"{out}.{rank}.json", "w") as file:
        json.dump(seen, file)


if __name__ == "__main__":
    main()
