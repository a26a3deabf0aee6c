"""``ckptfmt certify`` on real Lightning runs: a run resumed with a fault injected, each a real bug of
resumes, is named with its first diverging step and its cause; clean resumes are identical.

One reference run of 12 steps (a model with dropout, a shuffled loader of 4 batches an epoch, a
scheduler stepped every step), a checkpoint every 2 steps; each case stops a run at a checkpoint and
resumes it to step 12, with or without a fault.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.certificates import assert_diverged_at, assert_identical, assert_restored_but_not_recomputed
from tests.support.helpers import require_module, torchrun

L = require_module("lightning", "Lightning is a test dependency (pip install ckptfmt[lightning])")

from lightning.pytorch.callbacks import ModelCheckpoint

import ckptfmt
from ckptfmt.analytics import certify
from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, StepTimingCallback
from ckptfmt.integrations.sampler import ResumableSampler

STEPS = 12
EPOCH = 4  # batches an epoch


class Noisy(L.LightningModule):
    """An MLP with dropout (every step draws from torch's generator), AdamW, StepLR per step."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.perturb = None  # a fault: noise from a generator no checkpoint holds

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return loss if self.perturb is None else loss + self.perturb()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(8 * EPOCH, 8, generator=generator),
                                          torch.randn(8 * EPOCH, 1, generator=generator))


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=True)  # shuffled by torch's generator


def resumable_loader() -> torch.utils.data.DataLoader:
    data = dataset()
    return torch.utils.data.DataLoader(data, batch_sampler=ResumableSampler(data, 8, seed=3))


