"""ckptfmt.analytics.compare and `ckptfmt compare`: two real runs, aligned by step, explained.

The runs: the same seed twice (identical), another seed, a data order that
changes from step 6, another learning rate, and the same training on 2 ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.analytics import compare

from ranks import run_ranks

SAMPLES, BATCH, STEPS, EVERY = 64, 8, 12, 4


def train(repo: str, *, seed: int = 0, lr: float = 0.1, shuffle_from: int | None = None, rank: int = 0,
          world: int = 1) -> None:
    """A linear model on a fixed data set; the data order is a seeded permutation (another one from
    ``shuffle_from`` on); checkpoints every EVERY steps with a StepTimer and the learning rate."""
    torch.manual_seed(seed)
    data = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(123))
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    timer = ckptfmt.StepTimer()
    for step in range(STEPS):
        order_seed = step + (1000 if shuffle_from is not None and step >= shuffle_from else 0)
        indices = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(order_seed))[:BATCH]
        indices = indices.chunk(world)[rank]
        with timer.step(step):
            timer.batch(indices)
            loss = model(data[indices]).square().mean()
            if world > 1:
                loss = loss / world
            optimizer.zero_grad()
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
            optimizer.step()
        timer.metrics(loss=loss.item())
        if step % EVERY == EVERY - 1:
            ckptfmt.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f"{repo}/step-{step:04d}",
                         step=step, metadata={"lr": lr, "batch": BATCH}, timer=timer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for name, options in {"base": {}, "again": {}, "seed": {"seed": 1}, "order": {"shuffle_from": 6},
                          "lr": {"lr": 0.05}}.items():
        made[name] = str(root / name)
        train(made[name], **options)
    return made


def kinds(report: dict) -> set[str]:
    return {d["kind"] for d in report["differences"]}


def test_the_same_seed_twice_is_identical(runs):
    report = compare(runs["base"], runs["again"])
    assert report["identical"] and report["first_divergence"] is None
    assert report["differences"] == []
    assert [c["step"] for c in report["checkpoints"]] == [3, 7, 11]
    assert all(c["tensors_differing"] == 0 and c["values_equal"] for c in report["checkpoints"])


def test_another_seed_diverges_at_once_and_says_so(runs):
    report = compare(runs["base"], runs["seed"])
    assert not report["identical"]
    divergence = report["first_divergence"]
    assert divergence["step"] == 3 and divergence["tensor"] == "model/weight" and divergence["max_abs"] > 0
    seeds = [d for d in report["differences"] if d["kind"] == "seed"]
    assert {d["field"] for d in seeds} >= {"rng.torch_initial_seed", "rng.torch_cpu"}
    assert next(d for d in seeds if d["field"] == "rng.torch_initial_seed")["a"] == 0
    assert kinds(report) == {"seed"}  # the data order was the same: nothing else to blame


def test_a_data_order_change_is_found_at_its_first_step(runs):
    report = compare(runs["base"], runs["order"])
    assert not report["identical"]
    assert report["first_divergence"]["step"] == 7  # the first checkpoint after step 6
    order = [d for d in report["differences"] if d["kind"] == "data_order"]
    assert order == [{"kind": "data_order", "field": "batch", "rank": 0, "a": order[0]["a"], "b": order[0]["b"],
                      "first_step": 6}]
    assert order[0]["a"] != order[0]["b"]
    steps = {c["step"]: c for c in report["checkpoints"]}
    assert steps[3]["tensors_differing"] == 0 and steps[7]["tensors_differing"] > 0


def test_a_changed_hyperparameter_is_listed(runs):
    report = compare(runs["base"], runs["lr"])
    assert not report["identical"] and report["first_divergence"]["step"] == 3
    assert [d for d in report["differences"] if d["kind"] == "hyperparameters"] == [
        {"kind": "hyperparameters", "field": "lr", "a": "0.1", "b": "0.05", "first_step": 3}]
    assert "data_order" not in kinds(report) and "seed" not in kinds(report)


def test_tolerance_makes_small_differences_identical(runs, tmp_path):
    nudged = str(tmp_path / "nudged")
    for name in ckptfmt.Repository.open(runs["base"]).names():
        state = ckptfmt.load(f"{runs['base']}/{name}")
        state["model"]["weight"] += 1e-7
        reader = ckptfmt.open(f"{runs['base']}/{name}")
        ckptfmt.save(state, f"{nudged}/{name}", step=reader.metadata["step"], metadata=reader.metadata["user"])
    strict = compare(runs["base"], nudged)
    assert not strict["identical"] and strict["first_divergence"]["max_abs"] == pytest.approx(1e-7, rel=0.5)
    assert compare(runs["base"], nudged, atol=1e-6)["identical"]


def train_on_ranks(rank: int, world: int, folder: Path, repo: str) -> None:
    train(repo, rank=rank, world=world)


def test_another_world_size_is_a_topology_difference(runs, tmp_path):
    repo = str(tmp_path / "two")
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "ranks", repo=repo):
        outcome.unwrap()
    report = compare(runs["base"], repo)
    topology = {d["field"]: d for d in report["differences"] if d["kind"] == "topology"}
    assert topology["world_size"]["a"] == 1 and topology["world_size"]["b"] == 2
    assert "data_order" in kinds(report)  # each rank took half the batch: the digests differ from step 0
    if report["first_divergence"] is not None:  # summation order may change the last bits
        assert report["first_divergence"]["max_abs"] < 1e-5


def test_the_cli_prints_the_json_of_the_issue(runs):
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "compare", runs["base"], runs["order"], "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is False
    assert set(report["first_divergence"]) >= {"step", "checkpoint", "tensor", "max_abs"}
    assert {"kind", "field", "a", "b", "first_step"} <= set(report["differences"][0])
    text = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "compare", runs["base"], runs["again"]],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "identical" in text.stdout
