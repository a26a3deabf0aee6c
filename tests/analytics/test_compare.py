"""ckptfmt.analytics.compare and `ckptfmt compare`: two real runs, aligned by step, explained.

The runs: the same seed twice (identical), another seed, a data order that
changes from step 6, another learning rate (recorded in the metadata, or only
in the optimizer's state), NumPy drawn from for data augmentation with another
seed, Python's and NumPy's generators left unseeded (as in two processes), a
wall clock stored at each save, and the same training on 2 ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.analytics import compare
from ckptfmt.analytics.compare import Comparison, Difference
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.diff import diff
from tests.support.helpers import cuda_name
from tests.support.ranks import run_ranks
from tests.support.runs import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for name, options in {"base": {}, "again": {}, "seed": {"seed": 1}, "order": {"shuffle_from": 6},
                          "lr": {"lr": 0.05}, "unseeded": {"unseeded": True},
                          "plain": {"lr": 0.01, "metadata": False, "unseeded": True},
                          "plain_lr": {"lr": 0.05, "metadata": False, "unseeded": True},
                          "augment": {"augment": (1, 5), "unseeded": True},
                          "augment_seed": {"augment": (2, 5), "unseeded": True},
                          "clock": {"unseeded": True, "clock": True},
                          "clock_order": {"shuffle_from": 6, "unseeded": True, "clock": True}}.items():
        made[name] = str(root / name)
        train(made[name], **options)
    return made


def kinds(report: Comparison) -> set[str]:
    return {d.kind for d in report.differences}


def causes(report: Comparison) -> list[tuple[str, str]]:
    """(kind, field) of the differences that can explain the divergence, in the report's order."""
    return [(d.kind, d.field) for d in report.differences if d.explains]


def never_used(report: Comparison) -> set[tuple[str, int]]:
    """(field, rank) of the generators reported as differing but never drawn from."""
    return {(d.field, d.rank) for d in report.differences
            if d.kind == "seed" and not d.explains and d.evidence.startswith("differs, never used")}


def test_the_same_seed_twice_is_identical(runs):
    report = compare(runs["base"], runs["again"])
    assert report.identical and report.first_divergence is None
    assert report.differences == []
    assert [c.step for c in report.checkpoints] == [3, 7, 11]
    assert all(c.tensors_differing == 0 and c.values_equal for c in report.checkpoints)


def test_each_manifest_is_read_once(runs, monkeypatch):
    """The pairs, the tensor read at the divergence, the batches and the generators' history share one read."""
    reads: Counter = Counter()
    read = Repository.manifest

    def counted(repo, name, *args, **kwargs):
        reads[repo.url, name] += 1
        return read(repo, name, *args, **kwargs)

    monkeypatch.setattr(Repository, "manifest", counted)
    report = compare(runs["base"], runs["seed"])  # diverges at the first step: every part of compare runs
    assert report.first_divergence is not None and {d.kind for d in report.differences} == {"seed"}
    assert len(reads) == 6 and set(reads.values()) == {1}, reads  # 3 checkpoints in each run


def test_steps_computed_again_after_a_resume_keep_the_branch_the_run_went_on_with(tmp_path):
    """Run a saves at steps 2 and 4, and is resumed from step 2: step 3 is computed again on the other
    batch run b had, and saved. Its digest comes from the later save, not from the abandoned branch's."""
    def save(url: str, step: int, timer) -> None:
        ckptfmt.save({"w": torch.zeros(4)}, url, step=step, timer=timer)

    def steps(url: str, numbers, timer, batch) -> None:
        for step in numbers:
            with timer.step(step):
                timer.batch([batch(step)])
            if step % 2 == 0 or step == 3:
                save(f"{url}/s{step}", step, timer)

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    steps(b, [1, 2, 3, 4], ckptfmt.StepTimer(), lambda step: step)
    first = ckptfmt.StepTimer()
    steps(a, [1, 2], first, lambda step: step)
    with first.step(3):
        first.batch([1003])  # the branch that is given up: not saved at step 3
    with first.step(4):
        first.batch([4])
    save(f"{a}/s4", 4, first)
    steps(a, [3], ckptfmt.StepTimer(), lambda step: step)  # resumed from s2
    report = compare(a, b)
    assert [c.step for c in report.checkpoints] == [2, 3, 4]
    assert report.identical and report.differences == []


