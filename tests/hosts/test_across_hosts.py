"""What crosses nodes, on hosts simulated with network namespaces (tests/support/hosts.py): 2 hosts of
2 ranks each, gloo over the hosts' own network."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckptfmt
from ckptfmt.analytics import Thresholds, stragglers
from ckptfmt.cli import main
from ckptfmt.format.layout import chunk_key
from ckptfmt.format.node_parity import NodeParityRecord, record_key
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.copies import copy_records
from tests.corpus.generate import VERSIONS
from tests.support.helpers import needs_tool
from tests.support.hosts import FAKETIME_LIBRARY, clock_offset
from tests.support.old_trees import run_in_tree

pytestmark = pytest.mark.distributed


def test_a_collective_save_to_a_shared_folder_records_each_ranks_host_and_finds_the_slow_one(hosts):
    """The job of the issue's first run: one shared folder as the repository, 2 ranks on each of hostA and
    hostB; every checkpoint verifies, its topology names each rank's host, and stragglers names the
    slow rank on hostB and its steps. Then the resharding load across hosts: loaded by 2 hosts x 1
    rank, each rank reading its half of the sharded table (another box than any rank wrote) and the
    model."""
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
    found = {(s.rank, s.host, step) for s in report.stragglers for step in s.steps}
    assert found == {(3, "hostB", step) for step in range(5, 8)}, report.stragglers
    hosts.torchrun("hosts_restore.py", 1, f"{repo}/step-0012", "12")


@pytest.mark.exhaustive  # make test keeps the same job on true clocks
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
    found = {(s.rank, s.host, step) for s in report.stragglers for step in s.steps}
    assert found == {(3, "hostB", step) for step in range(5, 8)}, report.stragglers


def test_a_node_scoped_repository_holds_on_each_node_what_its_ranks_hold(hosts):
    """scope="node", the repository on each host's own disk (the same path on both): each node's
    repository commits every checkpoint, with the model (replicated) whole and the embedding table's
    rows of its own ranks (a DTensor sharded over the 4 ranks); the placement says which."""
    repo = hosts.local / "run"
    hosts.torchrun("hosts_train.py", 2, str(repo), "8", "4", "-1", "0", "0", "node")
    for index, host in enumerate(hosts.hosts):
        on_node = host.disk / "run"
        assert sorted(ckptfmt.Repository.open(str(on_node)).names()) == ["step-0004", "step-0008"]
        with ckptfmt.open(f"{on_node}/step-0008") as reader:
            placement = reader.manifest.placement
            assert [(node.host, node.ranks) for node in placement.nodes] == [("hostA", (0, 1)), ("hostB", (2, 3))]
            mine = set(placement.nodes[index].rows)
            present = {row for row, chunk in enumerate(reader.manifest.chunks)
                       if reader.repository.storage.exists(chunk_key(chunk.hash, chunk.codec))}
            assert present == mine  # exactly the chunks the placement says this node holds
            for entry in reader.manifest.tensors:
                for shard in entry.shards:
                    rows = {piece.chunk for piece in shard.pieces}
                    ours = not entry.key.startswith("table") or shard.rank in placement.nodes[index].ranks
                    assert (rows <= mine) == ours, (host.name, entry.key, shard.rank)
    for host in hosts.hosts:  # on its own node, every node's repository verifies: the rest is elsewhere
        report = ckptfmt.verify(str(host.disk / "run"), node=host.name)
        other = "hostB" if host.name == "hostA" else "hostA"
        assert report.ok and any(f"held on other nodes ({other})" in line for line in report.warnings), report
    away = ckptfmt.verify(str(hosts.hosts[0].disk / "run"), node="elsewhere")  # not a node: every chunk is due
    assert {problem.kind for problem in away.problems} == {"missing-chunk"}
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="node-scoped checkpoint: this tensor's chunks are "
                                                              "on hostA, hostB; this machine is"):
        ckptfmt.load(str(hosts.hosts[0].disk / "run" / "step-0008"))
    hosts.torchrun("hosts_restore.py", 2, f"{repo}/step-0008", "8")  # each rank from its own node


def test_a_manager_with_a_node_local_tier_copies_to_a_peer_drains_and_restores_whatever_was_lost(hosts, capsys):
    """The issue's failing job: CheckpointManager(tiers=[Tier(local, scope="node"), shared]) across 2
    hosts, the state a model and a table sharded over the 4 ranks. Every save commits on each node's
    own disk (before: every save failed on the second host); each node's leader sends its node's rows
    to the other node, which checks them and records the copy; both nodes drain their own rows to the
    shared tier, which commits each checkpoint whole (each node keeps the last 2). Then hostB's disk is
    wiped: the restarted job agrees on step 8, hostB gets its rows, manifest and commit back from
    hostA's copy, and every rank restores from its own disk, bit for bit; then every disk is lost and
    every rank restores step 10 from the shared tier."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "8", "--table")
    for host, other in zip(hosts.hosts, reversed(hosts.hosts)):
        repo = ckptfmt.Repository.open(str(host.disk / "run"))
        assert repo.names() == ["step-000000006", "step-000000008"], host.name
        for record in repo.commits():
            (copy,) = copy_records(repo, record.name, record.manifest_hash).values()
            assert copy.host == other.name and copy.chunks > 0, (host.name, record.name, copy)
        assert ckptfmt.verify(str(host.disk / "run"), node=host.name).ok
        assert main(["ls", str(host.disk / "run")]) == 0 and "step-000000008 (2 nodes)" in capsys.readouterr().out
    assert {"step-000000006", "step-000000008"} <= set(ckptfmt.Repository.open(str(shared)).names())
    assert ckptfmt.verify(str(shared)).ok
    state = ckptfmt.load(f"{shared}/step-000000008")
    assert torch.equal(state["table"], table(8))
    with ckptfmt.open(f"{shared}/step-000000008") as reader:
        assert [node.host for node in reader.manifest.placement.nodes] == ["hostA", "hostB"]
        assert_every_chunk_due_on_the_shared_tier(shared, reader.manifest)

    shutil.rmtree(hosts.hosts[1].disk / "run")
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "10", "--table", "--out", str(hosts.root / "first"))
    for rank in range(4):
        restored = torch.load(hosts.root / f"first.{rank}.pt")
        assert restored["step"] == 8
        assert torch.equal(restored["table"], table(8)[16 * rank:16 * (rank + 1)]), rank
        for key, value in state["model"].items():
            assert torch.equal(restored["model"][key], value), (rank, key)
        assert_moments(restored["optimizer"], state["optimizer"])
        (resume,) = restored["resumes"]
        assert resume["from"]["repository"] == str(local), (rank, resume["from"])
        assert restored["fetched"] == ["hostB's chunks of step-000000008 from hostA's copy"]
    assert ckptfmt.verify(str(hosts.hosts[1].disk / "run"), node="hostB").ok

    for host in hosts.hosts:
        shutil.rmtree(host.disk / "run")
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "12", "--table", "--out", str(hosts.root / "second"))
    expected = ckptfmt.load(f"{shared}/step-000000010")
    for rank in range(4):
        restored = torch.load(hosts.root / f"second.{rank}.pt")
        assert restored["step"] == 10 and restored["resumes"][0]["from"]["repository"] == str(shared)
        assert all(torch.equal(restored["model"][key], value) for key, value in expected["model"].items())
        assert_moments(restored["optimizer"], expected["optimizer"])
        assert torch.equal(restored["table"], table(10)[16 * rank:16 * (rank + 1)]), rank


