"""Deleting checkpoints and collecting the garbage they leave, safely while saves run (spec 11.6).

``remove`` deletes checkpoints: the commit record first, so a checkpoint half
deleted is never visible as complete; their chunks stay (others may share them).
``collect`` reclaims what no committed checkpoint references:

1. **mark**, without any lock: one listing of the repository and every committed
   manifest give the candidates (unreferenced chunks, manifests no commit record
   names, folders of saves that never committed, temporary files);
2. **sweep**, under a gc lease (``leases.try_gc_lease``): checkpoints committed
   since the mark are read and their chunks spared, then the candidates are deleted.

Why a sweep never deletes a chunk a save is about to reference:
docs/design/leases-and-gc.md.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.limits import is_valid_name
from ckptfmt.format.manifest import OPTIONAL_FIELDS
from ckptfmt.format.parity_record import record_digest
from ckptfmt.repository.history import removed_manifests
from ckptfmt.repository.leases import SAVE, Lease, live_leases, try_gc_lease
from ckptfmt.repository.lost_commits import lost_commits
from ckptfmt.repository.parity import RECORDS_DIR, parity_keys, read_record, stored_digests
from ckptfmt.repository.repository import CommitRecord, Repository

_CHUNK_NAME = re.compile(r"[0-9a-f]{64}(\.[a-z0-9-]+)?")
#: Deletions per batch; the gc lease is checked before each.
_BATCH = 1000


@dataclass
class GcReport:
    """What a collection freed (or, with ``dry_run``, would free)."""

    dry_run: bool
    #: Unreferenced chunks, and their stored bytes.
    chunks: int = 0
    chunk_bytes: int = 0
    #: Uncommitted manifests and folders, temporary files.
    other: int = 0
    other_bytes: int = 0
    #: Chunks that committed checkpoints still reference.
    kept_chunks: int = 0
    kept_bytes: int = 0
    #: Parity objects (spec 5.6) no committed checkpoint's parity record names, and their bytes.
    parity: int = 0
    parity_bytes: int = 0
    #: Parity objects and record copies kept for the remaining checkpoints, and their bytes.
    kept_parity: int = 0
    kept_parity_bytes: int = 0
    #: Live save leases that kept the sweep from running (nothing was deleted then).
    busy: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def swept(self) -> bool:
        return not self.dry_run and not self.busy

    def to_dict(self) -> dict:
        return {**asdict(self), "swept": self.swept}


@dataclass
class _Mark:
    """The mark phase's findings."""

    #: Each committed checkpoint's commit record.
    records: dict[str, CommitRecord]
    referenced: set[str]
    chunks: dict[str, int]
    other: dict[str, int]
    kept_bytes: int
    #: Unreferenced parity objects; the parity objects and record copies kept, and their bytes.
    parity: dict[str, int] = field(default_factory=dict)
    kept_parity: int = 0
    kept_parity_bytes: int = 0


def remove(repo: Repository, names: list[str]) -> list[str]:
    """Delete the checkpoints ``names`` (``Repository.remove``: the commit record first).

    Chunks stay until ``collect``. A folder whose commit record is already gone (a
    removal interrupted half way) is removed too. Raises CheckpointNotFoundError
    for a name with neither, and UnsafePathError for one whose folder is a
    symbolic link (it would delete another repository's checkpoint), before
    deleting anything.
    """
    for name in names:
        repo.storage.refuse_links(layout.commit_key(name))
        if not repo.storage.exists(layout.commit_key(name)) and not repo.storage.list(name) and not \
                stored_digests(repo.storage, name, folder=False):
            raise CheckpointNotFoundError(f"{repo.storage.describe(name)}: no such checkpoint (no commit record)")
    for name in names:
        repo.remove(name)
    return list(names)


def collect(repo: Repository, *, dry_run: bool = False, wait_s: float = 0.0,
            assume_removed: frozenset[str] = frozenset(), known: dict[str, frozenset[str]] | None = None) -> GcReport:
    """Reclaim everything no committed checkpoint references (see the module docstring).

    While saves hold leases the sweep waits for them, up to ``wait_s`` seconds
    (holding new saves back meanwhile), then gives up deleting nothing
    (``report.busy`` names them). A damaged commit record or manifest stops the
    collection: its chunks cannot be known. ``assume_removed``: for a dry run,
    checkpoints to count as already removed (what ``gc --keep-...`` would remove).
    ``known``: manifest hash -> chunk keys, kept by a caller that collects
    often (the manager), so that each manifest is read once.
    """
    if assume_removed and not dry_run:
        raise ValueError("assume_removed is for dry runs: remove() the checkpoints first")
    started = time.perf_counter()
    known = {} if known is None else known
    mark = _mark(repo, assume_removed, known)
    report = GcReport(dry_run=dry_run, kept_chunks=len(mark.referenced), kept_bytes=mark.kept_bytes,
                      kept_parity=mark.kept_parity, kept_parity_bytes=mark.kept_parity_bytes)
    if not dry_run:
        lease, report.busy = try_gc_lease(repo, drain_s=wait_s)
        if lease is None:
            report.seconds = time.perf_counter() - started
            return report
        try:
            _spare_new_commits(repo, mark, known)
            # A folder a save was writing when the mark listed it (its name may be a removed checkpoint's,
            # which a later one names as parent) is decided now that no save runs: committed since (spared
            # above), or left by a save that died, or a checkpoint that lost its commit record (refused).
            _refuse_lost_commits(repo, mark.other, mark.records, assume_removed)
            _sweep(repo, mark, lease)
        finally:
            lease.release()
    report.chunks, report.chunk_bytes = len(mark.chunks), sum(mark.chunks.values())
    report.parity, report.parity_bytes = len(mark.parity), sum(mark.parity.values())
    report.other, report.other_bytes = len(mark.other), sum(mark.other.values())
    report.seconds = time.perf_counter() - started
    return report