def test_another_seed_diverges_at_once_and_says_so(runs):
    report = compare(runs["base"], runs["seed"])
    assert not report.identical
    divergence = report.first_divergence
    assert divergence.step == 3 and divergence.tensor == "model/weight" and divergence.max_abs > 0
    seeds = [d for d in report.differences if d.kind == "seed" and not cuda_name(d.field)]
    assert {d.field for d in seeds} >= {"rng.torch_initial_seed", "rng.torch_cpu"}
    assert next(d for d in seeds if d.field == "rng.torch_initial_seed").a == 0
    assert kinds(report) == {"seed"}  # the data order was the same: nothing else to blame
    # torch's generator was drawn from only to initialise the model, before the first checkpoint: its state
    # is the same at every checkpoint, yet not the one manual_seed left, so it is in use
    assert all(d.explains and d.evidence == "in use: drawn from before step 3 in run a" for d in seeds)


def test_a_data_order_change_is_found_at_its_first_step(runs):
    report = compare(runs["base"], runs["order"])
    assert not report.identical
    assert report.first_divergence.step == 7  # the first checkpoint after step 6
    order = [d for d in report.differences if d.kind == "data_order"]
    assert order == [Difference("data_order", "batch", order[0].a, order[0].b, 6, True,
                                "batches differ from step 6, before the divergence at step 7", rank=0)]
    assert order[0].a != order[0].b and report.differences == order  # nothing else differs
    steps = {c.step: c for c in report.checkpoints}
    assert steps[3].tensors_differing == 0 and steps[7].tensors_differing > 0


def test_a_changed_hyperparameter_is_listed(runs):
    report = compare(runs["base"], runs["lr"])
    assert not report.identical and report.first_divergence.step == 3
    where = {"first_step": 3, "explains": True, "evidence": "differs from step 3, where the states diverge"}
    assert report.differences == [
        Difference("hyperparameters", "optim/param_groups/0/lr", 0.1, 0.05, **where),
        Difference("hyperparameters", "user.lr", 0.1, 0.05, **where)]


def test_a_learning_rate_saved_only_in_the_optimizer_comes_first_and_unused_generators_apart(runs):
    """The runs of the issue: seeded with torch.manual_seed only, lr 0.01 and 0.05, no metadata=, Python's
    and NumPy's generators as two processes start them."""
    report = compare(runs["plain"], runs["plain_lr"])
    assert report.first_divergence.step == 3
    assert report.differences[0].to_json() == {
        "kind": "hyperparameters", "field": "optim/param_groups/0/lr", "a": 0.01, "b": 0.05, "first_step": 3,
        "explains": True, "evidence": "differs from step 3, where the states diverge"}
    assert causes(report) == [("hyperparameters", "optim/param_groups/0/lr")]
    assert {(field, rank) for field, rank in never_used(report) if not cuda_name(field)} == {
        ("rng.numpy", 0), ("rng.python", 0)}
    assert len(report.differences) == 3


def test_diff_shows_the_learning_rate_saved_only_in_the_optimizer(runs):
    a, b = f"{runs['plain']}/step-0003", f"{runs['plain_lr']}/step-0003"
    assert diff(a, b).values == [("optim/param_groups/0/lr", 0.01, 0.05)]
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "diff", a, b, "--json"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr  # the states differ
    assert json.loads(result.stdout)["values"] == [{"key": "optim/param_groups/0/lr", "a": 0.01, "b": 0.05}]


def test_a_generator_drawn_from_with_another_seed_is_a_cause(runs):
    """NumPy, seeded 1 and 2, adds noise to the batches from step 5: its state advances between the
    checkpoints at steps 3 and 7, where the runs diverge. Python's generator, unseeded, is never drawn from."""
    report = compare(runs["augment"], runs["augment_seed"])
    assert report.first_divergence.step == 7
    first = report.differences[0]
    assert (first.kind, first.field, first.rank, first.explains) == ("seed", "rng.numpy", 0, True)
    assert first.evidence == "in use: advanced between steps 3 and 7 in run a"
    assert causes(report) == [("seed", "rng.numpy")]
    assert never_used(report) == {("rng.python", 0)}


def test_a_data_order_change_comes_before_what_cannot_explain_the_divergence(runs):
    """Both runs store the wall-clock time at each save (in the state and the metadata) and leave Python's
    and NumPy's generators unseeded; only the data order from step 6 explains the divergence at step 7."""
    report = compare(runs["clock"], runs["clock_order"])
    assert report.first_divergence.step == 7
    assert causes(report) == [("data_order", "batch")] and report.differences[0].kind == "data_order"
    rest = {(d.kind, d.field): d for d in report.differences[1:]}
    assert set(rest) == {("values", "saved_at"), ("values", "user.saved_at"), ("seed", "rng.numpy"),
                         ("seed", "rng.python")}
    for field in ("saved_at", "user.saved_at"):
        assert rest["values", field].first_step == 3 and rest["values", field].evidence == (
            "changes between steps 3 and 7 of run a: it records the run (a counter, clock or metric), "
            "it does not set it")
    assert {(field, rank) for field, rank in never_used(report) if not cuda_name(field)} == {
        ("rng.numpy", 0), ("rng.python", 0)}


