"""A checkpoint's parity in the repository (spec 5.6, 2.1): its parity record, kept in M+1 copies, and the
content-addressed parity objects the record names.

The record lives in the checkpoint's folder (``NAME/parity-<r>.msgpack``, named by the commit record) and
in M copies under ``_parity/records/NAME/``, so that losing the folder (its commit record, manifest and
record together) still leaves what rebuilds it. Every copy is named by the hash of its bytes, so each is
checked on its own; any good copy will do.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, StorageError
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.parity_record import (
    MAX_RECORD_BYTES,
    PARITY_DIR,
    ParityRecord,
    copy_key,
    record_digest,
    record_key,
)
from ckptfmt.storage.base import Storage

#: Where the copies of the records live, one folder per checkpoint name.
RECORDS_DIR = f"{PARITY_DIR}/records"


def record_keys(name: str, digest: str, m: int) -> list[str]:
    """Every key of the record (bytes hashing to ``digest``) of checkpoint ``name`` with M parity objects."""
    return [record_key(name, digest)] + [copy_key(name, digest, i) for i in range(1, m + 1)]


def write_record(storage: Storage, record: ParityRecord) -> str:
    """Store ``record`` in its checkpoint's folder, durably, and return its hash (what the commit record
    names): before the commit record, like the manifest."""
    data = record.to_bytes()
    digest = chunk_hash(data)
    storage.write(record_key(record.name, digest), data)
    return digest


def write_copies(storage: Storage, record: ParityRecord, digest: str) -> None:
    """Store the M copies of ``record`` outside its checkpoint's folder: only once the commit record names
    it, so that a copy there proves its checkpoint was committed (a repair may then rebuild a lost
    commit record from it; a save killed before its commit leaves none)."""
    data = record.to_bytes()
    keys = record_keys(record.name, digest, record.m)[1:]
    for key in keys:
        storage.write(key, data)


@dataclass(frozen=True)
class FoundRecord:
    """A good copy of a parity record, and the copies of it that are missing or damaged."""

    record: ParityRecord
    digest: str
    damaged: tuple[tuple[str, str], ...]  # (key, what is wrong)


def read_record(storage: Storage, name: str, digest: str, m: int | None = None) -> FoundRecord:
    """The record of checkpoint ``name`` whose bytes hash to ``digest``, from its first good copy, with the
    damaged ones named; CorruptDataError when no copy is good. ``m``: the number of copies past the first,
    when known (else the copies found by listing are read)."""
    keys = record_keys(name, digest, m) if m is not None else _listed_keys(storage, name, digest)
    damaged: list[tuple[str, str]] = []
    found = None
    for key in keys:
        try:
            data = storage.read(key, max_size=MAX_RECORD_BYTES)
            if chunk_hash(data) != digest:
                raise CorruptDataError(f"{storage.describe(key)}: hash mismatch (expected {digest[:16]}...)")
            record = ParityRecord.from_bytes(data, storage.describe(key))
            if record.name != name:
                raise CorruptDataError(f"{storage.describe(key)}: the record of {record.name!r}, not {name!r}")
        except StorageError:
            raise
        except CheckpointNotFoundError:
            damaged.append((key, "missing"))
            continue
        except CheckpointError as exc:
            damaged.append((key, str(exc)))
            continue
        if found is None:
            found = record
            if m is None:  # the first good copy says how many there are
                keys_now = record_keys(name, digest, record.m)
                keys += [k for k in keys_now if k not in keys]
    if found is None:
        raise CorruptDataError(f"{storage.describe(record_key(name, digest))}: no good copy of the parity record "
                               f"({'; '.join(f'{k}: {why}' for k, why in damaged) or 'none found'})")
    return FoundRecord(found, digest, tuple(damaged))


def _listed_keys(storage: Storage, name: str, digest: str) -> list[str]:
    keys = [record_key(name, digest)]
    for entry in storage.list(f"{RECORDS_DIR}/{name}"):
        if record_digest(entry) == digest:
            keys.append(f"{RECORDS_DIR}/{name}/{entry}")
    return keys


def stored_digests(storage: Storage, name: str, *, folder: bool = True) -> set[str]:
    """The hashes of the parity records of checkpoint ``name`` found among the copies outside its folder,
    and with ``folder``, in it."""
    entries = (storage.list(name) if folder else []) + storage.list(f"{RECORDS_DIR}/{name}")
    return {d for d in map(record_digest, entries) if d is not None}


def remove_copies(storage: Storage, name: str, keep: str | None = None) -> None:
    """Delete the records of checkpoint ``name`` kept outside its folder (all, or all but digest ``keep``):
    a removed checkpoint must leave nothing from which a repair would bring it back."""
    folder = f"{RECORDS_DIR}/{name}"
    entries = storage.list(folder)
    stale = [f"{folder}/{e}" for e in entries if keep is None or record_digest(e) != keep]
    if stale:
        storage.delete_many(stale)
    if entries and keep is None:
        storage.remove_folder(folder)


def copy_parity(source: Storage, target: Storage, name: str, digest: str) -> tuple[ParityRecord, int] | None:
    """Copy checkpoint ``name``'s parity record (into its folder) and the parity objects ``target`` lacks,
    each checked against its name, before its commit record is copied; ``write_copies`` follows the commit.
    Returns the record and the bytes copied, or None where the source's parity cannot be read whole (the
    checkpoint is then copied without it: damaged parity is never propagated)."""
    try:
        found = read_record(source, name, digest)
        lengths = {key: (d, s.length) for s in found.record.stripes for key, d in zip(s.keys, s.parity)}
        objects = {}
        for key, (d, length) in lengths.items():
            if target.size(key) == length:
                continue
            data = source.read(key, max_size=length)
            if len(data) != length or chunk_hash(data) != d:
                raise CorruptDataError(f"{source.describe(key)}: parity object is damaged")
            objects[key] = data
    except StorageError:
        raise
    except CheckpointError:
        return None
    for key, data in objects.items():
        target.write(key, data, durable=False)
    data = found.record.to_bytes()
    target.write(record_key(name, digest), data)
    target.sync([*objects, record_key(name, digest)])
    return found.record, sum(map(len, objects.values())) + len(data)


def parity_keys(record: ParityRecord) -> set[str]:
    """The keys of the parity objects ``record`` names."""
    return {key for stripe in record.stripes for key in stripe.keys}


__all__ = ["FoundRecord", "RECORDS_DIR", "copy_parity", "parity_keys", "read_record", "record_keys",
           "remove_copies", "stored_digests", "write_copies", "write_record"]
