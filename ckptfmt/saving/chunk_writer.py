"""Storing a save's chunks: hashed, deduplicated, and written exactly as hashed.

A chunk that views the caller's tensor memory can change while it is being
saved (a training step running beside an asynchronous save, a careless
thread). Its name must be the hash of the bytes stored, or later saves would
trust a chunk whose content is not what its name says. So such bytes are
copied, block by block, into private memory; each block is hashed and written
from that copy, and the chunk's name is the hash of what was written.

The copy is skipped where nothing needs writing: when the bytes are unchanged
since this process last saved them (the XXH3 fingerprint cache), or, on the
first save after a restart, when they hash to a chunk the parent checkpoint
already has; and for an asynchronous save's staging buffers, which nothing
changes until the save ends (sources marked ``frozen``): those are hashed and
written block by block straight from the buffer.

Each tensor's statistics (format/tensor_stats.py) are taken in the same pass,
block by block from the bytes being hashed, so they describe exactly the bytes
stored; unchanged bytes reuse the statistics remembered with their hash.

``compression="delta-zstd"`` and ``"auto"`` choose each chunk's codec from its
bytes (``_store_chosen``): a private copy is hashed, then encoded against the
parent's chunk for the same region (``delta_bases.py``) and whole, and the
smaller kept where it pays; ``auto`` also keeps bytes that compress by less than
10% uncompressed. A chunk equal to its base reuses the base's row. ``"float-zstd"`` stores the chunks
of a floating-point tensor (bf16, fp16, fp32, fp64) with the float codecs (``floatN-zstd``), which split
each element's sign and exponent from its mantissa (format/codecs.py); ``"auto"`` stores them with the
float codec or the shuffle, and their deltas with ``floatdeltaN-zstd`` or ``deltaN-zstd``, whichever
stores a sample of the chunk (16 blocks of 32 KiB) smaller: the float codec wins on weights and Adam's
second moment, the shuffle on the first moment, whose signs come in runs.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, overload

import blake3
import torch
import xxhash

from ckptfmt._platform import single_threaded_kernels
from ckptfmt.errors import CheckpointError
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.limits import MAX_CHUNK_BYTES
from ckptfmt.format.manifest import Chunk, Piece, TensorEntry
from ckptfmt.format.tensor_stats import merge_stats
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.chunker import ChunkJob, ChunkPlanner, PieceRef
from ckptfmt.saving.delta_bases import DeltaBases
from ckptfmt.saving.hashcache import HashCache
from ckptfmt.saving.options import Encoding
from ckptfmt.storage.base import Staged
from ckptfmt.tensors.sources import TensorSource
from ckptfmt.tensors.stats import StatsAccumulator, stats_of_spans

#: Bytes copied, hashed and written at a time from the caller's memory.
BLOCK_BYTES = 2**20
#: Bytes of a pack whose small tensors' statistics are reduced together: their 64-bit copy and its
#: masks (some 8 times as much) stay in each writer thread's memory after the save.
STATS_RUN_BYTES = 2**18


#: The statistics of one part of a chunk job: (source index, statistics of its bytes in the job).
PartStats = tuple[int, Mapping[str, Any]]


#: How much smaller than the alternative an encoding must be to be chosen (delta over whole, compressed over raw).
PAYS = 0.9
#: The dtypes whose chunks the float codecs store (sign, exponent, mantissa from the top bit down).
_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass
class StoredChunk:
    """A chunk row for the manifest, and how many bytes this save wrote for it."""

    chunk: Chunk
    written: int
    #: The statistics of the job's parts (none when statistics are off, or come with their source).
    stats: list[PartStats]
    #: The table ``chunk.base`` indexes (the parent's), for a delta or a reused parent row; else None.
    table: list[Chunk] | None = None


@dataclass
class StoredSources:
    """What storing a list of sources produced: a chunk table, and each source's pieces in it."""

    chunks: list[Chunk]
    #: Per source, its pieces (chunk row, offset, length) in byte order.
    pieces: list[tuple[Piece, ...]]
    #: Stored bytes of the chunks this call wrote (not found already stored).
    new_bytes: int
    #: Rows of ``chunks`` that this call wrote.
    written_rows: frozenset[int]
    #: Per source, the statistics of its elements (spec 6.10), or None when not taken.
    stats: list[Mapping[str, Any] | None]