def _mark(repo: Repository, assume_removed: frozenset[str], known: dict[str, frozenset[str]]) -> _Mark:
    """Everything stored, split into what committed checkpoints use and the candidates."""
    objects = repo.storage.find("")  # one listing: it also tells which checkpoints are committed
    committed = {key.partition("/")[0] for key in objects
                 if key.endswith(f"/{layout.COMMIT_NAME}") and is_valid_name(key.partition("/")[0])
                 and key.count("/") == 1} - assume_removed
    records = _records(repo, committed)
    if not live_leases(repo, SAVE):  # else decided under the gc lease, once no save runs (see collect)
        _refuse_lost_commits(repo, objects, records, assume_removed)
    referenced: set[str] = set()
    for record in records.values():
        referenced.update(_chunk_keys(repo, record, known))
    parity = _ParityMark(repo, records, assume_removed)
    manifests = {layout.manifest_key(r.name, r.manifest_hash) for r in records.values()}
    chunks: dict[str, int] = {}
    other: dict[str, int] = {}
    kept_bytes = 0
    for key, size in objects.items():
        top, _, rest = key.partition("/")
        if top == layout.PARITY_DIR and rest:
            parity.sort(key, size, other)
        elif top == layout.CHUNKS_DIR and rest:
            if key in referenced:
                kept_bytes += size
            elif _CHUNK_NAME.fullmatch(key.rsplit("/", 1)[-1]) or _is_temporary(key):
                chunks[key] = size
        elif is_valid_name(top) and rest and key not in manifests and key != layout.commit_key(top):
            if top not in records or layout.manifest_digest(rest) is not None or _is_temporary(key):
                other[key] = size
        elif top in assume_removed and rest:
            other[key] = size
    return _Mark(records, referenced, chunks, other, kept_bytes, parity.unreferenced, parity.kept, parity.kept_bytes)


class _ParityMark:
    """Sorts the parity objects and record copies (spec 5.6) into kept and garbage: a parity object is kept
    while a committed checkpoint's record names it, a record copy while its checkpoint's commit record
    does. A copy of a checkpoint with no commit record proves a commit that was lost (copies are written
    after the commit, deleted before a removal): the collection stops, as for any lost commit."""

    def __init__(self, repo: Repository, records: dict[str, CommitRecord], assume_removed: frozenset[str]):
        self.repo, self.records, self.assume_removed = repo, records, assume_removed
        self.unreferenced: dict[str, int] = {}
        self.kept = self.kept_bytes = 0
        self.named: set[str] | None = set()  # None: a record could not be read, so every parity object stays
        for record in records.values():
            if record.parity is None:
                continue
            try:
                found = read_record(repo.storage, record.name, record.parity)
            except CheckpointNotFoundError:
                continue
            except CorruptDataError:
                self.named = None
                break
            self.named.update(parity_keys(found.record))

    def sort(self, key: str, size: int, other: dict[str, int]) -> None:
        parts = key.split("/")
        if parts[1] == "records" and len(parts) == 4:
            name, digest = parts[2], record_digest(parts[3])
            record = self.records.get(name)
            if record is not None and digest == record.parity:
                self._keep(size)
            elif record is not None or name in self.assume_removed or digest is None or self._removed(name, digest):
                other[key] = size
            else:
                raise CheckpointError(f"cannot collect garbage: {self.repo.storage.describe(key)} holds the parity "
                                      f"record of checkpoint {name!r}, whose commit record is gone: "
                                      f"`ckptfmt repair {self.repo.url}` rebuilds it from parity; or, if it was being "
                                      f"removed, `ckptfmt rm {self.repo.url}/{name}` finishes the removal")
        elif self.named is None or key in self.named:
            self._keep(size)
        else:
            self.unreferenced[key] = size

    def _removed(self, name: str, digest: str) -> bool:
        """Whether the copy is a leftover of a removal that knew no parity (a history object records it)."""
        try:
            found = read_record(self.repo.storage, name, digest)
        except CorruptDataError:
            return False  # unreadable: no proof either way, so no deletion
        return found.record.manifest_hash in removed_manifests(self.repo, name)

    def _keep(self, size: int) -> None:
        self.kept += 1
        self.kept_bytes += size


