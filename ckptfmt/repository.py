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
from typing import Any

from . import layout
from .errors import (
    CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CheckpointWarning, CorruptDataError, ManifestError,
    StorageError, quoted,
)
from .hashing import check_chunk
from .limits import MAX_COMMIT_BYTES, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, check_hash, check_name, is_valid_name
from .manifest import FORMAT_VERSION, Manifest, check_version
from .storage import Storage, open_storage
from .values import unique_map

REPO_FORMAT = "ckptfmt-repository"
COMMIT_FORMAT = "ckptfmt-commit"
#: Tries of reading a commit record back after its create (``Repository.create_commit``).
_READ_BACK_TRIES = 4


@dataclass(frozen=True)
class CommitRecord:
    """The small record that makes a checkpoint exist: its manifest's hash plus a summary."""

    name: str
    manifest_hash: str
    manifest_size: int
    step: int | None
    created_ns: int
    parent: str | None
    stats: dict

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": COMMIT_FORMAT,
            "version": list(FORMAT_VERSION),
            "name": self.name,
            "manifest": self.manifest_hash,
            "manifest_size": self.manifest_size,
            "step": self.step,
            "created_ns": self.created_ns,
            "parent": self.parent,
            "stats": self.stats,
        }, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "CommitRecord":
        try:
            doc = json.loads(data, object_pairs_hook=unique_map)
            if not isinstance(doc, dict) or doc.get("format") != COMMIT_FORMAT:
                raise ManifestError("not a ckptfmt commit record")
            check_version(doc.get("version"), "commit record")
            size = doc["manifest_size"]
            step = doc.get("step")
            created = doc["created_ns"]
            if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest_size {quoted(size)} is invalid")
            if step is not None and type(step) is not int:
                raise ManifestError("step is not an integer")
            if type(created) is not int or not 0 <= created < 2**63:
                raise ManifestError("created_ns is not an integer in [0, 2**63)")
            parent = doc.get("parent")
            stats = doc.get("stats") or {}
            if not isinstance(stats, dict):
                raise ManifestError("stats is not a map")
            return cls(
                name=check_name(doc["name"]),
                manifest_hash=check_hash(doc["manifest"]),
                manifest_size=size,
                step=step,
                created_ns=created,
                parent=check_name(parent) if parent is not None else None,
                stats=stats,
            )
        except CheckpointError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        except KeyError as exc:
            raise ManifestError(f"{where}: malformed commit record (missing field {exc})") from None
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: deep JSON nesting
            raise ManifestError(f"{where}: malformed commit record ({exc})") from None


@dataclass(frozen=True)
class Listing:
    """A repository's top-level entries, sorted."""

    #: Valid checkpoint names with a commit record.
    checkpoints: list[str]
    #: Everything else but the marker and the chunk store: foreign files and folders,
    #: invalid names, unfinished saves (no commit record). Readers ignore them.
    ignored: list[str]


