"""Parity across the nodes of a node-scoped checkpoint (spec 9.8, "Parity across nodes", 2.1).

Each node's *stream* is the stored bytes of its placement rows, end to end in row order. The streams are
cut into pieces of one size and dealt into stripes, one round at a time: in round r the nodes
(r + j) mod N, j = 0..M-1, hold the round's M parity pieces, and each other node gives its next piece
(the K = N-M data pieces, in node order). The holders rotate round the ring, so every node holds about
M/K of a node's data in parity, and any M lost nodes lose at most M pieces of each stripe: the rest
rebuild them with the code of spec 5.6.

Everything here is arithmetic over the manifest's placement: which node gives which bytes to which
round, and the record a holder keeps of the parity pieces it holds (``NAME/node-parity-<host>.msgpack``,
each piece at ``NAME/node-parity-<host>.<round>.<place>.bin``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgpack

from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.erasure import CODE, check_coded_object, check_parameters
from ckptfmt.format.features import version_fields
from ckptfmt.format.limits import HASH_PATTERN, NAME_PATTERN, check_name
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.maps import parse_object
from ckptfmt.format.version import FORMAT_VERSION

NODE_PARITY_FORMAT = "ckptfmt-node-parity"
#: The feature a node parity record requires (spec 13.2).
FEATURE = "node-parity"
#: A record lists a few numbers per piece its holder keeps.
MAX_RECORD_BYTES = 64 * 2**20
#: A piece is at most this long (a holder receives K of them at a time).
MAX_PIECE_BYTES = 64 * 2**20
#: Pieces of one node's stream at most: the layout is computed round by round, in bounded time.
MAX_NODE_PIECES = 2**20
_PREFIX, _RECORD_SUFFIX, _PIECE_SUFFIX = "node-parity-", ".msgpack", ".bin"


@dataclass(frozen=True)
class Round:
    """One stripe: its holders (node indices, place j = 0..M-1), its data pieces as (node, offset in that
    node's stream, length) in node order, and its length (its longest data piece; 0: an empty stripe,
    which has no parity)."""

    index: int
    holders: tuple[int, ...]
    data: tuple[tuple[int, int, int], ...]
    length: int


@dataclass(frozen=True)
class NodeStripes:
    """The stripes of N node streams of ``sizes`` bytes under parity M with pieces of ``piece`` bytes."""

    sizes: tuple[int, ...]
    m: int
    piece: int

    def __post_init__(self) -> None:
        n = len(self.sizes)
        if n < 2 or not 1 <= self.m < n:
            raise ValueError(f"parity across {n} nodes must survive 1 to {n - 1} lost nodes, not {self.m}")
        check_parameters(self.k, self.m)
        if not 1 <= self.piece <= MAX_PIECE_BYTES:
            raise ValueError(f"a piece of {self.piece} bytes is not in [1, {MAX_PIECE_BYTES}]")
        if max(-(-size // self.piece) for size in self.sizes) > MAX_NODE_PIECES:
            raise ValueError(f"pieces of {self.piece} bytes cut a node's stream into more than {MAX_NODE_PIECES}")

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def k(self) -> int:
        return len(self.sizes) - self.m

    def holders(self, index: int) -> tuple[int, ...]:
        """The nodes holding round ``index``'s parity, by place."""
        return tuple((index + j) % self.n for j in range(self.m))

    def rounds(self) -> Iterator[Round]:
        """Every round up to the last one with data, in order (empty ones included: a node whose stream is
        shorter gives empty pieces)."""
        taken = [0] * self.n  # pieces each node has given
        wanted = [-(-size // self.piece) for size in self.sizes]
        index = 0
        while any(t < w for t, w in zip(taken, wanted)):
            holders = self.holders(index)
            data = []
            for node in range(self.n):
                if node in holders:
                    continue
                offset = taken[node] * self.piece
                data.append((node, offset, max(0, min(self.piece, self.sizes[node] - offset))))
                taken[node] += 1
            yield Round(index, holders, tuple(data), max(length for _, _, length in data))
            index += 1


def node_sizes(manifest: Manifest) -> tuple[int, ...]:
    """Each placement node's stream length: the stored bytes of its rows."""
    if manifest.placement is None:
        raise ManifestError("parity across nodes needs a node-scoped checkpoint (a placement)")
    chunks = manifest.chunks
    return tuple(sum(chunks[row].stored_size for row in node.rows) for node in manifest.placement.nodes)


@dataclass(frozen=True)
class HeldPiece:
    """A parity piece a holder keeps: round ``index``'s place ``place``, ``length`` bytes hashing to ``digest``."""

    index: int
    place: int
    length: int
    digest: str


@dataclass(frozen=True)
class NodeParityRecord:
    """The parity pieces node ``holder`` keeps of checkpoint ``name`` (manifest ``manifest_hash``)."""

    name: str
    manifest_hash: str
    holder: str
    m: int
    piece: int
    pieces: tuple[HeldPiece, ...]
    version: tuple[int, int] = FORMAT_VERSION

    @property
    def stored_bytes(self) -> int:
        return sum(p.length for p in self.pieces)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "format": NODE_PARITY_FORMAT,
            **version_fields(self.version, [FEATURE]),
            "name": self.name,
            "manifest": self.manifest_hash,
            "holder": self.holder,
            "code": CODE,
            "m": self.m,
            "piece": self.piece,
            "pieces": [[p.index, p.place, p.length, p.digest] for p in self.pieces],
        })

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> NodeParityRecord:
        """The record in ``data``, every member checked by itself; ``check_layout`` checks it against its
        checkpoint. Errors name ``where``."""
        return parse_object(data, where, NODE_PARITY_FORMAT, MAX_RECORD_BYTES, _parse)

    def check_layout(self, manifest: Manifest) -> NodeStripes:
        """The stripes of ``manifest``'s nodes under this record, which must list exactly the non-empty
        rounds' pieces its holder keeps, with their lengths; ManifestError otherwise."""
        hosts = [node.host for node in manifest.placement.nodes] if manifest.placement is not None else []
        if self.holder not in hosts:
            raise ManifestError(f"node parity record's holder {self.holder!r} is none of the checkpoint's nodes")
        try:
            stripes = NodeStripes(node_sizes(manifest), self.m, self.piece)
        except ValueError as exc:
            raise ManifestError(f"node parity record: {exc}") from None
        me = hosts.index(self.holder)
        listed = iter(self.pieces)
        for stripe in stripes.rounds():
            if not stripe.length or me not in stripe.holders:
                continue
            expected = (stripe.index, stripe.holders.index(me), stripe.length)
            found = next(listed, None)
            if found is None or (found.index, found.place, found.length) != expected:
                got = "nothing" if found is None else f"round {found.index}, place {found.place}, {found.length} bytes"
                raise ManifestError(f"node parity record: round {expected[0]}'s piece at place {expected[1]} "
                                    f"({expected[2]} bytes) expected, found {got}")
        extra = next(listed, None)
        if extra is not None:
            raise ManifestError(f"node parity record lists round {extra.index}, which {self.holder} holds no "
                                f"parity of")
        return stripes


