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

With ``format_version=`` (spec 13.3) the destination is for readers of that
version: a checkpoint they read as it is is copied as above; any other is
re-encoded for them (``lifecycle.rewrite``: its manifest in that version's forms,
chunks stored with codecs it lacks stored again with codecs it has, the others
copied or shared), which gives it a new manifest and commit record. The source's
signatures do not sign that record: they are dropped and counted, or ``signer=``
signs it. A checkpoint using what the version cannot express is refused, named,
before anything is written.

The destination's chunks are listed once per call (a paginated listing on
object stores rather than a request per chunk), under a save lease held until
the last commit (docs/design/leases-and-gc.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptDataError,
)
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import delta_depth, stored_key
from ckptfmt.format.features import refuse_unless_writable, version_text
from ckptfmt.format.hashing import check_chunk, chunk_hash
from ckptfmt.format.limits import check_name
from ckptfmt.format.manifest import OPTIONAL_FIELDS, Chunk, Manifest, optional_fields_except
from ckptfmt.format.signatures import SigningKey, signature_features
from ckptfmt.lifecycle import rewrite
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.history import copy_histories
from ckptfmt.repository.leases import Lease, save_lease
from ckptfmt.repository.parity import copy_parity, write_copies
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.repository.signatures import copy_signatures, signatures, write_signature
from ckptfmt.saving.chunker import DEFAULT_CHUNK_SIZE
from ckptfmt.saving.options import SIGNATURES_FROM, target_version
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
    #: ``format_version=``: the version written for ("1.6"), None for a copy byte for byte.
    format_version: str | None = None
    #: Checkpoints of ``copied`` re-encoded for ``format_version`` (new manifests and commit records).
    rewritten: tuple[str, ...] = ()
    #: Chunks stored again with a codec ``format_version`` has (counted in ``chunks_copied`` too).
    chunks_reencoded: int = 0
    #: Signatures of the rewritten checkpoints in the source, which do not sign their new manifests.
    signatures_dropped: int = 0
    #: Signatures ``signer=`` made of rewritten checkpoints.
    signatures_written: int = 0


@renamed_arguments(progress="callback")
def replicate(src: str | os.PathLike | Repository, dst: str | os.PathLike | Repository,
              name: str | Iterable[str] | None = None, *, storage_options: dict | None = None,
              dst_storage_options: dict | None = None, workers: int = 8, verify: bool = True,
              callback: Callback | None = None, yield_to: Callable[[], object] | None = None,
              format_version: str | tuple[int, int] | None = None, signer: Any = None) -> ReplicationReport:
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

    ``format_version`` ("1.6" or (1, 6)): write for readers of that version
    (spec 13.3; see the module docstring). A ``dst`` created here gets a marker
    of that version; an existing one whose marker is newer is written all the
    same, with a warning (its marker only rises). ``signer`` (as ``save``'s: a PEM
    file, a key) signs the checkpoints rewritten for ``format_version``, whose
    source signatures are dropped. Without ``format_version``, a ``dst`` created
    here gets the version of the source's marker.
    """
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError("workers must be a positive integer")
    version = None if format_version is None else target_version(format_version)
    signer = _signing_key(signer, version)
    started = time.perf_counter()
    source = _repository(src, storage_options, create=False)
    records = _records(source, name)
    if version is not None:  # what the version cannot express is refused before anything is written
        _refuse_inexpressible(source, records, version)
    target = _repository(dst, dst_storage_options, create=True, format_version=version or source.format_version)
    if version is not None and target.format_version > version:
        warnings.warn(f"{target.url}: the repository's marker declares format {version_text(target.format_version)}"
                      f", newer than {version_text(version)}: readers of format {version_text(version)} cannot "
                      "open it, though the checkpoints copied now are written for them", CheckpointWarning,
                      stacklevel=2)
    copier = _Copier(source, target, workers, verify, callback or NoOpCallback(), yield_to, version, signer)
    copied, present = _copy(copier, target, records)
    if version is None:
        histories = copy_histories(source, target, verify=verify)
    else:
        histories = rewrite.copy_histories_at(source, target, version)
    return _report(source, target, copier, copied, present, histories, version, started)


def _copy(copier: _Copier, target: Repository, records: list[CommitRecord]) -> tuple[list[str], list[str]]:
    """Each checkpoint of ``records`` copied unless ``target`` has it: (the names copied, those present)."""
    copied: list[str] = []
    present: list[str] = []
    missing: list[CommitRecord] = []
    for record in records:
        if copier.on_target(record):
            present.append(record.name)
        else:
            missing.append(record)
    if missing:
        with save_lease(target) as lease:  # before the listing: a collector must not delete what it finds
            copier.stored = target.storage.find(layout.CHUNKS_DIR)
            for record in missing:
                (copied if copier.copy(record, lease) else present).append(record.name)
    return copied, present


def _signing_key(signer: Any, version: tuple[int, int] | None) -> SigningKey | None:
    """``replicate``'s ``signer=`` loaded, once checked against its ``format_version=``."""
    if signer is not None:
        if version is None:
            raise ValueError("signer= signs the checkpoints rewritten for format_version=; give that too")
        if version < SIGNATURES_FROM:
            raise ValueError(f"signer= needs format {version_text(SIGNATURES_FROM)} (signatures, spec 10.3); "
                             f"format {version_text(version)} cannot express it")
        signer = SigningKey.load(signer)
        for feature in signature_features(signer.algorithm):  # ML-DSA keys: format 2.0
            refuse_unless_writable(feature, version, f"signer= (an {signer.algorithm} key)")
    return signer