def test_a_difference_that_appears_after_the_divergence_cannot_explain_it(runs, tmp_path):
    late = str(tmp_path / "late")
    train(late, lr=0.05, shuffle_from=9, unseeded=True)
    report = compare(runs["unseeded"], late)
    assert report.first_divergence.step == 3
    order = next(d for d in report.differences if d.kind == "data_order")
    assert not order.explains and order.first_step == 9
    assert order.evidence == "batches differ from step 9, after the divergence at step 3: it cannot explain it"
    assert causes(report) == [("hyperparameters", "optim/param_groups/0/lr"), ("hyperparameters", "user.lr")]


def train_scheduled(repo: str, *, gamma: float, tag: str) -> None:
    """An optimizer whose learning rate a StepLR lowers every 2 steps, its state under a key that does not
    say 'scheduler', and a plain value of the user's, saved at steps 2 and 5."""
    torch.manual_seed(0)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=gamma)
    for step in range(6):
        loss = model(data).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 3 == 2:
            ckptfmt.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                          "lr_policy": schedule.state_dict(), "tag": tag}, f"{repo}/step-{step}", step=step)


def test_scheduler_and_optimizer_settings_are_hyperparameters_before_other_values(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train_scheduled(a, gamma=0.5, tag="first try")
    train_scheduled(b, gamma=0.9, tag="second try")
    report = compare(a, b)
    assert report.first_divergence.step == 2  # steps 0 and 1 ran at the same learning rate
    fields = [(d.kind, d.field) for d in report.differences]
    assert fields == [("hyperparameters", "optim/param_groups/0/lr"), ("hyperparameters", "lr_policy/gamma"),
                      ("hyperparameters", "lr_policy/_last_lr"), ("values", "tag")]
    assert all(d.explains and d.first_step == 2 for d in report.differences)
    assert report.differences[-1].a == "first try"


def test_tolerance_makes_small_differences_identical(runs, tmp_path):
    nudged = str(tmp_path / "nudged")
    for name in ckptfmt.Repository.open(runs["base"]).names():
        state = ckptfmt.load(f"{runs['base']}/{name}")
        state["model"]["weight"] += 1e-7
        reader = ckptfmt.open(f"{runs['base']}/{name}")
        ckptfmt.save(state, f"{nudged}/{name}", step=reader.metadata["step"], metadata=reader.metadata["user"])
    strict = compare(runs["base"], nudged)
    assert not strict.identical and strict.first_divergence.max_abs == pytest.approx(1e-7, rel=0.5)
    assert compare(runs["base"], nudged, atol=1e-6).identical


def train_on_ranks(rank: int, world: int, folder: Path, repo: str) -> None:
    train(repo, rank=rank, world=world)


@pytest.mark.distributed
def test_another_world_size_is_a_topology_difference(runs, tmp_path):
    repo = str(tmp_path / "two")
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "ranks", repo=repo):
        outcome.unwrap()
    report = compare(runs["unseeded"], repo)
    topology = {d.field: d for d in report.differences if d.kind == "topology"}
    assert topology["world_size"].a == 1 and topology["world_size"].b == 2
    # rank 0 of run b is a new process: its unseeded Python and NumPy generators differ, never drawn from
    assert {(field, rank) for field, rank in never_used(report) if not cuda_name(field)} == {
        ("rng.numpy", 0), ("rng.python", 0)}
    assert "data_order" in kinds(report)  # each rank took half the batch: the digests differ from step 0
    if report.first_divergence is not None:  # summation order may change the last bits
        assert report.first_divergence.max_abs < 1e-5


@pytest.mark.slow
def test_the_cli_prints_the_json_of_the_issue(runs):
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "compare", runs["base"], runs["order"], "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr  # the runs differ
    report = json.loads(result.stdout)
    assert report["identical"] is False
    assert set(report["first_divergence"]) >= {"step", "checkpoint", "tensor", "max_abs"}
    assert {"kind", "field", "a", "b", "first_step", "explains", "evidence"} <= set(report["differences"][0])
    text = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "compare", runs["base"], runs["again"]],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "identical" in text.stdout
