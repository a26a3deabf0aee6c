"""The pieces of a node-local tier's drain (lifecycle/peer_drains.py, issue 30 part 3) that need no
second host: each node copies its rows (``copy_rows``), the checkpoint is committed on the next tier
only once every chunk is there (``commit_copy`` after the check). The drain itself, across simulated
hosts, is in tests/hosts/."""

from __future__ import annotations

import json

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointNotFoundError, CorruptDataError
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.lifecycle.peer_drains import _check_every_chunk_there
from ckptfmt.lifecycle.replicate import commit_copy, copy_rows
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import Repository
from tests.support.helpers import torchrun


@pytest.fixture
def node_and_shared(tmp_path):
    ckptfmt.save({"a": torch.arange(300_000.0), "b": torch.ones(300_000), "c": torch.zeros(5)},
                 tmp_path / "node" / "step-1", step=1, chunk_size=1 << 20)
    return Repository.open(str(tmp_path / "node")), Repository.open(str(tmp_path / "shared"), create=True)


def test_parts_copied_by_two_senders_commit_once_every_chunk_is_there(node_and_shared):
    node, shared = node_and_shared
    record = node.commit("step-1")
    rows = range(len(node.manifest("step-1").chunks))
    first, second = [row for row in rows if row % 2 == 0], [row for row in rows if row % 2]
    assert first and second
    copied = copy_rows(node, shared, record, first, workers=2)
    assert copied[0] == len(first)
    with pytest.raises(CheckpointNotFoundError, match=rf"chunk is missing \({len(second)} chunks? no node sent\)"):
        _check_every_chunk_there(node, shared, record)
    assert shared.names() == []  # nothing committed while a part is missing
    copy_rows(node, shared, record, second, workers=2)
    _check_every_chunk_there(node, shared, record)
    with save_lease(shared) as lease:
        assert commit_copy(node, shared, record, lease)
    assert shared.commit("step-1").manifest_hash == record.manifest_hash
    assert ckptfmt.verify(shared.url).ok
    assert torch.equal(ckptfmt.load(f"{shared.url}/step-1")["a"], torch.arange(300_000.0))


def test_a_damaged_chunk_in_a_nodes_part_is_never_sent(node_and_shared):
    node, shared = node_and_shared
    record = node.commit("step-1")
    chunks = node.manifest("step-1").chunks
    with open(node.storage.path(stored_key(chunks, chunks[0])), "r+b") as damaged:
        damaged.write(b"\x01\x02\x03")
    with pytest.raises(CorruptDataError, match="not replicated"):
        copy_rows(node, shared, record, [0], workers=1)
    assert stored_key(chunks, chunks[0]) not in shared.storage.find("chunks")


@pytest.mark.distributed
def test_a_leader_whose_node_tier_cannot_be_opened_still_takes_its_turn(tmp_path):
    """A node whose tier cannot be opened holds no checkpoint: its leader takes its turns of the peer copy
    (the others expect it) and neither side copies anything (it raised UnboundLocalError before)."""
    (tmp_path / "a-file").write_text("not a folder")
    torchrun("peer_copy_unopened_tier.py", 2, str(tmp_path), str(tmp_path / "out"))
    for rank in range(2):
        found = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert found == {"problems": [], "broken": None}, (rank, found)
