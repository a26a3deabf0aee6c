"""FSDP2 through Lightning's ModelParallelStrategy on CPU ranks (gloo), saving through ckptfmt.

    torchrun --nproc_per_node N lightning_model_parallel.py REPO STEPS OUT [RESUME_PATH]

Trains STEPS steps (a checkpoint every 4 into REPO, with every rank's step timing), resuming from
RESUME_PATH if given; rank 0 then writes the full model and optimizer states to OUT (torch.save).
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckptfmt.integrations.lightning import CkptfmtModelParallelStrategy, StepTimingCallback


class Sharded(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    repo, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    generator = torch.Generator().manual_seed(1)  # 4 batches of 8 per rank and epoch
    data = torch.utils.data.TensorDataset(torch.randn(32 * world, 16, generator=generator),
                                          torch.randn(32 * world, 1, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    model = Sharded()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=world,
                        strategy=CkptfmtModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True,
                        callbacks=[ModelCheckpoint(dirpath=repo, every_n_train_steps=4, save_top_k=-1),
                                   StepTimingCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=resume)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(trainer.strategy.model, options=options),
             "optimizer": get_optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], options=options)}
    if trainer.global_rank == 0:
        torch.save(state, out)


if __name__ == "__main__":
    main()
