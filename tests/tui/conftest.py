"""The TUI tests' repositories, built with fixed seeds in tmp_path. Those of snapshots lie at a relative path
(the app shows targets as given) and are saved with a frozen clock (commit times show on screen)."""

from __future__ import annotations

import time

import pytest
import torch

import ckptfmt
from ckptfmt.metadata import step_timer, timing
from tests.tui.states import gpt2_state, gpt2_trained, model_state

FROZEN_NS = 1_767_225_600_000_000_000  # 2026-01-01 00:00:00 UTC


@pytest.fixture
def repo(tmp_path) -> str:
    """A repository with two checkpoints: step-1, then step-2 where the q projections moved."""
    url = str(tmp_path / "runs" / "exp")
    ckptfmt.save(model_state(1), f"{url}/step-1", step=1, metadata={"lr": 0.1, "note": "first"})
    state = model_state(1)
    state["model"]["layers.0.attn.q_proj.weight"] += 1.0
    state["model"]["layers.1.attn.q_proj.weight"][0, 0] += 0.01
    state["model"]["new.weight"] = torch.ones(2)
    ckptfmt.save(state, f"{url}/step-2", step=2, metadata={"lr": 0.05, "note": "second"})
    return url


@pytest.fixture
def fixed_repo(tmp_path, monkeypatch) -> str:
    """The ``repo`` fixture's content at the relative path runs/exp, committed at FROZEN_NS."""
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as frozen:
        frozen.setattr(time, "time_ns", lambda: FROZEN_NS)
        ckptfmt.save(model_state(1), "runs/exp/step-1", step=1, metadata={"note": "first"})
        state = model_state(1)
        state["model"]["layers.0.attn.q_proj.weight"] += 1.0
        state["model"]["new.weight"] = torch.ones(2)
        ckptfmt.save(state, "runs/exp/step-2", step=2, metadata={"note": "second"})
    return "runs/exp"


@pytest.fixture
def gpt2_repo(tmp_path, monkeypatch) -> str:
    """A GPT-2's keys (``tests.tui.states.gpt2_state``) at the relative path runs/gpt2, committed at FROZEN_NS:
    step-100, then step-200 where layer 11 moved and the learning rate fell from 3e-4 to 1e-4."""
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as frozen:
        frozen.setattr(time, "time_ns", lambda: FROZEN_NS)
        ckptfmt.save(gpt2_state(), "runs/gpt2/step-100", step=100)
        ckptfmt.save(gpt2_trained(gpt2_state()), "runs/gpt2/step-200", step=200)
    return "runs/gpt2"


class SteadyClock:
    """Stands in for the ``time`` module where steps and saves are timed: each reading comes 1 ms after the
    last, plus what the test ``advance``s, so a run's timings are the same on every machine."""

    def __init__(self) -> None:
        self.ns = FROZEN_NS

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)

    def perf_counter_ns(self) -> int:
        self.ns += 1_000_000
        return self.ns

    def time_ns(self) -> int:
        return self.perf_counter_ns()

    def perf_counter(self) -> float:
        return self.perf_counter_ns() / 1e9


@pytest.fixture
def steady_run(tmp_path, monkeypatch) -> str:
    """A training run at the relative path runs/steady, timed on a SteadyClock and committed at FROZEN_NS:
    150 steps of a linear model whose data phase takes 20 ms more in steps 60 to 89, and a checkpoint every
    50 steps (step-000049, step-000099, step-000149) with the steps' loss."""
    monkeypatch.chdir(tmp_path)
    clock = SteadyClock()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as frozen:
        frozen.setattr(time, "time_ns", lambda: FROZEN_NS)
        for module in (step_timer, timing):
            frozen.setattr(module, "time", clock)
        timer = ckptfmt.StepTimer(system_interval=None)
        for step in range(150):
            with timer.step(step):
                with timer.phase("data"):
                    clock.advance(0.02 if 60 <= step < 90 else 0.0)
                    batch = data[step % 8 * 8:][:8]
                loss = model(batch).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            timer.metrics(loss=loss.item())
            if step % 50 == 49:
                ckptfmt.save({"model": model.state_dict()}, f"runs/steady/step-{step:06d}", step=step, timer=timer)
    return "runs/steady"
