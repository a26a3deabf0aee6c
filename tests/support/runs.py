"""Small real training runs, saved with a StepTimer, that the comparison tests and the TUI's run screen read."""

from __future__ import annotations

import random
import time

import numpy as np
import torch

import ckptfmt

SAMPLES, BATCH, STEPS, EVERY = 64, 8, 12, 4


def train(repo: str, *, seed: int = 0, lr: float = 0.1, shuffle_from: int | None = None, rank: int = 0,
          world: int = 1, metadata: bool = True, unseeded: bool = False, augment: tuple[int, int] | None = None,
          clock: bool = False) -> None:
    """A linear model on a fixed data set; the data order is a seeded permutation (another one from
    ``shuffle_from`` on); checkpoints every EVERY steps with a StepTimer and, with ``metadata``, the
    learning rate in the metadata.

    ``unseeded``: Python's and NumPy's generators start from OS entropy, as in a new process (the runs
    here share one). ``augment=(seed, from_step)``: NumPy's generator, seeded, adds noise to the batches
    from that step on. ``clock``: the wall-clock time is stored in the state and the metadata.
    """
    torch.manual_seed(seed)
    if unseeded:
        random.seed()
        np.random.set_state(np.random.RandomState().get_state())
    if augment is not None:
        np.random.seed(augment[0])
    data = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(123))
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    timer = ckptfmt.StepTimer()
    for step in range(STEPS):
        order_seed = step + (1000 if shuffle_from is not None and step >= shuffle_from else 0)
        indices = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(order_seed))[:BATCH]
        indices = indices.chunk(world)[rank]
        with timer.step(step):
            timer.batch(indices)
            batch = data[indices]
            if augment is not None and step >= augment[1]:
                batch = batch + torch.from_numpy(np.random.normal(0.0, 0.1, batch.shape)).float()
            loss = model(batch).square().mean()
            if world > 1:
                loss = loss / world
            optimizer.zero_grad()
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
            optimizer.step()
        timer.metrics(loss=loss.item())
        if step % EVERY == EVERY - 1:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            user = {"lr": lr, "batch": BATCH} if metadata else {}
            if clock:
                state["saved_at"] = user["saved_at"] = time.time()
            ckptfmt.save(state, f"{repo}/step-{step:04d}", step=step, metadata=user or None, timer=timer)


#: What ``sick_run`` does to its model, and when: the health analysis must find exactly these.
SICK_STEPS, SICK_EVERY = 60, 5
SICK_LOSS_SPIKE, SICK_SCALED, SICK_NAN = 37, 45, 55


def sick_run(repo: str) -> None:
    """A small MLP trained with AdamW, checkpointed every SICK_EVERY steps, that falls ill on purpose:
    its loss is multiplied by 50 at step SICK_LOSS_SPIKE, its last layer's weights by 4 after step
    SICK_SCALED, one bias becomes NaN after step SICK_NAN (the loss is NaN from the next step); a
    frozen layer, a large frozen table (its own chunk) and an all-zero mask never change."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    table = torch.randn(300, 256)  # 300 KiB: a chunk of its own
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timer = ckptfmt.StepTimer(system_interval=None)
    data = torch.Generator().manual_seed(1)
    for step in range(1, SICK_STEPS + 1):
        with timer.step(step):
            loss = model(torch.randn(16, 8, generator=data)).square().mean()
            if step == SICK_LOSS_SPIKE:
                loss = loss * 50
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        timer.metrics(loss=loss.item())
        with torch.no_grad():
            if step == SICK_SCALED:
                model[2].weight.mul_(4)
            if step == SICK_NAN:
                model[0].bias[3] = float("nan")
        if step % SICK_EVERY == 0:
            state = {"model": model.state_dict(), "frozen": frozen.state_dict(), "table": table,
                     "optim": optimizer.state_dict(), "mask": torch.zeros(100)}
            ckptfmt.save(state, f"{repo}/step-{step:04d}", step=step, timer=timer)
