"""A data position that survives a new world size (issue 29, part 6): ``ResumableSampler`` on real gloo
ranks. A 4-rank run cut after 3 steps resumes on 2 ranks, and a 2-rank run on 4: together the steps
before and after the cut consume each sample of the epoch exactly once, each step's global batch is the
uninterrupted run's, and the checkpoints' batch digests say so. A resume whose order would not be the
one consumed (another seed, another dataset) is refused with the field named."""

from __future__ import annotations

from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.integrations.sampler import ResumableSampler, check_position, data_position
from ckptfmt.metadata.step_timer import decode_steps
from tests.support.ranks import run_ranks

SAMPLES, GLOBAL_BATCH, CUT = 64, 8, 3


def dataset() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32)[:, None])


def train(rank: int, world: int, folder: Path, repo: str, resume: bool) -> dict[int, list[int]]:
    """Data parallel over the epoch (each rank GLOBAL_BATCH / world samples a step), a collective save
    after step CUT; ``resume``: from it, at this world size, to the epoch's end."""
    data = dataset()
    sampler = ResumableSampler(data, GLOBAL_BATCH // world, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    timer = ckptfmt.StepTimer(system_interval=None)
    step = 0
    if resume:
        state = ckptfmt.load(f"{repo}/cut")
        sampler.load_state_dict(state["sampler"])
        step = state["step"]
    seen = {}
    for (batch,) in loader:
        indices = batch[:, 0].long().tolist()
        with timer.step(step):
            timer.batch(indices)
        seen[step] = indices
        step += 1
        if not resume and step == CUT:
            ckptfmt.save({"sampler": sampler.state_dict(), "step": step}, f"{repo}/cut", step=step, timer=timer)
            return seen
    ckptfmt.save({"sampler": sampler.state_dict(), "step": step}, f"{repo}/end", step=step, timer=timer)
    return seen


def global_batches(outcomes: list) -> dict[int, list[int]]:
    """Each step's global batch: the ranks' slices in rank order."""
    steps = sorted({step for outcome in outcomes for step in outcome})
    return {step: [index for outcome in outcomes for index in outcome[step]] for step in steps}


@pytest.mark.distributed
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_a_resume_on_another_world_size_consumes_each_sample_once(tmp_path, before, after):
    repo = str(tmp_path / "run")
    first = [o.unwrap() for o in run_ranks(train, before, tmp_path / "a", repo=repo, resume=False)]
    second = [o.unwrap() for o in run_ranks(train, after, tmp_path / "b", repo=repo, resume=True)]
    consumed = global_batches(first) | global_batches(second)
    assert sorted(consumed) == list(range(SAMPLES // GLOBAL_BATCH))
    everything = [index for step in sorted(consumed) for index in consumed[step]]
    assert sorted(everything) == list(range(SAMPLES))  # each sample once: none repeated, none skipped
    expected = ResumableSampler(dataset(), GLOBAL_BATCH, num_replicas=1, rank=0, seed=5).order(0)
    assert everything == expected.tolist()  # the uninterrupted order, global batch by global batch
    with ckptfmt.open(f"{repo}/end") as reader:  # the record says the same: each rank's digests of its slices
        entries = reader.metadata["timing"]["ranks"]
    assert len(entries) == after
    for entry in entries:
        columns = decode_steps(entry["steps"], "end")
        for row, step in enumerate(columns.step.tolist()):
            mine = second[entry["rank"]][step]
            assert bytes(columns.batch[row]) == blake3.blake3(np.asarray(mine, "<i8").tobytes()).digest(16)


def test_a_resume_whose_order_is_not_the_one_consumed_is_refused_by_field():
    data = dataset()
    state = ResumableSampler(data, 4, num_replicas=2, rank=0, seed=5).state_dict(batches=2)
    assert state["consumed"] == 16 and state["dataset_length"] == SAMPLES
    with pytest.raises(ckptfmt.CheckpointError, match=r"seed was 5, is 6"):
        ResumableSampler(data, 4, num_replicas=2, rank=0, seed=6).load_state_dict(state)
    shorter = torch.utils.data.TensorDataset(torch.arange(SAMPLES - 8, dtype=torch.float32)[:, None])
    with pytest.raises(ckptfmt.CheckpointError, match=r"dataset_length was 64, is 56"):
        ResumableSampler(shorter, 4, num_replicas=2, rank=0, seed=5).load_state_dict(state)
    changed = torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32)[:, None] * 2)
    with pytest.raises(ckptfmt.CheckpointError, match=r"dataset_fingerprint was"):
        ResumableSampler(changed, 4, num_replicas=2, rank=0, seed=5).load_state_dict(state)
    resumed = ResumableSampler(data, 2, num_replicas=4, rank=3, seed=5)  # another world and batch size: fine
    resumed.load_state_dict(state)
    order = resumed.order(0)
    assert list(resumed)[0] == order[16 + 3 * 2:16 + 4 * 2].tolist() and len(resumed) == (SAMPLES - 16) // 8


def test_a_loaders_data_position_records_its_sampler_and_a_finished_epoch_is_the_next_ones_start():
    """What the integrations record for a loader: a DistributedSampler's contract and the job's samples
    consumed; a ResumableSampler's state; the last batch of an epoch moves the position to the next."""
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, seed=9)
    sampler.set_epoch(3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=0)
    position = data_position(loader, 2, epoch=3)
    assert {key: position[key] for key in ("epoch", "consumed", "seed", "shuffle", "num_replicas", "batch_size",
                                           "resumable")} == {"epoch": 3, "consumed": 16, "seed": 9, "shuffle": True,
                                                             "num_replicas": 2, "batch_size": 4, "resumable": False}
    assert data_position(loader, len(loader), epoch=3)["epoch"] == 4
    assert data_position(loader, len(loader), epoch=3)["consumed"] == 0
    resumable = torch.utils.data.DataLoader(data, batch_sampler=ResumableSampler(data, 4, num_replicas=2, rank=0))
    assert data_position(resumable, 3, epoch=0)["consumed"] == 24
    assert data_position(resumable, SAMPLES // 8, epoch=0)["epoch"] == 1
    assert data_position(iter(range(3)), 1, epoch=0) is None  # no sized dataset: no position


def test_a_resumes_data_position_check_names_what_was_not_restored():
    data = dataset()
    stored = data_position(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True), 3, epoch=1)
    fresh = data_position(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True), 0, epoch=1)
    check = check_position(stored, fresh)  # a framework that restarted the epoch
    assert (check.verdict, check.keys) == ("different", ["consumed was 24, is 0"])
    assert check_position(stored, dict(stored, num_replicas=4, batch_size=2)).verdict == "equal"
    assert check_position(stored, None).verdict == "missing"
    assert check_position(None, fresh).verdict == "not stored"

