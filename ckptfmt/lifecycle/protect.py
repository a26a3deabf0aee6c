"""protect(): add Reed-Solomon parity to a checkpoint, or to every checkpoint of a repository (spec 5.6),
so that lost or damaged objects rebuild with no replica anywhere (``repair``).

Each checkpoint's objects are read through their checks (parity of damaged bytes would rebuild damage),
the parity objects written, then the parity record in the checkpoint's folder, then the commit record,
rewritten atomically with the record's hash, and last the record's M copies outside the folder
(``repository/protecting.py``): a protect killed at any point leaves the checkpoint readable, its commit
record naming either no parity or complete parity. All of it under a save lease, so that no collector
sweeps the parity objects before the commit record names them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt.errors import CheckpointError, StorageError
from ckptfmt.format import layout
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.repository import parity as stored_parity
from ckptfmt.repository.checkpoint_objects import CheckpointObjects
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.protecting import protect_checkpoint
from ckptfmt.repository.protection import parse_parity
from ckptfmt.repository.repository import Repository, resolve
from ckptfmt.storage.factory import open_storage


@dataclass(frozen=True)
class Protected:
    """One checkpoint protected: its objects' bytes and the parity bytes added."""

    name: str
    objects: int
    stored_bytes: int
    parity_bytes: int
    stripes: int


@dataclass
class ProtectReport:
    """What a ``protect`` call did."""

    url: str
    k: int
    m: int
    protected: list[Protected] = field(default_factory=list)
    #: Checkpoints that already had parity of this K+M.
    unchanged: list[str] = field(default_factory=list)
    seconds: float = 0.0


def protect(url: str | os.PathLike, parity: str = "8+2", *, storage_options: dict | None = None,
            workers: int = 2, callback: Callback | None = None) -> ProtectReport:
    """Add parity ``"K+M"`` to checkpoint ``url``, or to every checkpoint of repository ``url``: any M of
    each stripe's K+M pieces may then be lost or damaged and ``repair`` rebuilds them. A checkpoint with
    parity of another K+M gets the new parity, then loses the old. ``callback`` counts the bytes read."""
    started = time.perf_counter()
    k, m = parse_parity(parity)
    storage = open_storage(url, storage_options)
    if storage.exists(layout.MARKER_KEY):
        repo = Repository(storage)
        repo.check_marker()
        names = repo.listing().checkpoints
    else:
        repo, name = resolve(url, storage_options)
        names = [name]
    report = ProtectReport(url=os.fspath(url), k=k, m=m)
    callback = callback or NoOpCallback()
    with save_lease(repo):
        for name in names:
            try:
                _protect_one(repo, name, k, m, report, callback, workers)
            except StorageError:
                raise
            except CheckpointError as exc:
                raise type(exc)(f"cannot protect {name!r}: {exc} (repair it first: parity of damaged bytes "
                                "would rebuild the damage)") from None
    report.seconds = time.perf_counter() - started
    return report


def _protect_one(repo: Repository, name: str, k: int, m: int, report: ProtectReport, callback: Callback,
                 workers: int) -> None:
    record = repo.commit(name)
    manifest = repo.manifest(name, record)
    if record.parity is not None and _code_of(repo, record) == (k, m):
        report.unchanged.append(name)
        return
    objects = CheckpointObjects(repo.storage, record, manifest)
    callback.set_size((callback.size or 0) + sum(size for _, size in objects.objects))

    def read(key: str, size: int) -> bytes:
        data = objects.read(key, size)
        callback.relative_update(len(data))
        return data

    _, added = protect_checkpoint(repo, record, manifest, k, m, read, workers=workers, objects=objects)
    report.protected.append(Protected(name, len(added.objects), sum(s for _, s in added.objects),
                                      added.parity_bytes, len(added.stripes)))


def _code_of(repo: Repository, record: CommitRecord) -> tuple[int, int] | None:
    """The K+M of the parity ``record`` names, None where its record cannot be read (protect again)."""
    assert record.parity is not None
    try:
        found = stored_parity.read_record(repo.storage, record.name, record.parity)
    except CheckpointError:
        return None
    if found.damaged:
        return None  # a copy is damaged: protecting again writes them all
    return found.record.k, found.record.m


__all__ = ["ProtectReport", "Protected", "protect"]
