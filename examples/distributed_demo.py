"""Distributed training that checkpoints with ckptfmt (``make demo``), on CPU ranks (gloo) under torchrun.

    torchrun --nproc_per_node 4 examples/distributed_demo.py REPO --steps 20 --every 5
    torchrun --nproc_per_node 2 examples/distributed_demo.py REPO --steps 30 --every 5 --resume

A small MLP language model sharded with FSDP2 (``fully_shard``) trains on a
synthetic global batch that is the same whatever the world size (each rank
takes its slice). A ``ckptfmt.StepTimer`` records each step's phases, the
samples each rank consumed and the loss. Every ``--every`` steps every rank
calls ``ckptfmt.async_save`` with the timer: the state is staged and training
goes on while the checkpoint is written in the background. ``--resume`` loads
the latest checkpoint into this run's own shards (any world size) and carries
on. ``--slow-rank R --slow-steps A-B`` makes rank R sleep in its data phase in
those steps, for ``ckptfmt stragglers`` to find; ``--reorder-from S`` draws the
batches of step S on from another stream, for ``ckptfmt compare`` to explain.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ckptfmt

VOCAB, DIM, CONTEXT, GLOBAL_BATCH = 256, 96, 16, 32


def seed_everything(seed: int) -> None:
    """Seed Python's and NumPy's generators too, as training scripts do: ckptfmt records their states, and
    unseeded they would differ between any two runs."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Flatten(), nn.Linear(DIM * CONTEXT, 4 * DIM), nn.GELU(),
                          nn.Linear(4 * DIM, VOCAB))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    return fully_shard(model)


def batch(step: int, rank: int, world: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (the same global batch at any world size), and the
    indices of its samples in the data set (``stream`` 1: another data order)."""
    sample = stream * 1_000_000 + step
    generator = torch.Generator().manual_seed(sample)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, CONTEXT + 1), generator=generator)
    mine = tokens.chunk(world)[rank]
    indices = (sample * GLOBAL_BATCH + torch.arange(GLOBAL_BATCH)).chunk(world)[rank]
    return mine[:, :-1], mine[:, -1], indices


def step_range(text: str) -> range:
    """Steps A to B from "A-B" (none from "")."""
    if not text:
        return range(0)
    first, last = text.split("-")
    return range(int(first), int(last) + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow-rank", type=int, default=None, help="a rank that sleeps in its data phase")
    parser.add_argument("--slow-steps", default="", help="the steps it sleeps in, as A-B")
    parser.add_argument("--reorder-from", type=int, default=None, help="another data order from this step on")
    args = parser.parse_args()
    slow = step_range(args.slow_steps)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(rank)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    if args.resume:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = ckptfmt.load(args.repo, into={"model": model_state, "optim": optimizer_state, "step": 0,
                                              "samples_seen": None})
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed {ckptfmt.Repository.open(args.repo).latest()} (step {start}) on {world} ranks; "
                  f"saved by {ckptfmt.open(args.repo).metadata['topology']['world_size']} ranks")
    pending = None
    timer = ckptfmt.StepTimer()
    for step in range(start + 1, args.steps + 1):
        began = time.perf_counter()
        with timer.step(step):
            with timer.phase("data"):
                stream = int(args.reorder_from is not None and step >= args.reorder_from)
                inputs, targets, indices = batch(step, rank, world, stream)
                timer.batch(indices)
                if rank == args.slow_rank and step in slow:
                    time.sleep(0.3)
            with timer.phase("forward"):  # FSDP2 all-gathers parameters here: the others wait for a straggler
                loss = nn.functional.cross_entropy(model(inputs), targets)
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        timer.metrics(loss=loss.item())
        if step % args.every == 0:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state, "step": step,
                     "samples_seen": ckptfmt.PerRank(step * GLOBAL_BATCH // world)}
            stall = time.perf_counter()
            pending = ckptfmt.async_save(state, f"{args.repo}/step-{step:06d}", step=step,
                                         parallelism={"fsdp": world}, timeout=120, timer=timer)
            stall = time.perf_counter() - stall
            if rank == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}  saving step-{step:06d} in the background "
                      f"(training blocked {stall * 1e3:.1f} ms)  step {time.perf_counter() - began:.3f} s")
    if pending is not None:
        url = pending.result()
        if rank == 0:
            print(f"last checkpoint committed: {url}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