def assert_every_chunk_due_on_the_shared_tier(shared, manifest) -> None:
    """The shared tier holds every node's rows of a drained checkpoint (issue 46: verify on hostA there
    said OK with one of hostB's chunks deleted, "held on other nodes"): a chunk of hostB's alone lost
    there is a problem, whichever node verifies."""
    row = max(set(manifest.placement.node("hostB").rows) - set(manifest.placement.node("hostA").rows))
    chunk = shared / chunk_key(manifest.chunks[row].hash, manifest.chunks[row].codec)
    kept = chunk.read_bytes()
    chunk.unlink()
    try:
        for node in ("hostA", "hostB", None):
            report = ckptfmt.verify(str(shared), node=node)
            assert not report.ok and [p.chunk for p in report.problems] == [manifest.chunks[row].hash], (node, report)
    finally:
        chunk.write_bytes(kept)
    assert ckptfmt.verify(str(shared), node="hostA").ok


def assert_moments(restored: dict, saved: dict) -> None:
    """A fresh AdamW restored by the manager holds every saved moment and step, bit for bit (issue 46:
    the restore of such an optimizer failed on every rank)."""
    assert sorted(restored["state"]) == sorted(saved["state"]) == [0, 1]
    for param, moments in saved["state"].items():
        assert sorted(restored["state"][param]) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(restored["state"][param][name], value) for name, value in moments.items()), param


