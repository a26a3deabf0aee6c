"""Protecting a checkpoint's stored objects with parity, and rebuilding lost ones from it (spec 5.6).

ckptfmt's striping (a writer's choice; a reader follows the record): objects are cut into pieces of at
most ``PIECE_LIMIT`` bytes, the pieces sorted longest first (among equal lengths, those of objects cut
into the most pieces first, which must spread over that many stripes) and dealt first-fit into stripes of
K pieces from K different objects. A lost or damaged object is then one missing piece in each stripe it touches:
any M lost objects of a stripe rebuild, whatever their sizes, and the padding of short pieces stays small
(pieces of similar length share a stripe). Whole objects are the unit because they are what storage loses
and what BLAKE3 finds damaged. Memory is bounded by the pieces in flight: each object is read once and
dropped when its last piece is encoded.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptfmt.errors import CheckpointError, CorruptDataError, StorageError
from ckptfmt.format import erasure
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.parity_record import ParityRecord, Piece, Stripe
from ckptfmt.format.version import FORMAT_VERSION

#: The longest piece ckptfmt cuts: K of them are held per stripe being encoded.
PIECE_LIMIT = 16 * 2**20

#: The verified bytes of a protected object, given its key and size (a save's memory, or a read back).
ReadObject = Callable[[str, int], bytes | bytearray | memoryview]


def parse_parity(text: str) -> tuple[int, int]:
    """``"K+M"`` as (K, M); ValueError naming the rule otherwise."""
    k_text, plus, m_text = str(text).partition("+")
    if not plus or not k_text.isdigit() or not m_text.isdigit():
        raise ValueError(f"parity {text!r}: write it K+M, for example 8+2 (K data pieces, M parity pieces a stripe)")
    k, m = int(k_text), int(m_text)
    erasure.check_parameters(k, m)
    return k, m


def plan_stripes(sizes: list[int], k: int, piece_limit: int = PIECE_LIMIT) -> list[list[Piece]]:
    """Stripes of at most ``k`` pieces of distinct objects covering objects of ``sizes`` (see the module)."""
    pieces = [Piece(obj, offset, min(piece_limit, size - offset))
              for obj, size in enumerate(sizes) for offset in range(0, size, piece_limit)]
    # An object of n pieces needs n stripes: dealt first, its pieces open them, and the objects of one piece
    # fill them up; dealt last, they would open stripes that only shorter pieces are left to fill (padding).
    count = Counter(p.obj for p in pieces)
    pieces.sort(key=lambda p: (-p.length, -count[p.obj], p.obj, p.offset))
    stripes: list[list[Piece]] = []
    members: list[set[int]] = []
    open_stripes: list[int] = []  # indices of stripes with room, oldest first
    for piece in pieces:
        place = next((p for p, i in enumerate(open_stripes) if piece.obj not in members[i]), len(open_stripes))
        if place == len(open_stripes):
            open_stripes.append(len(stripes))
            stripes.append([])
            members.append(set())
        index = open_stripes[place]
        stripes[index].append(piece)
        members[index].add(piece.obj)
        if len(stripes[index]) == k:
            del open_stripes[place]
    return stripes


class _HeldObjects:
    """Each object's bytes, read once and held until its last piece has been used."""

    def __init__(self, objects: tuple[tuple[str, int], ...], uses: Counter, read: ReadObject):
        self._objects, self._uses, self._read = objects, uses, read
        self._held: dict[int, bytes | bytearray | memoryview] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    def piece(self, piece: Piece) -> memoryview:
        with self._lock:
            lock = self._locks.setdefault(piece.obj, threading.Lock())
        with lock:
            data = self._held.get(piece.obj)
            if data is None:
                key, size = self._objects[piece.obj]
                data = self._read(key, size)
                if len(data) != size:
                    raise CorruptDataError(f"{key}: {len(data)} bytes, {size} expected")
                self._held[piece.obj] = data
        return memoryview(data)[piece.offset : piece.offset + piece.length]

    def release(self, pieces: Iterable[Piece]) -> None:
        with self._lock:
            for piece in pieces:
                self._uses[piece.obj] -= 1
                if self._uses[piece.obj] == 0:
                    self._held.pop(piece.obj, None)


def protect(name: str, manifest_hash: str, objects: list[tuple[str, int]], k: int, m: int, read: ReadObject,
            write_parity: Callable[[str, bytes], None], *, workers: int = 2,
            version: tuple[int, int] = FORMAT_VERSION) -> ParityRecord:
    """The parity record of checkpoint ``name`` protecting ``objects`` (key, size) with the K+M code; each
    parity object is handed to ``write_parity(key, data)`` as it is made."""
    erasure.check_parameters(k, m)
    frozen = tuple(objects)
    plans = plan_stripes([size for _, size in frozen], k)
    held = _HeldObjects(frozen, Counter(p.obj for plan in plans for p in plan), read)

    def encode(plan: list[Piece]) -> Stripe:
        length = max(p.length for p in plan)
        try:
            parity = erasure.encode([held.piece(p) for p in plan], k, m, length)
        finally:
            held.release(plan)
        stripe = Stripe(length, tuple(plan), tuple(chunk_hash(data) for data in parity))
        for key, data in zip(stripe.keys, parity):
            write_parity(key, data)
        return stripe

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptfmt-parity") as pool:
        stripes = tuple(pool.map(encode, plans))
    return ParityRecord(name, manifest_hash, k, m, frozen, stripes, version)


