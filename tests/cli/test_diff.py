"""ckptfmt.tools.diff: the plain values of two states (an optimizer's settings, a scheduler's state, a user's
values) compared from the manifests alone, type-exact, with tensors left to the tensor comparison."""

from __future__ import annotations

import math
import shutil

import torch

import ckptfmt
from ckptfmt.tools.diff import ABSENT, diff


def optimizer_state(**group) -> dict:
    model = torch.nn.Linear(3, 1)
    return torch.optim.AdamW(model.parameters(), **group).state_dict()


def test_plain_values_that_differ_are_listed_by_key_with_both_values(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(4)
    a = {"w": weight, "optim": optimizer_state(lr=0.01, betas=(0.9, 0.999)), "pair": (weight, 3),
         "note": None, "loss": math.nan, "count": 1, "same": [1, 2.5, "x"]}
    b = {"w": weight + 1, "optim": optimizer_state(lr=0.05, betas=(0.9, 0.99)), "pair": (weight, 4),
         "loss": math.nan, "count": 1.0, "same": [1, 2.5, "x"], "added": {}}
    ckptfmt.save(a, f"{tmp_path}/repo/a")
    ckptfmt.save(b, f"{tmp_path}/repo/b")
    report = diff(f"{tmp_path}/repo/a", f"{tmp_path}/repo/b")
    assert report.values == [
        ("optim/param_groups/0/lr", 0.01, 0.05),
        ("optim/param_groups/0/betas", (0.9, 0.999), (0.9, 0.99)),  # a tuple of numbers is one value
        ("pair/1", 3, 4),  # beside a tensor, a number is still a value
        ("note", None, ABSENT),  # None is a value; a missing key is not None
        ("count", 1, 1.0),  # type-exact; NaN equals NaN
        ("added", ABSENT, {}),
    ]
    assert [t.key for t in report.by_status("changed")] == ["w"]  # tensors are compared as tensors


def test_values_come_from_the_manifests_without_reading_a_tensor(tmp_path):
    state = {"w": torch.arange(1000.0), "optim": optimizer_state(lr=0.1, weight_decay=0.0)}
    ckptfmt.save(state, f"{tmp_path}/repo/a")
    state["optim"]["param_groups"][0]["weight_decay"] = 0.1
    ckptfmt.save(state, f"{tmp_path}/repo/b")
    shutil.rmtree(tmp_path / "repo" / "chunks")
    report = diff(f"{tmp_path}/repo/a", f"{tmp_path}/repo/b", measure=False)
    assert report.values == [("optim/param_groups/0/weight_decay", 0.0, 0.1)]
