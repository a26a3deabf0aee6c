"""FSDP2 (fully_shard on CPU, gloo): a model and its AdamW state saved on 4 ranks resume on 2 exactly.

Through torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict,
as an FSDP user writes it. Every rank computes the loss on the same full batch,
so the next-step loss (and the loss after one more optimizer step) must be
equal bit for bit whatever the world size, if parameters and optimizer state
came back exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

import ckptfmt
from tests.support.ranks import run_ranks


def build(seed: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.GELU(), torch.nn.Linear(37, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)  # 37 rows over 4 or 2 ranks: uneven shards
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, get_state_dict


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return torch.randn(32, 16, generator=generator), torch.randn(32, 5, generator=generator)


def train_step(model, optimizer) -> float:
    x, y = batch()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def next_losses(model, optimizer) -> list[str]:
    """The loss at the next step, and after one more step, as exact hex floats."""
    with torch.no_grad():
        x, y = batch()
        first = torch.nn.functional.mse_loss(model(x), y).item()
    train_step(model, optimizer)
    with torch.no_grad():
        second = torch.nn.functional.mse_loss(model(x), y).item()
    return [first.hex(), second.hex()]


def train_and_save(rank: int, world: int, folder: Path, url: str) -> list[str]:
    model, optimizer, get_state_dict = build(seed=0)
    for _ in range(3):
        train_step(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    ckptfmt.save({"model": model_state, "optim": optimizer_state, "step": 3}, url, step=3, timeout=60)
    ckptfmt.save({"model": model, "optim": optimizer, "step": 3}, f"{url}-objects", step=3, timeout=60)
    return next_losses(model, optimizer)  # the run going on at 4 ranks


def resume(rank: int, world: int, folder: Path, url: str) -> list[str]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optimizer, get_state_dict = build(seed=1)  # different initial values: all must be overwritten
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = ckptfmt.load(url, into={"model": model_state, "optim": optimizer_state, "step": 0})
    assert state["step"] == 3
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return next_losses(model, optimizer)


def resume_objects(rank: int, world: int, folder: Path, url: str) -> list[str]:
    """The model and a fresh AdamW (no moments yet) loaded in place as the objects themselves."""
    model, optimizer, _ = build(seed=1)
    state = ckptfmt.load(f"{url}-objects", into={"model": model, "optim": optimizer, "step": 0})
    assert state["step"] == 3 and state["optim"] is optimizer
    return next_losses(model, optimizer)


def test_fsdp2_saved_on_4_ranks_resumes_on_2_with_the_same_losses(tmp_path):
    url = str(tmp_path / "repo" / "step-3")
    at_four = [o.unwrap() for o in run_ranks(train_and_save, 4, tmp_path / "save", url=url)]
    assert ckptfmt.verify(url).ok
    with ckptfmt.open(url) as reader:
        weight = reader.tensor_info("model/0.weight")
        assert [s.shape for s in weight.shards] == [(10, 16), (10, 16), (10, 16), (7, 16)]  # FSDP2's uneven shards
        assert "optim/state/0.weight/exp_avg" in reader.keys()
    at_two = [o.unwrap() for o in run_ranks(resume, 2, tmp_path / "resume", url=url)]
    objects_at_two = [o.unwrap() for o in run_ranks(resume_objects, 2, tmp_path / "objects", url=url)]
    assert len({tuple(losses) for losses in at_four + at_two + objects_at_two}) == 1, (at_four, at_two,
                                                                                        objects_at_two)
