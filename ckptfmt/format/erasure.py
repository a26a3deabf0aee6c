"""The Reed-Solomon erasure code of parity (spec 5.6): K data pieces and M parity pieces per stripe, any K
of the K+M enough to rebuild the others.

The code is the systematic Vandermonde code over GF(2^8) that zfec implements (polynomial 0x11d, the
generator matrix defined in spec 5.6), so the parity bytes are defined by the spec, not by the library:
a second reader may rebuild with any GF(2^8) arithmetic. zfec does the field arithmetic (ckptfmt never
does its own) and releases the GIL while it works, so stripes encode on several threads.

Pieces are processed in column segments (the code works byte by byte across the pieces), so memory is
K+M segments whatever a stripe's piece length; a piece shorter than the stripe is zero past its end,
and a stripe with fewer than K pieces has all-zero pieces in the remaining places.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

#: The code's name in a parity record (spec 5.6).
CODE = "rs-vandermonde-gf256"
#: Pieces of one stripe, data and parity together: the field has 256 elements.
MAX_STRIPE_PIECES = 256
#: Bytes of each piece processed at once: ckptfmt's pieces (16 MiB at most) in one call, longer ones of
#: another writer's records in segments, so that memory stays K+M segments.
SEGMENT = 16 * 2**20

Buffer = bytes | bytearray | memoryview


def check_parameters(k: int, m: int) -> None:
    """Raise ValueError unless K data and M parity pieces make a code of this family."""
    if not (type(k) is int and type(m) is int and k >= 1 and m >= 1 and k + m <= MAX_STRIPE_PIECES):
        raise ValueError(f"parity {k}+{m}: K and M must be at least 1 and K+M at most {MAX_STRIPE_PIECES}")


def check_coded_object(doc: dict, what: str, feature: str) -> tuple[tuple[int, int], str, str]:
    """The checks every record of this code starts with (spec 5.6, 9.8): its version and required
    ``feature`` (declared, from format 2.1), this code, a checkpoint name and a manifest hash; returns the
    version, the name and the manifest hash. ManifestError (or the version's error) otherwise."""
    from ckptfmt.errors import ManifestError, quoted
    from ckptfmt.format.features import check_declared, check_object
    from ckptfmt.format.limits import HASH_PATTERN, is_valid_name

    version, declared = check_object(doc, what)
    check_declared([feature], declared, version, what)
    if version < (2, 1):
        raise ManifestError(f"{what}s came with format 2.1, this one says {version[0]}.{version[1]}")
    if doc.get("code") != CODE:
        raise ManifestError(f"unknown code {quoted(doc.get('code'))} (this ckptfmt knows {CODE!r})")
    name, manifest = doc["name"], doc["manifest"]
    if not is_valid_name(name):
        raise ManifestError(f"name {quoted(name)} is not a checkpoint name")
    if not isinstance(manifest, str) or not HASH_PATTERN.fullmatch(manifest):
        raise ManifestError(f"manifest must be 64 hex digits, found {quoted(manifest)}")
    return version, name, manifest


@functools.lru_cache(maxsize=32)
def _encoder(k: int, m: int):
    import zfec  # imported on first use: only repositories with parity need it

    return zfec.Encoder(k, k + m)


@functools.lru_cache(maxsize=32)
def _decoder(k: int, m: int):
    import zfec

    return zfec.Decoder(k, k + m)


@functools.lru_cache(maxsize=4)
def _zeros(size: int) -> bytes:
    return bytes(size)


def _segment(piece: Buffer, start: int, size: int) -> Buffer:
    """Bytes [start, start+size) of ``piece``, zero past its end."""
    view = memoryview(piece)[start : start + size]
    if len(view) == size:
        return view
    return bytes(view) + _zeros(size - len(view))


def encode(pieces: Sequence[Buffer], k: int, m: int, length: int) -> list[bytes]:
    """The M parity pieces of a stripe of ``length`` bytes whose data pieces are ``pieces`` (at most K,
    each at most ``length`` bytes)."""
    check_parameters(k, m)
    if len(pieces) > k or any(len(p) > length for p in pieces):
        raise ValueError("a stripe holds at most K pieces, none longer than the stripe")
    wanted = tuple(range(k, k + m))
    segments = []
    for start in range(0, length, SEGMENT):
        size = min(SEGMENT, length - start)
        blocks = tuple(_segment(p, start, size) for p in pieces) + (_zeros(size),) * (k - len(pieces))
        segments.append(_encoder(k, m).encode(blocks, wanted))
    if len(segments) == 1:
        return list(segments[0])  # zfec's own buffers: no copy
    return [b"".join(parts) for parts in zip(*segments)]


def rebuild(available: Mapping[int, Buffer], k: int, m: int, length: int, count: int,
            wanted: Sequence[int]) -> dict[int, bytes]:
    """Pieces ``wanted`` of a stripe (indices: data 0..K-1, parity K..K+M-1) from ``available`` ones,
    which must hold at least K. ``count``: the stripe's data pieces (the places from ``count`` to K-1
    are zero pieces, known without reading anything). Each rebuilt piece is ``length`` bytes."""
    check_parameters(k, m)
    known: dict[int, Buffer] = {i: _zeros(0) for i in range(count, k)}  # all zero: a segment each, below
    known.update((i, p) for i, p in available.items() if 0 <= i < k + m and not count <= i < k)
    if len(known) < k:
        raise ValueError(f"{len(known)} of the stripe's pieces are known, {k} are needed")
    chosen = sorted(known)[:k]
    parity_wanted = tuple(i for i in wanted if i >= k)
    segments: dict[int, list] = {i: [] for i in wanted}
    for start in range(0, length, SEGMENT):
        size = min(SEGMENT, length - start)
        blocks = tuple(_segment(known[i], start, size) for i in chosen)
        data = _decoder(k, m).decode(blocks, tuple(chosen))
        parity = dict(zip(parity_wanted, _encoder(k, m).encode(tuple(data), parity_wanted))) if parity_wanted else {}
        for i in wanted:
            segments[i].append(data[i] if i < k else parity[i])
    return {i: parts[0] if len(parts) == 1 else b"".join(parts) for i, parts in segments.items()}


__all__ = ["CODE", "MAX_STRIPE_PIECES", "check_coded_object", "check_parameters", "encode", "rebuild"]