def _refuse_lost_commits(repo: Repository, objects: dict[str, int], records: dict[str, CommitRecord],
                         assume_removed: frozenset[str]) -> None:
    """Stop the collection where a folder holds the manifest of a checkpoint that was surely committed but
    lost its commit record: sweeping it as an unfinished save would delete the checkpoint for good
    (spec 11.6: its chunks cannot be known). A save killed before its commit record is swept as usual."""
    uncommitted = sorted({key.partition("/")[0] for key in objects if "/" in key} - set(records) - assume_removed)
    lost = [found for found in lost_commits(repo, uncommitted, {n: r.parent for n, r in records.items()})
            if found.certain]
    if lost:
        raise CheckpointError(f"cannot collect garbage: {lost[0].message(repo.url)}; or, if it was being "
                              f"removed, `ckptfmt rm {repo.url}/{lost[0].name}` finishes the removal")


def _records(repo: Repository, names: set[str]) -> dict[str, CommitRecord]:
    """The commit records of ``names``, each read (never from the commit index: a stale or forged pack
    must not cost a chunk). One that cannot be read stops the collection; one removed meanwhile is left out."""
    records = {r.name: r for r in repo.commits(authority=True) if r.name in names}
    for name in sorted(names - set(records)):
        try:
            records[name] = repo.commit(name)
        except CheckpointNotFoundError:  # removed since the listing
            continue
        except CheckpointError as exc:
            raise CheckpointError(f"cannot collect garbage: {exc}; the chunks of {name!r} are unknown, so none "
                                  "can be deleted safely (remove or repair that checkpoint first)") from None
    return records


def _chunk_keys(repo: Repository, record: CommitRecord, known: dict[str, frozenset[str]]) -> frozenset[str]:
    if record.manifest_hash not in known:
        try:
            manifest = repo.manifest(record.name, record, skip=OPTIONAL_FIELDS)  # the chunk table is what it reads
        except CheckpointError as exc:
            raise CheckpointError(f"cannot collect garbage: {exc}; the chunks of {record.name!r} are unknown, so "
                                  "none can be deleted safely (remove or repair that checkpoint first)") from None
        known[record.manifest_hash] = frozenset(stored_key(manifest.chunks, c) for c in manifest.chunks)
    return known[record.manifest_hash]


def _is_temporary(key: str) -> bool:
    base = key.rsplit("/", 1)[-1]
    return base.startswith(".") and ".tmp-" in base


def _spare_new_commits(repo: Repository, mark: _Mark, known: dict[str, frozenset[str]]) -> None:
    """Under the gc lease: keep what checkpoints committed since the mark use (a name removed and saved
    again has another manifest), and take the records of now for the index rebuild."""
    now = {r.name: r for r in repo.commits(authority=True)}
    for name, record in now.items():
        if name in mark.records and mark.records[name].manifest_hash == record.manifest_hash:
            continue
        for key in _chunk_keys(repo, record, known):
            mark.chunks.pop(key, None)
        if record.parity is not None:  # committed since the mark, or protected since
            try:
                spared = parity_keys(read_record(repo.storage, name, record.parity).record)
            except CheckpointError:
                spared = set(mark.parity)
            for key in spared:
                mark.parity.pop(key, None)
            for key in [k for k in mark.other if k.startswith(f"{RECORDS_DIR}/{name}/")]:
                if record_digest(key.rsplit("/", 1)[-1]) == record.parity:
                    del mark.other[key]
        for key in [k for k in mark.other if k.startswith(f"{name}/")]:
            del mark.other[key]
    mark.records = now


def _sweep(repo: Repository, mark: _Mark, lease: Lease) -> None:
    """Delete the candidates in batches, each after checking that the gc lease still holds."""
    keys = sorted(mark.chunks) + sorted(mark.parity) + sorted(mark.other)
    for start in range(0, len(keys), _BATCH):
        lease.check("deleting garbage")
        repo.storage.delete_many(keys[start : start + _BATCH])
    for folder in sorted({k.split("/", 1)[0] for k in mark.other} - set(mark.records)):
        repo.storage.remove_folder(folder)
    for folder in sorted({k.rsplit("/", 1)[0] for k in mark.other if k.startswith(f"{RECORDS_DIR}/")}):
        repo.storage.remove_folder(folder)
    if repo.indexed:  # no save runs: entries of failed saves and records of removed checkpoints go (spec 4.4)
        lease.check("rebuilding the commit index")
        repo.index.rebuild(sorted(mark.records.values(), key=lambda r: (r.created_ns, r.name)))
