"""repair(): replace a repository's damaged or missing chunks, manifests and commit records with verified
copies from other repositories (its other tiers, replicas, a backup), then rebuild what they could not
mend from the checkpoints' parity (spec 5.6, ``parity_repair.py``): self-healing (spec 11.8).

Chunks are named by the hash of their decoded bytes, and a replicated checkpoint is the same manifest
bytes on every tier, so any repository holding an object of the same name holds exactly what was lost:
a replacement is checked against its name before it is written, never trusted because of where it came
from. A chunk may come from a copy stored under another codec (decoded, checked, encoded again), the
damaged repository's own other copies included (``repository/chunk_copies.py``).

Repairs follow the commit protocol's order (a manifest before its commit record) and each object is
replaced atomically (``Storage.write``), under a save lease so that no collector sweeps meanwhile: a
repair killed at any point leaves every object either as it was or repaired, never worse.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from fsspec.callbacks import Callback

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, ManifestError, StorageError
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.limits import MAX_MARKER_BYTES, is_valid_name
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.lifecycle.parity_repair import parity_lost_commits, rebuild_checkpoints, rebuild_objects
from ckptfmt.lifecycle.repair_report import Fix, RepairReport, Unrepaired
from ckptfmt.repository.chunk_copies import find_copy
from ckptfmt.repository.history import history_keys, read_history, read_history_bytes
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import MarkerDamagedError, Repository, no_repository, parse_marker
from ckptfmt.repository.signatures import signatures
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage
from ckptfmt.tools.verify import Problem, VerifyReport, check_chunks, verify


def repair(url: str | os.PathLike, sources: Sequence[str | os.PathLike] = (), *, storage_options: dict | None = None,
           source_options: list[dict | None] | None = None, dry_run: bool = False, workers: int = 8,
           callback: Callback | None = None) -> RepairReport:
    """Repair every committed checkpoint of repository ``url`` from ``sources`` (repository URLs).

    Finds each missing, truncated or corrupt chunk, manifest and commit record (a
    commit record is looked for where a checkpoint's folder still holds the manifest
    a source commits under that name), copies a verified replacement, then verifies
    the repository. ``dry_run`` reports what would be copied and writes nothing.
    ``source_options``: storage options per source, in order. ``callback`` (fsspec)
    counts the bytes checked.
    """
    started = time.perf_counter()
    options = list(source_options or [None] * len(sources))
    if len(options) != len(sources):
        raise ValueError("give one storage_options entry per source")
    others = [Repository.open(source, opts) for source, opts in zip(sources, options)]
    repo = Repository(open_storage(url, storage_options))
    marker_damage = _marker_damage(repo)
    report = RepairReport(url=repo.url, sources=[o.url for o in others], dry_run=dry_run)
    with save_lease(repo) if not dry_run else contextlib.nullcontext():
        if marker_damage is not None:
            _repair_marker(repo, others, marker_damage, report)
        listing = repo.listing()
        lost = _lost_commits(repo, others, listing.ignored)
        lost += [name for name in parity_lost_commits(repo) if name not in lost]
        report.checkpoints = listing.checkpoints + sorted(lost)
        manifests = _repair_checkpoints(repo, others, report)
        rebuild_checkpoints(repo, report, manifests)
        _repair_signatures(repo, others, list(manifests), report)
        _repair_histories(repo, others, report)
        damage = VerifyReport(url=repo.url, checkpoints=list(manifests))
        check_chunks(repo, manifests, damage, callback, workers=workers)
        _repair_chunks(repo, others, manifests, damage.problems, report, workers)
        rebuild_objects(repo, manifests, report)
    if not dry_run and (report.fixed or report.unrepaired):
        report.verified = verify(url, storage_options=storage_options, workers=workers)
    elif not dry_run:
        report.verified = damage
    report.seconds = time.perf_counter() - started
    return report


def _marker_damage(repo: Repository) -> str | None:
    """What is wrong with the repository's marker (None: nothing). A folder with neither a marker nor a
    chunk store is no repository at all: that raises, as a wrong URL should."""
    try:
        repo.check_marker(hint=False)
        return None
    except (MarkerDamagedError, CorruptDataError) as exc:  # CorruptDataError: over the size limit
        return str(exc)
    except CheckpointNotFoundError:
        if not repo.storage.exists(layout.CHUNKS_DIR):
            raise no_repository(repo.storage) from None
        return f"{repo.storage.describe(layout.MARKER_KEY)}: missing"


def _repair_marker(repo: Repository, others: list[Repository], damage: str, report: RepairReport) -> None:
    """Restore the marker from the first source whose marker is valid (checked as a reader checks it);
    without one, the marker is unrepaired and the repair cannot go on."""
    tried = []
    for other in others:
        where = other.storage.describe(layout.MARKER_KEY)
        try:
            data = other.storage.read(layout.MARKER_KEY, max_size=MAX_MARKER_BYTES)
            doc = parse_marker(data, where)
        except StorageError:
            raise
        except CheckpointError as exc:
            tried.append(str(exc))
            continue
        report.fixed.append(Fix("marker", layout.MARKER_KEY, where, damage))
        if not report.dry_run:
            repo.storage.write(layout.MARKER_KEY, data)
            repo.storage.sync([layout.MARKER_KEY])
        repo.index_version = doc.get("index")
        return
    raise MarkerDamagedError(f"{damage}; no source holds a valid marker to restore it from ({_tried_text(tried)})")


def _lost_commits(repo: Repository, others: list[Repository], ignored: list[str]) -> list[str]:
    """Names whose commit record is gone although their folder holds the manifest a source commits under
    that name: committed checkpoints that lost their record, not unfinished saves."""
    lost = []
    for name in ignored:
        if not is_valid_name(name):
            continue
        for other in others:
            record = other.readable_commit(name)
            if record and repo.storage.exists(layout.manifest_key(name, record.manifest_hash)):
                lost.append(name)
                break
    return lost


def _repair_checkpoints(repo: Repository, others: list[Repository], report: RepairReport) -> dict[str, Manifest]:
    """Each checkpoint's manifest, its commit record and manifest replaced from a source where they are
    damaged; a checkpoint with no good copy anywhere is reported and left out."""
    manifests = {}
    for name in report.checkpoints:
        try:
            manifests[name] = repo.manifest(name)
            continue
        except StorageError:
            raise
        except CheckpointError as exc:
            damage = str(exc)
        ours = repo.readable_commit(name)
        # Which checkpoint this was: its commit record's manifest hash or, the record lost, the hashes in its
        # manifests' names; a source's checkpoint of that name with another manifest is another checkpoint.
        wanted = {ours.manifest_hash} if ours is not None else _manifest_hashes(repo, name)
        tried: list[str] = []
        for other in others:
            found = _good_checkpoint(other, name, wanted, tried)
            if found is None:
                continue
            record, manifest, manifest_bytes = found
            manifest_key = layout.manifest_key(name, record.manifest_hash)
            if not _intact(repo, manifest_key, record):
                report.fixed.append(Fix("manifest", manifest_key, other.storage.describe(manifest_key), damage,
                                        (name,)))
                if not report.dry_run:
                    repo.storage.write(manifest_key, manifest_bytes)
                    repo.storage.sync([manifest_key])
            if ours is None:
                commit_key = layout.commit_key(name)
                report.fixed.append(Fix("commit-record", commit_key, other.storage.describe(commit_key), damage,
                                        (name,)))
                if not report.dry_run:
                    repo.storage.write(commit_key, record.to_bytes())
                    repo.storage.sync([commit_key])
            manifests[name] = manifest
            break
        else:
            report.unrepaired.append(Unrepaired("checkpoint", name, damage, _tried_text(tried)))
    return manifests


def _repair_signatures(repo: Repository, others: list[Repository], names: list[str], report: RepairReport) -> None:
    """Restore the signature objects (spec 10.3) a source holds for a checkpoint and this repository lacks
    or holds damaged; each must sign this very checkpoint under its own key."""
    for name in names:
        ours = repo.readable_commit(name)
        here = {found.key: found for found in signatures(repo, name)}
        for other in others:
            theirs = other.readable_commit(name)
            record = ours or theirs
            if theirs is None or record is None or theirs.manifest_hash != record.manifest_hash:
                continue
            for found in signatures(other, name):
                mine = here.get(found.key)
                if found.signature is None or not found.signature.verifies(record) or (
                        mine is not None and mine.signature is not None and mine.signature.verifies(record)):
                    continue
                damage = "missing" if mine is None else (mine.damage or "does not sign the checkpoint")
                report.fixed.append(Fix("signature", found.key, other.storage.describe(found.key),
                                        f"{repo.storage.describe(found.key)}: {damage}", (name,)))
                if not report.dry_run:
                    repo.storage.write(found.key, found.signature.to_bytes())
                here[found.key] = found


def _repair_histories(repo: Repository, others: list[Repository], report: RepairReport) -> None:
    """Restore the history objects (spec 4.5) that are damaged here, or that a source holds and this
    repository lacks: they are immutable and named by their hash, so a good copy is the object itself."""
    here = {key.key: key for key in history_keys(repo)}
    damaged: dict[str, str] = {}
    for key in here.values():
        try:
            read_history(repo, key)
        except (CorruptDataError, ManifestError) as exc:
            damaged[key.key] = str(exc)
    for other in others:
        for key in history_keys(other):
            if key.key in here and key.key not in damaged:
                continue
            try:
                data = read_history_bytes(other, key)
            except (CorruptDataError, ManifestError):
                continue
            damage = damaged.pop(key.key, f"{repo.storage.describe(key.key)}: missing")
            here[key.key] = key
            report.fixed.append(Fix("history", key.key, other.storage.describe(key.key), damage, (key.name,)))
            if not report.dry_run:
                repo.storage.write(key.key, data)
    for stored, damage in damaged.items():
        report.unrepaired.append(Unrepaired("history", here[stored].name, damage, "no source holds it intact", stored))


def _manifest_hashes(repo: Repository, name: str) -> set[str]:
    """The manifest hashes that the manifest files in checkpoint ``name``'s folder are named by."""
    return layout.manifest_digests(repo.storage.list(name))


