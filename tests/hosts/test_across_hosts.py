"""What crosses nodes, on hosts simulated with network namespaces (tests/support/hosts.py): 2 hosts of
2 ranks each, gloo over the hosts' own network."""

from __future__ import annotations

import os

import pytest

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers
from ckptfmt.metadata.step_timer import decode_steps
from tests.support.helpers import needs_tool
from tests.support.hosts import FAKETIME_LIBRARY, clock_offset

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


@needs_tool(os.path.exists(FAKETIME_LIBRARY), "libfaketime (Debian's package) runs a host on a clock of its own")
def test_a_host_whose_clock_is_seconds_ahead_changes_no_straggler_found(hosts):
    """hostB's processes run on a clock 7 s ahead (libfaketime): the steps' start times disagree by 7 s
    across hosts, and stragglers still names the slow rank on hostB at the same steps, and no other."""
    repo = hosts.shared / "run"
    hosts.torchrun("hosts_train.py", 2, str(repo), "12", "4", "3", "5", "7", env={"hostB": clock_offset(7)})
    with ckptfmt.open(f"{repo}/step-0012") as reader:
        starts = [decode_steps(entry["steps"], "step-0012").start_ns[0] for entry in reader.metadata["timing"]["ranks"]]
    assert starts[2] - starts[0] > 6e9 and starts[3] - starts[1] > 6e9  # hostB's clock is ahead
    report = stragglers(str(repo), thresholds=Thresholds(floor_s=0.1))
    found = {(s["rank"], s["host"], step) for s in report["stragglers"] for step in s["steps"]}
    assert found == {(3, "hostB", step) for step in range(5, 8)}, report["stragglers"]
