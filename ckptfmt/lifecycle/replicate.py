"""replicate(): copy checkpoints to another repository (a tier), only the chunks it lacks.

Each checkpoint is copied in the order of the commit protocol (spec 11.1):
the chunks the destination lacks, then the manifest, then the commit record,
last. The copy is byte for byte the same checkpoint (same manifest hash), so
verify and compare see one checkpoint on both sides. A replication killed at
any point leaves no checkpoint on the destination, only chunks; chunks are
content-addressed, so the next run finds them and copies only the rest.

Every chunk is checked against its name (decoded and hashed) before it is
written, so damage in the source is reported, never propagated; by default it
is also read back from the destination and its hash compared once it has
arrived (``verify=False`` skips that read, which doubles the traffic on an
object store).

The destination's chunks are listed once per call (a paginated listing on
object stores rather than a request per chunk), under a save lease held until
the last commit (docs/design/leases-and-gc.md).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import delta_depth, stored_key
from ckptfmt.format.hashing import check_chunk, chunk_hash
from ckptfmt.format.limits import check_name
from ckptfmt.format.manifest import OPTIONAL_FIELDS, Chunk
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.history import copy_histories
from ckptfmt.repository.leases import Lease, save_lease
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.repository.signatures import copy_signatures
from ckptfmt.saving.chunker import DEFAULT_CHUNK_SIZE
from ckptfmt.storage.budget import ByteBudget


@dataclass(frozen=True)
class ReplicationReport:
    """What one ``replicate`` call did."""

    source: str
    destination: str
    #: Checkpoints this call committed on the destination, oldest first.
    copied: tuple[str, ...]
    #: Checkpoints the destination already had (the same manifest), left as they were.
    present: tuple[str, ...]
    #: Chunks written to the destination, and chunks the copied checkpoints needed that it already had.
    chunks_copied: int
    chunks_skipped: int
    #: Bytes written to the destination (chunks as stored, and manifests), and stored bytes of skipped chunks.
    bytes_copied: int
    bytes_skipped: int
    seconds: float
    #: Signature objects (spec 10.3) written to the destination: those of the copied checkpoints, and
    #: those added to checkpoints it already had (signed since they were copied).
    signatures_copied: int = 0
    #: History objects (spec 4.5: the run history of removed checkpoints) written to the destination.
    histories_copied: int = 0


@renamed_arguments(progress="callback")
def replicate(src: str | os.PathLike | Repository, dst: str | os.PathLike | Repository,
              name: str | Iterable[str] | None = None, *, storage_options: dict | None = None,
              dst_storage_options: dict | None = None, workers: int = 8, verify: bool = True,
              callback: Callback | None = None, yield_to: Callable[[], object] | None = None) -> ReplicationReport:
    """Copy checkpoints of repository ``src`` to repository ``dst`` (created if missing).

    ``name``: a checkpoint name or several; None copies every committed
    checkpoint of ``src`` that ``dst`` lacks. Checkpoints are copied oldest
    first (``created_ns``). One that ``dst`` has with the same manifest is
    skipped; one it has with a different manifest raises CheckpointExistsError.
    Damage in the source (a missing or corrupt chunk) raises before that
    checkpoint's commit, naming the chunk. ``workers`` chunks are copied at a
    time; ``verify`` reads each one back from ``dst`` after writing it;
    ``callback`` (an fsspec Callback) counts the stored bytes to copy or check.
    ``yield_to`` is called before each chunk is queued and may block: the
    checkpoint manager pauses replication while the training loop saves.
    Every history object of ``src`` (spec 4.5: the run history of its removed
    checkpoints) that ``dst`` lacks is copied too, whatever ``name`` says.
    """
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError("workers must be a positive integer")
    started = time.perf_counter()
    source = _repository(src, storage_options, create=False)
    target = _repository(dst, dst_storage_options, create=True)
    copied: list[str] = []
    present: list[str] = []
    missing: list[CommitRecord] = []
    copier = _Copier(source, target, workers, verify, callback or NoOpCallback(), yield_to)
    for record in _records(source, name):
        if _on_target(source, target, record):
            present.append(record.name)
            copier.signatures_copied += copy_signatures(source, target, record)
        else:
            missing.append(record)
    if missing:
        with save_lease(target) as lease:  # before the listing: a collector must not delete what it finds
            copier.stored = target.storage.find(layout.CHUNKS_DIR)
            for record in missing:
                (copied if copier.copy(record, lease) else present).append(record.name)
    histories = copy_histories(source, target, verify=verify)
    return ReplicationReport(
        source=source.url, destination=target.url, copied=tuple(copied), present=tuple(present),
        chunks_copied=copier.chunks_copied, chunks_skipped=copier.chunks_skipped,
        bytes_copied=copier.bytes_copied, bytes_skipped=copier.bytes_skipped,
        seconds=time.perf_counter() - started, signatures_copied=copier.signatures_copied,
        histories_copied=histories,
    )


def copy_rows(source: Repository, target: Repository, record: CommitRecord, rows: Iterable[int], *,
              workers: int, yield_to: Callable[[], object] | None = None) -> tuple[int, int]:
    """Copy the chunks of rows ``rows`` of checkpoint ``record``'s chunk table to ``target`` (those it
    lacks or holds damaged), each checked against its name before and after, made durable; no commit:
    for a checkpoint whose chunks several nodes send (the caller holds a save lease on ``target`` until
    ``commit_copy``). The chunks and stored bytes copied."""
    copier = _Copier(source, target, workers, True, NoOpCallback(), yield_to)
    copier.stored = target.storage.find(layout.CHUNKS_DIR)
    manifest = source.manifest(record.name, record, skip=OPTIONAL_FIELDS)
    chunks = manifest.chunks
    local = target.storage.cheap_exists
    jobs = []
    for key, row in {stored_key(chunks, chunks[row]): row for row in rows}.items():
        size = copier.stored.get(key)
        if size == chunks[row].stored_size and not local:  # an object store's listing vouches for it
            continue
        jobs.append((key, (chunks, row), size))
    written, found = copier._run(jobs, record.name)
    target.storage.sync(written)
    target.storage.make_durable(found)
    return copier.chunks_copied, copier.bytes_copied


def commit_copy(source: Repository, target: Repository, record: CommitRecord, lease: Lease) -> bool:
    """Commit on ``target`` checkpoint ``record``, whose chunks are all there (``copy_rows``): its
    manifest, signatures and commit record, as ``replicate`` does, then the source's run histories it
    lacks. False if another writer committed it meanwhile."""
    requires = source.manifest(record.name, record, skip=OPTIONAL_FIELDS).requires
    committed = _Copier(source, target, 1, True, NoOpCallback())._commit(record, requires, lease)
    copy_histories(source, target)
    return committed


def _repository(repo: str | os.PathLike | Repository, options: dict | None, *, create: bool) -> Repository:
    if isinstance(repo, Repository):
        if options:
            raise ValueError("storage options apply to repository URLs, not to Repository objects")
        return repo
    return Repository.open(repo, options, create=create)


def _records(source: Repository, name: str | Iterable[str] | None) -> list[CommitRecord]:
    """The source's commit records to copy, oldest first (so parents come before their children)."""
    if name is None:
        return source.commits()  # damaged records are skipped with a warning
    names = [name] if isinstance(name, str) else list(name)
    records = [source.commit(check_name(n)) for n in dict.fromkeys(names)]
    return sorted(records, key=lambda r: (r.created_ns, r.name))


