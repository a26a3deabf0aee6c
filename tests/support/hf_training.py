"""A small Hugging Face Trainer run for tests/integrations/test_transformers.py and the programs it
launches: a dropout MLP (so resumed runs must restore the RNG), AdamW with a linear schedule, and
a train and an eval dataset made from fixed seeds."""

from __future__ import annotations

import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

SAMPLES = 64
BATCH = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 32)
        self.drop = torch.nn.Dropout(0.3)
        self.l2 = torch.nn.Linear(32, 1)

    def forward(self, x, labels=None):
        out = self.l2(self.drop(torch.relu(self.l1(x))))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    """SAMPLES (x, label) pairs from ``seed``."""

    def __init__(self, seed: int = 3):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Record(TrainerCallback):
    """The training loss logged at each step; stops training after step ``stop_at`` (an interrupted run)."""

    def __init__(self, stop_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.stop_at = stop_at

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def arguments(output_dir: str, **overrides) -> TrainingArguments:
    """Eight steps of batch 8, a log every step, a save every 4 steps; CPU, no reporting."""
    options = dict(max_steps=8, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                   logging_steps=1, save_steps=4, learning_rate=0.01, report_to=[], use_cpu=True, seed=7,
                   data_seed=11, disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(output_dir, **options)


class SlowFetches:
    """A data collator that sleeps ``seconds`` while collating batches ``first``..``last`` (0-based)."""

    def __init__(self, seconds: float, first: int, last: int):
        self.seconds, self.first, self.last, self.fetched = seconds, first, last, 0

    def __call__(self, samples):
        if self.first <= self.fetched <= self.last:
            time.sleep(self.seconds)
        self.fetched += 1
        return default_data_collator(samples)


def trainer(args: TrainingArguments, callbacks: list, collator=None) -> Trainer:
    """A Trainer of a freshly seeded Net over Data (and Data of another seed to evaluate on)."""
    torch.manual_seed(0)
    return Trainer(Net(), args, train_dataset=Data(), eval_dataset=Data(seed=4), callbacks=callbacks,
                   data_collator=collator)
