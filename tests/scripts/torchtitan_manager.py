"""Drive ckptfmt's torchtitan checkpoint manager as torchtitan's Trainer does (run by test_torchtitan.py).

    torchrun --nproc_per_node 2 tests/scripts/torchtitan_manager.py OUT CONFIG_JSON STEPS [STOP]

torchtitan's Trainer needs CUDA, so this is its loop on CPU: a small FSDP2 model on gloo,
torchtitan's own OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader built from
their Config classes, the Trainer itself as the ``train_state`` Stateful, and the manager built from
``CkptfmtCheckpointManager.Config(**CONFIG_JSON)`` (torchtitan's own DCP manager with
``"torchtitan_dcp": true``). It loads (``checkpoint.load_step``), trains to
STEPS calling ``save(step, last_step)`` after every step, and stops after step STOP when given (a
run cut short). Rank 0 writes OUT/result.pt: each step's loss, the whole parameters and the
optimizer state at the end, the step it started from, and what ``load`` returned.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer.dcp import CheckpointManager as DcpCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

from ckptfmt.integrations.torchtitan import CkptfmtCheckpointManager


class Numbers(IterableDataset):
    """An endless stream of batches, its own for each data-parallel rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def __iter__(self):
        generator = torch.Generator().manual_seed(100 + self.rank)
        while True:
            yield torch.randn(16, generator=generator)


class TrainState:
    """What torchtitan's Trainer registers as ``train_state``: its step and tokens seen."""

    def __init__(self):
        self.step = 0
        self.ntokens_seen = 0

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
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})],
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    dataloader = ParallelAwareDataloader(Numbers(rank), dp_rank=rank, dp_world_size=dist.get_world_size(),
                                         batch_size=4)
    train_state = TrainState()
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
        loss.backward()
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
