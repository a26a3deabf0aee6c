"""ckptfmt certify: does a run reproduce another bit for bit, and if not, from which step and why.

A small loop with everything a resume can get wrong (dropout's generator, a shuffled order drawn from
its own generator and a position in it, AdamW's moments, a step scheduler) is run straight through,
and cut at step 4 and resumed in a fresh set of objects: cleanly, or with one real resume bug each.
Every fault must be named with its first step and cause; no clean resume may be called diverged."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.analytics import certify
from ckptfmt.cli import main
from ckptfmt.metadata import resumes
from tests.support.certificates import assert_diverged_at

STEPS, CUT, BATCH, SAMPLES = 10, 4, 8, 48


@pytest.fixture(autouse=True)
def no_pending():
    resumes._PENDING.clear()
    yield
    resumes._PENDING.clear()


def train(repo: str, *, stop: int | None = None, resume: bool = False, fault: str | None = None,
          timer_on: bool = True, max_norm: float | None = None, hparams: bool = False,
          progress_interval: float = 10.0) -> None:
    """Train to STEPS (or ``stop``), saving every 2 steps; ``resume``: from the newest checkpoint, as a new
    process would, with ``fault`` (a resume bug) applied. ``max_norm``: gradients clipped to that norm,
    recorded in each save's metadata beside a counter of the samples seen, as a plain loop records its
    settings (``hparams``: under the metadata's ``hparams`` map)."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
    data = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(SAMPLES, 1, generator=torch.Generator().manual_seed(2))
    order = torch.Generator().manual_seed(3)
    position, permutation = 0, torch.randperm(SAMPLES, generator=order)
    timer = ckptfmt.StepTimer(system_interval=None, generators={"order": order},
                              progress_interval=progress_interval) if timer_on else None
    start = 0
    if resume:
        newest = ckptfmt.Repository.open(repo).commits()[-1]
        url = f"{repo}/{newest.name}"
        state = ckptfmt.load(url)
        model.load_state_dict(state["model"])
        if fault != "optimizer dropped":
            optimizer.load_state_dict(state["optimizer"])
        if fault != "scheduler dropped":
            scheduler.load_state_dict(state["scheduler"])
        if fault != "batches not skipped":
            position, permutation = state["position"], state["permutation"]
            order.set_state(state["order"])
        if fault != "rng dropped":
            ckptfmt.restore_rng(url)
        start = state["step"]
        parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if fault == "lr changed, position misreported":  # a loader reporting a position it does not hold
            parts["position"] = position + BATCH
        ckptfmt.record_resume(url, parts, loaders=["position"])
        if fault and fault.startswith("lr changed"):  # on purpose, after a clean resume: a setting, not a load
            for group in optimizer.param_groups:
                group["lr"] = 0.02
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")) if fault == "noise" else None
    for step in range(start, STEPS):
        indices = permutation[position:position + BATCH]
        position += BATCH
        if position >= SAMPLES:
            position, permutation = 0, torch.randperm(SAMPLES, generator=order)
        with timer.step(step) if timer is not None else _nothing():
            if timer is not None:
                timer.batch(indices)
            loss = (model(data[indices]) - target[indices]).square().mean()
            if noise is not None:  # a perturbation from no generator a checkpoint holds
                loss = loss + 1e-3 * torch.rand((), generator=noise)
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        if timer is not None:
            timer.metrics(loss=loss.detach())
        if (step + 1) % 2 == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "position": position, "permutation": permutation,
                     "order": order.get_state(), "step": step + 1}
            settings = {"max_norm": max_norm} if max_norm is not None else {}
            metadata = ({"hparams": settings} if hparams else settings) | (
                {"samples_seen": (step + 1) * BATCH} if settings else {})
            ckptfmt.save(state, f"{repo}/step-{step + 1:03d}", step=step + 1, timer=timer, metadata=metadata or None)
        if stop is not None and step + 1 == stop:
            return


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    repo = str(tmp_path_factory.mktemp("reference") / "run")
    train(repo)
    resumes._PENDING.clear()
    return repo


def resumed(tmp_path, fault: str | None, cut: int = CUT) -> str:
    repo = str(tmp_path / "run")
    train(repo, stop=cut)
    train(repo, resume=True, fault=fault)
    return repo


