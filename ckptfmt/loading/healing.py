"""Reads that heal: a chunk missing or damaged in the repository read from is read from another one
(a slower tier, a replica), and the damaged copy is repaired in the background.

Only the damaged chunks come from elsewhere; the rest is still read from the fast repository. Each
replacement is verified against the chunk's name before it is used (``repository/chunk_copies.py``)
and written back with an atomic ``Storage.write``; a failed write-back only warns, since the load has
what it needs.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptfmt.errors import CheckpointError, CheckpointWarning, StorageError
from ckptfmt.format.manifest import Chunk
from ckptfmt.repository.chunk_copies import find_copy
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.base import Storage

#: Other repositories to read damaged chunks from: URLs or opened ``Repository`` objects (None: none).
HealFrom = Sequence[str | os.PathLike | Repository] | None


class ChunkHealer:
    """Finds replacements for a repository's damaged chunks in ``others`` and writes them back."""

    def __init__(self, others: list[Repository]):
        self.others = others
        self._pool: ThreadPoolExecutor | None = None
        self._queued: set[str] = set()  # keys whose repair is under way: warned of once
        self._lock = threading.Lock()  # the load's threads ask at once

    @classmethod
    def of(cls, repositories: HealFrom) -> ChunkHealer | None:
        """A healer over repository URLs or opened repositories; None when none is given."""
        if not repositories:
            return None
        return cls([r if isinstance(r, Repository) else Repository.open(r) for r in repositories])

    def replacement(self, storage: Storage, chunk: Chunk, damage: CheckpointError, key: str,
                    base: tuple[str, bytes | memoryview] | None) -> bytes | memoryview:
        """The decoded, verified bytes of ``chunk`` (stored at ``key``; a delta's ``base``: its hash and
        decoded bytes) from another repository, the copy in ``storage`` queued for repair; raises
        ``damage``'s type, naming every place looked at, when no good copy exists."""
        tried: list[str] = []
        found = find_copy([o.storage for o in self.others], chunk, tried, base=base)
        if found is None:
            raise type(damage)(f"{damage}; no good copy elsewhere: {'; '.join(tried)}")
        with self._lock:
            if key not in self._queued:
                self._queued.add(key)
                warnings.warn(f"{damage}; read from {found.where} instead, and repairing this copy",
                              CheckpointWarning, stacklevel=2)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-heal")
                self._pool.submit(_write_back, storage, key, found.stored)
        return found.decoded

    def finish(self) -> None:
        """Wait for the repairs queued so far (their failures were warned of)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _write_back(storage: Storage, key: str, stored: bytes) -> None:
    try:
        storage.write(key, stored)
    except (StorageError, CheckpointError, OSError) as exc:
        warnings.warn(f"{storage.describe(key)}: the damaged chunk could not be repaired: {exc}", CheckpointWarning,
                      stacklevel=1)
