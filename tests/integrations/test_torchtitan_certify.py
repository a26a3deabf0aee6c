"""``ckptfmt certify`` on real torchtitan runs: a run stopped at a checkpoint and resumed with a fault,
each a real bug of resumes, is named with its first diverging step and cause; clean resumes are identical.

The loop of tests/scripts/torchtitan_manager.py on 2 gloo ranks (FSDP2, torchtitan's optimizer, scheduler,
data loader and clipping, ckptfmt's checkpoint manager saving every 2 steps), 8 steps. torchtitan's trainer
computes its loss where no hook sees it: each step's output is signed by the rank's gradients' norm after
clipping (``grad_norm_local``), and the trainer's settings by ``job_config/hyperparameters``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.certificates import assert_diverged_at, assert_identical, assert_restored_but_not_recomputed
from tests.support.helpers import require_module, torchrun

require_module("torchtitan", "torchtitan is a test dependency (pip install --no-deps torchtitan, see docs)")

from ckptfmt.analytics import certify

pytestmark = pytest.mark.distributed

STEPS = 8
OPTIONS = {"enable": True, "interval": 2, "last_save_model_only": False}


def train(out: Path, repo: Path, stop: int | None = None, ranks: int = 2, **config) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torchrun("torchtitan_manager.py", ranks, str(out), json.dumps({**OPTIONS, "folder": str(repo), **config}),
             str(STEPS), *([str(stop)] if stop is not None else []))


#: case -> (the step it resumes at, the resumed run's options, (first step, cause, evidence) or None).
CASES = {
    "clean at 4": (4, {}, None),
    "clean at 2": (2, {}, None),
    # torchtitan's own option, as a job changing its data mixture uses it: the stream starts again.
    "data loader left out": (4, {"exclude_from_loading": ["dataloader"]}, (5, "data", "step 1 again")),
    "optimizer left out": (4, {"exclude_from_loading": ["optimizer"]}, (6, "load", "optimizer different")),
    "schedule left out": (4, {"exclude_from_loading": ["lr_scheduler"]}, (7, "load", "lr_scheduler different")),
    "clipping norm changed": (4, {"max_norm": 0.01}, (5, "hyperparameters", "training.max_norm: 0.02 vs 0.01")),
    "loss perturbed": (4, {"perturbed": True}, (5, "nondeterminism", "agree")),
    # torchtitan refuses to reshard its data loader: a job on another world size leaves it out.
    "resumed on 1 rank": (4, {"ranks": 1, "exclude_from_loading": ["dataloader"]},
                          (5, "topology", "went from 2 to 1 ranks")),
}
#: Cases left to the exhaustive suite (make test keeps a clean resume and faults found through the
#: resume's record, the recorded settings and the gradients' signature).
EXHAUSTIVE = {"clean at 2", "data loader left out", "schedule left out", "loss perturbed", "resumed on 1 rank"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The reference, and the run stopped at step 4 (a case resumes a copy; at 2, without step-4)."""
    folder = tmp_path_factory.mktemp("torchtitan")
    train(folder / "reference", folder / "reference-repo")
    train(folder / "cut", folder / "cut-repo", stop=4)
    return folder


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.exhaustive) if case in EXHAUSTIVE else case
                                  for case in CASES])
def test_a_torchtitan_resume_is_certified_with_its_first_diverging_step_and_cause(runs, tmp_path, case):
    stop, config, expected = CASES[case]
    repo = tmp_path / "run"
    shutil.copytree(runs / "cut-repo", repo)
    if stop == 2:
        shutil.rmtree(repo / "step-4")
    train(tmp_path / "out", repo, **config)
    certificate = certify(runs / "reference-repo", repo)
    alone = certify(repo)  # each rank's resume, certified alone: none computed a step again
    if expected is None:
        assert_identical(certificate, STEPS)
        for resume in alone:
            assert_restored_but_not_recomputed(resume)
        return
    assert_diverged_at(certificate, *expected)
    # A part left out is on the resume's own record: no reference needed to see it.
    left_out = "exclude_from_loading" in config
    assert {resume.verdict for resume in alone} == ({"diverged"} if left_out else {"undetermined"})


@pytest.mark.exhaustive  # 20 s of ranks
def test_a_loader_that_reports_a_position_it_does_not_hold_is_found_at_the_resume_after(tmp_path):
    """torchdata's StatefulDataLoader resumes a dataset without ``state_dict`` by fast-forwarding it and then
    reports twice the batches it skipped: the first resume goes on right but is on record as leaving the
    data loader different; the second resume, from the position the first one saved, skips batches."""
    reference, repo = tmp_path / "reference-repo", tmp_path / "repo"
    train(tmp_path / "reference", reference, stateless_data=True)
    for stop in (4, 6, None):
        train(tmp_path / f"run-{stop}", repo, stop=stop, stateless_data=True)
    certificate = certify(reference, repo)
    divergence = certificate.first_divergence
    assert (certificate.verdict, divergence["step"], divergence["cause"]) == ("diverged", 7, "data"), \
        certificate.to_json()
    resumes = certify(repo)
    assert [(c.lineage()["resumed_from"], c.lineage()["not_restored"]) for c in resumes if c.resume["rank"] == 0] \
        == [("step-4", ["dataloader different"]), ("step-6", ["dataloader different"])]


def test_a_resume_at_another_world_size_with_the_data_loaders_positions_is_refused_by_name(runs, tmp_path):
    """torchtitan keeps one data loader position per data-parallel rank and cannot reshard them: the load
    says so, names the world sizes and the way out, before anything is loaded."""
    repo = tmp_path / "run"
    shutil.copytree(runs / "cut-repo", repo)
    with pytest.raises(AssertionError, match=r"CheckpointError: .*step-4: the data loader's position cannot be "
                                             r"resumed: its data-parallel world_size was 2, is 1"):
        train(tmp_path / "out", repo, ranks=1)
