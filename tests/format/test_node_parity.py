"""Parity across nodes (spec 9.8, format/node_parity.py; issue 48 part 2): the stripes dealt from the nodes'
streams, their rebuild after any M lost nodes, the holder's record, and hostile records refused by rule.
The exchange between real leaders is tests/lifecycle/test_node_parity_job.py and tests/hosts/."""

from __future__ import annotations

import itertools
import random
import time
from types import SimpleNamespace

import msgpack
import pytest

import ckptfmt
from ckptfmt.errors import ManifestError, UnsupportedVersionError
from ckptfmt.format import erasure
from ckptfmt.format.node_parity import (
    MAX_NODE_PIECES,
    HeldPiece,
    NodeParityRecord,
    NodeStripes,
    piece_key,
    record_holder,
    record_key,
)
from ckptfmt.lifecycle.peer_parity import piece_size
from ckptfmt.lifecycle.peer_parity_refills import ParityHeld, plan
from tests.support import spec_reader

HASH = "ab" * 32


def streams(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for size in sizes]


def encode_all(stripes: NodeStripes, data: list[bytes]) -> dict[tuple[int, int], bytes]:
    """(round, place) -> parity piece, as the first holders compute them."""
    parity = {}
    for stripe in stripes.rounds():
        if stripe.length:
            pieces = [data[node][offset:offset + length] for node, offset, length in stripe.data]
            for place, piece in enumerate(erasure.encode(pieces, stripes.k, stripes.m, stripe.length)):
                parity[stripe.index, place] = bytes(piece)
    return parity


@pytest.mark.parametrize("sizes, m, piece", [([1000, 1000, 1000, 1000], 1, 64), ([5000, 10, 0, 777], 1, 100),
                                             ([300, 300, 300, 300, 300], 2, 7), ([64, 9000], 1, 256)])
def test_every_byte_of_every_stream_is_in_one_stripe_and_holders_rotate(sizes, m, piece):
    stripes = NodeStripes(tuple(sizes), m, piece)
    given: list[list[tuple[int, int]]] = [[] for _ in sizes]
    first_holders = []
    for stripe in stripes.rounds():
        assert stripe.holders == tuple((stripe.index + j) % len(sizes) for j in range(m))
        assert [node for node, _, _ in stripe.data] == [n for n in range(len(sizes)) if n not in stripe.holders]
        assert stripe.length == max(length for _, _, length in stripe.data)
        for node, offset, length in stripe.data:
            if length:
                given[node].append((offset, length))
        first_holders.append(stripe.holders[0])
    for node, ranges in enumerate(given):  # each stream tiled in order, from 0 to its end
        assert sum(length for _, length in ranges) == sizes[node]
        assert [offset for offset, _ in ranges] == [piece * i for i in range(len(ranges))]
    for start in range(0, len(first_holders), len(sizes)):  # each node first holder once a period
        period = first_holders[start:start + len(sizes)]
        assert len(set(period)) == len(period)


@pytest.mark.parametrize("n, m", [(2, 1), (3, 1), (4, 1), (4, 2), (5, 2), (6, 3)])
def test_any_m_lost_nodes_are_rebuilt_bit_for_bit_and_m_plus_one_are_refused(n, m):
    sizes = [700 + 131 * node for node in range(n)]
    data = streams(sizes, seed=n * 10 + m)
    stripes = NodeStripes(tuple(sizes), m, 96)
    parity = encode_all(stripes, data)
    hosts = tuple(f"node{i}" for i in range(n))
    kept = {holder: frozenset(key for key in parity if stripes.holders(key[0])[key[1]] == holder)
            for holder in range(n)}
    for lost in itertools.combinations(range(n), m):
        held = {node: ParityHeld(hosts, stripes, kept[node]) for node in range(n) if node not in lost}
        rebuilt = {node: bytearray() for node in lost}
        for step in plan(held, set(range(n)) - set(lost), set(lost)):
            available = {}
            for index, node, length in step.sources:
                if index < stripes.k:
                    _, offset, _ = step.stripe.data[index]
                    available[index] = data[node][offset:offset + length]
                else:
                    available[index] = parity[step.stripe.index, index - stripes.k]
            for receiver in step.receivers:
                mine = next(i for i, (node, _, _) in enumerate(step.stripe.data) if node == receiver)
                piece = erasure.rebuild(available, stripes.k, m, step.stripe.length, stripes.k, [mine])[mine]
                rebuilt[receiver] += piece[:step.stripe.data[mine][2]]
        assert {node: bytes(b) for node, b in rebuilt.items()} == {node: data[node] for node in lost}, lost
    if m + 1 < n:
        lost = set(range(m + 1))
        held = {node: ParityHeld(hosts, stripes, kept[node]) for node in range(n) if node not in lost}
        with pytest.raises(ckptfmt.CheckpointError, match=f"keeps {n - m - 1} of its {n} pieces, {n - m} are "
                                                          f"needed .parity across nodes survives {m} lost node"):
            plan(held, set(range(n)) - lost, lost)


