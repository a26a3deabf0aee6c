"""``ckptfmt certify`` on real Lightning runs: a run resumed with a fault injected, each a real bug of
resumes, is named with its first diverging step and its cause; clean resumes are identical.

One reference run of 12 steps (a model with dropout, a shuffled loader of 4 batches an epoch, a
scheduler stepped every step), a checkpoint every 2 steps; each case stops a run at a checkpoint and
resumes it to step 12, with or without a fault.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.helpers import require_module

L = require_module("lightning", "Lightning is a test dependency (pip install ckptfmt[lightning])")

from lightning.pytorch.callbacks import ModelCheckpoint

from ckptfmt.analytics import certify
from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, StepTimingCallback

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


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8 * EPOCH, 8, generator=generator),
                                          torch.randn(8 * EPOCH, 1, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # shuffled by torch's generator


def fit(folder: Path, steps: int, *, resume_at: int | None = None, callbacks: tuple = (),
        timing: StepTimingCallback | None = None, **trainer_options) -> None:
    L.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(max_steps=steps, plugins=[CkptfmtCheckpointIO()],
                        callbacks=[*callbacks, saving, timing or StepTimingCallback()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        **trainer_options)
    ckpt_path = None if resume_at is None else str(folder / f"epoch={(resume_at - 1) // EPOCH}-step={resume_at}.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on resumable loaders and worker counts
        trainer.fit(Noisy(), loader(), ckpt_path=ckpt_path)


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
        assert certificate.verdict == "identical" and certificate.steps_compared == STEPS, certificate.to_json()
        (alone,) = certify(tmp_path)
        assert alone.verdict == "identical" and alone.resumed_from == f"epoch_{(stop - 1) // EPOCH}-step_{stop}"
        return
    step, cause = expected
    assert certificate.verdict == "diverged", certificate.to_json()
    divergence = certificate.first_divergence
    assert (divergence["step"], divergence["cause"], divergence["ranks"]) == (step, cause, [0]), certificate.to_json()
    part = {"optimizer dropped": "optimizer_states missing", "scheduler dropped": "lr_schedulers different"}
    named = part.get(case) or NAMED[cause]
    assert any(named in line for line in divergence["evidence"]), divergence["evidence"]
    if cause == "load":  # the resume's own record says so, without the reference
        (alone,) = certify(tmp_path)
        assert alone.verdict == "diverged" and alone.first_divergence["cause"] == "load"
