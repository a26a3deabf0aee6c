"""Drive ckptfmt's torchtitan checkpoint manager as torchtitan's Trainer does (run by test_torchtitan.py).

    torchrun --nproc_per_node 2 tests/scripts/torchtitan_manager.py OUT CONFIG_JSON STEPS [STOP]

torchtitan's Trainer needs CUDA, so this is its loop on CPU: a small FSDP2 model on gloo,
torchtitan's own OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader built from
their Config classes, the Trainer's stand-in as the ``train_state`` Stateful (its ``config`` holds
torchtitan's own ``training``, ``optimizer``, ``lr_scheduler`` and ``debug`` configs, as the
Trainer's does), gradients clipped by torchtitan's ``clip_grad_norm_`` to ``training.max_norm``, and
the manager built from ``CkptfmtCheckpointManager.Config(**CONFIG_JSON)`` (torchtitan's own DCP
manager with ``"torchtitan_dcp": true``). It loads (``checkpoint.load_step``), trains to STEPS
calling ``save(step, last_step)`` after every step, and stops after step STOP when given (a run cut
short). Rank 0 writes OUT/result.pt: each step's loss, the whole parameters and the optimizer state
at the end, the step it started from, and what ``load`` returned.

Keys of CONFIG_JSON that are the loop's: ``"stateless_data": true`` (a dataset without
``state_dict``, which torchdata's loader resumes by fast-forwarding), and for certify's fault campaign
``"max_norm"`` (the clipping norm, 0.02 by default: it clips every step) and ``"perturbed": true`` (the
loss scaled by noise from a generator no checkpoint holds, seeded anew by each process).
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer.dcp import CheckpointManager as DcpCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import DebugConfig, TrainingConfig
from torchtitan.distributed.utils import clip_grad_norm_

from ckptfmt.integrations.torchtitan import CkptfmtCheckpointManager


class Numbers(IterableDataset):
    """An endless stream of samples, its own for each data-parallel rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def __iter__(self):
        generator = torch.Generator().manual_seed(100 + self.rank)
        while True:
            yield torch.randn(16, generator=generator)


class StatefulNumbers(Numbers):
    """The same stream keeping its position as torchtitan's own datasets do (``state_dict``): a loader
    resumes it from there instead of fast-forwarding it."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.sample = 0

    def __iter__(self):
        samples = super().__iter__()
        for _ in range(self.sample):
            next(samples)
        for sample in samples:
            self.sample += 1
            yield sample

    def state_dict(self):
        return {"sample": self.sample}

    def load_state_dict(self, state):
        self.sample = state["sample"]


class TrainState:
    """What torchtitan's Trainer registers as ``train_state``: its step and tokens seen, and its config."""

    def __init__(self, config: SimpleNamespace):
        self.step = 0
        self.ntokens_seen = 0
        self.config = config

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def main(out: str, config: dict, steps: int, stop: int | None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Dropout(0.1), torch.nn.Linear(24, 4))
    fully_shard(model)
    job = SimpleNamespace(
        training=TrainingConfig(local_batch_size=4, seq_len=16, steps=steps, max_norm=config.pop("max_norm", 0.02)),
        optimizer=OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2), debug=DebugConfig(seed=0))
    noise = torch.Generator().manual_seed(time.time_ns()) if config.pop("perturbed", False) else None
    optimizers = job.optimizer.build(model_parts=[model])
    lr_schedulers = job.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    dataset = (Numbers if config.pop("stateless_data", False) else StatefulNumbers)(rank)
    dataloader = ParallelAwareDataloader(dataset, dp_rank=rank, dp_world_size=dist.get_world_size(),
                                         batch_size=job.training.local_batch_size)
    train_state = TrainState(job)
    manager_class = DcpCheckpointManager if config.pop("torchtitan_dcp", False) else CkptfmtCheckpointManager
    manager = manager_class.Config(**config).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None)
    loaded = manager.load(step=config.get("load_step", -1))
    torch.manual_seed(1000 + rank + 10 * train_state.step) if not loaded else None  # a fresh run's dropout
    started = train_state.step
    losses = []
    batches = iter(dataloader)
    while train_state.step < steps:
        train_state.step += 1
        batch = next(batches)
        train_state.ntokens_seen += batch.numel()
        loss = model(batch).square().mean()
        if noise is not None:
            loss = loss * (1 + 1e-3 * torch.rand((), generator=noise))
        loss.backward()
        clip_grad_norm_(list(model.parameters()), job.training.max_norm, foreach=True)
        manager.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        manager.save(train_state.step, last_step=train_state.step == steps)
        if stop is not None and train_state.step == stop:
            break
    manager.maybe_wait_for_staging()
    manager.close()
    params = {name: param.full_tensor() for name, param in model.named_parameters()}
    optimizer_state = {key: value.full_tensor() if hasattr(value, "full_tensor") else value
                       for key, value in optimizers.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "optimizer": optimizer_state, "started": started,
                    "loaded": loaded, "lr": lr_schedulers.schedulers[0].get_last_lr()}, f"{out}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
