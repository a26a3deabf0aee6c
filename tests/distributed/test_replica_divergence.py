"""Replica divergence (spec 9.7) on real DDP runs: 4 gloo ranks train a model wrapped in
DistributedDataParallel, then save it collectively; one rank's copy of one parameter nudged by one
ulp just before the save is found, named with its rank and tensor, and not the one stored."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import CollectiveError
from tests.support.ranks import run_ranks

WORLD = 4
pytestmark = pytest.mark.distributed


def ddp_save(rank: int, world: int, folder: Path, url: str, nudge: tuple[int, str] | None,
             on_divergence: str = "warn") -> dict:
    """Train a small DDP model a few steps (the ranks' parameters stay equal), nudge one rank's copy of
    one parameter by one ulp if asked, and save every rank's state dict collectively."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                        torch.nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8, generator=generator)).square().mean().backward()
        optimizer.step()
    state = {"model": model.module.state_dict()}
    honest = state["model"]["2.weight"].clone()
    if nudge is not None and nudge[0] == rank:
        with torch.no_grad():
            value = state["model"][nudge[1]].view(-1)
            value[0] = torch.nextafter(value[0], torch.tensor(float("inf")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            saved = ckptfmt.save(state, url, timeout=60, on_divergence=on_divergence)
        except CollectiveError as exc:
            return {"error": str(exc)}
    return {"url": saved, "warnings": [str(w.message) for w in caught], "honest": honest}


def test_a_rank_whose_copy_differs_by_one_ulp_is_named_and_the_majoritys_copy_stored(tmp_path, capsys):
    url = str(tmp_path / "repo" / "nudged")
    outcomes = [o.unwrap() for o in run_ranks(ddp_save, WORLD, tmp_path / "run", url=url, nudge=(2, "2.weight"))]
    with ckptfmt.open(url) as reader:
        replicas = reader.metadata["replicas"]
        stored = reader.get_tensor("model/2.weight")
    assert replicas["checked"] == 4  # every parameter is held by all four ranks
    assert replicas["divergent"] == [{"key": "model/2.weight", "offsets": [0, 0], "shape": [4, 16],
                                      "ranks": [0, 1, 2, 3], "majority": [0, 1, 3], "groups": [[0, 1, 3], [2]]}]
    assert torch.equal(stored, outcomes[0]["honest"])  # the majority's bytes, not rank 2's
    message = " ".join(outcomes[0]["warnings"])
    assert "'model/2.weight': rank 2 differs from the majority (ranks 0, 1, 3)" in message
    report = ckptfmt.verify(url)
    assert report.ok and [d["key"] for d in report.divergences] == ["model/2.weight"]
    assert any("model/2.weight: rank 2 differs" in w for w in report.warnings)
    assert main(["show", url]) == 0
    shown = capsys.readouterr().out
    assert "4 compared, 1 differ: model/2.weight: rank 2 differs from the majority (ranks 0, 1, 3)" in shown


def test_equal_replicas_report_none(tmp_path):
    url = str(tmp_path / "repo" / "clean")
    outcomes = [o.unwrap() for o in run_ranks(ddp_save, WORLD, tmp_path / "run", url=url, nudge=None)]
    with ckptfmt.open(url) as reader:
        assert reader.metadata["replicas"] == {"checked": 4, "divergent": []}
    assert not any("replicated" in w for o in outcomes for w in o["warnings"])
    assert not ckptfmt.verify(url).divergences


def test_raise_fails_every_rank_and_commits_nothing(tmp_path):
    url = str(tmp_path / "repo" / "refused")
    outcomes = [o.unwrap() for o in run_ranks(ddp_save, WORLD, tmp_path / "run", url=url, nudge=(1, "0.bias"),
                                              on_divergence="raise")]
    assert all("'model/0.bias': rank 1 differs from the majority" in o["error"] for o in outcomes)
    assert all("nothing was committed" in o["error"] for o in outcomes)
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        ckptfmt.open(url)
