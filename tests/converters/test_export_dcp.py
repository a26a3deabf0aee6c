"""Export to DCP: a folder torch.distributed.checkpoint.load reads, and that imports back."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.converters import export_checkpoint, import_checkpoint


def training_state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": {"state": {"0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "sharded": ckptfmt.Sharded((4, 2), [ckptfmt.Shard((0, 0), torch.ones(2, 2), 0),
                                            ckptfmt.Shard((2, 0), torch.full((2, 2), 2.0), 1)]),
        "step": 7,
    }


def test_dcp_reads_the_export(tmp_path):
    url = ckptfmt.save(training_state(), tmp_path / "repo" / "c")
    result = export_checkpoint(url, tmp_path / "dcp", format="dcp")
    assert ".metadata" in result.files and result.tensors == 5
    target = {
        "model": {"w": torch.empty(4, 3), "b": torch.empty(3, dtype=torch.bfloat16)},
        "optim": {"state": {"0": {"step": torch.empty(()), "exp_avg": torch.empty(4, 3)}},
                  "param_groups": [{"lr": 0.0, "params": []}]},
        "sharded": torch.empty(4, 2),
        "step": 0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    expected = ckptfmt.load(url)
    assert torch.equal(target["model"]["w"], expected["model"]["w"])
    assert torch.equal(target["model"]["b"], expected["model"]["b"])
    assert torch.equal(target["optim"]["state"]["0"]["exp_avg"], expected["optim"]["state"]["0"]["exp_avg"])
    assert torch.equal(target["sharded"], torch.cat([torch.ones(2, 2), torch.full((2, 2), 2.0)]))
    assert target["step"] == 7 and target["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_export_then_import_round_trips(tmp_path):
    url = ckptfmt.save(training_state(), tmp_path / "repo" / "c")
    export_checkpoint(url, tmp_path / "dcp", format="dcp")
    back = import_checkpoint(tmp_path / "dcp", tmp_path / "repo" / "back")
    assert back.kind == "dcp"
    original, again = ckptfmt.load(url), ckptfmt.load(back.url)
    assert torch.equal(again["model"]["w"], original["model"]["w"]) and again["step"] == 7
    assert torch.equal(again["sharded"], original["sharded"])


def test_export_refuses_an_existing_folder(tmp_path):
    url = ckptfmt.save(training_state(), tmp_path / "repo" / "c")
    (tmp_path / "dcp").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        export_checkpoint(url, tmp_path / "dcp", format="dcp")
