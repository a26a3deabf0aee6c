"""The stored objects of one checkpoint that parity protects (spec 5.6): its manifest and every chunk it
uses, each with the check that proves its bytes (the manifest's hash; a chunk's decoding and hash).

Protecting reads each object through its check (parity of damaged bytes would rebuild damage), and a
rebuild checks each object it made before anything writes it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptfmt.errors import CorruptDataError
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.limits import MAX_DELTA_DEPTH
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.storage.base import Storage


class CheckpointObjects:
    """Checkpoint ``record.name``'s protected objects in ``storage``, as (key, size), the manifest first."""

    def __init__(self, storage: Storage, record: CommitRecord, manifest: Manifest):
        self.storage, self.record, self.manifest = storage, record, manifest
        self.manifest_key = layout.manifest_key(record.name, record.manifest_hash)
        self.rows: dict[str, int] = {}
        for index, chunk in enumerate(manifest.chunks):
            self.rows.setdefault(stored_key(manifest.chunks, chunk), index)
        chunks = sorted((key, manifest.chunks[i].stored_size) for key, i in self.rows.items())
        self.objects: list[tuple[str, int]] = [(self.manifest_key, record.manifest_size), *chunks]

    def read(self, key: str, size: int) -> bytes:
        """The stored bytes of object ``key``, checked; CorruptDataError or CheckpointNotFoundError otherwise."""
        data = self.storage.read(key, max_size=size)
        self.check(key, data)
        return data

    def check(self, key: str, data: bytes | memoryview, rebuilt: Mapping[str, bytes] | None = None) -> None:
        """Raise CorruptDataError unless ``data`` are object ``key``'s stored bytes. A delta chunk's base is
        taken from ``rebuilt`` (objects made but not yet written) or read from storage, checked."""
        where = self.storage.describe(key)
        if key == self.manifest_key:
            if len(data) != self.record.manifest_size:
                raise CorruptDataError(f"{where}: {len(data)} bytes, commit record says {self.record.manifest_size}")
            check_chunk(data, self.record.manifest_hash, where)
            return
        index = self.rows[key]
        self._decoded(index, data, rebuilt or {}, 0)

    def _decoded(self, index: int, stored: bytes | memoryview, rebuilt: Mapping[str, bytes], depth: int):
        chunk: Chunk = self.manifest.chunks[index]
        where = self.storage.describe(stored_key(self.manifest.chunks, chunk))
        if len(stored) != chunk.stored_size:
            raise CorruptDataError(f"{where}: {len(stored)} bytes stored, manifest says {chunk.stored_size}")
        base = None
        if chunk.base is not None:
            if depth >= MAX_DELTA_DEPTH:
                raise CorruptDataError(f"{where}: deltas deeper than {MAX_DELTA_DEPTH}")
            base_key = stored_key(self.manifest.chunks, self.manifest.chunks[chunk.base])
            if base_key in rebuilt:
                base = self._decoded(chunk.base, rebuilt[base_key], rebuilt, depth + 1)
            else:
                base = self._decoded(chunk.base, self.storage.read(base_key, max_size=self.manifest.chunks[
                    chunk.base].stored_size), rebuilt, depth + 1)
        decoded = codecs.decode(chunk.codec, bytes(stored), chunk.size, where, base)
        check_chunk(decoded, chunk.hash, where)
        return decoded


__all__ = ["CheckpointObjects"]
