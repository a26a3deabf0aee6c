"""The commit index (spec 4.4): REPO/_index/, a cache of commit records that lists a repository cheaply.

It keeps listing and finding the latest checkpoint to a bounded number of
requests on object stores (why and how: docs/design/commit-index.md):

    _index/e/<created_ns:019d>.<NAME>.<manifest hash>            an entry (empty)
    _index/p/<seq:010d>.<count:08d>.<newest_ns:019d>.<tag>.json  a pack of commit records

A writer creates its entry before its commit record, so every committed
checkpoint has one; compaction folds entries whose commit record it has read
into packs, and small packs into bigger ones, each new pack written before what
it replaces is deleted and keyed after every pack it replaces. Commit records
(NAME/COMMIT) stay the authority: an entry or packed record only says where to
look, and what a reader takes from the index it checks against them or against
the repository's listing.
"""

from __future__ import annotations

import json
import re
import secrets
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    ManifestError,
    StorageError,
    UnsupportedVersionError,
    quoted,
)
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.features import check_object, version_fields
from ckptfmt.format.layout import INDEX_DIR
from ckptfmt.format.limits import MAX_INDEX_PACK_BYTES, is_valid_name
from ckptfmt.format.maps import unique_map
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.storage.base import Storage

ENTRIES_DIR = f"{INDEX_DIR}/e"
PACKS_DIR = f"{INDEX_DIR}/p"
PACK_FORMAT = "ckptfmt-index-pack"
#: Entries newer than every pack that make a writer compact after its commit.
COMPACT_AT = 32
#: Times a reader lists the index again when a pack it listed was replaced before it read it.
_LIST_TRIES = 3
#: Commit records read at once where each read is a network round trip.
_READERS = 8

_ENTRY_KEY = re.compile(r"([0-9]{19})\.(.+)\.([0-9a-f]{64})")
_PACK_KEY = re.compile(r"([0-9]{10})\.([0-9]{8})\.([0-9]{19})\.([0-9a-f]{8})\.json")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, order=True)
class Entry:
    """One checkpoint as the index names it; entries sort like "latest" orders checkpoints (spec 4.3)."""

    created_ns: int
    name: str
    manifest_hash: str

    @classmethod
    def of(cls, record: CommitRecord) -> Entry:
        return cls(record.created_ns, record.name, record.manifest_hash)

    @classmethod
    def parse(cls, basename: str) -> Entry | None:
        """The entry an ``_index/e`` key names, or None for anything else (ignored, like foreign files)."""
        match = _ENTRY_KEY.fullmatch(basename)
        if match is None or not is_valid_name(match[2]) or int(match[1]) >= 2**63:
            return None
        return cls(int(match[1]), match[2], match[3])

    @property
    def key(self) -> str:
        return f"{ENTRIES_DIR}/{self.created_ns:019d}.{self.name}.{self.manifest_hash}"

    def matches(self, record: CommitRecord) -> bool:
        return (record.name, record.manifest_hash, record.created_ns) == (self.name, self.manifest_hash,
                                                                          self.created_ns)


@dataclass(frozen=True)
class PackRef:
    """A pack as its key describes it: sequence number, record count and newest ``created_ns``."""

    seq: int
    count: int
    newest_ns: int
    tag: str

    @classmethod
    def parse(cls, basename: str) -> PackRef | None:
        match = _PACK_KEY.fullmatch(basename)
        if match is None or int(match[3]) >= 2**63:
            return None
        return cls(int(match[1]), int(match[2]), int(match[3]), match[4])

    @property
    def key(self) -> str:
        return f"{PACKS_DIR}/{self.seq:010d}.{self.count:08d}.{self.newest_ns:019d}.{self.tag}.json"


class IndexDamagedError(ManifestError):
    """An index object is malformed or contradicts its key; readers fall back to the commit records."""


class _PackGone(Exception):
    """A listed pack was deleted (replaced by a compaction) before it could be read: list again."""


def encode_pack(records: list[CommitRecord], version: tuple[int, int] = FORMAT_VERSION) -> bytes:
    return json.dumps({"format": PACK_FORMAT, **version_fields(version),
                       "records": [r.to_dict() for r in records]}, separators=(",", ":")).encode()