@pytest.mark.parametrize(("fault", "step", "cause"), [
    ("rng dropped", CUT, "rng"),  # dropout's mask differs at once
    ("batches not skipped", CUT, "data"),
    ("optimizer dropped", CUT + 1, "load"),  # the first step after it still starts from equal weights
    ("scheduler dropped", CUT + 3, "load"),  # the rate it kept holds until the reference's decays, at 6
    ("lr changed", CUT + 1, "hyperparameters"),
    # a data loader's position on record as different while the batches agree changed no step: the setting did
    ("lr changed, position misreported", CUT + 1, "hyperparameters"),
    ("noise", CUT, "nondeterminism"),
])
def test_each_resume_fault_is_named_with_its_first_step_and_cause(reference, tmp_path, fault, step, cause):
    result = certify(reference, resumed(tmp_path, fault))
    assert result.verdict == "diverged", result
    assert (result.first_divergence["step"], result.first_divergence["cause"]) == (step, cause), result.causes
    assert result.first_divergence["ranks"] == [0] and result.first_divergence["evidence"]
    assert result.steps_compared == step + 1 - 0  # steps 0 .. step, each compared


@pytest.mark.parametrize("hparams", [False, True])
def test_a_setting_changed_at_a_resume_is_named_not_taken_for_a_counter(tmp_path, hparams):
    """A plain loop records its gradient clipping in the metadata, beside a counter; resumed with another
    max_norm, the divergence is the setting's (it changes only where the run resumed), not noise, and the
    counter, which changes between every save of one process, explains nothing."""
    reference, run = str(tmp_path / "reference"), str(tmp_path / "run")
    train(reference, max_norm=0.5, hparams=hparams)
    train(run, stop=CUT, max_norm=0.5, hparams=hparams)
    train(run, resume=True, max_norm=0.05, hparams=hparams)
    field = "user.hparams.max_norm" if hparams else "user.max_norm"
    assert_diverged_at(certify(reference, run), CUT + 1, "hyperparameters", f"{field}: 0.5 vs 0.05 (from step 6)")
    differences = {d.field: d for d in ckptfmt.analytics.compare(reference, run).differences}
    assert (differences[field].kind, differences[field].explains) == ("hyperparameters", True)
    assert "user.samples_seen" not in differences  # a counter: the same along both runs


def test_a_clean_resume_reproduces_bit_for_bit_and_certifies_alone(reference, tmp_path, capsys):
    run = resumed(tmp_path, None)
    result = certify(reference, run)
    assert (result.verdict, result.steps_compared, result.first_divergence) == ("identical", STEPS, None)
    assert main(["certify", reference, run]) == 0
    assert "verdict: identical over 10 common steps" in capsys.readouterr().out


def test_a_resume_certified_alone_with_no_step_computed_again_cannot_tell(reference, tmp_path, capsys):
    """Issue 46: such a certificate said "identical over 0 common steps" and exited 0."""
    run = resumed(tmp_path, None)  # stopped right after its save at step 4: nothing computed twice
    (alone,) = certify(run)
    assert (alone.verdict, alone.steps_compared, alone.first_divergence) == ("undetermined", 0, None)
    assert "no step was computed again" in alone.missing and "entries equal" in alone.missing
    assert main(["certify", run]) == 2
    assert "cannot tell: no step was computed again" in capsys.readouterr().out


def test_the_steps_a_killed_process_computed_are_compared_with_their_second_computation(tmp_path, capsys):
    """The steps computed after the last save by a process that then died are in its progress object
    (spec 4.6): the resumed process computes them again, and certifying the resume compares the two."""
    run = str(tmp_path / "run")
    train(run, stop=CUT + 1, progress_interval=0.0)  # step 4 computed, never saved: the process "dies"
    train(run, resume=True, progress_interval=0.0)  # from step-004: step 4 again
    (alone,) = certify(run)
    assert (alone.verdict, alone.steps_compared) == ("identical", 1), alone.to_json()
    (faulty,) = certify(resumed_after_a_loss(tmp_path / "faulty"))
    assert (faulty.verdict, faulty.first_divergence["step"], faulty.first_divergence["cause"]) == (
        "diverged", CUT, "rng"), faulty.to_json()


def resumed_after_a_loss(folder) -> str:
    run = str(folder / "run")
    train(run, stop=CUT + 1, progress_interval=0.0)
    train(run, resume=True, fault="rng dropped", progress_interval=0.0)
    return run


@pytest.mark.parametrize("cut", [2, 6, 8])
def test_clean_resumes_at_other_steps_reproduce(reference, tmp_path, cut):
    """A clean resume at any checkpoint (before, inside and after the scheduler's first decay, and
    at a new pass over the data) is identical: never called diverged."""
    result = certify(reference, resumed(tmp_path, None, cut))
    assert (result.verdict, result.steps_compared) == ("identical", STEPS), result.to_json()


