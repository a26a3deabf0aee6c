"""A repository: the marker, the chunk store and the committed checkpoints at one URL.

A checkpoint exists for readers only once its commit record is written and
names a manifest whose hash matches; anything else under REPO/NAME is an
unfinished or failed save and is ignored.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptDataError,
    InvalidNameError,
    ManifestError,
    StorageError,
    UnsupportedVersionError,
    quoted,
    warn_caller,
)
from ckptfmt.format import layout
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.features import check_object, version_fields, version_text
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.limits import MAX_COMMIT_BYTES, MAX_MARKER_BYTES, check_name, is_valid_name
from ckptfmt.format.maps import unique_map
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.repository.index import CommitIndex, IndexDamagedError, read_each
from ckptfmt.repository.parity import remove_copies, stored_digests
from ckptfmt.repository.pointers import POINTER_SUFFIX, read_pointer
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import check_no_parent_segments, open_storage

if TYPE_CHECKING:
    from ckptfmt.format.manifest import Manifest

REPO_FORMAT = "ckptfmt-repository"
#: The version of the commit index (spec 4.4) that this ckptfmt reads and keeps: the marker's ``index``.
INDEX_VERSION = 1
#: Tries of reading a commit record back after its create (``Repository.create_commit``).
_READ_BACK_TRIES = 4


class MarkerDamagedError(ManifestError):
    """The repository marker is unreadable (not JSON, not a marker): every read of the repository needs it,
    and ``repair`` restores it from another copy."""


@dataclass(frozen=True)
class Listing:
    """A repository's top-level entries, sorted."""

    #: Valid checkpoint names with a commit record.
    checkpoints: list[str]
    #: Everything else but the marker and the chunk store: foreign files and folders,
    #: invalid names, unfinished saves (no commit record). Readers ignore them.
    ignored: list[str]


#: Rewrites of the marker a save tries while other writers rewrite it too (spec 10.2).
_DECLARE_TRIES = 8


