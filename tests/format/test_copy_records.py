"""Copy records (spec 9.8): a node's verified copy of another node's chunks of a node-scoped
checkpoint, what verify checks on a node because of one, and records refused or ignored, naming why.
The copies themselves, made across simulated hosts, are in tests/hosts/."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import torch

import ckptfmt
from ckptfmt.errors import ManifestError
from ckptfmt.format.copies import CopyRecord, copy_entry_host, copy_key
from ckptfmt.format.layout import chunk_key
from ckptfmt.repository.copies import copy_records, write_copy_record
from ckptfmt.repository.repository import Repository
from tests.format.test_spec_text import validate
from tests.support.helpers import rewrite_manifest

HOST = socket.gethostname()


@pytest.fixture
def two_nodes(tmp_path):
    """A node-scoped checkpoint of two chunks whose placement says this host holds row 0 and hostZ row 1
    (as hostZ's rows would be after a copy, both are on this disk)."""
    repo = tmp_path / "run"
    ckptfmt.save({"w": torch.ones(3), "big": torch.arange(300_000.0)}, repo / "a", scope="node")
    placement = {"scope": "node", "nodes": [{"host": HOST, "ranks": [0], "chunks": struct.pack("<I", 0)},
                                            {"host": "hostZ", "ranks": [1], "chunks": struct.pack("<I", 1)}]}
    rewrite_manifest(Repository.open(str(repo)).storage, "a", lambda doc: doc.update(placement=placement))
    return Repository.open(str(repo))


def test_verify_on_a_node_checks_the_rows_it_has_a_copy_record_for(two_nodes):
    repo = two_nodes
    report = ckptfmt.verify(repo.url)
    assert report.ok and any("1 chunk held on other nodes (hostZ), not checked" in w for w in report.warnings)
    record = repo.commit("a")
    write_copy_record(repo, "a", "hostZ", record.manifest_hash, 1, 1200000)
    (copy,) = copy_records(repo, "a", record.manifest_hash).values()
    assert (copy.host, copy.chunks, copy.stored_bytes) == ("hostZ", 1, 1200000)
    validate(json.loads(repo.storage.read(copy_key("a", "hostZ"), max_size=4096)))
    report = ckptfmt.verify(repo.url)
    assert report.ok and not any("held on other nodes" in w for w in report.warnings), report.warnings
    manifest = repo.manifest("a")
    row = manifest.chunks[1]
    path = repo.storage.path(chunk_key(row.hash, row.codec))
    with open(path, "r+b") as damaged:
        damaged.write(b"\xff\xff")
    problems = ckptfmt.verify(repo.url).problems
    assert [problem.kind for problem in problems] == ["corrupt-chunk"], problems


def test_a_copy_record_of_another_manifest_or_damaged_counts_for_nothing(two_nodes):
    repo = two_nodes
    write_copy_record(repo, "a", "hostZ", "0" * 64, 1, 1)
    assert copy_records(repo, "a", repo.commit("a").manifest_hash) == {}
    repo.storage.write(copy_key("a", "hostZ"), b"{not json")
    with pytest.warns(ckptfmt.CheckpointWarning, match=r"copy-hostZ.json: malformed copy record"):
        assert copy_records(repo, "a", repo.commit("a").manifest_hash) == {}
    report = ckptfmt.verify(repo.url)
    assert report.ok and any("copy-hostZ.json: malformed copy record" in w for w in report.warnings)


@pytest.mark.parametrize(("document", "message"), [
    ({"format": "ckptfmt-signature"}, "not a copy record"),
    ({"format": "ckptfmt-copy", "version": "1.10"}, "malformed version"),
    ({"format": "ckptfmt-copy", "version": [1, 10], "host": "../x"}, "host must be a host name"),
    ({"format": "ckptfmt-copy", "version": [1, 10], "host": "b", "manifest": "ab"}, "64 hex digits"),
    ({"format": "ckptfmt-copy", "version": [1, 10], "host": "b", "manifest": "a" * 64, "copied_ns": 1,
      "chunks": -1, "bytes": 0}, "integers >= 0"),
])
def test_a_malformed_copy_record_is_refused_naming_the_rule(document, message):
    with pytest.raises(ManifestError, match=message):
        CopyRecord.from_bytes(json.dumps(document).encode(), "REPO/a/copy-b.json")


def test_copy_record_names_are_hosts_that_are_valid_names():
    assert copy_key("step-1", "node-7.cluster") == "step-1/copy-node-7.cluster.json"
    assert copy_entry_host("copy-node-7.cluster.json") == "node-7.cluster"
    assert copy_entry_host("signature-0123456789abcdef.json") is None
    with pytest.raises(ValueError, match="cannot name a copy record"):
        copy_key("step-1", "../etc")


def test_the_lost_nodes_a_tier_survives_are_a_number_of_nodes():
    assert ckptfmt.Tier("/nvme/run", scope="node").survives == 1
    with pytest.raises(ValueError, match=r"survives= \(the lost nodes it survives\) must be an int >= 0"):
        ckptfmt.Tier("/nvme/run", scope="node", survives=-1)
    # Issue 50: its name until 1.2.0 warns and works, as a keyword and as an attribute.
    with pytest.warns(DeprecationWarning, match="use survives="):
        old = ckptfmt.Tier("/nvme/run", scope="node", replicas=2)
    with pytest.warns(DeprecationWarning, match="Tier.survives"):
        assert old.replicas == 2 and old == ckptfmt.Tier("/nvme/run", scope="node", survives=2)
