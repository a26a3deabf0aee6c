"""Cutting tensor bytes into chunks: big tensors split at ``chunk_size``, small ones packed.

A big tensor's chunks hold whole elements (``chunk_size`` rounded down to the
element size), so each chunk's statistics are those of its elements.

Small tensors of a *pack group* (the writer's choice: their floating dtype where the
float codec will store them, spec 5.2) share packs of their own, so that a pack of one
float dtype gets that dtype's codec; the others share one pack, in order.

The plan is pure bookkeeping: it yields the byte ranges to hash and store, and
records, for every tensor, which ranges (by chunk job) hold its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CHUNK_SIZE = 64 * 2**20
#: Tensors below this size are packed together so that a state of thousands of
#: small tensors does not become thousands of tiny objects.
SMALL_TENSOR_BYTES = 256 * 2**10
PACK_BYTES = 4 * 2**20
PACK_ALIGNMENT = 64


@dataclass
class ChunkJob:
    """The bytes of one future chunk: a slice of one tensor, or a pack of small ones."""

    index: int
    packed: bool
    #: (source, start in the source's bytes, length, offset in this chunk)
    parts: list[tuple[int, int, int, int]] = field(default_factory=list)
    size: int = 0
    #: Element width for byte-shuffling codecs (1 for packs of mixed dtypes).
    itemsize: int = 1
    #: The pack group every part of a pack belongs to (None: mixed dtypes, or not a pack).
    group: object = None


@dataclass(slots=True)
class PieceRef:
    """A tensor's byte range inside a chunk job (resolved to a chunk index after hashing)."""

    job: int
    offset: int
    length: int


class ChunkPlanner:
    """Assigns each source's bytes to chunk jobs; call ``add`` per source, then ``finish``."""

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE):
        if chunk_size < 4096:
            raise ValueError("chunk_size must be at least 4096 bytes")
        self.chunk_size = chunk_size
        self.jobs: list[ChunkJob] = []
        #: The open pack of each group.
        self._packs: dict[object, ChunkJob] = {}

    def add(self, source: int, nbytes: int, itemsize: int,
            group: object = None) -> tuple[list[PieceRef], list[ChunkJob]]:
        """Plan one source; returns its pieces and the jobs that became complete. A small source goes
        into the open pack of ``group`` (None: the pack of mixed dtypes), whose elements are ``itemsize``
        bytes wide when a group is given."""
        if nbytes == 0:
            return [], []
        if nbytes < SMALL_TENSOR_BYTES:
            return self._add_small(source, nbytes, itemsize, group)
        pieces, ready = [], []
        step = self.chunk_size - self.chunk_size % itemsize  # whole elements in every chunk
        for start in range(0, nbytes, step):
            length = min(step, nbytes - start)
            job = self._new_job(False, itemsize)
            job.parts.append((source, start, length, 0))
            job.size = length
            pieces.append(PieceRef(job.index, 0, length))
            ready.append(job)
        return pieces, ready

    def _add_small(self, source: int, nbytes: int, itemsize: int,
                   group: object) -> tuple[list[PieceRef], list[ChunkJob]]:
        ready = []
        pack = self._packs.get(group)
        if pack is not None:
            offset = -(-pack.size // PACK_ALIGNMENT) * PACK_ALIGNMENT
            if offset + nbytes > PACK_BYTES:
                ready.append(pack)
                pack = None
        if pack is None:
            pack = self._packs[group] = self._new_job(True, 1 if group is None else itemsize)
            pack.group = group
            offset = 0
        pack.parts.append((source, 0, nbytes, offset))
        pack.size = offset + nbytes
        return [PieceRef(pack.index, offset, nbytes)], ready

    def finish(self) -> list[ChunkJob]:
        """The partly filled packs, in the order they were opened."""
        packs = sorted(self._packs.values(), key=lambda job: job.index)
        self._packs = {}
        return packs

    def _new_job(self, packed: bool, itemsize: int) -> ChunkJob:
        job = ChunkJob(index=len(self.jobs), packed=packed, itemsize=itemsize)
        self.jobs.append(job)
        return job
