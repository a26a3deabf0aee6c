"""The end of a training job under torchrun, as users write it (tests/distributed/test_clean_exit.py).

    torchrun --nproc_per_node N clean_exit_job.py REPO RUN [--pending]

An FSDP2 model on gloo ranks loads run RUN-1's checkpoint (saved on another number
of ranks: a resharding load), checks every parameter against it, trains one step,
saves run RUN collectively (synchronously, then asynchronously), and ends:
``destroy_process_group()`` and a normal interpreter exit. With ``--pending`` the
last asynchronous save is still running when the script ends: ckptfmt's exit
hook finishes it, so the job cannot destroy the process group its save needs.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ckptfmt


def main(repo: str, run: int, pending: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, optim)  # creates the optimizer's moments
    if run > 0:
        previous = f"{repo}/run-{run - 1:03d}"
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state, "run": -1}
        ckptfmt.load(previous, into=state)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["run"] == run - 1
        with ckptfmt.open(previous) as saved:
            for name, param in model.named_parameters():
                assert torch.equal(param.full_tensor(), saved.get_tensor(f"model/{name}")), name
    step(model, optim)
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state, "run": run}
    ckptfmt.save(state, f"{repo}/sync-{run:03d}", step=run)
    future = ckptfmt.async_save(state, f"{repo}/run-{run:03d}", step=run)
    if pending:
        return  # the exit hook commits it; the group stays for it
    future.result()
    dist.barrier()
    dist.destroy_process_group()


def step(model, optim) -> None:
    torch.manual_seed(dist.get_rank())
    model(torch.randn(4, 64)).square().mean().backward()
    optim.step()
    optim.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--pending" in sys.argv[3:])