class Repository:
    """Access to one repository's checkpoints and chunks through a Storage."""

    def __init__(self, storage: Storage):
        self.storage = storage
        #: The marker's ``index`` (spec 4.4), known once ``check_marker`` has read it: None without an index.
        self.index_version: int | None = None
        #: The marker's format version and required features (spec 10.2), known once it is read.
        self.format_version: tuple[int, int] = FORMAT_VERSION
        self.features: frozenset[str] = frozenset()

    @property
    def indexed(self) -> bool:
        """Whether readers may use the commit index, and writers must keep it (the marker says so)."""
        return self.index_version == INDEX_VERSION

    @property
    def index(self) -> CommitIndex:
        return CommitIndex(self.storage, self._commit_or_error, self.format_version)

    @property
    def url(self) -> str:
        return self.storage.url

    @classmethod
    def open(cls, url: str | os.PathLike, storage_options: dict | None = None, *, create: bool = False,
             format_version: tuple[int, int] = FORMAT_VERSION, features: frozenset[str] = frozenset()) -> Repository:
        """The repository at ``url``; with ``create``, make it (marker included) when missing, for readers of
        ``format_version``, declaring ``features`` (format 2: those its first checkpoint will require)."""
        repo = cls(open_storage(url, storage_options))
        if repo.storage.exists(layout.MARKER_KEY):
            repo.check_marker()
        elif create:
            repo.storage.makedirs("")
            try:
                declared = features if format_version[0] >= 2 else frozenset()
                index = INDEX_VERSION if format_version >= INDEXED_FROM else None  # writers before 1.3 keep none
                repo.storage.create(layout.MARKER_KEY, marker_bytes(format_version, declared, index))
                repo.index_version, repo.format_version, repo.features = index, format_version, declared
            except FileExistsError:  # another writer created it first
                repo.check_marker()
        else:
            raise no_repository(repo.storage)
        return repo

    def declare(self, version: tuple[int, int], features: frozenset[str]) -> None:
        """Make the marker declare what a checkpoint about to be committed needs (spec 13.2): the newest
        version of its checkpoints, and from format 2 their required features, so that a reader that cannot
        read one refuses the repository at once. Writers that race each rewrite until theirs are in. A marker
        only rises, so what this object last read of it answers without a read when it covers them already."""
        if self._covers(version, features):
            return
        for _ in range(_DECLARE_TRIES):
            doc = self._read_marker()
            was = self.format_version
            if self._covers(version, features):
                return
            newer = max(was, version)
            if newer > was:
                refused = "now refuse it" if newer[0] > was[0] else "cannot read that checkpoint"
                warn_caller(f"{self.url}: a checkpoint of format {version_text(version)} makes the repository "
                            f"format {version_text(newer)}: readers of format {version_text(was)} {refused} "
                            f"(save with format_version=\"{version_text(was)}\" to keep it readable by them)")
            kept = self.features | features if newer[0] >= 2 else frozenset()
            self.storage.write(layout.MARKER_KEY, marker_bytes(newer, kept, doc.get("index")))
        raise StorageError(f"{self.url}: the repository marker kept changing while this save declared "
                           f"{', '.join(sorted(features)) or 'its format version'} in it")

    def _covers(self, version: tuple[int, int], features: frozenset[str]) -> bool:
        """Whether the marker as last read already shuts out every reader that cannot read a checkpoint of
        ``version`` using ``features``: from format 2 a minor adds only what readers of its major ignore or
        a feature it declares (spec 13.1), so a marker of that major with those features covers it."""
        if version[0] < 2:
            return version <= self.format_version
        return version[0] <= self.format_version[0] and features <= self.features

    def check_marker(self, *, hint: bool = True) -> None:
        """Read and check the marker; a damaged one's error says how to repair it (``hint``)."""
        self._read_marker(hint=hint)

    def _read_marker(self, *, hint: bool = True) -> dict:
        """The marker, checked (spec 10.2); notes whether the repository keeps a commit index (spec 4.4)."""
        where = self.storage.describe(layout.MARKER_KEY)
        repair_hint = (f"; `ckptfmt repair {self.url} --from REPLICA` restores it from another copy (a tier, "
                       "a replica)") if hint else ""
        doc = self.storage.read_checked(layout.MARKER_KEY, max_size=MAX_MARKER_BYTES,
                                        check=lambda data: parse_marker(data, where, repair_hint=repair_hint))
        self.index_version = doc.get("index")
        self.format_version, self.features = tuple(doc["version"]), frozenset(doc.get("requires") or ())
        return doc

    # -- checkpoints ---------------------------------------------------------
    def names(self) -> list[str]:
        """Names with a commit record, sorted (whether each record is valid is checked on reading it)."""
        if self.indexed:
            return [name for name, found in self._catalog() if found is not None]
        return self.listing().checkpoints

    def listing(self) -> Listing:
        """The repository's top-level entries: checkpoints, and what readers ignore (spec 4.1).

        The authority, whatever the index says: one existence check per entry.
        """
        checkpoints, ignored = [], []
        for entry in self.storage.list(""):
            if entry in layout.RESERVED_ENTRIES:
                continue
            if is_valid_name(entry) and self.storage.exists(layout.commit_key(entry)):
                checkpoints.append(entry)
            else:
                ignored.append(entry)
        return Listing(checkpoints, ignored)

    def _catalog(self) -> list[tuple[str, CommitRecord | CheckpointError | None]]:
        """Each valid top-level name, sorted, with its commit record, the error reading it (damaged), or None
        (no commit record). Records the index vouches for are taken from its packs, the rest are read:
        one listing of the repository, a few of the index, about COMPACT_AT reads (spec 4.4)."""
        names = [entry for entry in self.storage.list("") if is_valid_name(entry)]
        vouched = self.index.vouched(set(names))
        unread = [name for name in names if name not in vouched]
        read = dict(zip(unread, read_each(self.storage, self._commit_or_error, unread)))
        return [(name, vouched.get(name) or read[name]) for name in names]

    def readable_commit(self, name: str) -> CommitRecord | None:
        """``commit(name)``, or None where there is none or it cannot be read (a store failure raises)."""
        found = self._commit_or_error(name)
        return found if isinstance(found, CommitRecord) else None

    def _commit_or_error(self, name: str) -> CommitRecord | CheckpointError | None:
        """``commit(name)``; None where there is none, the error where it is damaged. A store failure raises:
        unreadable now is not damaged, and skipping it would change "latest"."""
        try:
            return self.commit(name)
        except CheckpointNotFoundError:
            return None
        except StorageError:
            raise
        except CheckpointError as exc:
            return exc

    def commit(self, name: str) -> CommitRecord:
        key = layout.commit_key(name)
        where = self.storage.describe(key)
        def parsed(data: bytes) -> CommitRecord:
            record = CommitRecord.from_bytes(data, where)
            if record.name != name:
                raise ManifestError(f"{where}: commit record names checkpoint {record.name!r}")
            return record

        try:
            return self.storage.read_checked(key, max_size=MAX_COMMIT_BYTES, check=parsed)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.storage.describe(name)}: no such checkpoint (no commit record)"
            ) from None

    def create_commit(self, record: CommitRecord) -> None:
        """Write ``record`` as its checkpoint's commit record, once; CheckpointExistsError if the name is taken.

        In an indexed repository the record's index entry is written first, so
        no commit goes unindexed, and deleted again if the save loses; once
        committed, the index is compacted when due (spec 4.4).
        """
        key = layout.commit_key(record.name)
        where = self.storage.describe(record.name)
        if self.index_version is not None and not self.indexed:
            raise UnsupportedVersionError(f"{self.url}: the repository keeps a commit index of version "
                                          f"{self.index_version}, which this ckptfmt cannot keep; upgrade ckptfmt")
        if self.storage.exists(key):  # a long save leaves a window: check again just before the create
            raise CheckpointExistsError(f"{where}: checkpoint already exists")
        if not self.indexed:
            self._create_record(key, record.to_bytes(), where)
            return
        index = self.index
        index.add(record)
        try:
            self._create_record(key, record.to_bytes(), where)
        except CheckpointExistsError:
            index.discard(record)
            raise
        except CheckpointError:  # the disk filled up, the store failed: the entry goes if the record is absent
            if not self._exists_or_unknown(key):
                index.discard(record)
            raise
        try:
            index.after_commit(record)
        except CheckpointError as exc:  # committed all the same: the next save or a rebuild compacts
            warnings.warn(f"{where}: committed, but the commit index was not compacted: {exc}", stacklevel=3,
                          category=CheckpointWarning)

    def _exists_or_unknown(self, key: str) -> bool:
        """Whether ``key`` exists, True where that cannot be told (the store fails): keep what may be needed."""
        try:
            return self.storage.exists(key)
        except CheckpointError:
            return True

    def _create_record(self, key: str, data: bytes, where: str) -> None:
        """Create commit record ``key``. Where the storage's create cannot be taken on trust
        (``create_settle_s`` is set: object stores), the record is read back, and again that long after,
        and only our own bytes both times mean a commit (spec 11.3)."""
        settle_s = self.storage.create_settle_s
        trusted = settle_s is None
        try:
            self.storage.create(key, data)
            outcome: str | StorageError = "created"
        except FileExistsError:
            if trusted:
                raise CheckpointExistsError(f"{where}: checkpoint already exists") from None
            outcome = "exists"
        except StorageError as exc:  # the PUT may or may not have landed: the read-back tells
            if trusted:
                raise
            outcome = exc
        if settle_s is not None:
            self._confirm_commit(key, data, outcome, where, settle_s)

    def _confirm_commit(self, key: str, data: bytes, outcome: str | StorageError, where: str,
                        settle_s: float) -> None:
        """Read the record back twice, ``settle_s`` apart; return only if both reads are ``data``.

        ``outcome`` is what the create said. "exists" with our own bytes stored is
        our own earlier attempt: its answer was lost and botocore's retry got 412.
        A failed create (a StorageError) with our bytes stored landed after all.
        Another writer's bytes at the first read mean we lost; after a create that
        *succeeded*, or at the second read, they also mean the store ignored
        ``If-None-Match`` (or checked without a lock, as moto does). The second
        read only catches a rival PUT landing within the delay; without conditional
        writes, one landing later replaces our record unseen (spec 11.5).
        """
        for check in range(2):
            if check:
                time.sleep(settle_s)
            stored = self._read_back(key, where, data)
            if stored == data:
                continue
            if stored is None:
                if isinstance(outcome, StorageError):
                    raise outcome
                raise StorageError(f"{where}: the commit record vanished after it was written")
            if outcome == "created" or check:
                raise CheckpointExistsError(
                    f"{where}: another writer's commit record replaced this save's: the store did not honour "
                    "the conditional create (If-None-Match), so both writes landed and the other one stands")
            raise CheckpointExistsError(f"{where}: checkpoint already exists")

    def _read_back(self, key: str, where: str, expected: bytes) -> bytes | None:
        """The bytes of commit record ``key``, or None when absent.

        The commit's outcome hinges on this read, so it gets a few more tries than
        other reads: the client retries most failures itself, but a truncated body
        only once (s3fs), and an unknown outcome is worse than a slower save.
        """
        seen: list[bytes] = []

        def ours(stored: bytes) -> bytes:  # other bytes are read again: they may have been damaged in transit
            seen.append(stored)
            if stored != expected:
                raise CorruptDataError(f"{where}: not this save's commit record")
            return stored

        for attempt in range(_READ_BACK_TRIES):
            if attempt:
                time.sleep(0.2 * 2**attempt)
            try:
                return self.storage.read_checked(key, max_size=MAX_COMMIT_BYTES, check=ours)
            except CheckpointNotFoundError:
                return None
            except CorruptDataError:  # the same other bytes read twice: another writer's record
                return seen[-1]
            except StorageError as exc:
                error = exc
        raise StorageError(f"{where}: cannot read the commit record back, the checkpoint may or may not be "
                           f"committed ({error})")

    def commits(self, *, authority: bool = False) -> list[CommitRecord]:
        """Valid commit records, oldest first; damaged ones are skipped with a warning (verify reports them).

        ``authority``: read every commit record, whatever the index holds: a request per checkpoint, for
        what must not trust a cache (the garbage collector: a stale or forged pack must not cost chunks).
        """
        return self._commits(authority=authority)[0]

    def latest(self) -> str:
        """The newest checkpoint's name: greatest ``created_ns`` (stamped just before commit)."""
        record, damaged = self._latest()
        if record is not None:
            return record.name
        if damaged:
            raise CheckpointNotFoundError(f"{self.url}: no readable checkpoint ({len(damaged)} with damaged "
                                          f"commit records; the first: {damaged[0]})")
        raise CheckpointNotFoundError(f"{self.url}: repository has no checkpoints")

    def latest_record(self) -> CommitRecord | None:
        """The newest checkpoint's commit record, None in a repository without a readable checkpoint (a
        save's default parent). With the index, a few requests whatever the number of checkpoints."""
        return self._latest()[0]

    def _latest(self) -> tuple[CommitRecord | None, list[str]]:
        """The newest valid commit record and what was wrong with the damaged ones met (each also warned)."""
        if self.indexed:
            try:
                record, errors = self.index.latest()
            except IndexDamagedError as exc:
                warnings.warn(f"ignoring the commit index: {exc}", stacklevel=3, category=CheckpointWarning)
            else:
                for error in errors:
                    warnings.warn(f"skipping a checkpoint: {error}", stacklevel=3, category=CheckpointWarning)
                return record, [str(e) for e in errors]
        records, damaged = self._commits(authority=True)
        return (records[-1] if records else None), damaged

    def _commits(self, *, authority: bool = False) -> tuple[list[CommitRecord], list[str]]:
        """Valid commit records, oldest first, and what was wrong with the others (each also warned).
        ``authority``: every commit record read, whatever the index holds."""
        if self.indexed and not authority:
            found = self._catalog()
        else:
            names = [entry for entry in self.storage.list("") if is_valid_name(entry)]
            found = list(zip(names, read_each(self.storage, self._commit_or_error, names)))
        records, damaged = [], []
        for name, outcome in found:
            if isinstance(outcome, CommitRecord):
                records.append(outcome)
            elif outcome is not None:
                damaged.append(str(outcome))
                warnings.warn(f"skipping checkpoint {name!r}: {outcome}", stacklevel=3, category=CheckpointWarning)
        return sorted(records, key=lambda r: (r.created_ns, r.name)), damaged

    def remove(self, name: str) -> None:
        """Delete checkpoint ``name``: its commit record first, so that it is never seen half deleted, then
        the rest of its folder (manifests, a failed save's leftovers); a folder whose commit record is
        already gone (a removal interrupted half way) goes too. Its chunks stay for the collector.
        Packed index records of it are then ignored by readers: its name is gone from the listing."""
        key = layout.commit_key(check_name(name))
        copies = stored_digests(self.storage, name, folder=False)
        if not self.storage.exists(key) and not self.storage.list(name) and not copies:
            raise CheckpointNotFoundError(f"{self.storage.describe(name)}: no such checkpoint (no commit record)")
        self._archive_history(name)
        remove_copies(self.storage, name)  # first: a copy outside the folder would let a repair bring it back
        self.storage.delete(key)
        self.storage.delete_many([f"{name}/{entry}" for entry in self.storage.list(name)])
        self.storage.remove_folder(name)

    def keep_history(self, record: CommitRecord) -> HistoryKey:
        """Write the history object of committed checkpoint ``record`` (spec 4.5: its steps, system
        samples and save timing) and return its key; the same history always makes the same object."""
        from ckptfmt.format.manifest import optional_fields_except  # parsing needs numpy: not for ls

        manifest = self.manifest(record.name, record, skip=optional_fields_except("timing", "topology"))
        history = History.of(record, manifest)
        data = history.to_bytes(self.format_version)
        key = history.key(data)
        self.storage.write(key.key, data)
        return key

    def _archive_history(self, name: str) -> None:
        """Keep the run history checkpoint ``name`` holds (spec 4.5) before it goes: a store that fails
        stops the removal; a damaged checkpoint, whose history cannot be read, goes with a warning."""
        try:
            self.keep_history(self.commit(name))
        except CheckpointNotFoundError:
            return  # a removal interrupted half way: archived before its commit record went
        except (CorruptDataError, ManifestError) as exc:
            warnings.warn(f"removing {self.storage.describe(name)} without keeping its run history: {exc}",
                          stacklevel=4, category=CheckpointWarning)

    def rebuild_index(self) -> int:
        """Rebuild the commit index from the commit records, every one read, and mark the repository as
        indexed; returns the number of checkpoints indexed. For repair and for repositories made before
        the index, and only while no save runs: an entry of a save about to commit would be lost."""
        marker = self._read_marker()
        if self.index_version is not None and not self.indexed:
            raise UnsupportedVersionError(f"{self.url}: the repository keeps a commit index of version "
                                          f"{self.index_version}, which this ckptfmt cannot rebuild; upgrade ckptfmt")
        records, _ = self._commits(authority=True)
        self.index.rebuild(records)
        if not self.indexed:
            self.storage.write(layout.MARKER_KEY, json.dumps({**marker, "index": INDEX_VERSION}, indent=1).encode())
            self.index_version = INDEX_VERSION
        return len(records)

    def manifest(self, name: str, record: CommitRecord | None = None, *,
                 skip: frozenset[str] = frozenset()) -> Manifest:
        """Read a committed checkpoint's manifest, checked against its commit record (``skip``: top-level
        fields not needed, see ``Manifest.from_bytes``)."""
        record = record or self.commit(name)
        key = layout.manifest_key(name, record.manifest_hash)
        where = self.storage.describe(key)

        from ckptfmt.format.manifest import Manifest  # parsing needs numpy: only when a manifest is read (not ls)

        def parsed(data: bytes) -> Manifest:
            if len(data) != record.manifest_size:
                raise CorruptDataError(f"{where}: {len(data)} bytes, commit record says {record.manifest_size}")
            check_chunk(data, record.manifest_hash, where, parallel=True)  # a large manifest over every core
            return Manifest.from_bytes(data, where, skip=skip)

        manifest = self.storage.read_checked(key, max_size=record.manifest_size, check=parsed)
        if (manifest.name, manifest.step, manifest.created_ns, manifest.parent) != (
            name, record.step, record.created_ns, record.parent
        ):
            raise ManifestError(f"{where}: name, step, created_ns or parent differ from the commit record")
        return manifest