def table(step: int) -> torch.Tensor:
    """hosts_manager.py's table at ``step``, whole."""
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + step


@pytest.mark.exhaustive  # make test keeps the manager across hosts at today's format
def test_a_manager_for_format_1_10_writes_every_tier_for_its_readers(hosts):
    """CheckpointManager(format_version="1.10") across 2 hosts: the node tiers (created on each node, the
    peer copies included) and the shared tier the nodes drain to (created by a drain) are repositories of
    format 1.10, and the ckptfmt of 1.10 lists, verifies and loads each of them."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "4", "--format-version", "1.10")
    repositories = [host.disk / "run" for host in hosts.hosts] + [shared]
    for repo in repositories:
        assert ckptfmt.Repository.open(str(repo)).format_version == (1, 10), repo
    found = run_in_tree(VERSIONS["1.10"], OLD_READER, *map(str, repositories), timeout=300)
    assert found == [{"names": ["step-000000002", "step-000000004"], "ok": True, "loaded": True}] * 3


#: Run by the ckptfmt of format 1.10: each repository's checkpoints, its verify (on the node whose disk it
#: is: 1.10's verify checks the chunks of the machine it runs on, here the test's, which holds them all),
#: and a load of the newest.
OLD_READER = """
import json, sys
import ckptfmt
out = []
for repo in sys.argv[1:]:
    names = ckptfmt.Repository.open(repo).names()
    loaded = ckptfmt.load(f"{repo}/{names[-1]}")
    out.append({"names": names, "ok": ckptfmt.verify(repo).ok, "loaded": isinstance(loaded, dict)})