def decode_pack(data: bytes, ref: PackRef, where: str) -> list[CommitRecord]:
    """A pack's records, each checked as a commit record, and all consistent with the pack's key."""
    try:
        doc = json.loads(data, object_pairs_hook=unique_map)
    except CheckpointError as exc:  # a duplicate key
        raise IndexDamagedError(f"{where}: {exc}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise IndexDamagedError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != PACK_FORMAT:
        raise IndexDamagedError(f"{where}: not a ckptfmt index pack")
    try:
        check_object(doc, where)
        if not isinstance(doc.get("records"), list):
            raise IndexDamagedError(f"{where}: the pack's records are not an array")
        records = [CommitRecord.from_dict(r, f"{where}: record {i}") for i, r in enumerate(doc["records"])]
    except UnsupportedVersionError:
        raise  # written by a newer ckptfmt: "upgrade", never damage to work around (spec 13.2)
    except CheckpointError as exc:  # a malformed record
        raise IndexDamagedError(str(exc)) from None
    newest = max((r.created_ns for r in records), default=None)
    if len(records) != ref.count or newest != ref.newest_ns:
        raise IndexDamagedError(f"{where}: holds {len(records)} records, newest created_ns {quoted(newest)}; "
                                f"its name says {ref.count} and {ref.newest_ns}")
    return records


def read_each(storage: Storage, function: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``function`` of each item, in order; several at once where each is a network round trip."""
    items = list(items)
    if storage.cheap_exists or len(items) < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(_READERS, len(items))) as pool:
        return list(pool.map(function, items))


class CommitIndex:
    """The index of one repository; ``read_commit(name)`` reads the authority, a checkpoint's commit record:
    the record, the error reading a damaged one, or None when there is none (store failures raise)."""

    def __init__(self, storage: Storage, read_commit: Callable[[str], CommitRecord | CheckpointError | None],
                 version: tuple[int, int] = FORMAT_VERSION):
        self.storage = storage
        self.read_commit = read_commit
        #: The version its packs are written for: the repository marker's.
        self.version = version

    # -- listing ------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """The entries, oldest first; keys that are not entries are ignored."""
        return sorted(e for e in map(Entry.parse, self.storage.list(ENTRIES_DIR)) if e is not None)

    def packs(self) -> list[PackRef]:
        """The packs, in key (sequence) order; keys that are not packs are ignored."""
        return sorted((p for p in map(PackRef.parse, self.storage.list(PACKS_DIR)) if p is not None),
                      key=lambda p: p.key)

    def read_pack(self, ref: PackRef) -> list[CommitRecord]:
        """A pack's records; _PackGone if it was deleted since it was listed."""
        where = self.storage.describe(ref.key)
        try:
            return self.storage.read_checked(ref.key, max_size=MAX_INDEX_PACK_BYTES,
                                             check=lambda data: decode_pack(data, ref, where))
        except CheckpointNotFoundError:
            raise _PackGone(where) from None
        except (StorageError, IndexDamagedError):
            raise
        except CheckpointError as exc:  # over the limit, not a regular file
            raise IndexDamagedError(str(exc)) from None

    def confirm(self, entry: Entry) -> CommitRecord | CheckpointError | None:
        """What the authority says of ``entry``: its commit record, the error reading a damaged one, or None
        when no commit record names this manifest (an unfinished or failed save, or a removed checkpoint)."""
        outcome = self.read_commit(entry.name)
        if isinstance(outcome, CommitRecord):
            return outcome if entry.matches(outcome) else None
        return outcome

    # -- readers ------------------------------------------------------------
    def vouched(self, names: set[str]) -> dict[str, CommitRecord]:
        """Packed records of ``names`` that readers may take without reading them: one packed record for
        the name and no entry (an entry means a save of that name since its compaction)."""
        listed = self.listed()
        if listed is None:
            return {}  # compactions keep replacing packs: the commit records say it all
        entries, packed = listed
        loose = {e.name for e in entries}
        found: dict[str, dict[str, CommitRecord]] = {}
        for record in packed:
            if record.name in names and record.name not in loose:
                found.setdefault(record.name, {})[record.manifest_hash] = record
        return {name: next(iter(records.values())) for name, records in found.items() if len(records) == 1}

    def listed(self) -> tuple[list[Entry], list[CommitRecord]] | None:
        """The entries and every packed record (damaged packs skipped with a warning), listed consistently;
        None when compactions kept replacing packs while they were read."""
        for _ in range(_LIST_TRIES):
            entries, refs = self.entries(), self.packs()  # entries first: compaction packs, then deletes
            try:
                return entries, [r for ref in refs for r in self._read_or_skip(ref)]
            except _PackGone:
                continue
        return None

    def _read_or_skip(self, ref: PackRef) -> list[CommitRecord]:
        """A pack's records, or none with a warning when it is damaged (its names' commit records are read)."""
        try:
            return self.read_pack(ref)
        except IndexDamagedError as exc:
            warnings.warn(f"ignoring a damaged commit index pack: {exc}", stacklevel=4, category=CheckpointWarning)
            return []

    def latest(self) -> tuple[CommitRecord | None, list[CheckpointError]]:
        """The newest committed checkpoint's record (None: no checkpoint), and the damaged commit records met.

        Candidates are taken newest first, from the entries and from the packs whose newest record could
        still be newer, and each is confirmed by its commit record. IndexDamagedError: use the authority.
        """
        for _ in range(_LIST_TRIES):
            try:
                return self._latest_once()
            except _PackGone:
                continue
        raise IndexDamagedError(f"{self.storage.describe(PACKS_DIR)}: packs keep being replaced while read")

    def _latest_once(self) -> tuple[CommitRecord | None, list[CheckpointError]]:
        candidates = set(self.entries())
        refs = sorted(self.packs(), key=lambda p: p.newest_ns)
        pending = sorted(candidates)
        damaged: list[CheckpointError] = []
        while True:
            if refs and (not pending or refs[-1].newest_ns >= pending[-1].created_ns):
                candidates.update(Entry.of(r) for r in self.read_pack(refs.pop()))
                pending = sorted(candidates)
                continue
            if not pending:
                return None, damaged
            entry = pending.pop()
            candidates.discard(entry)
            outcome = self.confirm(entry)
            if isinstance(outcome, CommitRecord):
                return outcome, damaged
            if outcome is not None:
                damaged.append(outcome)

    # -- writers ------------------------------------------------------------
    def add(self, record: CommitRecord) -> None:
        """Create ``record``'s entry, durably: before its commit record, so no commit goes unindexed."""
        key = Entry.of(record).key
        self.storage.write(key, b"", durable=False)  # the sync makes it durable, with its folder
        self.storage.sync([key])

    def discard(self, record: CommitRecord) -> None:
        """Delete ``record``'s entry after a save that did not commit it (best effort: a stale entry is
        skipped by readers and deleted by the next rebuild)."""
        try:
            self.storage.delete(Entry.of(record).key)
        except CheckpointError:
            pass

    def after_commit(self, record: CommitRecord) -> None:
        """Compact once COMPACT_AT entries are newer than every pack (one listing otherwise). Of writers
        committing together, only the one whose entry is the newest does, not all at once; any writer
        does at twice that (an entry from a clock ahead, never committed, must not stop compactions)."""
        entries = self.entries()
        threshold = COMPACT_AT if entries and entries[-1] == Entry.of(record) else 2 * COMPACT_AT
        if len(entries) < threshold:
            return
        newest = max((p.newest_ns for p in self.packs()), default=-1)
        if sum(e.created_ns > newest for e in entries) >= threshold:
            self.compact(entries)

    def compact(self, entries: list[Entry] | None = None) -> None:
        """Fold the entries whose commit record confirms them, and the newest packs up to twice the size of
        what is being folded, into one new pack; then delete what it replaces. Unconfirmed entries stay (a save
        may be about to commit them). A pack that vanishes meanwhile (a rival compaction) ends this one."""
        entries = self.entries() if entries is None else entries
        refs = self.packs()
        outcomes = read_each(self.storage, self.confirm, entries)
        records = {e: outcome for e, outcome in zip(entries, outcomes) if isinstance(outcome, CommitRecord)}
        folded = list(records)
        if not folded:
            return
        merged = []
        for ref in reversed(refs):  # newest first: each pack kept is over twice all newer ones together
            if ref.count > 2 * len(records):
                break
            try:
                records.update((Entry.of(r), r) for r in self.read_pack(ref))
            except (_PackGone, IndexDamagedError):
                break
            merged.append(ref)
        seq = max((r.seq for r in refs), default=0) + 1
        self.write_packs(seq, [records[e] for e in sorted(records)])
        self.storage.delete_many([ref.key for ref in merged] + [e.key for e in folded])

    def write_packs(self, seq: int, records: list[CommitRecord]) -> None:
        """Write ``records`` (oldest first) as packs numbered from ``seq``, each under the size limit."""
        start = 0
        while start < len(records):
            end, data = self._fitting(records, start)
            ref = PackRef(seq, end - start, max(r.created_ns for r in records[start:end]), secrets.token_hex(4))
            self.storage.write(ref.key, data, durable=False)
            self.storage.sync([ref.key])
            seq, start = seq + 1, end

    def _fitting(self, records: list[CommitRecord], start: int) -> tuple[int, bytes]:
        """The longest run of records from ``start`` whose pack fits MAX_INDEX_PACK_BYTES, and that pack."""
        end = len(records)
        while True:
            data = encode_pack(records[start:end], self.version)
            if len(data) <= MAX_INDEX_PACK_BYTES or end - start == 1:
                return end, data
            end = start + (end - start) // 2

    def rebuild(self, records: list[CommitRecord]) -> None:
        """Replace the whole index by packs of ``records`` (every committed checkpoint, oldest first).
        Only while no save runs: an entry deleted here may belong to a save about to commit."""
        refs = self.packs()
        stale = [e.key for e in self.entries()] + [r.key for r in refs]
        self.write_packs(max((r.seq for r in refs), default=0) + 1, records)
        self.storage.delete_many(stale)
