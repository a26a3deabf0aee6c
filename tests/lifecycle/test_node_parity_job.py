"""Parity across nodes in a real job (lifecycle/peer_parity.py, peer_parity_refills.py; issue 48 part 2):
4 ranks as 4 nodes of one machine, each node tier in its own process's memory, gloo between the
leaders. The same job across simulated hosts, with disks wiped between runs, is in tests/hosts/."""

from __future__ import annotations

import json

import pytest

import ckptfmt
from tests.support.helpers import torchrun


def test_a_tier_takes_parity_across_nodes_only_where_it_is_node_scoped_and_written_for_2_1(tmp_path):
    tier = ckptfmt.Tier("/nvme/run", scope="node", redundancy="parity", survives=2)
    assert (tier.redundancy, tier.survives) == ("parity", 2)
    assert ckptfmt.Tier("/nvme/run", scope="node").redundancy == "copies"
    with pytest.raises(ValueError, match="redundancy must be one of copies, parity, not 'mirror'"):
        ckptfmt.Tier("/nvme/run", scope="node", redundancy="mirror")
    with pytest.raises(ValueError, match="scope 'job' takes parity='K[+]M' instead"):
        ckptfmt.Tier("/shared/run", redundancy="parity")
    with pytest.raises(ValueError, match="Tier.redundancy='parity'. needs format 2.1"):
        ckptfmt.CheckpointManager(tiers=[ckptfmt.Tier(str(tmp_path / "node"), scope="node", redundancy="parity"),
                                         str(tmp_path / "shared")], format_version="2.0")


@pytest.mark.distributed
def test_a_wiped_node_is_rebuilt_from_parity_and_two_wiped_with_m_1_restore_from_the_shared_tier(tmp_path):
    """M=1: one wiped node's rows are rebuilt bit for bit from the other three's data and parity, and the
    parity it held is computed again in the background; two
    wiped are more than the parity survives: every rank says why, and the wiped nodes' ranks read the
    shared tier while the others read their own."""
    shared, out = tmp_path / "shared", tmp_path / "out"
    torchrun("node_parity_job.py", 4, str(shared), str(out), "1", timeout=240)
    reports = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in range(4)]
    for rank, report in enumerate(reports):
        parity = report["parity"]
        assert parity["m"] == 1 and parity["pieces"] > 4, parity  # rounds rotate: every node holds parity
        first, second = report["restores"]
        assert first["step"] == 6 and first["from"] == "memory://run/step-000000006" and first["equal"], first
        assert first["fetched"] == ["nodeB's chunks of step-000000006 rebuilt from the parity across nodes"]
        assert report["parity_again"], rank  # nodeB's parity of step 6 too, every node's checked by verify
        # the wiped nodes' ranks read the shared tier, the others their own
        where = f"{shared}/step-000000006" if rank in (1, 2) else "memory://run/step-000000006"
        assert second["step"] == 6 and second["from"] == where and second["equal"], second
        assert second["fetched"] == []
        (given_up,) = [w for w in second["warnings"] if "given up" in w]
        assert "nodeB, nodeC lost: round" in given_up and "parity across nodes survives 1 lost node" in given_up
        assert report["verified"], rank
        if rank in (0, 3):
            name, host = "step-000000006", f"node{'ABCD'[rank]}"
            problems = {key: message for kind, key, message in report["verify"] if kind == "bad-parity"}
            assert all(key.startswith(f"{name}/node-parity-{host}.") for key in problems), problems
            assert sorted(message.rsplit(": ", 1)[1] for message in problems.values()) == [
                "parity piece damaged (its hash or length is not the record's)", "parity piece missing"]
    # about M/(N-M) = 1/3 of the data in parity, over all nodes (pieces are cut from each node's stream)
    ratio = sum(r["parity"]["bytes"] for r in reports) / sum(r["parity"]["data"] for r in reports)
    assert 0.30 < ratio < 0.45, ratio


@pytest.mark.exhaustive  # make test keeps M=1
@pytest.mark.distributed
def test_parity_2_across_4_nodes_rebuilds_two_wiped_nodes(tmp_path):
    """M=2: two wiped nodes are rebuilt together, each round's 2 known data pieces and 2 parity pieces
    sent to both; parity is about 2/2 = 1.0 of the data."""
    shared, out = tmp_path / "shared", tmp_path / "out"
    torchrun("node_parity_job.py", 4, str(shared), str(out), "2", timeout=240)
    reports = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in range(4)]
    for report in reports:
        first, second = report["restores"]
        assert first["step"] == second["step"] == 6 and first["equal"] and second["equal"], report
        assert second["from"] == "memory://run/step-000000006", second
        assert not [w for w in second["warnings"] if "given up" in w], second
        assert second["fetched"] == [f"node{n}'s chunks of step-000000006 rebuilt from the parity across nodes"
                                     for n in "BC"]
    ratio = sum(r["parity"]["bytes"] for r in reports) / sum(r["parity"]["data"] for r in reports)
    assert 0.9 < ratio < 1.2, ratio
