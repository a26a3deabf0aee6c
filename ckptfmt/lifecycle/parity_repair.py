"""Repair from parity (spec 5.6): rebuild lost or damaged manifests, commit records, chunks and parity
objects of protected checkpoints with no replica anywhere.

``repair`` tries its sources first (a copy costs one read; a rebuild reads K pieces), then parity for
what they left. Every rebuilt object is checked against its name before it is written (a manifest
against its hash, a chunk through its decoding and hash, a parity object against its hash); one that
fails is reported as not rebuilt and nothing is written for it. A commit record is rebuilt only where
the checkpoint was surely committed (its damaged record is still there, or the evidence of
``lost_commits``): a save killed before its commit leaves parity records too, and must stay uncommitted.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptfmt.errors import CheckpointError, StorageError
from ckptfmt.format import layout
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.limits import is_valid_name
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.parity_record import ParityRecord, record_key
from ckptfmt.lifecycle.repair_report import Fix, RepairReport, Unrepaired
from ckptfmt.repository import parity as stored_parity
from ckptfmt.repository.checkpoint_objects import CheckpointObjects
from ckptfmt.repository.history import removed_manifests
from ckptfmt.repository.protection import rebuild
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.parity_check import ParityCheck, check_parity, read_parity


def parity_lost_commits(repo: Repository) -> list[str]:
    """Names whose commit record is gone (their folder too, perhaps) while a parity record of theirs is
    kept outside the folder: written only after a commit and deleted before a removal, such a copy proves
    the checkpoint was committed (spec 5.6), unless a history object says it was removed (by a writer that
    knew no parity and left the copies behind)."""
    lost = []
    for name in repo.storage.list(stored_parity.RECORDS_DIR):
        if not is_valid_name(name) or repo.storage.exists(layout.commit_key(name)):
            continue
        records = [r for d in stored_parity.stored_digests(repo.storage, name, folder=False)
                   if (r := _record_of(repo, name, d)) is not None]
        removed = removed_manifests(repo, name) if records else set()
        if any(r.manifest_hash not in removed for r in records):
            lost.append(name)
    return lost


def rebuild_checkpoints(repo: Repository, report: RepairReport, manifests: dict[str, Manifest]) -> None:
    """Rebuild the manifest (and, where it is gone or damaged, the commit record) of each checkpoint the
    sources could not repair, from its parity."""
    for lost in [u for u in report.unrepaired if u.kind == "checkpoint"]:
        found = _rebuilt_checkpoint(repo, lost.checkpoint, lost.damage, report)
        if found is not None:
            report.unrepaired.remove(lost)
            manifests[lost.checkpoint] = found


def _records(repo: Repository, name: str, commit: CommitRecord | None) -> list[tuple[str, ParityRecord]]:
    """The parity records that may rebuild checkpoint ``name``: the one its commit record names; with no
    readable commit record, those of the copies outside its folder (or, where its damaged commit record is
    still there, in it), provided they all name one manifest: never a choice between two checkpoints."""
    if commit is not None:
        if commit.parity is None:
            return []
        found = _record_of(repo, name, commit.parity)
        return [(commit.parity, found)] if found is not None and found.manifest_hash == commit.manifest_hash else []
    digests = stored_parity.stored_digests(repo.storage, name, folder=False) or (
        stored_parity.stored_digests(repo.storage, name) if repo.storage.exists(layout.commit_key(name)) else set())
    records = [(d, r) for d in sorted(digests) if (r := _record_of(repo, name, d)) is not None]
    return records if len({r.manifest_hash for _, r in records}) == 1 else []


def _rebuilt_checkpoint(repo: Repository, name: str, damage: str, report: RepairReport) -> Manifest | None:
    commit = repo.readable_commit(name)
    for digest, record in _records(repo, name, commit):
        manifest_key = layout.manifest_key(name, record.manifest_hash)
        index = next(i for i, (key, _) in enumerate(record.objects) if key == manifest_key)
        size = record.objects[index][1]
        check = _manifest_check(size, record.manifest_hash)
        data = _manifest_bytes(repo, manifest_key, size, check)
        source = f"parity {record.k}+{record.m} of {name}"
        if data is None:
            built = rebuild(record, {index}, set(), _reader(repo), _parity_reader(repo))
            data = built.objects.get(index)
            if data is None or not check(data):
                continue
            report.fixed.append(Fix("manifest", manifest_key, source, damage, (name,)))
            if not report.dry_run:
                repo.storage.write(manifest_key, data)
                repo.storage.sync([manifest_key])
        manifest = Manifest.from_bytes(data, repo.storage.describe(manifest_key))
        if commit is None:
            commit_key = layout.commit_key(name)
            rebuilt = CommitRecord(name=name, manifest_hash=record.manifest_hash, manifest_size=size,
                                   step=manifest.step, created_ns=manifest.created_ns, parent=manifest.parent,
                                   totals=manifest.totals, version=manifest.version, parity=digest)
            report.fixed.append(Fix("commit-record", commit_key, source, damage, (name,)))
            if not report.dry_run:
                repo.storage.write(commit_key, rebuilt.to_bytes())
                repo.storage.sync([commit_key])
        return manifest
    return None


def _manifest_check(size: int, digest: str) -> Callable[[bytes], bool]:
    return lambda data: len(data) == size and chunk_hash(data) == digest


def _manifest_bytes(repo: Repository, key: str, size: int, check: Callable[[bytes], bool]) -> bytes | None:
    """The manifest's stored bytes where they are intact, else None."""
    try:
        data = repo.storage.read(key, max_size=size)
    except StorageError:
        raise
    except CheckpointError:
        return None
    return data if check(data) else None


