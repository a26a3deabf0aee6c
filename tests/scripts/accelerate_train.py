"""An Accelerate training loop on CPU (one process, or ranks under torchrun) saving through ckptfmt.

    [torchrun --nproc_per_node 2] accelerate_train.py MODE LOADER PLACE STEPS OUT [SAVE_AT [FAULT]]

A dropout MLP with AdamW and a StepLR schedule over 64 samples in shuffled batches of 8 (4 steps
per epoch on 2 ranks), the loop's progress registered for checkpointing. The sampler is Accelerate's
seedable one; LOADER ``stateful`` makes the loader torchdata's StatefulDataLoader (positions within an
epoch), ``plain`` leaves it a DataLoader (resumable at epoch ends).
MODE:

- ``straight``: trains STEPS steps and saves PLACE/step-STEPS; rank 1 sleeps 0.25 s while collating
  batches 5..7.
- ``stop``: trains, saves PLACE/step-SAVE_AT after step SAVE_AT, and exits.
- ``resume``: loads the checkpoint PLACE, trains to STEPS and saves step-STEPS beside it.
- ``automatic``: PLACE is the project_dir; automatic checkpoint naming with total_limit=2, a save
  every 2 steps until SAVE_AT, then it exits.
- ``automatic-resume``: loads the newest checkpoint of project_dir PLACE and trains to STEPS.

FAULT, in ``resume`` mode, goes in after the load, each a real bug of resumes: ``reseeded`` (the loop
seeds torch again), ``optimizer`` (the optimizer's state dropped), ``scheduler`` (the schedule back at
its start), ``perturbed`` (noise on the loss from a generator no checkpoint holds).

Rank 0 writes the final model and optimizer states to OUT (torch.save).
"""

from __future__ import annotations

import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed

from ckptfmt.integrations.accelerate import StepTiming, load_state, save_state

SLEEP_S = 0.25


class Progress:
    """Where the loop is: registered with the accelerator, so checkpoints carry it."""

    def __init__(self):
        self.epoch = self.step = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


class SlowCollate:
    """Sleeps while collating batches ``first``..``last`` (0-based, counted across epochs) when ``slow``."""

    def __init__(self, slow: bool, first: int = 5, last: int = 7):
        self.slow, self.first, self.last, self.fetched = slow, first, last, 0

    def __call__(self, samples):
        if self.slow and self.first <= self.fetched <= self.last:
            time.sleep(SLEEP_S)
        self.fetched += 1
        return torch.utils.data.default_collate(samples)


def inject(fault: str | None, optimizer, scheduler, fresh_schedule: dict) -> torch.Generator | None:
    """The FAULT after a load; the generator of ``perturbed``'s noise (seeded by the clock), else None."""
    if fault == "reseeded":
        set_seed(0)
    elif fault == "optimizer":
        optimizer.optimizer.state.clear()
    elif fault == "scheduler":
        scheduler.scheduler.load_state_dict(fresh_schedule)
    elif fault == "perturbed":
        return torch.Generator().manual_seed(time.time_ns())
    elif fault is not None:
        raise ValueError(f"no fault {fault!r}")
    return None


def main() -> None:
    mode, kind, place, steps, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    save_at = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    fault = sys.argv[7] if len(sys.argv) > 7 else None
    project = ProjectConfiguration(project_dir=place, automatic_checkpoint_naming=True, total_limit=2) \
        if mode.startswith("automatic") else None
    loading = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=kind == "stateful")
    accelerator = Accelerator(cpu=True, project_config=project, dataloader_config=loading)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    numbers = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=numbers), torch.randn(64, 1, generator=numbers))
    slow = mode == "straight" and accelerator.process_index == 1
    # A generator of its own: else each new iterator draws its base seed from torch's global RNG, and a
    # run resumed in the middle of an epoch (a new iterator there) would draw dropout one number ahead.
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, collate_fn=SlowCollate(slow),
                                         generator=torch.Generator().manual_seed(2))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    timing = StepTiming(accelerator)
    fresh_schedule = scheduler.scheduler.state_dict()
    if mode == "resume":
        load_state(accelerator, place)
        noise = inject(fault, optimizer, scheduler, fresh_schedule)
    elif mode == "automatic-resume":
        load_state(accelerator)
    while progress.step < steps:
        for x, y in loader:
            model.train()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if mode == "resume" and noise is not None:
                loss = loss + 1e-3 * torch.rand((), generator=noise)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            timing.timer.metrics(loss=loss.detach())  # the step's signature holds its loss (certify)
            progress.step += 1
            if mode == "stop" and progress.step == save_at:
                save_state(accelerator, f"{place}/step-{save_at:06d}")
                return
            if mode == "automatic" and progress.step % 2 == 0:
                save_state(accelerator)
                if progress.step == save_at:
                    return
            if progress.step == steps:
                break
        else:
            progress.epoch += 1
    if mode in ("straight", "resume"):  # a resumed run saves beside the checkpoint it resumed from
        repo = place if mode == "straight" else place.rstrip("/").rsplit("/", 1)[0]
        save_state(accelerator, f"{repo}/step-{steps:06d}")
    if accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict()}, out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