@pytest.mark.parametrize("n, m, piece", [(3, 1, 40), (4, 2, 33), (2, 1, 64)])
def test_a_second_reader_from_the_spec_alone_computes_the_same_parity_and_rebuilds_lost_nodes(n, m, piece):
    """tests/support/spec_reader.py, written from FORMAT.md 9.8 and 5.6 with reedsolo's arithmetic: the
    same rounds, the same parity bytes as the holders compute, and lost nodes' streams solved."""
    sizes = [150 + 37 * node for node in range(n)]
    sizes[-1] = 0 if n > 2 else sizes[-1]  # a node that holds nothing gives empty pieces
    data = streams(sizes, seed=n + m)
    stripes = NodeStripes(tuple(sizes), m, piece)
    parity = encode_all(stripes, data)
    assert spec_reader.node_parity(data, m, piece) == parity
    assert [(r, holders) for r, holders, _ in spec_reader.node_rounds(sizes, m, piece)] == \
        [(s.index, list(s.holders)) for s in stripes.rounds()]
    for lost in itertools.combinations(range(n), m):
        known = {node: data[node] for node in range(n) if node not in lost}
        kept = {key: piece for key, piece in parity.items() if stripes.holders(key[0])[key[1]] not in lost}
        assert spec_reader.node_rebuild(known, kept, sizes, m, piece) == {node: data[node] for node in lost}


def test_a_lost_parity_piece_counts_as_lost():
    """A holder whose record is gone (or damaged) keeps nothing: with M=1 a lost data node is then not
    rebuilt in the rounds that holder held."""
    stripes = NodeStripes((500, 500, 500), 1, 64)
    hosts = ("a", "b", "c")
    held = {1: ParityHeld(hosts, stripes, frozenset())}
    with pytest.raises(ckptfmt.CheckpointError, match="keeps 1 of its 3 pieces, 2 are needed"):
        plan(held, {1, 2}, {0})


@pytest.mark.parametrize("n, m", [(4, 1), (8, 2), (5, 1)])
def test_parity_stored_is_m_over_n_minus_m_of_the_data(n, m):
    sizes = [64 << 20] * n
    stripes = NodeStripes(tuple(sizes), m, piece_size(tuple(sizes), m))
    stored = sum(stripe.length * m for stripe in stripes.rounds())
    assert stored / sum(sizes) == pytest.approx(m / (n - m), rel=0.01)