def _on_target(source: Repository, target: Repository, record: CommitRecord) -> bool:
    """Whether ``target`` has this checkpoint already; CheckpointExistsError if it has another of that name."""
    try:
        theirs = target.commit(record.name)
    except CheckpointNotFoundError:
        return False
    if theirs.manifest_hash != record.manifest_hash:
        raise CheckpointExistsError(
            f"{target.storage.describe(record.name)}: a different checkpoint of that name exists (manifest "
            f"{theirs.manifest_hash[:16]}...); {source.storage.describe(record.name)} has manifest "
            f"{record.manifest_hash[:16]}...")
    return True


class _Copier:
    """Copies checkpoints' chunks, manifests and commit records to the target; counts what it did."""

    def __init__(self, source: Repository, target: Repository, workers: int, verify: bool, progress: Callback,
                 yield_to: Callable[[], object] | None = None):
        self.yield_to = yield_to
        self.source = source
        self.target = target
        self.workers = workers
        self.verify = verify
        self.progress = progress
        #: The target's chunk keys and sizes, as listed once under the lease.
        self.stored: dict[str, int] = {}
        #: Chunk keys known intact and durable on the target: copied or checked by this call, or committed.
        self.good: set[str] = set()
        # A larger chunk runs alone; a compressed one also holds its decoded bytes while checked.
        self.budget = ByteBudget(workers * DEFAULT_CHUNK_SIZE)
        self.lock = threading.Lock()
        self.chunks_copied = self.chunks_skipped = self.bytes_copied = self.bytes_skipped = 0
        self.signatures_copied = 0
        self.total = 0

    def copy(self, record: CommitRecord, lease: Lease) -> bool:
        """Copy one checkpoint, committing it last; False if another writer committed it meanwhile."""
        manifest = self.source.manifest(record.name, record, skip=OPTIONAL_FIELDS)
        # Bases before the deltas stored against them (spec 5.5), though a delta is checked against its
        # base's bytes in the source, so the order is for readers of a half-copied repository only.
        order = sorted(range(len(manifest.chunks)), key=lambda i: delta_depth(manifest.chunks, i))
        chunks = list({stored_key(manifest.chunks, manifest.chunks[i]): (manifest.chunks, i) for i in order}.items())
        local = self.target.storage.cheap_exists
        trusted = self._parent_chunks(manifest.parent) if local else set()
        jobs = []
        for key, (table, index) in chunks:
            chunk = table[index]
            size = self.stored.get(key)
            if key in self.good or (size == chunk.stored_size and (key in trusted or not local)):
                self._skipped(chunk)
            else:  # absent, damaged, or on a local disk vouched for by no commit (spec 11.2): checked first
                jobs.append((key, (table, index), size))
        self.total += sum(table[index].stored_size for _, (table, index), _ in jobs)
        self.progress.set_size(self.total)
        written, found = self._run(jobs, record.name)
        self.target.storage.sync(written)
        self.target.storage.make_durable(found)  # left by a killed run, which may not have made them durable
        committed = self._commit(record, manifest.requires, lease)
        self.good.update(key for key, _ in chunks)
        return committed

    def _parent_chunks(self, parent: str | None) -> set[str]:
        """Chunk keys of the target's copy of ``parent``: committed there, so present and durable."""
        if parent is None:
            return set()
        try:
            chunks = self.target.manifest(parent, skip=OPTIONAL_FIELDS).chunks
            return {stored_key(chunks, c) for c in chunks}
        except CheckpointError:  # absent or unreadable: its chunks are checked like any other
            return set()

    def _run(self, jobs: list[tuple[str, tuple[list[Chunk], int], int | None]],
             name: str) -> tuple[list[str], list[str]]:
        """Transfer the jobs' chunks, ``workers`` at a time; the keys written, and those found intact."""
        written: list[str] = []
        found: list[str] = []
        failures: list[BaseException] = []
        slots = threading.BoundedSemaphore(2 * self.workers)  # bounds the queue, not just the threads

        def done(future: Future, key: str) -> None:
            slots.release()
            if future.cancelled():
                return
            error = future.exception()
            if error is not None:
                failures.append(error)
            else:
                (written if future.result() else found).append(key)

        with ThreadPoolExecutor(self.workers, thread_name_prefix="ckptfmt-replicate") as pool:
            for key, chunk, size in jobs:
                if self.yield_to is not None:
                    self.yield_to()
                slots.acquire()
                if failures:
                    slots.release()
                    break
                future = pool.submit(self._transfer, key, chunk, size)
                future.add_done_callback(functools.partial(_call_with_key, done, key))
            pool.shutdown(cancel_futures=bool(failures))
        if failures:
            error = failures[0]
            if isinstance(error, CheckpointError):
                raise type(error)(f"{error} (checkpoint {name!r} not replicated)") from None
            raise error
        return written, found

    def _transfer(self, key: str, row: tuple[list[Chunk], int], size: int | None) -> bool:
        """Make ``key`` hold chunk ``row`` (a manifest's table, an index) intact on the target; True if it
        had to be written."""
        table, index = row
        chunk = table[index]
        footprint = chunk.size * (2 if chunk.base is not None else 1) + (
            chunk.stored_size if chunk.codec != codecs.NONE else 0)
        with self.budget.take(footprint):
            base = None if chunk.base is None else ChunkReader(self.source.storage, table).read(chunk.base)
            if size is not None and self._intact(key, chunk, size, base):
                self._skipped(chunk, progress=True)
                return False
            stored = read_chunk(self.source.storage, key, chunk, base=base).stored  # damage in the source stops here
            digest = chunk.hash if chunk.codec == codecs.NONE else chunk_hash(stored)
            self.target.storage.write(key, stored, durable=False)  # synced with the others before the manifest
            del stored
            if self.verify:
                self._check_arrival(key, chunk, digest)
        with self.lock:
            self.chunks_copied += 1
            self.bytes_copied += chunk.stored_size
            self.progress.relative_update(chunk.stored_size)
        return True

    def _intact(self, key: str, chunk: Chunk, size: int, base: bytes | memoryview | None) -> bool:
        """Whether the target's existing copy of ``chunk`` checks out; a damaged one is written again.

        A compressed chunk can be stored intact under another size (another
        encoder's frame): other checkpoints there use it as it is, and this one's
        manifest cannot be made to, so that is an error rather than a rewrite.
        """
        if size != chunk.stored_size and (chunk.codec == codecs.NONE or size > chunk.size + chunk.stored_size):
            return False  # damaged (read no further than its budget)
        try:
            read_chunk(self.target.storage, key, chunk._replace(stored_size=size), base=base)
        except (CorruptDataError, CheckpointNotFoundError):
            return False
        if size != chunk.stored_size:
            raise CheckpointExistsError(
                f"{self.target.storage.describe(key)}: stored with another encoding ({size} bytes, the source's "
                f"manifest says {chunk.stored_size}): the checkpoint cannot be copied byte for byte")
        return True

    def _check_arrival(self, key: str, chunk: Chunk, digest: str) -> None:
        """Read the copy back from the target and compare its hash with what was sent."""
        where = self.target.storage.describe(key)

        def same(arrived: bytes) -> None:
            if len(arrived) != chunk.stored_size or chunk_hash(arrived) != digest:
                raise CorruptDataError(f"{where}: the copy read back differs from the bytes written")

        try:
            self.target.storage.read_checked(key, max_size=chunk.stored_size, check=same)
        except CorruptDataError as exc:
            self.target.storage.delete(key)  # so that a later run writes it again rather than trusting it
            raise CorruptDataError(f"{exc} (removed)") from None

    def _skipped(self, chunk: Chunk, progress: bool = False) -> None:
        with self.lock:
            self.chunks_skipped += 1
            self.bytes_skipped += chunk.stored_size
            if progress:
                self.progress.relative_update(chunk.stored_size)

    def _commit(self, record: CommitRecord, requires: frozenset[str], lease: Lease) -> bool:
        """Write the source's manifest bytes, then the commit record (spec 11.1 steps 3 and 4), once the
        target's marker declares what the manifest ``requires`` (spec 10.2)."""
        key = layout.manifest_key(record.name, record.manifest_hash)
        where = self.source.storage.describe(key)

        def exactly_what_was_parsed(data: bytes) -> bytes:
            check_chunk(data, record.manifest_hash, where)
            return data

        data = self.source.storage.read_checked(key, max_size=record.manifest_size, check=exactly_what_was_parsed)
        self.target.storage.write(key, data)
        self.target.storage.sync([key])
        with self.lock:
            self.bytes_copied += len(data)
        self.signatures_copied += copy_signatures(self.source, self.target, record)  # signed when it appears
        lease.check("writing the commit record")
        self.target.declare(record.version, requires)
        try:
            self.target.create_commit(record)
        except CheckpointExistsError:  # a rival replication of the same checkpoint is fine; another is not
            if not _on_target(self.source, self.target, record):
                raise
            return False
        return True


def _call_with_key(done: Callable[[Future, str], None], key: str, future: Future) -> None:
    """A future's done callback that also gets the chunk's key."""
    done(future, key)