def _good_checkpoint(other: Repository, name: str, wanted: set[str],
                     tried: list[str]) -> tuple[CommitRecord, Manifest, bytes] | None:
    """``other``'s copy of checkpoint ``name``, verified, if it is the checkpoint whose manifest hash is
    one of ``wanted``."""
    where = other.storage.describe(name)
    try:
        record = other.commit(name)
        if record.manifest_hash not in wanted:
            tried.append(f"{where}: another checkpoint of that name (manifest {record.manifest_hash[:16]}...)"
                         if wanted else f"{where}: cannot tell whether it is the same checkpoint (no manifest "
                         "or commit record is left here to compare)")
            return None
        manifest = other.manifest(name, record)
        key = layout.manifest_key(name, record.manifest_hash)
        data = other.storage.read(key, max_size=record.manifest_size)
        check_chunk(data, record.manifest_hash, other.storage.describe(key))  # the bytes just parsed, exactly
    except StorageError:
        raise
    except CheckpointError as exc:
        tried.append(str(exc))
        return None
    return record, manifest, data


def _intact(repo: Repository, key: str, record: CommitRecord) -> bool:
    try:
        data = repo.storage.read(key, max_size=record.manifest_size)
        check_chunk(data, record.manifest_hash, key)
    except StorageError:
        raise
    except CheckpointError:
        return False
    return len(data) == record.manifest_size