print(json.dumps(out))
"""


@pytest.mark.exhaustive  # 4 hosts: make test keeps the 2-host runs
@pytest.mark.parametrize("hosts", [4], indirect=True)
def test_four_hosts_save_node_scoped_and_each_restores_from_its_own_disk(hosts):
    """4 hosts x 1 rank: each node's repository holds the model and its rank's rows of the table, verifies
    on its node, and every rank restores its part from its own disk."""
    repo = hosts.local / "run"
    hosts.torchrun("hosts_train.py", 1, str(repo), "4", "4", "-1", "0", "0", "node")
    for host in hosts.hosts:
        with ckptfmt.open(f"{host.disk / 'run'}/step-0004") as reader:
            assert [node.host for node in reader.manifest.placement.nodes] == [h.name for h in hosts.hosts]
        assert ckptfmt.verify(str(host.disk / "run"), node=host.name).ok
    hosts.torchrun("hosts_restore.py", 1, f"{repo}/step-0004", "4")


@pytest.mark.exhaustive  # 4 hosts: make test keeps the 2-host manager
@pytest.mark.parametrize("hosts", [4], indirect=True)
def test_four_hosts_copy_round_the_ring_and_a_wiped_node_restores_from_the_next(hosts):
    """4 hosts x 1 rank, a node-local tier and a shared one: each node's rows are copied to the next node
    (hostA's to hostB, ..., hostD's to hostA); the shared tier gets each checkpoint whole, every node
    sending its own rows. hostC's disk wiped: it gets its rows back from hostD's copy."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "4", "--table")
    names = [host.name for host in hosts.hosts]
    for index, host in enumerate(hosts.hosts):
        repo = ckptfmt.Repository.open(str(host.disk / "run"))
        record = repo.commit("step-000000004")
        assert set(copy_records(repo, record.name, record.manifest_hash)) == {names[index - 1]}, host.name
        assert ckptfmt.verify(str(host.disk / "run"), node=host.name).ok
    assert ckptfmt.verify(str(shared)).ok
    assert torch.equal(ckptfmt.load(f"{shared}/step-000000004")["table"], table(4))
    shutil.rmtree(hosts.hosts[2].disk / "run")
    hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "6", "--table", "--out", str(hosts.root / "wiped"))
    for rank in range(4):
        restored = torch.load(hosts.root / f"wiped.{rank}.pt")
        assert restored["step"] == 4 and torch.equal(restored["table"], table(4)[16 * rank:16 * (rank + 1)]), rank
        assert restored["fetched"] == ["hostC's chunks of step-000000004 from hostD's copy"]


@pytest.mark.exhaustive  # make test keeps the refill from an intact copy
def test_a_damaged_peer_copy_is_never_restored_and_the_shared_tier_serves_instead(hosts):
    """hostA's copy of hostB's rows is damaged, then hostB's disk wiped: the refill refuses the damaged
    chunk (hostA sends zeros in its place, hostB's check refuses them), the restore from the nodes'
    copies is given up on every rank, and hostB's ranks restore the same step from the shared tier,
    bit for bit, while hostA's read their own disk."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "4", "--table")
    host_a = ckptfmt.Repository.open(str(hosts.hosts[0].disk / "run"))
    manifest = host_a.manifest("step-000000004")
    row = max(manifest.placement.node("hostB").rows)  # a row of hostB's alone: its part of the table
    assert row not in manifest.placement.node("hostA").rows
    with open(host_a.storage.path(chunk_key(manifest.chunks[row].hash, manifest.chunks[row].codec)), "r+b") as file:
        file.write(b"\x00\x01\x02\x03")
    shutil.rmtree(hosts.hosts[1].disk / "run")
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "6", "--table", "--out", str(hosts.root / "out"))
    for rank in range(4):
        restored = torch.load(hosts.root / f"out.{rank}.pt")
        assert restored["step"] == 4 and restored["fetched"] == []
        assert torch.equal(restored["table"], table(4)[16 * rank:16 * (rank + 1)]), rank
        assert restored["resumes"][0]["from"]["repository"] == str(local if rank < 2 else shared), rank


@pytest.mark.exhaustive  # make test keeps the restore at the same world size
def test_a_manager_restores_a_node_tier_at_another_world_size_resharded(hosts):
    """Saved by 2 hosts x 2 ranks to node-local tiers, restored by 2 hosts x 1 rank: each rank reads its
    half of the table (rows two ranks of its node wrote) and the model from its own node's tier."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 2, str(local), str(shared), "4", "--table")
    hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "4", "--table", "--out", str(hosts.root / "out"))
    for rank in range(2):
        restored = torch.load(hosts.root / f"out.{rank}.pt")
        assert restored["step"] == 4 and restored["fetched"] == []
        assert torch.equal(restored["table"], table(4)[32 * rank:32 * (rank + 1)]), rank
        assert restored["resumes"][0]["from"]["repository"] == str(local), rank


#: Run by the ckptfmt released as 1.0.0 (format 2.0) on a node's tier: its checkpoints, and its verify as that node.
OLD_NODE_READER = """
import json, sys
import ckptfmt
repo, node = sys.argv[1:]
print(json.dumps({"names": ckptfmt.Repository.open(repo).names(), "ok": ckptfmt.verify(repo, node=node).ok}))
"""


