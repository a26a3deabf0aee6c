"""A tier in memory (issue 48, part 3): a CheckpointManager whose first tier is node-scoped on each node's
memory (a tmpfs, as /dev/shm is), on 2 simulated hosts x 2 ranks (tests/support/hosts.py), the state
a model, AdamW's moments and a table sharded over the 4 ranks (tests/scripts/hosts_memory_tier.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.repository.copies import copy_records

pytestmark = pytest.mark.distributed

SCRIPT = "hosts_memory_tier.py"
#: Every launch's limit: a launch that hangs fails the test instead of holding it up.
TIMEOUT_S = 180


def test_a_rank_killed_mid_run_restores_from_its_nodes_memory(hosts):
    """hostB's leader (rank 2) is killed (SIGKILL) just after its save of step 6 returned, while the copies
    to the peer and the shared tier may still run: the launch fails, each host's memory (a tmpfs, which
    outlives the job's processes) still holds step 6 whole, and the relaunched job restores step 6 on
    every rank from its own node's memory, nothing fetched, bit for bit."""
    killed_and_restored(hosts, end=8)


@pytest.mark.exhaustive  # make test keeps the kill; the node replaced after it is this one's
def test_a_rank_killed_then_a_node_replaced_restore_from_memory_own_then_a_peers(hosts):
    """The kill above, the relaunched job running on to step 10 (every checkpoint in both nodes' memory,
    each holding a verified copy of the other's rows); then hostB's memory is wiped (the node
    replaced): the next launch restores step 10, hostB's rows, manifest and commit fetched from hostA's
    copy in its memory (not from the shared tier), bit for bit."""
    memory, shared, record = killed_and_restored(hosts, end=10)
    for host, other in zip(hosts.hosts, reversed(hosts.hosts)):
        repo = ckptfmt.Repository.open(str(host.memory / "run"))
        assert repo.names() == ["step-000000008", "step-000000010"], host.name
        for commit in repo.commits():
            (copy,) = copy_records(repo, commit.name, commit.manifest_hash).values()
            assert copy.host == other.name and copy.chunks > 0, (host.name, commit.name, copy)
        assert ckptfmt.verify(str(host.memory / "run"), node=host.name).ok
    assert "step-000000010" in ckptfmt.Repository.open(str(shared)).names()

    shutil.rmtree(hosts.hosts[1].memory / "run")  # hostB replaced: its memory is empty
    hosts.torchrun(SCRIPT, 2, str(memory), str(shared), "12", str(record), "--out", str(hosts.root / "replaced"),
                   timeout=TIMEOUT_S)
    for rank in range(4):
        restored = torch.load(hosts.root / f"replaced.{rank}.pt")
        assert restored["step"] == 10, (rank, restored["step"])
        assert restored["fetched"] == ["hostB's chunks of step-000000010 from hostA's copy"], restored["fetched"]
        assert restored["resumes"][0]["from"]["repository"] == str(memory), (rank, restored["resumes"])
        assert_restored(restored, record / f"10.{rank}.pt", rank)
    assert ckptfmt.verify(str(hosts.hosts[1].memory / "run"), node="hostB").ok


def killed_and_restored(hosts, end: int) -> tuple[Path, Path, Path]:
    """A job killed at step 6 (rank 2, SIGKILL), relaunched to run to ``end``: each rank restores step 6 from
    its own node's memory, bit for bit. The memory tier, the shared tier, the folder of what was saved."""
    memory, shared, record = hosts.memory / "run", hosts.shared / "run", hosts.root / "record"
    record.mkdir()
    assert all(is_tmpfs(host.memory) for host in hosts.hosts) or not hosts.memory_is_tmpfs

    killed = hosts.torchrun(SCRIPT, 2, str(memory), str(shared), "8", str(record), "--die-after", "6",
                            "--die-rank", "2", timeout=TIMEOUT_S, check=False)
    assert all(result.returncode != 0 for result in killed), [result.returncode for result in killed]
    assert "Signal 9 (SIGKILL)" in killed[1].stderr, killed[1].stderr[-3000:]
    assert not (record / "8.0.pt").exists()  # the job ended at the kill
    for host in hosts.hosts:  # the memory outlived the job's processes; nothing went to the disk
        assert not (host.disk / "run").exists()
        assert ckptfmt.Repository.open(str(host.memory / "run")).names()[-1] == "step-000000006", host.name

    hosts.torchrun(SCRIPT, 2, str(memory), str(shared), str(end), str(record), "--out", str(hosts.root / "killed"),
                   timeout=TIMEOUT_S)
    for rank in range(4):
        restored = torch.load(hosts.root / f"killed.{rank}.pt")
        assert restored["step"] == 6 and restored["fetched"] == [], (rank, restored["step"], restored["fetched"])
        assert restored["resumes"][0]["from"]["repository"] == str(memory), (rank, restored["resumes"])
        assert_restored(restored, record / f"6.{rank}.pt", rank)
    return memory, shared, record


def assert_restored(restored: dict, saved_at: Path, rank: int) -> None:
    """What a rank restored is, bit for bit, what it held when it saved: the model, every moment and step of
    AdamW, its rows of the table."""
    saved = torch.load(saved_at)
    assert sorted(restored["model"]) == sorted(saved["model"])
    assert all(torch.equal(restored["model"][key], value) for key, value in saved["model"].items()), rank
    assert sorted(restored["optimizer"]["state"]) == sorted(saved["optimizer"]["state"]) == [0, 1]
    for param, moments in saved["optimizer"]["state"].items():
        assert sorted(restored["optimizer"]["state"][param]) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(restored["optimizer"]["state"][param][name], value)
                   for name, value in moments.items()), (rank, param)
    assert torch.equal(restored["table"], saved["table"]), rank


def is_tmpfs(path: Path) -> bool:
    """Whether ``path`` is a tmpfs mount point of this namespace."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, kind, *_ = line.split()
        if point == str(path):
            return kind == "tmpfs"
    return False