def fit(folder: Path, steps: int, *, resume_at: int | None = None, callbacks: tuple = (),
        timing: StepTimingCallback | None = None, make_loader=loader, **trainer_options) -> None:
    L.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(max_steps=steps, plugins=[CkptfmtCheckpointIO()],
                        callbacks=[*callbacks, saving, timing or StepTimingCallback()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        **trainer_options)
    ckpt_path = None if resume_at is None else str(folder / f"epoch={(resume_at - 1) // EPOCH}-step={resume_at}.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on resumable loaders and worker counts
        trainer.fit(Noisy(), make_loader(), ckpt_path=ckpt_path)


class DropOptimizerState(L.Callback):
    """The optimizer's restored moments thrown away (a resume that loads the model only)."""

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].state.clear()


class SkipSchedulerState(L.Callback):
    """The scheduler left as configured (a framework that skips a missing scheduler file)."""

    def on_fit_start(self, trainer, pl_module):  # before Lightning restores the training state
        self.fresh = trainer.lr_scheduler_configs[0].scheduler.state_dict()

    def on_train_start(self, trainer, pl_module):
        trainer.lr_scheduler_configs[0].scheduler.load_state_dict(self.fresh)


class PerturbLoss(L.Callback):
    """Noise on the loss from a generator seeded by the clock, which no checkpoint holds."""

    def on_train_start(self, trainer, pl_module):
        noise = torch.Generator().manual_seed(time.time_ns())
        pl_module.perturb = lambda: 1e-3 * torch.rand((), generator=noise)


#: case -> (where the run stops and resumes, how the resumed run is made, (first step, cause) or None).
CASES = {
    "clean at 4": (4, {}, None),
    "clean at 8": (8, {}, None),
    "rng not restored": (4, {"timing": StepTimingCallback(restore_rng=False)}, (4, "rng")),
    "batches not skipped": (6, {}, (6, "data")),  # mid-epoch: Lightning replays the epoch's batches
    "optimizer dropped": (4, {"callbacks": (DropOptimizerState(),)}, (5, "load")),
    "scheduler dropped": (4, {"callbacks": (SkipSchedulerState(),)}, (7, "load")),
    "clipping changed": (4, {"gradient_clip_val": 0.05}, (5, "hyperparameters")),
    "loss perturbed": (4, {"callbacks": (PerturbLoss(),)}, (4, "nondeterminism")),
}
#: What the cause's evidence names.
NAMED = {"rng": "generator torch", "data": "batch", "load": None, "hyperparameters": "gradient_clip_val",
         "nondeterminism": "agree"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    fit(folder, STEPS)
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_is_certified_with_its_first_diverging_step_and_cause(reference, tmp_path, case):
    stop, resumed, expected = CASES[case]
    fit(tmp_path, stop)
    fit(tmp_path, STEPS, resume_at=stop, **resumed)
    certificate = certify(reference, tmp_path)
    if expected is None:
        assert_identical(certificate, STEPS)
        (alone,) = certify(tmp_path)
        assert_restored_but_not_recomputed(alone)
        assert alone.resumed_from == f"epoch_{(stop - 1) // EPOCH}-step_{stop}"
        return
    step, cause = expected
    part = {"optimizer dropped": "optimizer_states missing", "scheduler dropped": "lr_schedulers different"}
    divergence = assert_diverged_at(certificate, step, cause, part.get(case) or NAMED[cause])
    assert divergence["ranks"] == [0], certificate.to_json()
    if cause == "load" or case == "batches not skipped":  # the resume's own record says so, without the reference
        (alone,) = certify(tmp_path)
        assert alone.verdict == "diverged" and alone.first_divergence["cause"] == "load", alone.to_json()
        if case == "batches not skipped":  # the loader restarted its epoch: 2 batches of 8 were consumed
            assert any("consumed was 16, is 0" in line for line in alone.first_divergence["evidence"])


@pytest.mark.parametrize("stop", [2, 6])
def test_a_resumable_sampler_resumes_mid_epoch_where_the_epoch_stood(tmp_path, stop):
    """With a ResumableSampler, the mid-epoch resume Lightning replays ("batches not skipped" above)
    takes the epoch's next batch: identical to the uninterrupted run, and the position on record."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    fit(reference, STEPS, make_loader=resumable_loader)
    fit(run, stop, make_loader=resumable_loader)
    fit(run, STEPS, resume_at=stop, make_loader=resumable_loader)
    certificate = certify(reference, run)
    assert_identical(certificate, STEPS)
    (alone,) = certify(run)
    assert_restored_but_not_recomputed(alone)
    assert {part["part"]: part["verdict"] for part in alone.resume["parts"]}["data_position"] == "equal"
    saved = ckptfmt.load(f"{run}/epoch_{(stop - 1) // EPOCH}-step_{stop}")["data_position"]
    assert (saved["epoch"], saved["consumed"], saved["resumable"]) == (stop // EPOCH, stop % EPOCH * 8, True)


def steps_seen(prefix: Path, ranks: int) -> dict[int, list[int]]:
    """Step -> the sorted sample indices every rank of a lightning_sampler.py launch took at it."""
    seen: dict[int, list[int]] = {}
    for rank in range(ranks):
        for step, indices in json.loads(Path(f"{prefix}.{rank}.json").read_text()):
            seen.setdefault(step, []).extend(indices)
    return {step: sorted(indices) for step, indices in seen.items()}


@pytest.mark.distributed
@pytest.mark.exhaustive  # 25 s of ranks: make test keeps the helper's proofs on gloo (test_sampler.py)
def test_a_resumable_sampler_resumes_a_2_rank_run_on_1_rank_with_no_sample_repeated_or_skipped(tmp_path):
    """Lightning DDP on 2 gloo ranks stopped mid-epoch, resumed on 1 rank with the same global batch:
    each step takes the samples the uninterrupted 2-rank run took at it, into the next epoch; certify
    names the new world size, and the resume's record has the position restored."""
    torchrun("lightning_sampler.py", 2, str(tmp_path / "reference"), "18", str(tmp_path / "reference"))
    run = tmp_path / "run"
    torchrun("lightning_sampler.py", 2, str(run), "6", str(tmp_path / "before"))
    torchrun("lightning_sampler.py", 1, str(run), "18", str(tmp_path / "after"), str(run / "epoch=0-step=6.ckpt"))
    expected = steps_seen(tmp_path / "reference", 2)
    assert sorted(expected) == list(range(18))
    assert {**steps_seen(tmp_path / "before", 2), **steps_seen(tmp_path / "after", 1)} == expected
    certificate = certify(tmp_path / "reference", run)
    assert (certificate.verdict, certificate.first_divergence["cause"]) == ("diverged", "topology"), \
        certificate.to_json()
    (alone,) = certify(run)
    assert alone.resume["world_size"] == [2, 1]
    assert {part["part"]: part["verdict"] for part in alone.resume["parts"]}["data_position"] == "equal"
