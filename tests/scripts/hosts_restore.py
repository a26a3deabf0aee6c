"""Every rank of a job across simulated hosts loads its part of a checkpoint from its own node's
repository (tests/hosts/), as hosts_train.py saved it.

    torchrun --nnodes N --node_rank I ... hosts_restore.py CHECKPOINT_URL STEP

Each rank fills its model, its optimizer and its rows of the sharded embedding table in place
(``ckptfmt.load(into=)``), reading only what its node holds, and checks the rows against the values
hosts_train.py saved at step STEP (``arange + STEP - 1``) and the model against rank 0's.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfmt


def main() -> None:
    url, step = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    table = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
    model = torch.nn.Linear(16, 4)
    state = {"model": model.state_dict(), "table": table}
    ckptfmt.load(url, into=state, strict=False)
    expected = distribute_tensor(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + step - 1, mesh, [Shard(0)])
    assert torch.equal(state["table"].to_local(), expected.to_local()), "the table's rows differ"
    for value in model.state_dict().values():
        reference = value.clone()
        dist.broadcast(reference, 0)
        assert torch.equal(value, reference), "the model differs from rank 0's"
    assert not torch.equal(model.weight, torch.zeros_like(model.weight))


if __name__ == "__main__":
    main()
    dist.destroy_process_group()  # and a normal exit, as a user's job ends