#: The commit index came with format 1.3 (spec 4.4): a repository for older writers has none, since they
#: would save without updating it and the index's latest would stay behind theirs.
INDEXED_FROM = (1, 3)


def marker_bytes(version: tuple[int, int], features: frozenset[str], index: int | None = INDEX_VERSION) -> bytes:
    """A marker for ``version`` declaring ``features`` (spec 10.2); repositories keep a commit index (4.4)."""
    doc: dict[str, Any] = {"format": REPO_FORMAT, **version_fields(version, features)}
    if index is not None:
        doc["index"] = index
    return json.dumps(doc, indent=1).encode()


def parse_marker(data: bytes, where: str, *, repair_hint: str = "") -> dict:
    """A repository marker's members, checked (spec 10.2): MarkerDamagedError (ending in ``repair_hint``)
    where the bytes are no marker; UnsupportedVersionError for a marker of another major version."""
    try:
        doc = json.loads(data, object_pairs_hook=unique_map)
    except ManifestError as exc:  # a duplicate key
        raise MarkerDamagedError(f"{where}: the repository marker is damaged ({exc}){repair_hint}") from None
    except (ValueError, RecursionError):  # RecursionError: deep JSON nesting
        raise MarkerDamagedError(f"{where}: the repository marker is damaged (not valid JSON){repair_hint}") from None
    if not isinstance(doc, dict) or doc.get("format") != REPO_FORMAT:
        raise MarkerDamagedError(f"{where}: not a ckptfmt repository marker{repair_hint}")
    try:
        check_object(doc, where)
    except ManifestError as exc:  # malformed; another major version or an unknown feature: UnsupportedVersionError
        raise MarkerDamagedError(f"{exc}{repair_hint}") from None
    index = doc.get("index")
    if index is not None and (type(index) is not int or index < 1):
        raise MarkerDamagedError(f"{where}: index {quoted(index)} is not a positive integer{repair_hint}")
    return doc


