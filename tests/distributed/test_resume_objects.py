"""Resumes into the objects users hold on 2 gloo ranks (issue 46, part 1): DDP and FSDP2 jobs save
their model, AdamW and schedule as the objects themselves, and fresh ones resume from the checkpoint
in place, through ``ckptfmt.load(into=)`` and a CheckpointManager with two tiers.

Truth is the uninterrupted run on the same ranks: every loss and every parameter of the resumed run
must be equal bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptfmt
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.distributed

STEPS, SAVED_AT = 6, 3


def build(kind: str, seed: int):
    """A model wrapped as ``kind`` ("ddp" or "fsdp2"), its AdamW and a step schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.GELU(), torch.nn.Linear(37, 5))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)  # 37 rows over 2 ranks: uneven shards
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def step(model, optim, sched, rank: int, index: int) -> str:
    """One step on this rank's batch for step ``index``; the loss as an exact hex float."""
    generator = torch.Generator().manual_seed(1000 * index + rank)
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 5, generator=generator)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return loss.item().hex()


def local_weights(model) -> list[torch.Tensor]:
    return [getattr(p, "to_local", lambda p=p: p)().detach().clone() for p in model.parameters()]


def uninterrupted(rank: int, world: int, folder: Path, kind: str) -> dict:
    model, optim, sched = build(kind, seed=0)
    losses = [step(model, optim, sched, rank, i) for i in range(STEPS)]
    return {"losses": losses, "weights": local_weights(model)}


def save_then_resume(rank: int, world: int, folder: Path, kind: str, how: str, url: str) -> dict:
    """Train to SAVED_AT and save the objects, then resume fresh objects (other initial weights) and go on."""
    model, optim, sched = build(kind, seed=0)
    losses = [step(model, optim, sched, rank, i) for i in range(SAVED_AT)]
    ckptfmt.save({"model": model, "optim": optim, "sched": sched}, f"{url}/step-{SAVED_AT}", step=SAVED_AT,
                  timeout=60)
    del model, optim, sched
    model, optim, sched = build(kind, seed=1)
    if how == "objects":
        ckptfmt.load(f"{url}/step-{SAVED_AT}", into={"model": model, "optim": optim, "sched": sched})
    else:  # the state dicts of a fresh optimizer (no moments yet) and of the model, as a loop passes them
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict()}
        ckptfmt.load(f"{url}/step-{SAVED_AT}", into=state)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    losses += [step(model, optim, sched, rank, i) for i in range(SAVED_AT, STEPS)]
    return {"losses": losses, "weights": local_weights(model)}


def managed(rank: int, world: int, folder: Path, kind: str, tiers: list[str]) -> dict:
    """A CheckpointManager with two tiers saving every step; fresh objects restored from it go on."""
    model, optim, sched = build(kind, seed=0)
    losses = []
    with ckptfmt.CheckpointManager(tiers=tiers, housekeeping="thread", timeout=60) as manager:
        for i in range(SAVED_AT):
            losses.append(step(model, optim, sched, rank, i))
            manager.save(i, {"model": model, "optim": optim, "sched": sched}, force=True)
    model, optim, sched = build(kind, seed=1)
    with ckptfmt.CheckpointManager(tiers=tiers, housekeeping="thread", timeout=60) as manager:
        manager.restore(into={"model": model, "optim": optim, "sched": sched})
        start = manager.start_step
    losses += [step(model, optim, sched, rank, i) for i in range(start, STEPS)]
    return {"losses": losses, "weights": local_weights(model)}


def assert_same_runs(expected: list, resumed: list) -> None:
    for rank, (a, b) in enumerate(zip(expected, resumed)):
        a, b = a.unwrap(), b.unwrap()
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])), rank


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_objects_and_fresh_state_dicts_resume_bit_exactly_on_two_ranks(tmp_path, kind):
    expected = run_ranks(uninterrupted, 2, tmp_path / "whole", kind=kind)
    for how in ("objects", "state_dicts"):
        resumed = run_ranks(save_then_resume, 2, tmp_path / how, kind=kind, how=how, url=str(tmp_path / how / "run"))
        assert_same_runs(expected, resumed)


def test_the_manager_restores_fsdp2_objects_from_tiers_bit_exactly(tmp_path):
    expected = run_ranks(uninterrupted, 2, tmp_path / "whole", kind="fsdp2")
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    assert_same_runs(expected, run_ranks(managed, 2, tmp_path / "managed", kind="fsdp2", tiers=tiers))