def _repair_chunks(repo: Repository, others: list[Repository], manifests: dict[str, Manifest],
                   problems: list[Problem], report: RepairReport, workers: int) -> None:
    """Replace each damaged chunk with a verified copy from a source, re-encoded where it is stored
    under another codec."""
    rows = {stored_key(m.chunks, c): (m, i) for m in manifests.values() for i, c in enumerate(m.chunks)}
    damaged: dict[str, list[Problem]] = {}
    for problem in problems:
        if problem.key is not None:
            damaged.setdefault(problem.key, []).append(problem)

    storages = [o.storage for o in others] + [repo.storage]

    def fix(key: str) -> None:
        (manifest, index), found = rows[key], damaged[key]
        chunk = manifest.chunks[index]
        tried: list[str] = []
        # The sources first, then this repository's own copies under other codecs.
        try:
            replacement = find_copy(storages, chunk, tried, skip=(repo.storage, chunk.codec),
                                    base=_base_of(storages, manifest.chunks, index, tried))
        except _NoBase as missing:
            tried.append(f"its base chunk {str(missing)[:16]}... has no good copy anywhere")
            replacement = None
        checkpoints = tuple(sorted({p.checkpoint for p in found}))
        if replacement is None:
            for problem in found:
                report.unrepaired.append(Unrepaired("chunk", problem.checkpoint, problem.message, _tried_text(tried),
                                                    key, problem.tensors))
            return
        if _holds(repo.storage, key, replacement.stored):
            return  # intact: a delta found unreadable only for want of its base, repaired on its own
        if not report.dry_run:
            repo.storage.write(key, replacement.stored)
        report.fixed.append(Fix("chunk", key, replacement.where, found[0].message, checkpoints))

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-repair") as pool:
        list(pool.map(fix, sorted(damaged)))
    report.fixed.sort(key=lambda f: (f.kind, f.key))
    report.unrepaired.sort(key=lambda u: (u.kind, u.checkpoint, u.key or ""))


def _holds(storage: Storage, key: str, stored: bytes) -> bool:
    """Whether ``key`` holds exactly ``stored``."""
    try:
        return storage.read(key, max_size=len(stored)) == stored
    except StorageError:
        raise
    except CheckpointError:
        return False


def _base_of(storages: list[Storage], chunks: list[Chunk], index: int,
             tried: list[str]) -> tuple[str, bytes | memoryview] | None:
    """A delta chunk's base: its hash and decoded bytes, from the first good copy anywhere (decoded through
    its own bases); None for a chunk stored whole. An unavailable base is said in ``tried``."""
    base = chunks[index].base
    if base is None:
        return None
    copy = find_copy(storages, chunks[base], tried, base=_base_of(storages, chunks, base, tried))
    if copy is None:
        raise _NoBase(chunks[base].hash)
    return chunks[base].hash, copy.decoded


class _NoBase(Exception):
    """A delta's base chunk has no good copy anywhere."""


def _tried_text(tried: list[str]) -> str:
    return "; ".join(tried) or "no source given (--from)"
