"""A run's history kept past its checkpoints (spec 4.5, 1.8): archived by each removal, read with the rest.

``Repository.remove`` keeps a checkpoint's history (training steps, system
samples, save timing) as a history object before it deletes the commit record
(``Repository.keep_history``). ``removed_histories`` lists the history
objects of checkpoints no longer committed, which every analysis reads beside
the manifests of those that are.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckptfmt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptDataError,
    ManifestError,
    StorageError,
    UnsupportedVersionError,
)
from ckptfmt.format.history import MAX_HISTORY_BYTES, History, HistoryKey
from ckptfmt.format.layout import HISTORY_DIR

if TYPE_CHECKING:
    from ckptfmt.format.commit_record import CommitRecord
    from ckptfmt.repository.repository import Repository

def history_keys(repo: Repository) -> list[HistoryKey]:
    """Every history object of the repository, oldest first (other entries of ``_history/`` are ignored)."""
    keys = [key for entry in repo.storage.list(HISTORY_DIR) if (key := HistoryKey.parse(entry)) is not None]
    return sorted(keys, key=lambda k: (k.created_ns, k.name, k.digest))


def removed_histories(repo: Repository, committed: Iterable[CommitRecord]) -> list[HistoryKey]:
    """The history objects of checkpoints that are not among ``committed`` (their manifests hold the
    same history), one per removed checkpoint, oldest first."""
    present = {(record.name, record.created_ns) for record in committed}
    chosen: dict[tuple[str, int], HistoryKey] = {}
    for key in history_keys(repo):  # two objects of one checkpoint: written by different writers, take one
        if (key.name, key.created_ns) not in present:
            chosen.setdefault((key.name, key.created_ns), key)
    return list(chosen.values())


def read_history(repo: Repository, key: HistoryKey) -> History:
    """A history object, checked against its key (hash, name, time)."""
    where = repo.storage.describe(key.key)
    return repo.storage.read_checked(key.key, max_size=MAX_HISTORY_BYTES,
                                     check=lambda data: History.from_bytes(data, key, where))


def read_history_bytes(repo: Repository, key: HistoryKey) -> bytes:
    """A history object's bytes, checked as ``read_history`` checks them (for copies: byte for byte)."""
    where = repo.storage.describe(key.key)

    def checked(data: bytes) -> bytes:
        History.from_bytes(data, key, where)
        return data
    return repo.storage.read_checked(key.key, max_size=MAX_HISTORY_BYTES, check=checked)


def read_histories(repo: Repository, keys: Iterable[HistoryKey]) -> list[History]:
    """The history objects of ``keys`` that can be read; a damaged one is skipped with a warning
    (``ckptfmt verify`` reports it, and ``repair`` restores it from a copy)."""
    histories = []
    for key in keys:
        try:
            histories.append(read_history(repo, key))
        except (CorruptDataError, ManifestError, UnsupportedVersionError) as exc:
            warnings.warn(f"skipping a history object: {exc}", stacklevel=2, category=CheckpointWarning)
    return histories



def removed_manifests(repo: Repository, name: str) -> set[str]:
    """The manifest hashes of checkpoints named ``name`` whose removal a history object records (spec 4.5:
    written before the commit record goes); parity record copies of them are leftovers (spec 5.6)."""
    found = set()
    for key in history_keys(repo):
        if key.name == name:
            try:
                found.add(read_history(repo, key).manifest_hash)
            except StorageError:
                raise
            except CheckpointError:
                continue
    return found


def copy_histories(source: Repository, target: Repository, *, verify: bool = True) -> int:
    """Copy the history objects ``target`` lacks from ``source``, each checked against its key before it
    is written (and, with ``verify``, read back and checked again); returns how many were copied. A
    damaged one is left behind with a warning (``verify`` names it, ``repair`` restores it)."""
    present = {key.key for key in history_keys(target)}
    copied = 0
    for key in history_keys(source):
        if key.key in present:
            continue
        try:
            data = read_history_bytes(source, key)
        except (CorruptDataError, ManifestError, UnsupportedVersionError) as exc:  # the checkpoints still go
            warnings.warn(f"not copying a history object: {exc}", stacklevel=3, category=CheckpointWarning)
            continue
        target.storage.write(key.key, data)
        if verify:
            read_history(target, key)
        copied += 1
    return copied