def store_sources(repo: Repository, sources: list[TensorSource], encoding: Encoding, *, parent_keys: set[str],
                  cache: HashCache, timer, bases: DeltaBases | None = None,
                  breaks: Collection[int] = ()) -> StoredSources:
    """Cut ``sources`` into chunks, store them (durably) as ``encoding`` says (a save's
    ``SaveOptions.encoding``) and return the chunk table and pieces; with ``encoding.tensor_stats``, each
    source's statistics too, taken as its bytes are hashed. ``bases``: the parent's chunks that delta
    chunks may be stored against. ``breaks``: indices of sources that start a new pack of small tensors
    (a sequence another writer stores alike).

    ``timer`` gets the phases ``write_chunks`` and ``sync``.
    """
    writer = ChunkWriter(repo, sources, encoding, parent_keys, cache, bases)
    try:
        with timer.phase("write_chunks"):
            planner = ChunkPlanner(encoding.chunk_size)
            refs: list[list[PieceRef]] = []
            starts = set(breaks)
            for index, source in enumerate(sources):
                if index in starts:
                    for job in planner.finish():
                        writer.submit(job)
                source_refs, ready = planner.add(index, source.nbytes, source.itemsize, writer.pack_group(source))
                refs.append(source_refs)
                for job in ready:
                    writer.submit(job)
            for job in planner.finish():
                writer.submit(job)
            stored = writer.results()
        with timer.phase("sync"):
            writer.make_durable()
    finally:
        writer.close()
    return _table(stored, refs, sources, encoding.tensor_stats)


class ChunkTable:
    """A manifest's chunk table being built: one row per distinct chunk, whoever stored it.

    A chunk met twice (two jobs, or two ranks, with equal bytes) keeps one row,
    the one with a known stored size; rows some writer stored are remembered
    for ``new_bytes``.
    """

    def __init__(self):
        self.chunks: list[Chunk] = []
        self.written: set[int] = set()
        self._rows: dict[str, int] = {}

    def add_with_bases(self, chunk: Chunk, table: list[Chunk] | None, written: bool) -> int:
        """The row of ``chunk``, whose ``base`` (if any) indexes ``table``: its bases are added first,
        and its own row points at theirs."""
        if chunk.base is None:
            return self.add(chunk, written)
        assert table is not None
        base = self.add_with_bases(table[chunk.base], table, False)
        return self.add(chunk._replace(base=base), written)

    def add(self, chunk: Chunk, written: bool) -> int:
        """The row of ``chunk`` (its base, if any, a row of this table); ``written``: this writer stored
        it (it was not stored before)."""
        row = self._rows.setdefault(stored_key(self.chunks, chunk), len(self.chunks))
        if row == len(self.chunks):
            self.chunks.append(chunk)
        elif self.chunks[row].stored_size < 0:
            self.chunks[row] = chunk
        if written:
            self.written.add(row)
        return row

    @property
    def new_bytes(self) -> int:
        return sum(self.chunks[row].stored_size for row in self.written)


def checkpoint_totals(tensors: list[TensorEntry], chunks: list[Chunk], new_bytes: int) -> dict:
    """The manifest's ``stats`` (spec 9.5): what the tensors hold, what the chunks occupy, what was new."""
    return {
        "tensor_count": len(tensors),
        "tensor_bytes": sum(t.nbytes for t in tensors if t.same_as is None),
        "chunk_count": len(chunks),
        "stored_bytes": sum(c.stored_size for c in chunks),
        "new_bytes": new_bytes,
    }


def _table(stored: dict[int, StoredChunk], refs: list[list[PieceRef]], sources: list[TensorSource],
           tensor_stats: bool) -> StoredSources:
    """One chunk row per distinct chunk (twins take the row with a stored size); pieces point at rows;
    each source's statistics merged from its parts'."""
    table = ChunkTable()
    job_row = {index: table.add_with_bases(stored[index].chunk, stored[index].table, stored[index].written > 0)
               for index in sorted(stored)}
    pieces = [tuple(Piece(job_row[p.job], p.offset, p.length) for p in source_refs) for source_refs in refs]
    return StoredSources(table.chunks, pieces, table.new_bytes, frozenset(table.written),
                         _source_stats(stored, sources) if tensor_stats else [None] * len(sources))