@dataclass
class Rebuilt:
    """What a rebuild made: lost objects' bytes (unchecked: the caller checks each against its name) and
    lost parity objects' bytes by key (checked against their names here), and what it could not rebuild."""

    objects: dict[int, bytes] = field(default_factory=dict)
    parity: dict[str, bytes] = field(default_factory=dict)
    #: Object index -> why it cannot be rebuilt.
    failed: dict[int, str] = field(default_factory=dict)
    #: Parity object key -> why it cannot be rebuilt.
    failed_parity: dict[str, str] = field(default_factory=dict)


def erasures(record: ParityRecord, lost: set[int], bad_parity: set[str]) -> list[int]:
    """Pieces lost in each stripe: its pieces of ``lost`` objects and its parity objects (keys) in ``bad_parity``."""
    return [sum(p.obj in lost for p in s.pieces) + sum(key in bad_parity for key in s.keys) for s in record.stripes]


def rebuildable(record: ParityRecord, lost: set[int], bad_parity: set[str]) -> tuple[set[int], set[str]]:
    """The ``lost`` objects and ``bad_parity`` objects that every stripe holding them can rebuild."""
    counts = erasures(record, lost, bad_parity)
    objects, parity = set(lost), set(bad_parity)
    for stripe, count in zip(record.stripes, counts):
        if count > record.m:
            objects -= {p.obj for p in stripe.pieces}
            parity -= set(stripe.keys)
    return objects, parity


def rebuild(record: ParityRecord, lost: set[int], bad_parity: set[str], read: ReadObject,
            read_parity: Callable[[str, int], bytes]) -> Rebuilt:
    """Rebuild the ``lost`` objects and ``bad_parity`` parity objects (keys) of ``record`` from the other
    pieces of their stripes. Parity pieces are read first (``read_parity(key, length)`` checks each against
    its name); a parity object that fails there counts as lost too. Objects not in ``lost`` are taken as good."""
    out = Rebuilt()
    touched = [s for s in record.stripes if any(p.obj in lost for p in s.pieces) or set(s.keys) & bad_parity]
    uses = Counter(p.obj for s in touched for p in s.pieces if p.obj not in lost)
    held = _HeldObjects(record.objects, uses, read)
    assembled = {obj: bytearray(record.objects[obj][1]) for obj in lost}
    for stripe in touched:
        _rebuild_stripe(record, stripe, lost, bad_parity, held, read_parity, assembled, out)
    for obj, data in assembled.items():
        if obj not in out.failed:
            out.objects[obj] = bytes(data)
    return out


def _rebuild_stripe(record: ParityRecord, stripe: Stripe, lost: set[int], bad_parity: set[str], held: _HeldObjects,
                    read_parity: Callable[[str, int], bytes], assembled: dict[int, bytearray], out: Rebuilt) -> None:
    k, m = record.k, record.m
    available: dict[int, bytes | memoryview] = {}
    bad = set(bad_parity)
    for j, key in enumerate(stripe.keys):
        if key in bad:
            continue
        try:
            available[k + j] = read_parity(key, stripe.length)
        except StorageError:
            raise
        except CheckpointError:
            bad.add(key)
    wanted = [i for i, p in enumerate(stripe.pieces) if p.obj in lost]
    wanted += [k + j for j, key in enumerate(stripe.keys) if key in bad and key in bad_parity]
    good_members = [(i, p) for i, p in enumerate(stripe.pieces) if p.obj not in lost]
    missing = len(wanted) + sum(key in bad and key not in bad_parity for key in stripe.keys)
    try:
        for i, piece in good_members:
            if missing > m:
                break
            try:
                available[i] = held.piece(piece)
            except StorageError:
                raise
            except CheckpointError:  # missing or of the wrong size: lost too, if the others suffice
                missing += 1
        if missing > m:
            why = f"a stripe lost {missing} of its {len(stripe.pieces)}+{m} pieces; parity {k}+{m} rebuilds at most {m}"
            for i in wanted:
                if i < k:
                    out.failed.setdefault(stripe.pieces[i].obj, why)
                else:
                    out.failed_parity.setdefault(stripe.keys[i - k], why)
            return
        pieces = erasure.rebuild(available, k, m, stripe.length, len(stripe.pieces), wanted)
    finally:
        held.release(p for _, p in good_members)
    for i, data in pieces.items():
        if i < k:
            piece = stripe.pieces[i]
            assembled[piece.obj][piece.offset : piece.offset + piece.length] = data[: piece.length]
        else:
            if chunk_hash(data) == stripe.parity[i - k]:
                out.parity[stripe.keys[i - k]] = data
            else:
                out.failed_parity[stripe.keys[i - k]] = "its rebuilt bytes do not hash to its name (a piece is damaged)"


__all__ = ["PIECE_LIMIT", "Rebuilt", "erasures", "parse_parity", "plan_stripes", "protect", "rebuild", "rebuildable"]