def _parse(doc: dict) -> NodeParityRecord:
    version, name, manifest = check_coded_object(doc, "node parity record", FEATURE)
    holder = doc["holder"]
    if not isinstance(holder, str) or not NAME_PATTERN.fullmatch(holder):
        raise ManifestError(f"holder must be a host name, found {quoted(holder)}")
    m, piece = doc["m"], doc["piece"]
    if type(m) is not int or not 1 <= m < 256:
        raise ManifestError(f"m must be an integer in [1, 255], found {quoted(m)}")
    if type(piece) is not int or not 1 <= piece <= MAX_PIECE_BYTES:
        raise ManifestError(f"piece must be an integer in [1, {MAX_PIECE_BYTES}], found {quoted(piece)}")
    pieces = doc["pieces"]
    if type(pieces) is not list:
        raise ManifestError("pieces must be an array")
    held, last = [], -1
    for entry in pieces:
        if type(entry) is not list or len(entry) != 4 or not all(type(v) is int for v in entry[:3]):
            raise ManifestError("a piece is not [round, place, length, hash]")
        index, place, length, digest = entry
        if index <= last or not 0 <= place < m or not 1 <= length <= piece:
            raise ManifestError(f"piece [{index}, {place}, {length}] is out of order or out of range "
                                f"(rounds increasing, place < m={m}, length in [1, {piece}])")
        if not isinstance(digest, str) or not HASH_PATTERN.fullmatch(digest):
            raise ManifestError(f"round {index}'s piece hash must be 64 hex digits, found {quoted(digest)}")
        held.append(HeldPiece(index, place, length, digest))
        last = index
    return NodeParityRecord(name, manifest, holder, m, piece, tuple(held), version)


def record_key(name: str, holder: str) -> str:
    """The key of the record of the parity node ``holder`` keeps of checkpoint ``name``."""
    return f"{check_name(name)}/{_PREFIX}{_host(holder)}{_RECORD_SUFFIX}"


def piece_key(name: str, holder: str, index: int, place: int) -> str:
    """The key of the parity piece at ``place`` of round ``index`` that ``holder`` keeps."""
    return f"{check_name(name)}/{_PREFIX}{_host(holder)}.{index}.{place}{_PIECE_SUFFIX}"


def record_holder(entry: str) -> str | None:
    """The holder a checkpoint folder's entry names as a node parity record, else None."""
    if not (entry.startswith(_PREFIX) and entry.endswith(_RECORD_SUFFIX)):
        return None
    host = entry[len(_PREFIX):-len(_RECORD_SUFFIX)]
    return host if NAME_PATTERN.fullmatch(host) else None


def _host(host: str) -> str:
    if not NAME_PATTERN.fullmatch(host):
        raise ValueError(f"host name {host!r} cannot name node parity (spec 9.8: letters, digits, '.', '_', '-')")
    return host


__all__ = ["FEATURE", "NODE_PARITY_FORMAT", "HeldPiece", "NodeParityRecord", "NodeStripes", "Round", "node_sizes",
           "piece_key", "record_holder", "record_key"]
