"""The parity record (spec 5.6, 2.1): which stored objects of a checkpoint a Reed-Solomon code protects,
cut into which pieces, striped how, and the names of the parity objects, so that any M lost or damaged
pieces of a stripe are rebuilt from the other pieces with no replica anywhere.

The record is self-contained: it names every protected object by its key and size (the manifest among
them), so a checkpoint whose manifest is lost is rebuilt from the record alone. Everything is checked
before it is used: keys of the repository's forms only (no path escapes), pieces that tile each object
exactly, at most K pieces a stripe, M parity names, sizes within the format's limits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack

from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format import codecs
from ckptfmt.format.erasure import CODE, check_coded_object, check_parameters
from ckptfmt.format.features import version_fields
from ckptfmt.format.layout import PARITY_DIR
from ckptfmt.format.limits import (
    HASH_PATTERN,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    check_hash,
    check_name,
)
from ckptfmt.format.maps import parse_object
from ckptfmt.format.version import FORMAT_VERSION

PARITY_FORMAT = "ckptfmt-parity"
#: The feature a parity record requires (spec 13.2).
FEATURE = "parity"
#: A record is at most as large as a manifest.
MAX_RECORD_BYTES = MAX_MANIFEST_BYTES
#: A stripe's pieces are at most this long: a reader holds K+M segments of them, never whole pieces.
MAX_PIECE_BYTES = MAX_CHUNK_BYTES
#: The keys a record may name: a chunk (spec 4.1: a known codec's suffix, a base exactly for the delta
#: codecs) or the manifest of the record's checkpoint.
_CHUNK_KEY = re.compile(r"chunks/([0-9a-f]{2})/\1[0-9a-f]{62}(?:\.([a-z0-9-]{1,32})(?:\.([0-9a-f]{64}))?)?")


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of protected object ``obj`` (an index into the record's objects)."""

    obj: int
    offset: int
    length: int


