"""Resumes into the objects users hold (issue 46, part 1), in one process: modules, optimizers,
schedulers and a GradScaler saved as themselves and loaded back into fresh ones in place, a fresh
optimizer's ``state_dict()`` given its moments, and nothing dropped silently.

Truth is an uninterrupted run: the resumed one must continue bit for bit (every loss and every
parameter), which it cannot if one moment, step count, learning rate or scale came back otherwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


class Job:
    """A small training job: a model, an optimizer, a learning-rate schedule and a GradScaler."""

    def __init__(self, optimizer: str = "adamw", seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.optim = OPTIMIZERS[optimizer](self.model.parameters())
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def objects(self) -> dict:
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "scaler": self.scaler}

    def step(self, step: int) -> str:
        """One training step on the batch of ``step``; its loss as an exact hex float."""
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.optim.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optim)
        self.scaler.update()
        self.sched.step()
        return loss.item().hex()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def uninterrupted(optimizer: str, steps: int) -> tuple[list[str], list[torch.Tensor]]:
    job = Job(optimizer)
    return [job.step(i) for i in range(steps)], job.weights()


def assert_continues(job: Job, optimizer: str, start: int, steps: int = 8) -> None:
    """The resumed ``job`` from step ``start`` gives the uninterrupted run's losses and weights, bit for bit."""
    losses, weights = uninterrupted(optimizer, steps)
    assert [job.step(i) for i in range(start, steps)] == losses[start:]
    assert all(torch.equal(a, b) for a, b in zip(job.weights(), weights))


def saved_at(url: str, optimizer: str, start: int = 4) -> str:
    job = Job(optimizer)
    for i in range(start):
        job.step(i)
    return ckptfmt.save(job.objects(), url, step=start)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_objects_saved_as_themselves_resume_in_place_bit_exactly(tmp_path, optimizer):
    url = saved_at(f"{tmp_path}/run/step-4", optimizer)
    job = Job(optimizer, seed=1)  # other initial weights: everything must come from the checkpoint
    into = job.objects()
    assert ckptfmt.load(url, into=into) is into
    assert into == job.objects()  # the same objects, not dicts put in their place
    assert len(job.optim.state) == 4 and job.sched.last_epoch == 4
    assert_continues(job, optimizer, 4)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_fresh_optimizers_state_dict_gets_the_saved_moments(tmp_path, optimizer):
    url = saved_at(f"{tmp_path}/run/step-4", optimizer)
    job = Job(optimizer, seed=1)
    state = {name: obj.state_dict() for name, obj in job.objects().items()}
    assert state["optim"]["state"] == {}  # before its first step, as every resume starts
    ckptfmt.load(url, into=state)
    assert sorted(state["optim"]["state"]) == [0, 1, 2, 3]
    for name, obj in job.objects().items():
        obj.load_state_dict(state[name])
    assert_continues(job, optimizer, 4)


def test_an_async_save_and_the_manager_take_objects_too(tmp_path):
    job = Job()
    for i in range(4):
        job.step(i)
    ckptfmt.async_save(job.objects(), f"{tmp_path}/run/step-4", step=4).result()
    with CheckpointManager(f"{tmp_path}/managed") as manager:
        manager.save(4, job.objects(), force=True)
    for url in (f"{tmp_path}/run/step-4", f"{tmp_path}/managed"):
        resumed = Job(seed=1)
        ckptfmt.load(url, into=resumed.objects())
        assert_continues(resumed, "adamw", 4)


def test_a_save_leaves_the_callers_state_as_it_was(tmp_path):
    job = Job()
    state = {"objects": [job.model, (job.optim, 3)], "step": 4}
    ckptfmt.save(state, f"{tmp_path}/run/a")
    assert state == {"objects": [job.model, (job.optim, 3)], "step": 4}
    with ckptfmt.open(f"{tmp_path}/run/a") as reader:
        assert "objects/0/0.weight" in reader.keys() and reader.load_state()["objects"][1][1] == 3


def test_a_parameter_without_saved_moments_gets_none_after_the_resume(tmp_path):
    """A parameter that never had a gradient before the save has no state in the checkpoint: the moments
    the fresh optimizer was given to load into are dropped again, as at the save."""
    def make(seed):
        torch.manual_seed(seed)
        used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        return used, unused, torch.optim.AdamW([*used.parameters(), *unused.parameters()], lr=0.1)
    used, unused, optim = make(0)
    used(torch.ones(1, 3)).sum().backward()
    optim.step()
    assert len(optim.state) == 2
    url = ckptfmt.save({"optim": optim}, f"{tmp_path}/run/a")
    used2, unused2, optim2 = make(1)
    ckptfmt.load(url, into={"optim": optim2})
    assert sorted(optim2.state_dict()["state"]) == [0, 1]
    assert optim2.state_dict()["state"][1]["exp_avg"].equal(optim.state_dict()["state"][1]["exp_avg"])


