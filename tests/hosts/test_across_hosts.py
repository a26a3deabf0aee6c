"""What crosses nodes, on hosts simulated with network namespaces (tests/support/hosts.py): 2 hosts of
2 ranks each, gloo over the hosts' own network."""

from __future__ import annotations

import pytest

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers

pytestmark = pytest.mark.distributed


def test_a_collective_save_to_a_shared_folder_records_each_ranks_host_and_finds_the_slow_one(hosts):
    """The job of the issue's first run: one shared folder as the repository, 2 ranks on each of hostA and
    hostB; every checkpoint verifies, its topology names each rank's host, and stragglers names the
    slow rank on hostB and its steps."""
    repo = hosts.shared / "run"
    hosts.torchrun("hosts_train.py", 2, str(repo), "12", "4", "3", "5", "7")
    names = sorted(ckptfmt.Repository.open(str(repo)).names())
    assert names == ["step-0004", "step-0008", "step-0012"]
    assert ckptfmt.verify(str(repo)).ok
    with ckptfmt.open(f"{repo}/step-0012") as reader:
        ranks = reader.metadata["topology"]["ranks"]
        assert [(entry["rank"], entry["host"]) for entry in ranks] == [
            (0, "hostA"), (1, "hostA"), (2, "hostB"), (3, "hostB")]
    report = stragglers(str(repo), thresholds=Thresholds(floor_s=0.1))
    found = {(s["rank"], s["host"], step) for s in report["stragglers"] for step in s["steps"]}
    assert found == {(3, "hostB", step) for step in range(5, 8)}, report["stragglers"]
