"""Data-parallel training across simulated hosts (tests/hosts/), saving collectively.

    torchrun --nnodes N --node_rank I ... hosts_train.py REPO STEPS EVERY SLOW_RANK FIRST LAST [SCOPE]

Each rank trains a small model on its own batches (gradients averaged every step, so the ranks wait
for each other), timed by a StepTimer; rank SLOW_RANK waits 0.2 s more for its data at steps
FIRST..LAST; a collective save to REPO every EVERY steps (``scope=SCOPE``, ``job`` by default), with
an embedding table sharded over the ranks (a DTensor: each rank's rows are its own) beside the model.
With ``KILL_NODE_AT=S`` in its environment, a host's ranks are killed (SIGKILL) as the save after step
S begins: a node lost in the middle of a save.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfmt

SLEEP_S = 0.2


def main() -> None:
    repo, steps, every, slow_rank, first, last = sys.argv[1], *map(int, sys.argv[2:7])
    scope = sys.argv[7] if len(sys.argv) > 7 else "job"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    table = distribute_tensor(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8), mesh, [Shard(0)])
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = ckptfmt.StepTimer(system_interval=None)
    batches = torch.Generator().manual_seed(rank)
    for step in range(steps):
        with timer.step(step):
            with timer.phase("data"):
                batch = torch.randn(8, 16, generator=batches)
                if rank == slow_rank and first <= step <= last:
                    time.sleep(SLEEP_S)
            with timer.phase("forward_backward"):
                loss = model(batch).square().mean()
                loss.backward()
            with timer.phase("sync"):
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= dist.get_world_size()
            optimizer.step()
            optimizer.zero_grad()
            timer.metrics(loss=loss.detach())
        if (step + 1) % every == 0:
            if os.environ.get("KILL_NODE_AT") == str(step + 1):
                os.kill(os.getpid(), signal.SIGKILL)
            ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "table": table + step,
                          "step": step + 1}, f"{repo}/step-{step + 1:04d}", step=step + 1, timer=timer, scope=scope,
                         timeout=60)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()  # and a normal exit, as a user's job ends