class Repository:
    """Access to one repository's checkpoints and chunks through a Storage."""

    def __init__(self, storage: Storage):
        self.storage = storage

    @property
    def url(self) -> str:
        return self.storage.url

    @classmethod
    def open(cls, url: str | os.PathLike, storage_options: dict | None = None, *, create: bool = False) -> "Repository":
        """The repository at ``url``; with ``create``, make it (marker included) when missing."""
        repo = cls(open_storage(url, storage_options))
        if repo.storage.exists(layout.MARKER_KEY):
            repo.check_marker()
        elif create:
            repo.storage.makedirs("")
            try:
                repo.storage.create(layout.MARKER_KEY, repo._marker_bytes())
            except FileExistsError:  # another writer created it first
                repo.check_marker()
        else:
            raise CheckpointNotFoundError(f"{repo.url}: not a ckptfmt repository (no {layout.MARKER_KEY})")
        return repo

    @staticmethod
    def _marker_bytes() -> bytes:
        return json.dumps({"format": REPO_FORMAT, "version": list(FORMAT_VERSION)}, indent=1).encode()

    def check_marker(self) -> None:
        where = self.storage.describe(layout.MARKER_KEY)
        try:
            doc = json.loads(self.storage.read(layout.MARKER_KEY, max_size=MAX_MARKER_BYTES), object_pairs_hook=unique_map)
        except CheckpointError:
            raise
        except (ValueError, RecursionError):  # RecursionError: deep JSON nesting
            raise ManifestError(f"{where}: not valid JSON") from None
        except ManifestError as exc:  # a duplicate key
            raise ManifestError(f"{where}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != REPO_FORMAT:
            raise ManifestError(f"{where}: not a ckptfmt repository marker")
        check_version(doc.get("version"), where)

    # -- checkpoints ---------------------------------------------------------
    def names(self) -> list[str]:
        """Names with a commit record, sorted (whether each record is valid is checked on reading it)."""
        return self.listing().checkpoints

    def listing(self) -> "Listing":
        """The repository's top-level entries: checkpoints, and what readers ignore (spec 4.1)."""
        checkpoints, ignored = [], []
        for entry in self.storage.list(""):
            if entry in (layout.MARKER_KEY, layout.CHUNKS_DIR):
                continue
            if is_valid_name(entry) and self.storage.exists(layout.commit_key(entry)):
                checkpoints.append(entry)
            else:
                ignored.append(entry)
        return Listing(checkpoints, ignored)

    def commit(self, name: str) -> CommitRecord:
        key = layout.commit_key(name)
        where = self.storage.describe(key)
        try:
            data = self.storage.read(key, max_size=MAX_COMMIT_BYTES)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"{self.storage.describe(name)}: no such checkpoint (no commit record)") from None
        record = CommitRecord.from_bytes(data, where)
        if record.name != name:
            raise ManifestError(f"{where}: commit record names checkpoint {record.name!r}")
        return record

    def create_commit(self, record: CommitRecord) -> None:
        """Write ``record`` as its checkpoint's commit record, once; CheckpointExistsError if the name is taken.

        Where the storage's create cannot be taken on trust (``create_settle_s``
        is set: object stores), the record is read back, and again that long
        after, and only our own bytes both times mean a commit (spec 11.3).
        """
        key = layout.commit_key(record.name)
        where = self.storage.describe(record.name)
        data = record.to_bytes()
        trusted = self.storage.create_settle_s is None
        if self.storage.exists(key):  # a long save leaves a window: check again just before the create
            raise CheckpointExistsError(f"{where}: checkpoint already exists")
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
        if not trusted:
            self._confirm_commit(key, data, outcome, where)

    def _confirm_commit(self, key: str, data: bytes, outcome: str | StorageError, where: str) -> None:
        """Read the record back twice, ``create_settle_s`` apart; return only if both reads are ``data``.

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
                time.sleep(self.storage.create_settle_s)
            stored = self._read_back(key, where)
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

    def _read_back(self, key: str, where: str) -> bytes | None:
        """The bytes of commit record ``key``, or None when absent.

        The commit's outcome hinges on this read, so it gets a few more tries than
        other reads: the client retries most failures itself, but a truncated body
        only once (s3fs), and an unknown outcome is worse than a slower save.
        """
        for attempt in range(_READ_BACK_TRIES):
            if attempt:
                time.sleep(0.2 * 2**attempt)
            try:
                return self.storage.read(key, max_size=MAX_COMMIT_BYTES)
            except CheckpointNotFoundError:
                return None
            except StorageError as exc:
                error = exc
        raise StorageError(f"{where}: cannot read the commit record back, the checkpoint may or may not be "
                           f"committed ({error})")

    def commits(self) -> list[CommitRecord]:
        """Valid commit records, oldest first; damaged ones are skipped with a warning (verify reports them)."""
        return self._commits()[0]

    def latest(self) -> str:
        """The newest checkpoint's name: greatest ``created_ns`` (stamped just before commit)."""
        records, damaged = self._commits()
        if records:
            return records[-1].name
        if damaged:
            raise CheckpointNotFoundError(f"{self.url}: no readable checkpoint ({len(damaged)} with damaged "
                                          f"commit records; the first: {damaged[0]})")
        raise CheckpointNotFoundError(f"{self.url}: repository has no checkpoints")

    def _commits(self) -> tuple[list[CommitRecord], list[str]]:
        """Valid commit records, oldest first, and what was wrong with the others (each also warned)."""
        records, damaged = [], []
        for name in self.names():
            try:
                records.append(self.commit(name))
            except StorageError:  # unreadable now is not damaged: skipping it would change "latest"
                raise
            except CheckpointError as exc:
                damaged.append(str(exc))
                warnings.warn(f"skipping checkpoint {name!r}: {exc}", stacklevel=3, category=CheckpointWarning)
        return sorted(records, key=lambda r: (r.created_ns, r.name)), damaged

    def manifest(self, name: str, record: CommitRecord | None = None, *,
                 skip: frozenset[str] = frozenset()) -> Manifest:
        """Read a committed checkpoint's manifest, checked against its commit record (``skip``: top-level
        fields not needed, see ``Manifest.from_bytes``)."""
        record = record or self.commit(name)
        key = layout.manifest_key(name, record.manifest_hash)
        where = self.storage.describe(key)
        data = self.storage.read(key, max_size=record.manifest_size)
        if len(data) != record.manifest_size:
            raise CorruptDataError(f"{where}: {len(data)} bytes, commit record says {record.manifest_size}")
        check_chunk(data, record.manifest_hash, where)
        manifest = Manifest.from_bytes(data, where, skip=skip)
        if (manifest.name, manifest.step, manifest.created_ns, manifest.parent) != (
            name, record.step, record.created_ns, record.parent
        ):
            raise ManifestError(f"{where}: name, step, created_ns or parent differ from the commit record")
        return manifest


def resolve(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> tuple[Repository, str]:
    """Map a checkpoint URL (REPO/NAME) or a repository URL (its latest checkpoint) to both parts."""
    text = os.fspath(url).rstrip("/")
    storage = open_storage(text, storage_options)
    if storage.exists(layout.MARKER_KEY):
        repo = Repository(storage)
        repo.check_marker()
        return repo, repo.latest()
    parent, sep, name = text.rpartition("/")
    if not sep or not name:
        raise CheckpointNotFoundError(f"{text}: not a ckptfmt repository or checkpoint")
    check_name(name)
    try:
        repo = Repository.open(parent or "/", storage_options)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{text}: not a ckptfmt repository or checkpoint") from None
    return repo, name


def split_checkpoint_url(url: str | os.PathLike) -> tuple[str, str]:
    """Split 'REPO/NAME' for a save; the name must be one valid path segment."""
    text = os.fspath(url).rstrip("/")
    parent, sep, name = text.rpartition("/")
    if not sep:
        parent, name = ".", text
    return parent or "/", check_name(name)