def resolve(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> tuple[Repository, str]:
    """Map a checkpoint URL (REPO/NAME) or a repository URL (its latest checkpoint) to both parts."""
    text = check_no_parent_segments(os.fspath(url).rstrip("/"))
    storage = open_storage(text, storage_options)
    if storage.exists(layout.MARKER_KEY):
        repo = Repository(storage)
        repo.check_marker()
        return repo, repo.latest()
    parent, sep, name = text.rpartition("/")
    if not sep or not name:
        raise no_repository(storage, "repository or checkpoint")
    if not name.endswith(POINTER_SUFFIX):
        check_name(name)
    try:
        repo = Repository.open(parent or "/", storage_options)
    except MarkerLostError:
        raise
    except CheckpointNotFoundError:
        raise no_repository(storage, "repository or checkpoint") from None
    if name.endswith(POINTER_SUFFIX) and not (is_valid_name(name) and repo.storage.exists(layout.commit_key(name))):
        return repo, _pointed(repo, name)
    return repo, name


def _pointed(repo: Repository, key: str) -> str:
    """The checkpoint the pointer file ``key`` of ``repo`` names (a path Lightning saved to)."""
    name = read_pointer(repo.storage, key)
    if name is None:
        raise CheckpointNotFoundError(f"{repo.storage.describe(key)}: no checkpoint and no ckptfmt pointer there")
    return name


class MarkerLostError(CheckpointNotFoundError):
    """A folder holds a chunk store but no marker: a repository that lost it (``repair`` restores it)."""


def no_repository(storage: Storage, what: str = "repository") -> CheckpointNotFoundError:
    """The error for a URL without a marker, saying why where that can be told: the bucket does not
    exist, or the folder holds a chunk store and lost its marker."""
    missing = storage.missing_container()
    if missing:
        return CheckpointNotFoundError(f"{storage.url}: {missing}")
    if storage.exists(layout.CHUNKS_DIR):
        return MarkerLostError(
            f"{storage.url}: a repository that lost its marker ({layout.MARKER_KEY}): it holds a chunk store; "
            f"`ckptfmt repair {storage.url} --from REPLICA` restores the marker from another copy")
    return CheckpointNotFoundError(f"{storage.url}: not a ckptfmt {what} (no {layout.MARKER_KEY})")


def split_checkpoint_url(url: str | os.PathLike) -> tuple[str, str]:
    """Split 'REPO/NAME' for a save; the name must be one valid path segment.

    A bare name (``"step-100"``, ``"s3://bucket"``) is refused rather than read as a checkpoint
    of the current directory or of a bucket's parent: that would make a repository of them.
    """
    text = check_no_parent_segments(os.fspath(url).rstrip("/"))
    protocol, scheme, path = text.rpartition("://")
    parent, sep, name = path.rpartition("/")
    if not sep or (scheme and not parent):
        raise InvalidNameError(f"{quoted(text)}: a checkpoint URL is REPO/NAME (e.g. runs/exp1/step-000100), "
                               "not a bare name")
    return f"{protocol}{scheme}{parent or '/'}", check_name(name)
