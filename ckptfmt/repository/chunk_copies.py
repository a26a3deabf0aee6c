"""Finding a good copy of a chunk in other repositories: the lookup behind ``repair`` and the reads
that fall back to another tier.

A chunk is named by the hash of its decoded bytes, so a copy stored anywhere under any codec is the
same chunk once it decodes to bytes of that hash; nothing is trusted for where it was found.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, StorageError
from ckptfmt.format import codecs, layout
from ckptfmt.format.manifest import Chunk
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.storage.base import Storage


@dataclass(frozen=True)
class ChunkCopy:
    """A verified copy of a chunk: where it was read, its decoded bytes, and its bytes as the chunk's
    own codec stores them (what a repair writes)."""

    where: str
    decoded: bytes | memoryview
    stored: bytes


def find_copy(storages: list[Storage], chunk: Chunk, tried: list[str], *,
              skip: tuple[Storage, str] | None = None,
              base: tuple[str, bytes | memoryview] | None = None) -> ChunkCopy | None:
    """The first verified copy of ``chunk`` among ``storages``, each looked at under the chunk's codec,
    then under the others; None when there is none, with what each copy found had wrong appended to
    ``tried``. ``skip``: a (storage, codec) not to look at (the damaged copy itself). A delta chunk
    needs its ``base``: the base chunk's hash and decoded bytes; only copies stored against that base
    are looked at (a delta cannot be re-encoded against another)."""
    if codecs.is_delta(chunk.codec) and base is None:
        raise ValueError("a delta chunk's copy needs its base")
    others = [] if base is not None else sorted(codecs.CODECS - codecs.DELTA_CODECS - {chunk.codec})
    for storage in storages:
        for codec in [chunk.codec, *others]:
            if skip is not None and storage is skip[0] and codec == skip[1]:
                continue
            key = layout.chunk_key(chunk.hash, codec, base[0] if base is not None else None)
            where = storage.describe(key)
            try:
                copy = read_chunk(storage, key, chunk, base=None if base is None else base[1], codec=codec,
                                  max_size=_stored_bound(chunk.size))
            except StorageError:
                raise
            except CheckpointNotFoundError:
                continue  # absent here: worth a line only when no copy is anywhere (said below)
            except CheckpointError as exc:
                tried.append(str(exc))
                continue
            stored = copy.stored
            if codec != chunk.codec:  # stored whole elsewhere: encoded as the manifest says
                stored = bytes(codecs.encode(chunk.codec, memoryview(copy.decoded)))
                if len(stored) != chunk.stored_size:
                    tried.append(f"{where}: encoded as {chunk.codec} it is {len(stored)} bytes, the manifest "
                                 f"records {chunk.stored_size}")
                    continue
            return ChunkCopy(where, copy.decoded, bytes(stored))
    if not tried:
        tried.append("no other copy of the chunk" if storages else "no other repository to look in")
    return None


def _stored_bound(size: int) -> int:
    """The most bytes a stored chunk of ``size`` decoded bytes can take under any codec (zstd's bound)."""
    return size + size // 255 + 2**16