@dataclass(frozen=True)
class Stripe:
    """Up to K data pieces, each zero-padded to ``length`` bytes, and the names of its M parity objects."""

    length: int
    pieces: tuple[Piece, ...]
    parity: tuple[str, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of its parity objects, one per place (two places of equal bytes are two objects)."""
        return tuple(parity_key(digest, place) for place, digest in enumerate(self.parity))


@dataclass(frozen=True)
class ParityRecord:
    """Checkpoint ``name`` (manifest ``manifest_hash``) protected by the K+M code: its objects and stripes."""

    name: str
    manifest_hash: str
    k: int
    m: int
    #: Every protected object: its key in the repository and its size in bytes.
    objects: tuple[tuple[str, int], ...]
    stripes: tuple[Stripe, ...]
    version: tuple[int, int] = FORMAT_VERSION

    @property
    def parity_bytes(self) -> int:
        """Bytes of parity objects the record names (a name shared by two stripes counts twice)."""
        return sum(s.length * len(s.parity) for s in self.stripes)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "format": PARITY_FORMAT,
            **version_fields(self.version, [FEATURE]),
            "name": self.name,
            "manifest": self.manifest_hash,
            "code": CODE,
            "k": self.k,
            "m": self.m,
            "objects": [key for key, _ in self.objects],
            "sizes": [size for _, size in self.objects],
            "stripes": [[s.length, [[p.obj, p.offset, p.length] for p in s.pieces], list(s.parity)]
                        for s in self.stripes],
        })

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ParityRecord:
        """The record in ``data``, every member checked (spec 5.6); errors name ``where``."""
        return parse_object(data, where, PARITY_FORMAT, MAX_RECORD_BYTES, _parse)


def _parse(doc: dict) -> ParityRecord:
    version, name, manifest = check_coded_object(doc, "parity record", FEATURE)
    k, m = doc["k"], doc["m"]
    try:
        check_parameters(k, m)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    objects = _objects(doc["objects"], doc["sizes"], name, manifest)
    stripes = doc["stripes"]
    if type(stripes) is not list or not stripes:
        raise ManifestError("stripes must be a non-empty array")
    parsed = tuple(_stripe(entry, i, k, m, objects) for i, entry in enumerate(stripes))
    _check_tiling(objects, parsed)
    return ParityRecord(name, manifest, k, m, objects, parsed, version)


def _check_tiling(objects: tuple[tuple[str, int], ...], stripes: tuple[Stripe, ...]) -> None:
    """Each object's pieces, by offset, cover it exactly: from 0, each where the last ended, to its end."""
    ranges: list[list[tuple[int, int]]] = [[] for _ in objects]
    for stripe in stripes:
        for piece in stripe.pieces:
            ranges[piece.obj].append((piece.offset, piece.length))
    for index, ((key, size), pieces) in enumerate(zip(objects, ranges)):
        end = 0
        for offset, length in sorted(pieces):
            if offset != end:
                fault = "overlap" if offset < end else "leave a gap"
                raise ManifestError(f"object {index} ({key}): its pieces {fault} at byte {min(offset, end)}")
            end += length
        if end != size:
            raise ManifestError(f"object {index} ({key}) has {size} bytes, its pieces cover {end}")


def _objects(keys: object, sizes: object, name: str, manifest: str) -> tuple[tuple[str, int], ...]:
    if type(keys) is not list or type(sizes) is not list or len(keys) != len(sizes) or not keys:
        raise ManifestError("objects and sizes must be non-empty arrays of one length")
    own_manifest = f"{name}/manifest-{manifest}.msgpack"
    for key in keys:
        if not isinstance(key, str) or not (key == own_manifest or _is_chunk_key(key)):
            raise ManifestError(f"object {quoted(key)} is neither a chunk key nor the checkpoint's manifest")
    if own_manifest not in keys:
        raise ManifestError(f"the checkpoint's manifest {own_manifest} is not among the objects protected")
    for size in sizes:
        if type(size) is not int or not 0 <= size <= MAX_CHUNK_BYTES:
            raise ManifestError(f"object size {quoted(size)} is not an integer in [0, {MAX_CHUNK_BYTES}]")
    if len(set(keys)) != len(keys):
        raise ManifestError("an object is listed twice")
    return tuple(zip(keys, sizes))


def _is_chunk_key(key: str) -> bool:
    match = _CHUNK_KEY.fullmatch(key)
    if match is None:
        return False
    codec, base = match.group(2), match.group(3)
    if codec is None:
        return True
    return codec in codecs.CODECS and codec != codecs.NONE and codecs.is_delta(codec) == (base is not None)


def _stripe(entry: object, index: int, k: int, m: int, objects: tuple[tuple[str, int], ...]) -> Stripe:
    if type(entry) is not list or len(entry) != 3:
        raise ManifestError(f"stripe {index} is not [length, pieces, parity]")
    length, pieces, parity = entry
    if type(length) is not int or not 1 <= length <= MAX_PIECE_BYTES:
        raise ManifestError(f"stripe {index}: length {quoted(length)} is not in [1, {MAX_PIECE_BYTES}]")
    if type(pieces) is not list or not 1 <= len(pieces) <= k:
        raise ManifestError(f"stripe {index} must hold 1 to K={k} pieces")
    if type(parity) is not list or len(parity) != m or not all(
            isinstance(p, str) and HASH_PATTERN.fullmatch(p) for p in parity):
        raise ManifestError(f"stripe {index} must name M={m} parity objects (64 hex digits each)")
    out = []
    for piece in pieces:
        if type(piece) is not list or len(piece) != 3 or not all(type(v) is int for v in piece):
            raise ManifestError(f"stripe {index}: a piece is not [object, offset, length]")
        obj, offset, size = piece
        if not 0 <= obj < len(objects):
            raise ManifestError(f"stripe {index}: piece of object {obj}, past the {len(objects)} objects")
        if offset < 0 or not 0 < size <= length or offset + size > objects[obj][1]:
            raise ManifestError(f"stripe {index}: piece [{offset}, +{size}) of object {obj} is not within the "
                                f"object ({objects[obj][1]} bytes) and the stripe ({length})")
        out.append(Piece(obj, offset, size))
    return Stripe(length, tuple(out), tuple(parity))


_RECORD_PREFIX, _RECORD_SUFFIX = "parity-", ".msgpack"


def parity_key(digest: str, place: int) -> str:
    """The key of the parity object at place ``place`` (0..M-1) of its stripe whose bytes hash to ``digest``:
    the place keeps equal bytes at two places of a stripe (K=1, or one piece times equal constants) two
    objects, so that losing one loses one piece."""
    return f"{PARITY_DIR}/{check_hash(digest)[:2]}/{digest}.{place}"


def parity_digest(key: str) -> str:
    """The hash a parity object's key names."""
    return key.rsplit("/", 1)[-1].split(".", 1)[0]


def record_key(name: str, digest: str) -> str:
    """The key of checkpoint ``name``'s parity record (bytes hashing to ``digest``) in its own folder."""
    return f"{check_name(name)}/{_RECORD_PREFIX}{check_hash(digest)}{_RECORD_SUFFIX}"


def copy_key(name: str, digest: str, copy: int) -> str:
    """The key of copy ``copy`` (1..M) of that record, kept outside the folder: a lost folder is rebuilt."""
    return f"{PARITY_DIR}/records/{check_name(name)}/{_RECORD_PREFIX}{check_hash(digest)}.{copy}{_RECORD_SUFFIX}"


def record_digest(entry: str) -> str | None:
    """The record hash in a folder entry or copy's base name (``parity-<h>[.<i>].msgpack``), else None."""
    if not (entry.startswith(_RECORD_PREFIX) and entry.endswith(_RECORD_SUFFIX)):
        return None
    digest = entry[len(_RECORD_PREFIX):-len(_RECORD_SUFFIX)].split(".", 1)[0]
    return digest if HASH_PATTERN.fullmatch(digest) else None


__all__ = ["FEATURE", "PARITY_DIR", "PARITY_FORMAT", "ParityRecord", "Piece", "Stripe", "copy_key", "parity_digest",
           "parity_key", "record_digest", "record_key"]