def test_a_mismatch_names_the_entries_and_changes_nothing(tmp_path):
    url = saved_at(f"{tmp_path}/run/step-4", "adamw")
    job = Job(seed=1)
    job.model.append(torch.nn.Linear(2, 2))  # a layer the checkpoint does not have
    before = job.weights()
    with pytest.raises(ckptfmt.StateMismatchError, match=r"2 missing from the checkpoint: model/3\.weight, "
                                                         r"model/3\.bias$"):
        ckptfmt.load(url, into=job.objects())
    assert all(torch.equal(a, b) for a, b in zip(job.weights(), before))
    assert not job.optim.state and job.sched.last_epoch == 0  # the moments given to load into are taken back


def test_a_live_object_the_checkpoint_lacks_is_named(tmp_path):
    url = ckptfmt.save({"model": Job().model}, f"{tmp_path}/run/a")
    job = Job(seed=1)
    with pytest.raises(ckptfmt.StateMismatchError, match="missing from the checkpoint: optim"):
        ckptfmt.load(url, into={"model": job.model, "optim": job.optim})
    assert not job.optim.state


def test_strict_false_loads_what_matches_and_warns_with_the_rest(tmp_path):
    saved = Job()
    url = ckptfmt.save({"model": saved.model, "extra": torch.ones(2)}, f"{tmp_path}/run/a")
    job = Job(seed=1)
    with pytest.warns(ckptfmt.CheckpointWarning, match="not: 1 missing from the checkpoint: optim; 1 not in the "
                                                       "state: extra"):
        ckptfmt.load(url, into={"model": job.model, "optim": job.optim}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(job.weights(), saved.weights()))
    assert not job.optim.state  # nothing was restored into it: left as it was, with no moments


def test_an_object_a_load_cannot_fill_is_refused_not_replaced(tmp_path):
    class Opaque:
        pass

    url = ckptfmt.save({"config": {"lr": 0.1}}, f"{tmp_path}/run/a")
    target = {"config": Opaque()}
    with pytest.raises(ckptfmt.StateMismatchError, match=r"config \(a Opaque in the state, which a load cannot fill"):
        ckptfmt.load(url, into=target)
    assert isinstance(target["config"], Opaque)


def test_an_object_that_refuses_its_state_is_named(tmp_path):
    class Picky:
        def state_dict(self):
            return {"n": 0}

        def load_state_dict(self, state):
            raise ValueError(f"n must be even, not {state['n']}")

    url = ckptfmt.save({"counter": {"n": 3}}, f"{tmp_path}/run/a")
    with pytest.raises(ckptfmt.CheckpointError, match=r"counter \(a Picky\) refused the checkpoint's state: n must "
                                                      "be even, not 3"):
        ckptfmt.load(url, into={"counter": Picky()})


def test_the_manager_restores_objects_from_tiers_bit_exactly(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    job = Job()
    with CheckpointManager(tiers=tiers, housekeeping="thread") as manager:
        for i in range(4):
            job.step(i)
            manager.save(i, job.objects(), force=True)
    resumed = Job(seed=1)
    with CheckpointManager(tiers=tiers, housekeeping="thread") as manager:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manager.restore(into=resumed.objects())
        assert manager.start_step == 4
    assert_continues(resumed, "adamw", 4)


def test_a_restore_that_does_not_match_says_so_without_trying_another_tier(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    with CheckpointManager(tiers=tiers, housekeeping="thread") as manager:
        manager.save(1, {"model": Job().model}, force=True)
    job = Job(seed=1)
    with CheckpointManager(tiers=tiers, housekeeping="thread") as manager, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ckptfmt.StateMismatchError, match="missing from the checkpoint: optim"):
            manager.restore(into={"model": job.model, "optim": job.optim})


def lose_manifest(repo) -> None:
    """The manifest of the repository's one checkpoint deleted: its copy there cannot be read."""
    (manifest,) = repo.glob("step-*/manifest-*.msgpack")
    manifest.unlink()


def test_a_lost_copy_is_read_from_the_next_tier_and_only_a_next_tier_is_announced(tmp_path):
    tiers = [tmp_path / "fast", tmp_path / "slow"]
    with CheckpointManager(tiers=[str(t) for t in tiers], housekeeping="thread") as manager:
        manager.save(4, Job().objects(), force=True)
    lose_manifest(tiers[0])
    resumed = Job(seed=1)
    with CheckpointManager(tiers=[str(t) for t in tiers], housekeeping="thread") as manager, \
            pytest.warns(ckptfmt.CheckpointWarning, match=f"restoring step 4 from {tiers[1]}: "):
        manager.restore(into=resumed.objects())
    assert resumed.sched.last_epoch == 0 and torch.equal(resumed.weights()[0], Job().weights()[0])
    lose_manifest(tiers[1])
    with CheckpointManager(tiers=[str(t) for t in tiers], housekeeping="thread") as manager, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ckptfmt.CheckpointNotFoundError, match="step 4: no tier has a readable copy"):
            manager.restore(into=Job(seed=1).objects())
    announced = [str(w.message) for w in caught if "restoring step" in str(w.message)]
    assert len(announced) == 1 and announced[0].startswith(f"restoring step 4 from {tiers[1]}: ")  # none after it