def test_a_resume_certified_alone_names_the_part_it_did_not_restore(tmp_path, capsys):
    run = resumed(tmp_path, "optimizer dropped")
    (alone,) = certify(run)
    assert (alone.verdict, alone.first_divergence["cause"], alone.first_divergence["step"]) == (
        "diverged", "load", CUT + 1)
    assert "optimizer missing (12 of" in alone.first_divergence["evidence"][0]
    assert main(["certify", run]) == 1
    out = capsys.readouterr().out
    assert "cause load" in out and "    optimizer/state/0/exp_avg" in out
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_the_cli_exit_codes_and_json(reference, tmp_path, capsys):
    run = resumed(tmp_path, "batches not skipped")
    assert main(["certify", reference, run, "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert set(document) >= {"verdict", "steps_compared", "first_divergence", "causes"}
    assert document["verdict"] == "diverged" and document["first_divergence"]["cause"] == "data"
    assert [c["cause"] for c in document["causes"]] == ["data"]  # its order's generator is as the reference's
    assert main(["certify", reference, run]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 4, ranks 0, cause data" in out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    untimed = str(tmp_path / "untimed")
    train(untimed, timer_on=False)
    assert main(["certify", reference, untimed]) == 2
    assert "cannot tell: " in capsys.readouterr().out


def test_the_report_shows_the_certificate_and_the_runs_lineage(reference, tmp_path):
    from ckptfmt.analytics.report import report

    faulty = resumed(tmp_path / "faulty", "optimizer dropped")
    made = report(faulty, html_path=tmp_path / "faulty.html", compare_with=reference)
    page = (tmp_path / "faulty.html").read_text()
    assert made.certificate.verdict == "diverged" and [c.verdict for c in made.resumes] == ["diverged"]
    assert "Certified against it: diverges at step 5 (load), after 6 steps compared." in page
    assert "<p id='resumes-verdict'>A resume diverged.</p>" in page
    row = re.search(r"<table id='resumes'>.*?<tbody><tr>(.*?)</tr>", page, flags=re.S).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[:4] == ["0", "step-004", "4", "1"] and float(cells[4]) >= 0
    assert cells[5] == "optimizer missing" and cells[6] == "diverges at step 5 (load)"
    clean = resumed(tmp_path / "clean", None)
    report(clean, html_path=tmp_path / "clean.html", compare_with=reference)
    page = (tmp_path / "clean.html").read_text()
    assert f"Certified against it: reproduces it bit for bit over {STEPS} steps." in page
    assert "Every resume restored what its checkpoint held." in page


def train_on_ranks(rank: int, world: int, folder, repo: str, stop: int | None = None, resume: bool = False) -> None:
    """Data parallel on gloo ranks: each rank its share of a batch of 8, gradients averaged, a
    collective save every 2 steps; ``resume``: from the newest checkpoint, at this world size."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    timer = ckptfmt.StepTimer(system_interval=None)
    start = 0
    if resume:
        url = f"{repo}/{ckptfmt.Repository.open(repo).commits()[-1].name}"
        state = ckptfmt.load(url)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        ckptfmt.record_resume(url, {"model": model, "optimizer": optimizer})
    for step in range(start, STEPS):
        with timer.step(step):
            mine = (torch.arange(step * 8, step * 8 + 8) % 64).chunk(world)[rank]
            timer.batch(mine)
            loss = model(data[mine]).square().mean()
            loss.backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
            optimizer.step()
            optimizer.zero_grad()
        timer.metrics(loss=loss.detach())
        if (step + 1) % 2 == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            ckptfmt.save(state, f"{repo}/step-{step + 1:03d}", step=step + 1, timer=timer)
        if stop is not None and step + 1 == stop:
            return


@pytest.mark.distributed
def test_a_resume_on_another_world_size_is_named_a_topology_change(tmp_path):
    from tests.support.ranks import run_ranks

    reference, run = str(tmp_path / "reference"), str(tmp_path / "run")
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "a", repo=reference):
        outcome.unwrap()
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "b", repo=run, stop=CUT):
        outcome.unwrap()
    for outcome in run_ranks(train_on_ranks, 1, tmp_path / "c", repo=run, resume=True):
        outcome.unwrap()
    result = certify(reference, run)
    assert result.verdict == "diverged" and result.steps_compared == CUT + 1
    first = result.first_divergence
    assert (first["step"], first["ranks"], first["cause"]) == (CUT, [0], "topology"), result.to_json()
    assert first["evidence"][0] == f"rank 0: the resume from step-{CUT:03d} went from 2 to 1 ranks"
    assert [c.cause for c in result.causes][:2] == ["topology", "data"]  # rank 0 now takes the whole batch
    same = str(tmp_path / "same")  # the same cut resumed on 2 ranks: identical
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "d", repo=same, stop=CUT):
        outcome.unwrap()
    for outcome in run_ranks(train_on_ranks, 2, tmp_path / "e", repo=same, resume=True):
        outcome.unwrap()
    assert certify(reference, same).verdict == "identical"
