"""Writing a checkpoint's parity (spec 5.6) in the order that keeps every commit record true: the parity
objects, then the parity record in the checkpoint's folder, then the commit record naming it, and last
the record's copies outside the folder (whose existence then proves the commit). ``save(parity=...)``
and ``protect`` both come here.
"""

from __future__ import annotations

import dataclasses

from ckptfmt.format import layout
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.parity_record import ParityRecord, record_key
from ckptfmt.repository import parity as stored_parity
from ckptfmt.repository.checkpoint_objects import CheckpointObjects
from ckptfmt.repository.protection import ReadObject
from ckptfmt.repository.protection import protect as encode_protection
from ckptfmt.repository.repository import Repository


def protect_checkpoint(repo: Repository, record: CommitRecord, manifest: Manifest, k: int, m: int,
                       read: ReadObject | None = None, *, workers: int = 2,
                       objects: CheckpointObjects | None = None, commit: bool = True) -> tuple[CommitRecord,
                                                                                              ParityRecord]:
    """Write K+M parity of committed checkpoint ``record`` and its record's copies; with ``commit``, rewrite
    its commit record to name them and drop parity it had before. Returns the commit record naming the
    parity (a save that has not committed yet creates it) and the parity record. ``read``: the checked
    bytes of an object (default: read back through its check)."""
    objects = objects or CheckpointObjects(repo.storage, record, manifest)
    written: list[str] = []

    def write_parity(key: str, data: bytes) -> None:
        if repo.storage.size(key) != len(data):  # content-addressed: one already there of its size is this one
            repo.storage.write(key, data, durable=False)
            written.append(key)

    version = max(record.version, (2, 1))
    added = encode_protection(record.name, record.manifest_hash, objects.objects, k, m, read or objects.read,
                              write_parity, workers=workers, version=version)
    digest = stored_parity.write_record(repo.storage, added)
    repo.storage.sync([*written, record_key(record.name, digest)])
    new = dataclasses.replace(record, parity=digest)
    if commit:
        previous = record.parity
        repo.storage.write(layout.commit_key(record.name), new.to_bytes())
        repo.storage.sync([layout.commit_key(record.name)])
        finish_protection(repo, added, digest)
        if previous is not None and previous != digest:
            repo.storage.delete(record_key(record.name, previous))
            stored_parity.remove_copies(repo.storage, record.name, keep=digest)
    return new, added


def finish_protection(repo: Repository, added: ParityRecord, digest: str) -> None:
    """Once the commit record names the parity record: its copies outside the folder (spec 5.6)."""
    stored_parity.write_copies(repo.storage, added, digest)
    repo.storage.sync(stored_parity.record_keys(added.name, digest, added.m)[1:])


__all__ = ["finish_protection", "protect_checkpoint"]