def _refuse_inexpressible(source: Repository, records: list[CommitRecord], version: tuple[int, int]) -> None:
    """Raise, naming it, for a checkpoint to copy that uses what format ``version`` cannot express."""
    for record in records:
        if record.version > version:
            manifest = source.manifest(record.name, record, skip=optional_fields_except("placement"))
            rewrite.refuse_inexpressible(manifest, version, source.storage.describe(record.name))


def _report(source: Repository, target: Repository, copier: _Copier, copied: list[str], present: list[str],
            histories: int, version: tuple[int, int] | None, started: float) -> ReplicationReport:
    """What ``replicate`` did: the copier's counts with its re-encoder's (``format_version=``)."""
    reencoder = copier.reencoder
    return ReplicationReport(
        source=source.url, destination=target.url, copied=tuple(copied), present=tuple(present),
        chunks_copied=copier.chunks_copied + (reencoder.chunks_written if reencoder else 0),
        chunks_skipped=copier.chunks_skipped + (reencoder.chunks_found if reencoder else 0),
        bytes_copied=copier.bytes_copied + (reencoder.bytes_written if reencoder else 0),
        bytes_skipped=copier.bytes_skipped + (reencoder.bytes_found if reencoder else 0),
        seconds=time.perf_counter() - started, signatures_copied=copier.signatures_copied,
        histories_copied=histories, format_version=None if version is None else version_text(version),
        rewritten=tuple(name for name in copied if name in copier.rewritten),
        chunks_reencoded=reencoder.chunks_written if reencoder else 0,
        signatures_dropped=copier.signatures_dropped, signatures_written=copier.signatures_written,
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


def _repository(repo: str | os.PathLike | Repository, options: dict | None, *, create: bool,
                format_version: tuple[int, int] | None = None) -> Repository:
    if isinstance(repo, Repository):
        if options:
            raise ValueError("storage options apply to repository URLs, not to Repository objects")
        return repo
    if format_version is None:
        return Repository.open(repo, options, create=create)
    return Repository.open(repo, options, create=create, format_version=format_version)


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
                 yield_to: Callable[[], object] | None = None, version: tuple[int, int] | None = None,
                 signer: SigningKey | None = None):
        self.yield_to = yield_to
        #: ``format_version=``: the version written for (None: copies byte for byte), and who signs rewrites.
        self.version = version
        self.signer = signer
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
        self.signatures_copied = self.signatures_dropped = self.signatures_written = 0
        self.total = 0
        #: Checkpoints this call rewrote for ``version``, and what stores their chunks again.
        self.rewritten: set[str] = set()
        self.reencoder: rewrite.Reencoder | None = None
        #: Source manifests read whole (``version``), by name: the checks and the rewrite share them.
        self._manifests: dict[str, Manifest] = {}

    def on_target(self, record: CommitRecord) -> bool:
        """Whether the target has this checkpoint already (its signatures the target lacks are copied
        then); CheckpointExistsError if it has another of that name. With ``version``, a copy rewritten
        for it by an earlier call counts (``signer`` signs it if it has not), and one newer than it is an
        error."""
        if self.version is None:
            if not _on_target(self.source, self.target, record):
                return False
            self.signatures_copied += copy_signatures(self.source, self.target, record)
            return True
        try:
            theirs = self.target.commit(record.name)
        except CheckpointNotFoundError:
            return False
        where = self.target.storage.describe(record.name)
        if theirs.manifest_hash == record.manifest_hash:
            if not rewrite.readable_at(self._manifest(record), self.version):
                raise CheckpointExistsError(
                    f"{where}: holds this checkpoint as format {version_text(theirs.version)}, newer than "
                    f"{version_text(self.version)}; remove it there to rewrite it for format "
                    f"{version_text(self.version)}")
            self.signatures_copied += copy_signatures(self.source, self.target, record)
            return True
        mine = self._manifest(record)
        if rewrite.readable_at(mine, self.version) or not rewrite.same_checkpoint(
                mine, self.target.manifest(record.name, theirs), self.version):
            return _on_target(self.source, self.target, record)  # raises: a different checkpoint
        if self.signer is not None:
            self.signatures_written += write_signature(self.target, theirs, self.signer)[1]
        return True

    def _manifest(self, record: CommitRecord) -> Manifest:
        """The source's manifest of ``record``, read whole once."""
        manifest = self._manifests.get(record.name)
        if manifest is None:
            manifest = self._manifests[record.name] = self.source.manifest(record.name, record)
        return manifest

    def copy(self, record: CommitRecord, lease: Lease) -> bool:
        """Copy one checkpoint, committing it last; False if another writer committed it meanwhile."""
        if self.version is not None:
            manifest = self._manifests.pop(record.name, None) or self.source.manifest(record.name, record)
            if not rewrite.readable_at(manifest, self.version):
                return self._rewrite(record, manifest, lease)
        else:
            manifest = self.source.manifest(record.name, record, skip=OPTIONAL_FIELDS)
        keys = self._copy_rows(record.name, manifest.chunks, manifest.parent, set())
        committed = self._commit(record, manifest.requires, lease)
        self.good.update(keys)
        return committed

    def _rewrite(self, record: CommitRecord, manifest: Manifest, lease: Lease) -> bool:
        """Commit ``record``'s checkpoint re-encoded for ``self.version`` (``lifecycle.rewrite``): the rows
        whose codec the version has copied as they are, the others stored again, then the new manifest,
        its signature (``signer``) and its commit record. False if another writer committed it meanwhile."""
        assert self.version is not None
        where = self.source.storage.describe(record.name)
        rewrite.refuse_inexpressible(manifest, self.version, where)  # before anything of it is written
        chosen = rewrite.plan(manifest.chunks, self.version)
        keys = self._copy_rows(record.name, manifest.chunks, manifest.parent, set(chosen.codecs))
        if self.reencoder is None:
            self.reencoder = rewrite.Reencoder(self.source, self.target, self.workers, self.verify, self.budget,
                                               self.stored, self.yield_to, self.progress)
        self.total += self.reencoder.pending_bytes(manifest.chunks, chosen)
        self.progress.set_size(self.total)
        try:
            chunks = self.reencoder.run(manifest.chunks, chosen)
        except CheckpointError as error:
            raise type(error)(f"{error} (checkpoint {record.name!r} not replicated)") from None
        data, parsed = rewrite.rewritten(manifest, chunks, self.version, self.target.storage.describe(record.name))
        new = rewrite.record_for(record, data, self.version)
        key = layout.manifest_key(new.name, new.manifest_hash)
        self.target.storage.write(key, data)
        self.target.storage.sync([key])
        with self.lock:
            self.bytes_copied += len(data)
        self.signatures_dropped += sum(1 for found in signatures(self.source, record.name)
                                       if found.signature is not None and found.signature.verifies(record))
        if self.signer is not None:  # before the commit record: a signed copy is never seen unsigned
            self.signatures_written += write_signature(self.target, new, self.signer)[1]
        lease.check("writing the commit record")
        self.target.declare(self.version, parsed.requires)
        try:
            self.target.create_commit(new)
        except CheckpointExistsError:  # a rival sync's rewrite of the same checkpoint is fine
            theirs = self.target.manifest(record.name)
            if not rewrite.same_checkpoint(manifest, theirs, self.version):
                raise
            return False
        self.rewritten.add(record.name)
        self.good.update(keys | {stored_key(chunks, chunks[i]) for i in chosen.codecs})
        return True

    def _copy_rows(self, name: str, table: list[Chunk], parent: str | None, leave: set[int]) -> set[str]:
        """Copy the chunks of ``table`` (the rows of ``leave`` left out) that the target lacks, made durable;
        the keys of those copied or found."""
        # Bases before the deltas stored against them (spec 5.5), though a delta is checked against its
        # base's bytes in the source, so the order is for readers of a half-copied repository only.
        order = sorted((i for i in range(len(table)) if i not in leave), key=lambda i: delta_depth(table, i))
        chunks = list({stored_key(table, table[i]): (table, i) for i in order}.items())
        local = self.target.storage.cheap_exists
        trusted = self._parent_chunks(parent) if local else set()
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
        written, found = self._run(jobs, name)
        self.target.storage.sync(written)
        self.target.storage.make_durable(found)  # left by a killed run, which may not have made them durable
        return {key for key, _ in chunks}

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
        parity = None
        if record.parity is not None:  # copied with the chunks it protects (spec 5.6)
            copied = copy_parity(self.source.storage, self.target.storage, record.name, record.parity)
            if copied is None:
                warnings.warn(f"{self.source.storage.describe(record.name)}: its parity cannot be read whole; "
                              "copied without it (`ckptfmt repair` mends it on the source)", CheckpointWarning,
                              stacklevel=2)
                record = dataclasses.replace(record, parity=None)
            else:
                parity = copied[0]
                with self.lock:
                    self.bytes_copied += copied[1]
        lease.check("writing the commit record")
        self.target.declare(record.version, requires)
        try:
            self.target.create_commit(record)
        except CheckpointExistsError:  # a rival replication of the same checkpoint is fine; another is not
            if not _on_target(self.source, self.target, record):
                raise
            return False
        if parity is not None and record.parity is not None:
            write_copies(self.target.storage, parity, record.parity)
        return True


def _call_with_key(done: Callable[[Future, str], None], key: str, future: Future) -> None:
    """A future's done callback that also gets the chunk's key."""
    done(future, key)
