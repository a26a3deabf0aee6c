"""A node-scoped checkpoint's placement (spec 9.8, format 1.10): written by a save with scope="node",
read back, and refused, naming the rule, when a manifest's placement breaks one."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import ManifestError
from ckptfmt.repository.repository import Repository
from tests.support.helpers import rewrite_manifest


def test_a_node_scoped_save_by_one_process_places_every_chunk_on_its_node(tmp_path, capsys):
    url = ckptfmt.save({"w": torch.arange(100_000.0), "b": torch.ones(3)}, tmp_path / "run" / "a", scope="node")
    with ckptfmt.open(url) as reader:
        (node,) = reader.manifest.placement.nodes
        every = tuple(range(len(reader.manifest.chunks)))
        assert (node.host, node.ranks, node.rows) == (socket.gethostname(), (0,), every)
    assert ckptfmt.verify(str(tmp_path / "run")).ok
    assert main(["show", url]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"placement node-scoped, 1 node: {socket.gethostname()} (rank 0): 2 of 2 chunks" in shown
    assert main(["ls", str(tmp_path / "run")]) == 0
    assert "a (1 node)" in capsys.readouterr().out  # from the commit record's copy of the totals
    assert Repository.open(str(tmp_path / "run")).commit("a").totals["nodes"] == 1
    with pytest.raises(ValueError, match="node-scoped repository does not promise"):
        ckptfmt.save({"w": torch.ones(3)}, tmp_path / "run" / "b", scope="node", compression="delta-zstd")
    with pytest.raises(ValueError, match="scope must be one of job, node"):
        ckptfmt.save({"w": torch.ones(3)}, tmp_path / "run" / "b", scope="host")


def rows(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


@pytest.mark.parametrize(("placement", "message"), [
    ([1, 2], "has type list"),
    ({"scope": "job", "nodes": []}, "scope 'node'"),
    ({"scope": "node", "nodes": [{"host": "", "ranks": [0], "chunks": b""}]}, r"host must be a non-empty string"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [-1], "chunks": b""}]}, r"ranks must be a non-empty list"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [], "chunks": b""}]}, r"ranks must be a non-empty list"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [0], "chunks": b"\x00\x00\x00"}]}, "little-endian uint32"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [0], "chunks": rows(7)}]}, "increasing rows"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [0], "chunks": rows(0, 0)}]}, "increasing rows"),
    ({"scope": "node", "nodes": [{"host": "a", "ranks": [0], "chunks": rows(0)},
                                 {"host": "a", "ranks": [1], "chunks": rows(0)}]}, "names a host twice"),
    ({"scope": "node", "nodes": [{"host": "b", "ranks": [2, 3], "chunks": rows(0)},  # issue 46: was accepted
                                 {"host": "a", "ranks": [1, 0], "chunks": rows(1)}]},
     r"nodes\[1\] \(lowest rank 0\) comes after a node whose lowest rank is 2"),
])
def test_a_placement_that_breaks_a_rule_is_refused_naming_it(tmp_path, placement, message):
    repo = tmp_path / "run"
    ckptfmt.save({"w": torch.ones(3), "big": torch.zeros(300_000)}, repo / "a")  # two chunks
    rewrite_manifest(Repository.open(str(repo)).storage, "a", lambda doc: doc.update(placement=placement))
    with pytest.raises(ManifestError, match=message):
        ckptfmt.open(f"{repo}/a")
