"""Training health (``ckptfmt health``, ``analytics.health``) on a real run that falls ill on purpose
(tests/support/runs.py ``sick_run``): every injected fault is found where it was injected, nothing else is
reported as a jump, and a healthy run is reported healthy."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ckptfmt
from ckptfmt.analytics import health
from ckptfmt.analytics.health import group_of
from ckptfmt.cli import main
from tests.support.runs import SICK_LOSS_SPIKE, SICK_NAN, SICK_SCALED, sick_run, train


@pytest.fixture(scope="module")
def sick(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sick") / "run")
    sick_run(repo)
    return repo


def test_the_first_nan_is_found_in_the_checkpoint_that_holds_it(sick):
    found = health(sick)
    assert found.first_non_finite == {"checkpoint": f"step-{SICK_NAN:04d}", "step": SICK_NAN,
                                      "tensors": [{"key": "model/0.bias", "nan": 1, "posinf": 0, "neginf": 0}]}
    assert [entry["checkpoint"] for entry in found.non_finite] == ["step-0055", "step-0060"]
    assert not found.healthy


def test_a_layer_scaled_by_four_is_a_jump_and_steady_layers_are_not(sick):
    found = health(sick)
    model_jumps = [(j["group"], j["step"]) for j in found.jumps if j["group"].startswith("model")]
    # The scaled layer at its checkpoint; after the NaN (step 60) anything may move.
    assert ("model.2", SICK_SCALED) in model_jumps
    assert [jump for jump in model_jumps if jump[1] < SICK_NAN] == [("model.2", SICK_SCALED)]
    scaled = next(j for j in found.jumps if j["group"] == "model.2")
    assert 3.5 < scaled["factor"] < 4.5
    assert not [j for j in found.jumps if j["group"] in ("frozen", "table")]  # unchanged norms never jump
    assert set(found.group_norms) >= {"model.0", "model.2", "optim exp_avg", "optim exp_avg_sq", "frozen"}


def test_loss_spikes_are_placed_between_their_checkpoints(sick):
    spikes = health(sick).metric_spikes
    first = spikes[0]
    assert (first["metric"], first["first_step"], first["after"], first["before"]) == (
        "loss", SICK_LOSS_SPIKE, "step-0035", "step-0040")
    assert first["peak"] > 10 * first["baseline"]
    diverged = spikes[-1]
    assert diverged["non_finite"] and diverged["first_step"] == SICK_NAN + 1 and diverged["last_step"] == 60
    assert diverged["after"] == "step-0055"


def test_unchanged_and_mostly_zero_tensors(sick):
    found = health(sick)
    unchanged = {u["key"]: u["evidence"] for u in found.unchanged}
    assert unchanged == {"frozen/weight": "statistics", "frozen/bias": "statistics", "mask": "statistics",
                         "table": "chunks"}
    assert [(z["key"], z["share"]) for z in found.mostly_zeros] == [("mask", 1.0)]


def test_deep_measures_how_far_each_tensor_moved_reading_only_those_whose_chunks_changed(sick, monkeypatch):
    from ckptfmt.loading import reader as reader_module

    read = []
    original = reader_module.CheckpointReader.read_box

    def counting(self, key, *args, **kwargs):
        read.append(key)
        return original(self, key, *args, **kwargs)
    monkeypatch.setattr(reader_module.CheckpointReader, "read_box", counting)
    updates = health(sick, deep=True).updates
    assert updates is not None and "table" not in read  # its chunk never changed: never read
    # Small tensors share a pack with others, whose hash changes with them: read, and found unmoved.
    assert {u["ratio"] for u in updates if u["key"] in ("frozen/weight", "mask")} <= {0.0, None}
    one = next(u for u in updates if u["key"] == "model/2.weight" and u["checkpoint"] == "step-0020")
    before = ckptfmt.load(f"{sick}/step-0015")["model"]["2.weight"].double()
    after = ckptfmt.load(f"{sick}/step-0020")["model"]["2.weight"].double()
    assert one["ratio"] == pytest.approx(float((after - before).norm() / after.norm()), rel=1e-12)
    scaled = next(u for u in updates if u["key"] == "model/2.weight" and u["checkpoint"] == "step-0045")
    assert scaled["ratio"] > 0.7  # multiplied by 4: moved by 3/4 of its new size


def test_the_cli_prints_the_findings_and_exits_1_on_nan(sick, capsys):
    assert main(["health", sick]) == 1
    out = capsys.readouterr().out
    assert "NaN/Inf: first in step-0055 (step 55): model/0.bias (1 NaN)" in out
    assert "model.2" in out and "x3." in out and "step-0035 and step-0040" in out
    assert main(["health", sick, "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["healthy"] is False and document["first_non_finite"]["checkpoint"] == "step-0055"
    assert document["rules"]["jump_mads"] > 0


def test_a_healthy_run_is_reported_healthy(tmp_path, capsys):
    repo = str(tmp_path / "run")
    train(repo)
    found = health(repo)
    assert found.healthy and found.first_non_finite is None and not found.jumps and not found.metric_spikes
    assert main(["health", repo]) == 0
    out = capsys.readouterr().out
    assert "NaN/Inf: none in any checkpoint" in out and "norm jumps: none" in out


@pytest.mark.parametrize("key, group", [
    ("model/layers.3.attn.q.weight", "model.layers.3"), ("model/layers.12.ffn.bias", "model.layers.12"),
    ("optim/state/7/exp_avg", "optim exp_avg"), ("optim/state/7/exp_avg_sq", "optim exp_avg_sq"),
    ("model/embed.weight", "model.embed"), ("weight", "weight"), ("model/0.bias", "model.0"),
])
def test_tensor_groups(key, group):
    assert group_of(key) == group


def test_a_run_without_statistics_has_no_norms_but_still_its_spikes(tmp_path):
    repo = str(tmp_path / "run")
    timer = ckptfmt.StepTimer(system_interval=None)
    for step in range(30):
        with timer.step(step):
            pass
        timer.metrics(loss=1.0 + 0.01 * math.sin(step) + (100 if step == 20 else 0))
    ckptfmt.save({"w": torch.ones(4)}, f"{repo}/a", step=29, timer=timer, tensor_stats=False)
    found = health(repo)
    assert found.group_norms == {} and found.first_non_finite is None
    assert [(s["first_step"], s["before"]) for s in found.metric_spikes] == [(20, "a")]
