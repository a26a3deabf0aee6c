"""A job that only loads, then ends as users end it (tests/distributed/test_clean_exit.py).

    torchrun --nproc_per_node N load_exit_job.py URL [--save]

An FSDP2 model on gloo ranks and a fresh AdamW load a collective checkpoint in place
(``ckptfmt.load(url, into=...)`` of the objects themselves), check every parameter
against it, and the job ends: ``destroy_process_group()`` and a normal interpreter
exit. No ckptfmt save runs in it: whatever ckptfmt needs at exit, its load must set up.
``--save``: train a step and save the checkpoint instead (the job the loads start from).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckptfmt


def main(url: str, save: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0 if save else 1)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if save:
        model(torch.randn(4, 64)).square().mean().backward()
        optim.step()
        ckptfmt.save({"model": model, "optim": optim}, url)
        dist.destroy_process_group()
        return
    ckptfmt.load(url, into={"model": model, "optim": optim})
    with ckptfmt.open(url) as saved:
        for name, param in model.named_parameters():
            assert torch.equal(param.full_tensor(), saved.get_tensor(f"model/{name}")), name
    assert len(optim.state) == 4
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], "--save" in sys.argv[2:])