def _source_stats(stored: dict[int, StoredChunk], sources: list[TensorSource]) -> list[Mapping[str, Any] | None]:
    """Each source's statistics: given with it (taken on its device), or merged from its parts' in
    byte order (jobs are numbered in byte order); an empty source has its count alone."""
    first: list[Mapping[str, Any] | None] = [None] * len(sources)  # a small tensor's one part: no list of it
    more: dict[int, list[Mapping[str, Any]]] = {}
    for index in sorted(stored):
        for source, part in stored[index].stats:
            known = first[source]
            if known is None:
                first[source] = part
            else:
                more.setdefault(source, [known]).append(part)
    return [source.stats if source.stats is not None
            else merge_stats(more[index]) if index in more
            else found if found is not None
            else StatsAccumulator(source.tensor.dtype).result()
            for index, (source, found) in enumerate(zip(sources, first))]


class ChunkWriter:
    """Hashes, deduplicates and stores chunk jobs on a thread pool, with bounded memory.

    ``parent_keys`` are the chunk keys of the parent checkpoint: committed, so
    present and durable. Any other chunk found already stored (left by a killed
    or concurrent save) is made durable before the save commits.
    """

    def __init__(self, repo: Repository, sources: list[TensorSource], encoding: Encoding,
                 parent_keys: set[str], cache: HashCache, bases: DeltaBases | None = None):
        self.repo = repo
        self.encoding = encoding
        self.sources = sources
        self.bases = bases
        #: Whether to take each part's statistics (sources that come with theirs are passed over).
        self.tensor_stats = encoding.tensor_stats
        self.parent_keys = parent_keys
        self.cache = cache
        self.pool = ThreadPoolExecutor(max_workers=encoding.workers, thread_name_prefix="ckptfmt-save",
                                       initializer=single_threaded_kernels)
        # Jobs materialise their bytes only when they run (packs, compression, remote
        # copies), so this bounds both the queue and the memory in flight.
        self.slots = threading.BoundedSemaphore(encoding.workers)
        self.futures: dict[int, Future] = {}
        #: Set by the first job that fails: no job is submitted after it (results() raises its error).
        self.failed = False
        self.claimed: set[str] = set()
        self.lock = threading.Lock()
        #: Keys this save wrote, and keys it found stored but not in the parent.
        self.written_keys: list[str] = []
        self.found_keys: list[str] = []
        self.blocks = threading.local()

    def submit(self, job: ChunkJob) -> None:
        self.slots.acquire()
        if self.failed:
            self.slots.release()
            return
        future = self.pool.submit(self._store, job)
        future.add_done_callback(self._finished)
        self.futures[job.index] = future

    def _finished(self, future: Future) -> None:
        self.failed = self.failed or (not future.cancelled() and future.exception() is not None)
        self.slots.release()

    def results(self) -> dict[int, StoredChunk]:
        futures = list(self.futures.values())
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:
                self.close(cancel=True)
                raise error
        return {index: future.result() for index, future in self.futures.items()}

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        # Each future holds this writer through its done callback: let go of them, so that reference
        # counting frees the writer and its sources now, not the cyclic collector some time later.
        self.futures.clear()

    def make_durable(self) -> None:
        """Sync what this save wrote (each file, then the folders: one pass over them all, which is
        faster than an fsync per chunk as it is written), and what it reused that no committed
        checkpoint vouches for."""
        self.repo.storage.sync(self.written_keys)
        self.repo.storage.make_durable(self.found_keys)

    # -- one job -------------------------------------------------------------------
    def _store(self, job: ChunkJob) -> StoredChunk:
        if self.encoding.chooses_per_chunk:
            return self._store_chosen(job)
        codec = codecs.codec_for(self.encoding.compression, job.itemsize, self._floating(job))
        data, address = self._bytes(job)
        if address is None:  # private bytes (a pack, a copy): hash and write them as they are
            return self._put(job, codec, chunk_hash(data), lambda key: self._write(key, codec, data),
                             self._pack_stats(job, data))
        source_index = job.parts[0][0]
        source = self.sources[source_index]
        dtype = source.tensor.dtype if self._wants_stats(source) else None
        known = self.cache.lookup(data, address, dtype)
        digest, stats = known.digest, known.stats
        if digest is None and not known.seen and self.parent_keys:
            digest, stats = self._hash_unchanged(data, address, known.fingerprint, dtype)
        if digest is not None and (dtype is None or stats is not None):  # (stats of another dtype: rare)
            stored = self._put(job, codec, digest, None, [(source_index, stats)] if stats is not None else [])
            if stored is not None:
                return stored
        return self._snapshot(job, codec, data, address, copy=not source.frozen)

    def _store_chosen(self, job: ChunkJob) -> StoredChunk:
        """Store a private copy of the job's bytes under the codec that stores them smallest (see the
        module docstring); a chunk equal to the parent's for its region reuses that row."""
        data, _ = self._bytes(job)
        private = memoryview(bytearray(data))  # what is hashed is what is stored, whatever the caller does
        digest = chunk_hash(private)
        source_index, start, length, _ = job.parts[0]
        source = self.sources[source_index]
        if job.packed:
            stats = self._pack_stats(job, private)
        else:
            stats = [(source_index, _stats_of(source.tensor.dtype, _as_tensor(private)))] \
                if self._wants_stats(source) else []
        row = None if job.packed or self.bases is None else self.bases.base_for(source_index, start, length)
        if row is not None and self.bases is not None and not self.encoding.float_codecs \
                and _chain_is_float(self.bases.table, row):
            row = None  # a parent's float chunk, in a format without them: neither reused nor a base
        if row is not None and self.bases is not None and self.bases.table[row].hash == digest:
            return StoredChunk(self.bases.table[row], 0, stats, self.bases.table)
        floating = self.encoding.weighs_codecs and self._floating(job)
        codec = codecs.codec_for(self.encoding.compression, job.itemsize, floating)
        if floating:  # the float codec or the shuffle, whichever stores a sample smaller
            codec = codecs.smaller_on_sample([codec, codecs.codec_for("shuffle-zstd", job.itemsize)], private)
        encoded = codecs.encode(codec, private)
        base = None
        if row is not None and self.bases is not None:
            base_bytes = self.bases.read(row)
            delta_codec = codecs.delta_codec_for(job.itemsize, floating)
            if floating:
                delta_codec = codecs.smaller_on_sample([delta_codec, codecs.delta_codec_for(job.itemsize)],
                                                       private, base_bytes)
            delta = codecs.encode(delta_codec, private, base_bytes)
            if len(delta) < PAYS * len(encoded):
                codec, encoded, base = delta_codec, delta, (self.bases.table, row)
        if self.encoding.weighs_codecs and base is None and len(encoded) > PAYS * len(private):
            codec, encoded = codecs.NONE, private
        return self._put(job, codec, digest, lambda key: self._write_encoded(key, encoded), stats, base)

    def pack_group(self, source: TensorSource) -> torch.dtype | None:
        """The pack group of a small source: its dtype where the float codec may store it (a pack of one
        float dtype is stored as that dtype's tensors are, spec 5.2), else None (the mixed pack)."""
        dtype = source.tensor.dtype
        if self.encoding.float_coded and dtype in _FLOAT_DTYPES:
            return dtype
        return None

    def _floating(self, job: ChunkJob) -> bool:
        """Whether the job's bytes are the elements of real floating-point tensors of one dtype: one
        tensor's chunk, or a pack of one float dtype's tensors."""
        if job.packed:
            return job.group is not None
        return self.encoding.float_codecs and self.sources[job.parts[0][0]].tensor.dtype in _FLOAT_DTYPES

    def _wants_stats(self, source: TensorSource) -> bool:
        return self.tensor_stats and source.stats is None

    def _pack_stats(self, job: ChunkJob, data: memoryview) -> list[PartStats]:
        """The statistics of each part of a job held in private memory (a pack of small tensors)."""
        if not any(self._wants_stats(self.sources[part[0]]) for part in job.parts):
            return []
        whole = _as_tensor(data)
        by_dtype: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for index, _, length, offset in job.parts:
            if self._wants_stats(self.sources[index]):
                by_dtype.setdefault(self.sources[index].tensor.dtype, []).append((index, offset, length))
        found: list[PartStats] = []
        for dtype, parts in by_dtype.items():
            for batch in _batches(parts):  # the float64 copy of a batch stays bounded
                stats = stats_of_spans(dtype, whole, [(offset, length) for _, offset, length in batch])
                found += zip([index for index, _, _ in batch], stats)
        return found

    def _bytes(self, job: ChunkJob) -> tuple[memoryview, int | None]:
        """The job's bytes, and their address when they are the caller's memory (None: private)."""
        if not job.packed:
            source_index, start, length, _ = job.parts[0]
            source = self.sources[source_index]
            view = source.byte_view()[start : start + length]
            address = source.tensor.data_ptr() + start if source.borrowed else None
            return view, address
        return memoryview(self._packed(job)), None

    def _packed(self, job: ChunkJob) -> bytearray:
        """A pack's bytes: each small tensor's copied from its address (a byte view per tensor cost 3 us of
        torch calls, most of a pack's time), every range checked against both ends first."""
        buffer = bytearray(job.size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if job.size else 0
        for source_index, start, length, offset in job.parts:
            source = self.sources[source_index]
            if start < 0 or length < 0 or start + length > source.nbytes or offset < 0 or offset + length > job.size:
                raise AssertionError(f"pack part {start}+{length} of {source.nbytes} bytes at {offset} of {job.size}")
            ctypes.memmove(base + offset, source.tensor.data_ptr() + start, length)
        return buffer

    def _hash_unchanged(self, data: memoryview, address: int, fingerprint: bytes, dtype: torch.dtype | None
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """BLAKE3 of the caller's bytes and their statistics as ``dtype`` elements (None: not wanted),
        if the bytes did not change while read (fingerprinted again); else (None, None)."""
        digest = chunk_hash(data)
        stats = _stats_of(dtype, _as_tensor(data)) if dtype is not None else None
        if xxhash.xxh3_128_digest(data) != fingerprint:
            return None, None
        self.cache.remember(address, len(data), fingerprint, digest, dtype=dtype, stats=stats)
        return digest, stats

    def _snapshot(self, job: ChunkJob, codec: str, data: memoryview, address: int, copy: bool) -> StoredChunk:
        """Hash, take the statistics of and stage the caller's bytes block by block (each block read
        from memory once, then hashed, fingerprinted, measured and written while in the CPU's
        cache); name the chunk after them.

        ``copy``: each block is first copied into private memory and everything
        done from the copy, since the caller's memory may change meanwhile.
        """
        source_index, start, _, _ = job.parts[0]
        source = self.sources[source_index]
        block, block_tensor = self._block_buffer() if copy else (None, None)
        accumulator = StatsAccumulator(source.tensor.dtype) if self._wants_stats(source) else None
        hasher, fingerprint = blake3.blake3(), xxhash.xxh3_128()
        staged: Staged | None
        kept: bytearray | None
        if codec == codecs.NONE:  # streamed to storage as hashed
            staged, kept = self.repo.storage.stage(layout.CHUNKS_DIR), None
            sink: Callable[[memoryview], object] = staged.write
        else:  # kept whole, to be compressed once hashed
            staged, kept = None, bytearray()
            sink = kept.extend
        try:
            for offset in range(0, len(data), BLOCK_BYTES):
                piece = data[offset : offset + BLOCK_BYTES]
                if block is not None:
                    piece = block[: len(piece)]
                    piece[:] = data[offset : offset + len(piece)]
                hasher.update(piece)
                fingerprint.update(piece)
                if accumulator is not None:
                    accumulator.add_bytes(block_tensor[: len(piece)] if block_tensor is not None
                                          else source.bytes_tensor()[start + offset : start + offset + len(piece)])
                sink(piece)
            digest = hasher.hexdigest()
            stats = accumulator.result() if accumulator is not None else None
            self.cache.remember(address, len(data), fingerprint.digest(), digest,
                                dtype=source.tensor.dtype if stats is not None else None, stats=stats)
            result = self._put(job, codec, digest, self._publisher(staged, codec, kept, len(data)),
                               [(source_index, stats)] if stats is not None else [])
        finally:
            if staged is not None:
                staged.discard()  # nothing left to remove once published
        return result

    @overload
    def _put(self, job: ChunkJob, codec: str, digest: str, write: None,
             stats: list[PartStats], base: tuple[list[Chunk], int] | None = None) -> StoredChunk | None: ...

    @overload
    def _put(self, job: ChunkJob, codec: str, digest: str, write: Callable[[str], int],
             stats: list[PartStats], base: tuple[list[Chunk], int] | None = None) -> StoredChunk: ...

    def _put(self, job: ChunkJob, codec: str, digest: str, write: Callable[[str], int] | None,
             stats: list[PartStats], base: tuple[list[Chunk], int] | None = None) -> StoredChunk | None:
        """The chunk row for ``digest`` (with its parts' ``stats``; a delta's ``base``: the parent's table
        and row), storing it with ``write(key)`` unless it is stored already.

        Without ``write``, returns None when the chunk is not stored.
        """
        table, row = base if base is not None else (None, None)
        key = layout.chunk_key(digest, codec, None if table is None or row is None else table[row].hash)
        stored_size = self._present(key, digest, job.size, codec)
        if stored_size is None and write is None:
            return None
        with self.lock:
            twin = key in self.claimed
            self.claimed.add(key)
        if twin:  # another job of this save stores the same bytes; the manifest takes its stored size
            return StoredChunk(Chunk(digest, codec, job.size, -1, row), 0, stats, table)
        if stored_size is not None:
            if key not in self.parent_keys:
                with self.lock:
                    self.found_keys.append(key)
            return StoredChunk(Chunk(digest, codec, job.size, stored_size, row), 0, stats, table)
        assert write is not None  # not stored, so the caller gave a writer (checked above)
        written = write(key)
        with self.lock:
            self.written_keys.append(key)
        return StoredChunk(Chunk(digest, codec, job.size, written, row), written, stats, table)

    def _present(self, key: str, digest: str, size: int, codec: str) -> int | None:
        """The stored size of ``key`` if a usable copy is stored, else None.

        The parent's chunks are trusted on object stores (one request saved per
        chunk); on local disks a stat is cheap, so every chunk is checked. A
        local chunk no committed checkpoint vouches for may come from a killed
        save that renamed it before its bytes reached the disk (spec 11.2): it
        is read and hashed before it is reused.
        """
        if key in self.parent_keys and not self.repo.storage.cheap_exists and codec == codecs.NONE:
            return size
        stored = self.repo.storage.size(key)
        if stored is None or (codec == codecs.NONE and stored != size):
            return None  # absent, or a damaged copy that writing replaces
        if (
            key not in self.parent_keys
            and self.repo.storage.cheap_exists
            and not self._intact(key, digest, size, codec)
        ):
            return None
        return stored

    def _intact(self, key: str, digest: str, size: int, codec: str) -> bool:
        if codecs.is_delta(codec):
            return False  # checking it needs its base: written again instead (the same bytes)
        try:
            stored = self.repo.storage.read(key, max_size=MAX_CHUNK_BYTES)
            return chunk_hash(codecs.decode(codec, stored, size, self.repo.storage.describe(key))) == digest
        except CheckpointError:
            return False

    def _publisher(self, staged, codec: str, kept: bytearray | None, size: int):
        """How a snapshot gets stored under its key: the staged object renamed, or the kept bytes encoded."""
        if staged is None:
            return lambda key: self._write(key, codec, kept)

        def publish(key: str) -> int:
            staged.publish(key, durable=False)  # made durable with the others in make_durable
            return size
        return publish

    def _write(self, key: str, codec: str, data) -> int:
        return self._write_encoded(key, codecs.encode(codec, memoryview(data)))

    def _write_encoded(self, key: str, encoded) -> int:
        self.repo.storage.write(key, encoded, durable=False)  # made durable with the others in make_durable
        return len(memoryview(encoded).cast("B"))

    def _block_buffer(self) -> tuple[memoryview, torch.Tensor]:
        """This thread's reusable copy buffer, and a uint8 tensor over it for the statistics: fresh
        memory for every chunk would cost page faults."""
        buffer = getattr(self.blocks, "buffer", None)
        if buffer is None:
            memory = bytearray(BLOCK_BYTES)
            buffer = self.blocks.buffer = (memoryview(memory), torch.frombuffer(memory, dtype=torch.uint8))
        return buffer


def _batches(parts: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """``parts`` (index, offset, length), in offset order, cut into runs spanning at most STATS_RUN_BYTES
    bytes of the pack, from the first's start to the last's end (a part longer alone): what a run's segmented
    reductions copy to 64-bit, other dtypes' parts between included."""
    batches: list[list[tuple[int, int, int]]] = [[]]
    for part in parts:
        if batches[-1] and part[1] + part[2] - batches[-1][0][1] > STATS_RUN_BYTES:
            batches.append([])
        batches[-1].append(part)
    return batches


def _as_tensor(data: memoryview) -> torch.Tensor:
    """``data``'s bytes as a uint8 tensor, without a copy."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def _stats_of(dtype: torch.dtype, data: torch.Tensor) -> dict[str, Any]:
    """The statistics of the ``dtype`` elements held by ``data`` (uint8), a block at a time."""
    accumulator = StatsAccumulator(dtype)
    for start in range(0, data.numel(), BLOCK_BYTES):
        accumulator.add_bytes(data[start : start + BLOCK_BYTES])
    return accumulator.result()


def _chain_is_float(table: Sequence[Chunk], row: int | None) -> bool:
    """Whether chunk ``row`` or a chunk it is stored against uses a float codec (format 1.11)."""
    while row is not None:
        if codecs.is_float(table[row].codec):
            return True
        row = table[row].base
    return False
