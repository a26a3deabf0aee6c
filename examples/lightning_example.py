"""A Lightning run that saves through ckptfmt: the two objects added to a Trainer, and a resume.

    python examples/lightning_example.py RUN_FOLDER [--steps 40]

Trains a small regression model, keeping the two best checkpoints by training loss and last.ckpt in
RUN_FOLDER (a local folder or s3://bucket/prefix), with every step timed; then a second Trainer
resumes from last.ckpt and trains as long again. Prints what the repository holds.
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ckptfmt
from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, StepTimingCallback


class Regression(L.LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def trainer(folder: str, steps: int) -> L.Trainer:
    """A Trainer as a user writes one, plus the two ckptfmt objects."""
    return L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[CkptfmtCheckpointIO()],                                     # added: saves through ckptfmt
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=10, save_top_k=2, monitor="train_loss",
                                   save_last=True),
                   StepTimingCallback()],                                    # added: every step timed
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on data loader workers
        first = trainer(args.folder, args.steps)
        first.fit(Regression(), loader)
        second = trainer(args.folder, 2 * args.steps)
        second.fit(Regression(), loader, ckpt_path="last")  # resumes from the newest last.ckpt
    print(f"trained to step {second.global_step}, resumed from step {first.global_step}")
    for record in sorted(ckptfmt.Repository.open(args.folder).commits(), key=lambda r: r.step):
        print(f"{record.name}: step {record.step}")
    assert ckptfmt.verify(args.folder).ok


if __name__ == "__main__":
    main()