def test_piece_sizes_stay_within_the_round_and_the_layouts_bounds():
    assert piece_size((100, 100, 100), 1) == 64  # small states: the smallest piece, rounds enough to spread
    assert piece_size((3 << 30,) * 4, 1) == 16 << 20  # large: 16 MiB, K of them a round
    assert piece_size((3 << 30,) * 64, 1) == (256 << 20) // 63 // 64 * 64  # many nodes: K pieces a round
    for sizes, m in [((0, 0), 1), ((10**12, 5), 1), ((1 << 40,) * 3, 2)]:
        piece = piece_size(sizes, m)
        assert NodeStripes(sizes, m, piece).piece == piece  # within MAX_NODE_PIECES
        assert max(-(-s // piece) for s in sizes) <= MAX_NODE_PIECES


def manifest_of(sizes: list[int], hosts: list[str] | None = None) -> SimpleNamespace:
    """The parts of a node-scoped manifest the layout reads: one chunk per node of ``sizes`` stored bytes."""
    hosts = hosts or [f"node{i}" for i in range(len(sizes))]
    nodes = [SimpleNamespace(host=host, rows=(row,)) for row, host in enumerate(hosts)]
    return SimpleNamespace(placement=SimpleNamespace(nodes=nodes),
                           chunks=[SimpleNamespace(stored_size=size) for size in sizes])


def record_for(manifest, holder: str, m: int = 1, piece: int = 64) -> NodeParityRecord:
    sizes = tuple(c.stored_size for c in manifest.chunks)
    me = [node.host for node in manifest.placement.nodes].index(holder)
    pieces = tuple(HeldPiece(s.index, s.holders.index(me), s.length, HASH)
                   for s in NodeStripes(sizes, m, piece).rounds() if s.length and me in s.holders)
    return NodeParityRecord("step-4", "cd" * 32, holder, m, piece, pieces)


def test_a_record_round_trips_and_fits_its_checkpoints_stripes():
    manifest = manifest_of([1000, 900, 800, 10])
    record = record_for(manifest, "node2")
    again = NodeParityRecord.from_bytes(record.to_bytes(), "r")
    assert again == record and again.pieces and again.version == ckptfmt.FORMAT_VERSION
    assert again.check_layout(manifest).sizes == (1000, 900, 800, 10)
    assert msgpack.unpackb(record.to_bytes())["requires"] == ["node-parity"]
    assert record_key("step-4", "node2") == "step-4/node-parity-node2.msgpack"
    assert piece_key("step-4", "node2", 7, 0) == "step-4/node-parity-node2.7.0.bin"
    assert record_holder("node-parity-node-7.cluster.msgpack") == "node-7.cluster"
    assert record_holder("node-parity-node2.7.0.bin") is None and record_holder("parity-" + HASH + ".msgpack") is None
    with pytest.raises(ValueError, match="cannot name node parity"):
        record_key("step-4", "../etc")


def hostile(**changes) -> bytes:
    doc = msgpack.unpackb(record_for(manifest_of([1000, 900, 800, 10]), "node2").to_bytes())
    doc.update(changes)
    return msgpack.packb(doc)


@pytest.mark.parametrize("changes, error", [
    ({"format": "ckptfmt-parity"}, "not a ckptfmt node-parity object"),
    ({"requires": ["node-parity", "from-the-future"]}, "upgrade"),
    ({"requires": []}, "uses node-parity without declaring it"),
    ({"version": [2, 0]}, "came with format 2.1"),
    ({"version": [3, 0]}, "upgrade"),
    ({"code": "rs-cauchy"}, "unknown code"),
    ({"name": "../x"}, "not a checkpoint name"),
    ({"manifest": "zz"}, "manifest must be 64 hex"),
    ({"holder": "a/b"}, "holder must be a host name"),
    ({"m": 0}, "m must be an integer in"),
    ({"m": True}, "m must be an integer in"),
    ({"piece": 0}, "piece must be an integer in"),
    ({"piece": 2**40}, "piece must be an integer in"),
    ({"pieces": {}}, "pieces must be an array"),
    ({"pieces": [[0, 0, 10]]}, "not .round, place, length, hash."),
    ({"pieces": [[3, 0, 10, HASH], [3, 0, 10, HASH]]}, "out of order"),
    ({"pieces": [[3, 1, 10, HASH]]}, "out of order or out of range"),
    ({"pieces": [[3, 0, 65, HASH]]}, "out of order or out of range"),
    ({"pieces": [[3, 0, 10, "nothex"]]}, "hash must be 64 hex"),
    ({"extra": [1] * 10}, None),  # unknown members are ignored
])
def test_hostile_records_are_refused_by_rule(changes, error):
    if error is None:
        assert NodeParityRecord.from_bytes(hostile(**changes), "r").holder == "node2"
        return
    with pytest.raises((ManifestError, UnsupportedVersionError), match=error):
        NodeParityRecord.from_bytes(hostile(**changes), "REPO/step-4/node-parity-node2.msgpack")


@pytest.mark.parametrize("pieces, error", [
    (lambda p: p[:-1], "expected, found nothing"),
    (lambda p: p + [[10**6, 0, 10, HASH]], "which node2 holds no parity of"),
    (lambda p: [[p[0][0], p[0][1], p[0][2] - 1, HASH]] + p[1:], "expected, found round"),
])
def test_a_record_that_does_not_fit_its_checkpoints_stripes_is_refused(pieces, error):
    manifest = manifest_of([1000, 900, 800, 10])
    listed = [[p.index, p.place, p.length, p.digest] for p in record_for(manifest, "node2").pieces]
    record = NodeParityRecord.from_bytes(hostile(pieces=pieces(listed)), "r")
    with pytest.raises(ManifestError, match=error):
        record.check_layout(manifest)
    with pytest.raises(ManifestError, match="holder 'node9' is none of the checkpoint's nodes"):
        NodeParityRecord.from_bytes(hostile(holder="node9"), "r").check_layout(manifest)


def test_a_record_whose_pieces_cut_streams_too_fine_is_refused_in_bounded_time():
    manifest = manifest_of([1 << 40, 5, 5, 5])  # a claimed 1 TiB stream in 1-byte pieces: 2^40 rounds
    record = NodeParityRecord.from_bytes(hostile(piece=1, pieces=[]), "r")
    started = time.perf_counter()
    with pytest.raises(ManifestError, match="more than 1048576"):
        record.check_layout(manifest)
    assert time.perf_counter() - started < 1
    with pytest.raises(ManifestError, match="over the .* limit"):
        NodeParityRecord.from_bytes(b"\x00" * (64 * 2**20 + 1), "r")