def rebuild_objects(repo: Repository, manifests: dict[str, Manifest], report: RepairReport) -> None:
    """Rebuild the chunks the sources left damaged, and each protected checkpoint's damaged parity objects
    and record copies, from parity."""
    lost: dict[str, list[Unrepaired]] = {}
    for entry in report.unrepaired:
        if entry.kind == "chunk" and entry.key is not None:
            lost.setdefault(entry.key, []).append(entry)
    notes: dict[str, list[str]] = {}
    for name, manifest in manifests.items():
        commit = repo.readable_commit(name)
        if commit is None or commit.parity is None:
            continue
        found = check_parity(repo.storage, name, commit.parity)
        if found.record is None:
            for key in lost:
                notes.setdefault(key, []).append(f"parity of {name}: {found.error}")
            report.unrepaired.append(Unrepaired("parity", name, found.error or "", "no good copy of the record",
                                                record_key(name, commit.parity)))
            continue
        record = found.record
        source = f"parity {record.k}+{record.m} of {name}"
        _restore_copies(repo, found, source, report)
        indices = {key: i for i, (key, _) in enumerate(record.objects)}
        wanted = {indices[key] for key in lost if key in indices}
        if not wanted and not found.bad_parity:
            continue
        built = rebuild(record, wanted, set(found.bad_parity), _reader(repo), _parity_reader(repo))
        rebuilt = {record.objects[i][0]: data for i, data in built.objects.items()}
        objects = CheckpointObjects(repo.storage, commit, manifest)
        for key, data in sorted(rebuilt.items()):
            try:
                objects.check(key, data, rebuilt)
            except StorageError:
                raise
            except CheckpointError as exc:
                notes.setdefault(key, []).append(f"{source}: the rebuilt bytes fail their check ({exc})")
                continue
            entries = lost.pop(key)
            report.fixed.append(Fix("chunk", key, source, entries[0].damage,
                                    tuple(sorted({e.checkpoint for e in entries}))))
            if not report.dry_run:
                repo.storage.write(key, data)
        for i, why in built.failed.items():
            notes.setdefault(record.objects[i][0], []).append(f"{source}: {why}")
        for key, data in sorted(built.parity.items()):
            report.fixed.append(Fix("parity", key, source, found.bad_parity[key], (name,)))
            if not report.dry_run:
                repo.storage.write(key, data)
        for key, why in sorted(built.failed_parity.items()):
            report.unrepaired.append(Unrepaired("parity", name, found.bad_parity.get(key, why), f"{source}: {why}",
                                                key))
    report.unrepaired = [_noted(entry, notes) for entry in report.unrepaired
                         if entry.kind != "chunk" or entry.key is None or entry.key in lost]


def _noted(entry: Unrepaired, notes: dict[str, list[str]]) -> Unrepaired:
    """``entry`` with what parity said of its object added to what was tried."""
    said = notes.get(entry.key or "") if entry.kind == "chunk" else None
    if not said:
        return entry
    tried = "; ".join(said) if entry.tried.startswith("no source given") else "; ".join([entry.tried, *said])
    return Unrepaired(entry.kind, entry.checkpoint, entry.damage, tried, entry.key, entry.tensors)


def _restore_copies(repo: Repository, found: ParityCheck, source: str, report: RepairReport) -> None:
    """Write a good copy's bytes over the record's missing or damaged copies."""
    if not found.damaged_copies or found.record is None:
        return
    data = _stored_copy(repo, found)
    for key, why in found.damaged_copies:
        report.fixed.append(Fix("parity", key, source, why, (found.name,)))
        if not report.dry_run and data is not None:
            repo.storage.write(key, data)


def _stored_copy(repo: Repository, found: ParityCheck) -> bytes | None:
    assert found.record is not None
    damaged = {key for key, _ in found.damaged_copies}
    for key in stored_parity.record_keys(found.record.name, found.digest, found.record.m):
        if key in damaged:
            continue
        try:
            data = repo.storage.read(key, max_size=stored_parity.MAX_RECORD_BYTES)
        except CheckpointError:
            continue
        if chunk_hash(data) == found.digest:
            return data
    return None


def _reader(repo: Repository):
    return lambda key, size: repo.storage.read(key, max_size=size)


def _parity_reader(repo: Repository):
    return lambda key, length: read_parity(repo.storage, key, length)


def _record_of(repo: Repository, name: str, digest: str) -> ParityRecord | None:
    try:
        return stored_parity.read_record(repo.storage, name, digest).record
    except StorageError:
        raise
    except CheckpointError:
        return None


__all__ = ["parity_lost_commits", "rebuild_checkpoints", "rebuild_objects"]
