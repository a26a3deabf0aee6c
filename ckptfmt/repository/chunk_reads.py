"""The verified chunk read (spec 5.4): a stored chunk's bytes, their size, their decoding and the BLAKE3
hash of what they decode to, checked before anyone uses them.

Loading, replication and repair all read chunks this way, so one rule decides what counts as damage:
a read whose bytes fail a check is tried again by the storage (``Storage.read_checked``), then raises
CorruptDataError naming the object; a missing object raises CheckpointNotFoundError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from ckptfmt.errors import CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import codecs
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk
from ckptfmt.storage.base import Storage


@dataclass(frozen=True)
class VerifiedChunk:
    """A chunk as it was stored, and the bytes it decodes to (the same object when stored whole)."""

    stored: bytes
    decoded: bytes | memoryview


def read_chunk(storage: Storage, key: str, chunk: Chunk, *, base: bytes | memoryview | None = None,
               codec: str | None = None, max_size: int | None = None, parallel: bool = False,
               verify: bool = True) -> VerifiedChunk:
    """Chunk ``chunk`` from ``key`` of ``storage``, checked: its stored size (the manifest's, when it
    is stored under the manifest's codec), its decoding and its hash. ``base``: a delta's decoded base;
    ``codec``: the codec of this copy when it is not the manifest's (another repository's, found by
    repair); ``max_size``: the most bytes read (the manifest's stored size unless given); ``parallel``:
    hash on several threads (large chunks); ``verify=False``: no hash (a reader that chose to trust the
    bytes: the size and the decoding are still checked)."""
    codec = codec or chunk.codec
    own_encoding = codec == chunk.codec
    where = storage.describe(key)

    def checked(stored: bytes) -> VerifiedChunk:
        if own_encoding and len(stored) != chunk.stored_size:
            raise CorruptDataError(f"{where}: {len(stored)} bytes stored, manifest says {chunk.stored_size}")
        decoded = codecs.decode(codec, stored, chunk.size, where, base)
        if verify:
            check_chunk(decoded, chunk.hash, where, parallel=parallel)
        return VerifiedChunk(stored, decoded)

    with missing_chunk_named(storage, key):
        return storage.read_checked(key, max_size=chunk.stored_size if max_size is None else max_size, check=checked)


@contextlib.contextmanager
def missing_chunk_named(storage: Storage, key: str) -> Iterator[None]:
    """A chunk's object not found in the block is said as such: "<where>: chunk is missing"."""
    try:
        yield
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{storage.describe(key)}: chunk is missing") from None