@pytest.mark.exhaustive  # 4 hosts: make test keeps parity across 4 "nodes" of one machine
@pytest.mark.parametrize("hosts", [4], indirect=True)
def test_four_hosts_with_parity_across_nodes_rebuild_a_wiped_node_and_say_why_two_are_too_many(hosts):
    """Issue 48 part 2: 4 hosts x 1 rank, a node tier protected by parity 1 across the nodes instead of
    copies. Each node keeps its own rows and parity pieces of a third of a node's data (M/(N-M)), no
    copy. hostC's disk wiped: its rows of step 4 are rebuilt from the other three's data and parity,
    checked, and every rank restores bit for bit from its own disk. Then hostB's and hostC's disks
    wiped: more than parity 1 survives, every rank says so, and the two restore from the shared tier."""
    local, shared = hosts.local / "run", hosts.shared / "run"
    hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "4", "--table", "--parity", "1")
    parity_bytes = data_bytes = 0
    for host in hosts.hosts:
        repo = ckptfmt.Repository.open(str(host.disk / "run"))
        record = repo.commit("step-000000004")
        assert copy_records(repo, record.name, record.manifest_hash) == {}, host.name
        manifest = repo.manifest(record.name)
        parity = NodeParityRecord.from_bytes(repo.storage.read(record_key(record.name, host.name), max_size=1 << 20),
                                             host.name)
        assert parity.manifest_hash == record.manifest_hash and parity.pieces, host.name
        parity.check_layout(manifest)
        parity_bytes += parity.stored_bytes
        data_bytes += sum(manifest.chunks[row].stored_size for row in manifest.placement.node(host.name).rows)
        assert ckptfmt.verify(str(host.disk / "run"), node=host.name).ok
    assert 0.30 < parity_bytes / data_bytes < 0.45, (parity_bytes, data_bytes)
    # ckptfmt 1.0.0 (format 2.0, before parity across nodes) reads every node's tier as before: it lists
    # the checkpoints and verifies each node's rows there, ignoring the node-parity entries of the folders
    for host in hosts.hosts:
        found = run_in_tree(VERSIONS["2.0"], OLD_NODE_READER, str(host.disk / "run"), host.name, timeout=300)
        assert found == {"names": ["step-000000002", "step-000000004"], "ok": True}, (host.name, found)

    shutil.rmtree(hosts.hosts[2].disk / "run")
    hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "6", "--table", "--parity", "1",
                   "--out", str(hosts.root / "wiped"))
    for rank in range(4):
        restored = torch.load(hosts.root / f"wiped.{rank}.pt")
        assert restored["step"] == 4 and torch.equal(restored["table"], table(4)[16 * rank:16 * (rank + 1)]), rank
        assert restored["resumes"][0]["from"]["repository"] == str(local), rank
        assert restored["fetched"] == ["hostC's chunks of step-000000004 rebuilt from the parity across nodes"]
    assert ckptfmt.verify(str(hosts.hosts[2].disk / "run"), node="hostC").ok

    for host in hosts.hosts[1:3]:
        shutil.rmtree(host.disk / "run")
    results = hosts.torchrun("hosts_manager.py", 1, str(local), str(shared), "8", "--table", "--parity", "1",
                             "--out", str(hosts.root / "two"))
    for rank, result in enumerate(results):
        assert "restore from the nodes' tiers given up: step-000000006: hostB, hostC lost: round" in result.stderr
        assert "parity across nodes survives 1 lost node" in result.stderr
        restored = torch.load(hosts.root / f"two.{rank}.pt")
        assert restored["step"] == 6 and torch.equal(restored["table"], table(6)[16 * rank:16 * (rank + 1)]), rank
        assert restored["resumes"][0]["from"]["repository"] == str(shared if rank in (1, 2) else local), rank
