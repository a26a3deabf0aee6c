"""A Hugging Face Trainer run that saves through ckptfmt: the callback added to a Trainer, and a resume.

    python examples/transformers_example.py FOLDER [--repo URL] [--steps 20]

Trains a small regression model for --steps steps with FOLDER as the Trainer's output_dir, saving
every 5 steps into the repository URL (FOLDER/repo unless given; s3://bucket/prefix works) and
keeping the newest two (save_total_limit), with every step timed. The first Trainer is stopped
halfway, as a preempted job would be; a second one resumes from the newest checkpoint. Prints where
it resumed and what the repository holds.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import ckptfmt
from ckptfmt.integrations.transformers import CkptfmtCallback


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 32, generator=generator), torch.randn(512, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Preempted(TrainerCallback):
    """Stops training after step ``at``, as a preempted job would stop."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.at


def train(folder: str, repo: str, steps: int, stop_at: int) -> Trainer:
    """A Trainer as a user writes one, plus the ckptfmt callback, resuming where the repository ends."""
    args = TrainingArguments(folder, max_steps=steps, per_device_train_batch_size=16, save_steps=5,
                             save_total_limit=2, logging_steps=5, report_to=[], use_cpu=True, disable_tqdm=True)
    saving = CkptfmtCallback(repo)                                           # added: saves through ckptfmt
    trainer = Trainer(Regression(), args, train_dataset=Pairs(), callbacks=[saving, Preempted(stop_at)])
    trainer.train(resume_from_checkpoint=saving.resume_folder(args))         # added: None on a fresh start
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--repo")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    repo = args.repo or os.path.join(args.folder, "repo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's notes on CPU training
        first = train(args.folder, repo, args.steps, stop_at=args.steps // 2)
        second = train(args.folder, repo, args.steps, stop_at=args.steps)
    print(f"resumed from step {first.state.global_step}, trained to step {second.state.global_step}")
    for record in sorted(ckptfmt.Repository.open(repo).commits(), key=lambda r: r.step):
        print(f"{record.name}: step {record.step}")
    assert ckptfmt.verify(repo).ok


if __name__ == "__main__":
    main()
